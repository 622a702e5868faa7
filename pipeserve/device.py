"""Everything that differs between CPU and CUDA lives here: device choice, the compute dtype
(`--dtype best`), thread budget, memory size, collective backend, the native kernels."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pipeserve import envs

if TYPE_CHECKING:
    from pipeserve.config import EngineConfig

T = TypeVar("T")
log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str = "auto") -> torch.device:
    """The device this process computes on. A bare 'cuda' is the thread's current GPU, with
    its index, so that threads started later (which begin on GPU 0) and every tensor land on
    the GPU `bind_device` chose for this worker."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def bind_device(name: str, local_index: int) -> torch.device:
    """One GPU per worker: the node's `local_index`-th worker takes `cuda:local_index` of the
    GPUs CUDA_VISIBLE_DEVICES leaves visible, made current before anything is allocated.
    CPU workers share the machine (their thread budgets split its cores)."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if name.startswith("cuda:"):
        raise ValueError(
            f"--device {name}: workers take one GPU each (worker i: cuda:i); name the GPUs "
            "with CUDA_VISIBLE_DEVICES and pass --device cuda"
        )
    if local_index >= count:
        raise ValueError(
            f"worker {local_index} of this node has no GPU of its own: {count} visible "
            "(CUDA_VISIBLE_DEVICES); start fewer workers per node or make more GPUs visible"
        )
    device = torch.device("cuda", local_index)
    torch.cuda.set_device(device)
    return device


def bind_thread(device: torch.device, own_stream: bool = False) -> None:
    """A thread that launches device work starts on GPU 0: point it at this worker's GPU.
    `own_stream`: give the thread a stream of its own, so that what it waits for (a receive
    blocks its stream until the message arrives) never holds up another thread's work, as a
    stream shared by all threads (CUDA's default) would."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if own_stream:
            torch.cuda.set_stream(torch.cuda.Stream(device))


def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX tiles),
    read from its feature flags (PIPESERVE_CPU_BF16 overrides). Without either, torch
    emulates bf16 products: ~100x slower than float32 (an AMD Zen 3, AVX2 only: 0.8-1.4 vs
    53-117 GFLOP/s). Other architectures count as without."""
    forced = envs.cpu_native_bf16()
    return _cpu_flags_bf16() if forced is None else forced


@cache
def _cpu_flags_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def best_dtype(device: torch.device) -> str:
    """What `--dtype best` computes in on `device`: bfloat16 on GPUs that have it (float16 on
    older ones) and on CPUs with native bf16 products; float32 on other CPUs, whose bf16
    matmul is emulated (weights and KV cache are then float32 too)."""
    if device.type == "cpu":
        return "bfloat16" if cpu_native_bf16() else "float32"
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"


def resolve_dtype(name: str, checkpoint_dtype: str, device: str = "auto") -> torch.dtype:
    """The torch dtype of a --dtype value: 'best' for `device` (see `best_dtype`), 'auto' the
    checkpoint's."""
    if name == "best":
        name = best_dtype(resolve_device(device))
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in DTYPES else "bfloat16"
    return DTYPES[name]


def with_compute_dtype(config: EngineConfig) -> EngineConfig:
    """`config` with --dtype best made concrete for its device. Called once where a run is
    launched; workers get the concrete name with the other flags, and workers on other
    nodes take rank 0's (distributed/worker.py), so nodes with different CPUs agree."""
    m = config.model
    if m.dtype != "best":
        return config
    dtype, reason = best_model_dtype(m.model_path, resolve_device(m.device))
    log.info("compute dtype: %s (%s)", dtype, reason)
    return dataclasses.replace(config, model=dataclasses.replace(m, dtype=dtype))


def best_model_dtype(model_path: str | None, device: torch.device) -> tuple[str, str]:
    """What `--dtype best` computes `model_path` in on `device`, and why: `best_dtype`, but
    float32 for the built-in model on a CPU (below). Where a run starts and where a GGUF is
    converted for it (models/resolve.py) both ask here, so they agree."""
    from pipeserve.models.default_model import names_built_in_model

    dtype = best_dtype(device)
    if device.type == "cpu" and dtype != "float32" and names_built_in_model(model_path):
        return "float32", BUILT_IN_MODEL_FLOAT32
    return dtype, _dtype_reason(device, dtype)


# The built-in model (SmolLM2-135M-Instruct) computes in float32 on every CPU under --dtype
# best. Its demo's first answer hangs on a margin of 0.10 nats ("What is the capital of
# France?": 'The' -1.864 against 'L' -1.963 in float32), inside bfloat16's own rounding
# (transformers' bfloat16 moves this model's prompt logprobs by up to 0.4 against float32),
# and an AVX512-BF16 machine's bfloat16 run answered it wrongly. At 135M parameters float32
# costs little; --dtype bfloat16 still computes in bfloat16.
BUILT_IN_MODEL_FLOAT32 = (
    "--dtype best for the built-in model on a CPU: its demo answers' margins are inside "
    "bfloat16's rounding; --dtype bfloat16 forces it"
)


def _dtype_reason(device: torch.device, dtype: str) -> str:
    if device.type != "cpu":
        return f"--dtype best on {device.type}"
    forced = " (PIPESERVE_CPU_BF16)" if envs.cpu_native_bf16() is not None else ""
    if dtype == "bfloat16":
        return f"--dtype best: this CPU multiplies bfloat16 natively{forced}"
    return f"--dtype best: this CPU has no native bfloat16 matmul{forced}"


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    """A bfloat16 run on a CPU that emulates bf16 products works, slowly: say by how much."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_native_bf16():
        return
    log.warning(
        "bfloat16 on a CPU without native bf16 products (AVX512-BF16 or AMX): its matmul "
        "measured %.0fx slower than float32 here just now; --dtype best (the default) or "
        "float32 computes in float32",
        bf16_slowdown(),
    )


def bf16_slowdown(size: int = 256, repeats: int = 2) -> float:
    """How many times slower a bfloat16 size^3 matmul runs than a float32 one on this CPU
    (best of `repeats` each: ~0.1 s where bf16 is emulated, for a warning only)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size).to(dtype)
        torch.matmul(a, a)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, a)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def synchronize(device: torch.device) -> None:
    """Wait for all queued device work (a no-op on CPU, where ops run synchronously). Not for
    the hot path: there the host waits on one batch's events (pipeserve/streams.py)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (CUDA), so memory a
    finished engine freed is free for the next one's budget (`memory_budget` reads the
    device's free memory), with the cuBLAS workspaces its streams were given (32 MiB per
    stream on Hopper, allocated from the caching allocator and kept by torch per (handle,
    stream) until cleared: each engine's new streams would otherwise keep theirs). A no-op
    on CPU."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        gc.collect()  # an engine's runner may sit in reference cycles
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def queues_on_streams(device: torch.device) -> bool:
    """Whether work on `device` queues asynchronously on streams the host orders with events
    (CUDA): inputs cross through pinned host memory on a copy stream, and the host waits
    for a batch's events, not for its ops."""
    return device.type == "cuda"


def reset_peak_memory(device: torch.device) -> None:
    """Start counting the peak of the device memory this process allocates (CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """The peak device memory this process allocated since `reset_peak_memory` (CUDA; None
    on a CPU, whose memory is the process's own)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def profiler_activities(device: torch.device) -> list[Any]:
    """What torch's profiler records for work on `device`: host ops, and CUDA kernels."""
    from torch.profiler import ProfilerActivity

    cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    return [ProfilerActivity.CPU, *cuda]


def cuda_graphs_unavailable(device: torch.device) -> str | None:
    """Why steps on `device` cannot be captured as CUDA graphs (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this is {device.type})"
    return None


# CUDA compute capabilities (major) where torch runs bf16 grouped GEMMs as one kernel; on
# others it loops over the groups after copying their sizes to the host
GROUPED_MM_SM = (9, 10)


def grouped_gemm_pays(device: torch.device) -> bool:
    """Grouped GEMMs for routed experts by default on CUDA devices. On CPU the per-expert
    loop: a host read waits for nothing there, and torch's CPU grouped GEMM, itself a loop
    over the groups, is slower on prefill-sized batches (faster on decode-sized ones)."""
    return device.type == "cuda"


def grouped_gemm_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs `dtype` weights on `device`: on CUDA bfloat16 on a
    device with a grouped kernel (`GROUPED_MM_SM`), on CPU bfloat16 and float32."""
    if device.type == "cuda":
        sm = torch.cuda.get_device_capability(device)[0]
        return torch.version.cuda is not None and dtype == torch.bfloat16 and sm in GROUPED_MM_SM
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def stream_synchronize(device: torch.device) -> None:
    """Wait for the work queued on this thread's current stream only (e.g. a receive, before
    another thread's stream reads what it received)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def small_tensor(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on `device`, queued without blocking the host (CUDA:
    through pinned memory; a pageable copy would wait for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def dist_backend(device: torch.device) -> str:
    """torch.distributed backend per tensor device: on GPUs, NCCL for GPU tensors and gloo
    for CPU-side control messages in the same groups."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def comm_group_options(backend: str, max_sms: int | None) -> Any:
    """Options for the expert-parallel group, whose transfers single-batch and two-batch
    overlap run beside compute. Their launches are asynchronous on both backends: NCCL runs
    them on the group's own stream (the alternate stream; waiting on the handle makes the
    compute stream wait on its event), gloo on the group's own threads while the main thread
    computes. On NCCL `max_sms` caps the SMs (CTAs) its kernels take, leaving the rest to
    compute: the communication/compute split. None: the backend's defaults (on gloo there is
    nothing to split: compute and transfers share the cores)."""
    if max_sms is not None and max_sms < 1:
        raise ValueError(f"--moe-comm-max-sms {max_sms} must be at least 1")
    if max_sms is None or "nccl" not in backend:
        return None
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_sms
    options.config.min_ctas = min(options.config.min_ctas, max_sms)
    return options


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(max(1, num_threads))


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def total_memory(device: torch.device) -> int:
    """Bytes of memory on the device (CPU: physical RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes of RAM the kernel says can be taken without swapping (MemAvailable); where that
    is unknown, all of it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_memory(torch.device("cpu"))


def memory_budget(device: torch.device, fraction: float, local_workers: int) -> float:
    """Bytes one worker may fill with weights and KV cache (--mem-fraction-static). A GPU is
    the worker's own: `fraction` of its memory, less what is already in use on it (another
    process's, the CUDA context) — the free memory minus the (1 - fraction) share left
    unused. A CPU's RAM is split among the node's workers."""
    if device.type == "cuda":
        # what this process freed is free again: a cost probe's blocks, and an earlier
        # engine's pool and weights, which reference cycles of its runner can keep until a
        # collection (seen on an H200: the next engine in a process got a budget of -1.3 GiB)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return free - total * (1 - fraction)
    return total_memory(device) * fraction / local_workers


def overlap_schedule_pays(device: torch.device, in_process: bool) -> bool:
    """Whether the CPU/device overlap loop is the faster default. It pays when the forward
    runs outside the scheduler's interpreter: on an accelerator (kernels queue
    asynchronously) or in a worker process. In-process on a CPU the forward's own Python and
    the scheduler take turns on one GIL and share the cores: the plain loop measured faster
    there (overlap at 0.62-0.92x of its decode throughput with 64 requests)."""
    return device.type != "cpu" or not in_process


def min_pipeline_chunk(device: torch.device) -> int:
    """The smallest chunk a PP/TP layout picks by itself. CPU: stages running side by side
    slow each other by ~17% at 256-token chunks but ~6% from 512 up (measured on 2 cores,
    bench preset), which a profile of one stage at a time cannot see. Accelerators: kernels
    need a few thousand rows to fill the device."""
    return 512 if device.type == "cpu" else 2048


def _native_function(
    name: str, device: torch.device | None = None
) -> Callable[..., torch.Tensor] | None:
    """A function of the compiled CPU kernels, or None (not built, or disabled, or `device`
    given and not the CPU)."""
    from pipeserve.kernels import native

    module = native() if device is None or device.type == "cpu" else None
    return None if module is None else getattr(module, name)


def native_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled CPU decode-attention kernel, or None (not built, or disabled)."""
    return _native_function("paged_decode_attention")


def native_index_scores(device: torch.device | None = None) -> Callable[..., torch.Tensor] | None:
    """The compiled CPU kernel of DeepSeek-V3.2's indexer scores (float32), or None (also for
    tensors on another `device`)."""
    return _native_function("index_scores", device)


def native_index_topk(device: torch.device | None = None) -> Callable[..., torch.Tensor] | None:
    """The compiled CPU kernel of DeepSeek-V3.2's indexer selection (scores and top-k fused:
    each query's index_topk best positions; float32), or None (also off the CPU)."""
    return _native_function("index_topk", device)


def native_index_topk_segments(
    device: torch.device | None = None,
) -> Callable[..., torch.Tensor] | None:
    """`native_index_topk` of a batch's segments in one call (each over its own rows of the
    keys), or None (also off the CPU)."""
    return _native_function("index_topk_segments", device)


def native_sparse_kernel(device: torch.device | None = None) -> Callable[..., torch.Tensor] | None:
    """The compiled CPU kernel of DeepSeek-V3.2's sparse attention in latent space (each query
    over its chosen cache rows only, read in place; float32 or bfloat16), or None (also off
    the CPU)."""
    return _native_function("sparse_latent_attention", device)


def native_bf16_pairs() -> bool:
    """Whether the compiled DeepSeek-V3.2 kernels multiply bfloat16 inputs by vdpbf16ps (built
    where the compiler targets AVX512-BF16): the bfloat16 forms of the indexer and of both sparse
    attention kernels. False without the kernels."""
    supported = _native_function("bf16_pairs_supported")
    return supported is not None and bool(supported())


def native_sparse_expanded_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled CPU kernel of DeepSeek-V3.2's sparse attention on up-projected keys (each
    query over its chosen positions only, swept in cache-sized blocks; float32 or bfloat16),
    or None."""
    return _native_function("sparse_expanded_attention")


def native_skinny_linear() -> Callable[..., torch.Tensor] | None:
    """The compiled CPU product of a linear layer for a few rows (decode steps; float32 or
    bfloat16 activations and weights, float32 arithmetic), or None."""
    return _native_function("skinny_linear")


# torch's CPU capabilities whose float32 sums add in the order kernels/rms_norm.cpp copies
# (8-lane vectors: x86's AVX512 builds run the AVX2 sum kernel); tested at all three
TORCH_SUM_ORDERS = ("AVX512", "AVX2", "DEFAULT")


def native_norm_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The compiled CPU RMSNorm and its residual-add form (kernels/rms_norm.cpp, bitwise the
    torch ops), or None: without the kernels, or where torch sums in another order (another
    CPU capability: ATEN_CPU_CAPABILITY, or another architecture)."""
    if (
        platform.machine().lower() not in ("x86_64", "amd64")  # aarch64's vectors: 4 lanes
        or torch.backends.cpu.get_cpu_capability() not in TORCH_SUM_ORDERS
    ):
        return None
    rms, add = _native_function("rms_norm"), _native_function("add_rms_norm")
    return None if rms is None or add is None else (rms, add)


def native_rope_store() -> Callable[..., torch.Tensor] | None:
    """The compiled CPU rotary embedding and KV write of a GQA layer (kernels/rope_store.cpp),
    or None."""
    return _native_function("rope_store")


def native_decode_stack() -> Callable[[], Any] | None:
    """The compiled CPU decode step through a stage's Llama-family layers in one call
    (kernels/decode_stack.cpp: its class, built empty and given its layers), or None."""
    return _native_function("DecodeStack")


def native_block_kernels() -> tuple[Callable[..., torch.Tensor], ...] | None:
    """The compiled kernels for weights kept in GGUF blocks (layers/block_quant.py): the
    skinny product (integer dot products, x in two 8-bit parts), the kept blocks' float32
    values, and a float32 weight's GGUF blocks (or None where its values are no
    dequantisation); None without the compiled kernels."""
    names = ("skinny_linear_blocks", "dequantize_blocks", "requantize_blocks")
    found = [_native_function(name) for name in names]
    return None if any(f is None for f in found) else tuple(f for f in found if f is not None)


def native_prefill_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """The compiled CPU prefill-attention kernel for `dtype`, or None: bfloat16 products on
    CPUs with AVX512-BF16; else float32 arithmetic on CPUs with AVX2 and FMA, for float32
    and (widened on load) bfloat16."""
    from pipeserve.kernels import native

    module = native()
    if module is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    if dtype == torch.bfloat16 and module.prefill_attention_supported():
        return module.paged_prefill_attention
    if module.prefill_attention_avx2_supported():
        return module.paged_prefill_attention_avx2
    return None


def fp8_gemm_unavailable(device: torch.device) -> str | None:
    """Why --fp8-weights keep cannot run on `device` (None: it can): the block-scaled FP8
    product (kernels/triton_fp8.py) needs fp8 matrix units and triton."""
    if device.type != "cuda":
        return (
            f"needs a CUDA GPU (this is {device.type}; on CPUs FP8 checkpoints are dequantised, "
            "as torch has no block-scaled fp8 product there)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (
            "needs fp8 matrix units (compute capability 8.9 or newer); this GPU's is "
            f"{capability[0]}.{capability[1]}"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs triton, which does not import here"
    return None


class ComputeStream:
    """An in-order queue of device work that runs while the caller's thread goes on.

    CPU: one worker thread with its own torch thread budget (torch releases the GIL inside
    ops, so the scheduler's Python runs meanwhile). CUDA: the same worker issues its kernels
    onto a dedicated `torch.cuda.Stream`.
    """

    def __init__(self, device: torch.device, num_threads: int) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute",
            initializer=self._init,
            initargs=(device, num_threads),
        )

    @staticmethod
    def _init(device: torch.device, num_threads: int) -> None:
        set_threads(num_threads)
        bind_thread(device, own_stream=True)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
