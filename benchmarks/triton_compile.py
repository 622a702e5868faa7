"""Every Triton kernel the engine launches, compiled for NVIDIA GPUs on a machine without one:
what each launch would cost in shared memory and registers, and whether it compiles at all,
before GPU time is spent finding out.

The kernels' own wrappers are called on CPU tensors shaped as the engine's layers are (the
bench presets, small released models' presets, the released DeepSeek-V3.1 and Qwen3-235B
configs under tensor-parallel sizes they are served at, and what the CUDA tests run: the
tiny presets in float32 and bfloat16, the kernel tests' shapes in each dtype). Each launch
is caught before it runs and compiled instead by Triton's own path (`JITFunction.warmup`:
the same specialisation and options a GPU launch would get) for a GPU of the named compute
capability, through a stand-in for the CUDA driver that only names the target. ptxas
(shipped with triton) builds the binary; cuobjdump reads its registers and spill stack. A
kernel that fails to compile, a call that launches none, or a launch asking for more shared
memory than the GPU gives one block fails the run.

    python benchmarks/triton_compile.py --json out/triton_compile.json
    python benchmarks/triton_compile.py --arch 80 --cases bench bench-deepseek
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from pipeserve.backends.base import ExpandedSpan
from pipeserve.kernels import triton_attention, triton_fp8, triton_norm, triton_rope
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import CONFIG_PRESETS
from pipeserve.models.presets import PRESETS

# Shared memory one block may use (bytes), by compute capability: the opt-in maximum
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
FP8_CAPABILITY = 89  # fp8 matrix units: the FP8 kernels run from here on
KERNELS = [
    (triton_attention, "_decode_kernel"),
    (triton_attention, "_extend_kernel"),
    (triton_norm, "_rms_norm_kernel"),
    (triton_rope, "_norm_rope_store_kernel"),
    (triton_fp8, "_fp8_gemm_kernel"),
    (triton_fp8, "_fp8_grouped_kernel"),
]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@dataclass
class Compiled:
    case: str
    call: str
    kernel: str
    constexprs: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_bytes: int  # a thread's stack: registers spilled to local memory
    seconds: float
    error: str = ""


class TargetOnly:
    """The driver calls a compile makes, naming `capability` as the current GPU."""

    def __init__(self, capability: int) -> None:
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread of the kernel takes, from cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {text!r}")
    return int(match[1]), int(match[2])


class Caught:
    """A kernel whose launches are compiled, not run: each one's figures go to `out`."""

    def __init__(self, kernel: Any, out: list[Compiled], where: list[str]) -> None:
        self.kernel, self.out, self.where = kernel, out, where

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            constexprs = {k: v for k, v in kwargs.items() if k in self.kernel.arg_names}
            shown = ", ".join(f"{k}={v}" for k, v in constexprs.items())
            start = time.perf_counter()
            row = Compiled(*self.where, self.kernel.fn.__name__, shown, 0, 0, 0, 0, 0, 0.0)
            try:
                compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            except Exception as e:  # whatever the compiler raises
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            else:
                meta = compiled.metadata
                row.num_warps, row.num_stages, row.shared_bytes = (
                    meta.num_warps,
                    meta.num_stages,
                    meta.shared,
                )
                row.registers, row.spill_bytes = resources(compiled.asm["cubin"])
            row.seconds = round(time.perf_counter() - start, 2)
            self.out.append(row)

        return launch


@contextmanager
def offline(capability: int, out: list[Compiled], where: list[str]) -> Iterator[None]:
    """Within: Triton compiles for `capability`, and the engine's kernels' launches are
    compiled into `out` instead of run (`where`: the case and call now running)."""
    saved = driver._active
    driver.set_active(TargetOnly(capability))  # type: ignore[arg-type]
    originals = [(module, name, getattr(module, name)) for module, name in KERNELS]
    # a kernel keeps its target per device once it has compiled: this target's apart
    caches = [kernel.device_caches for _, _, kernel in originals]
    try:
        for module, name, kernel in originals:
            kernel.device_caches = defaultdict(kernel.create_binder)
            setattr(module, name, Caught(kernel, out, where))
        yield
    finally:
        for (module, name, kernel), cache in zip(originals, caches, strict=True):
            setattr(module, name, kernel)
            kernel.device_caches = cache
        driver._active = saved


# -- the launches of a layer, per kind of model ---------------------------------------------


def _pool(kv_heads: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(kv_heads, 64, width, dtype=dtype)


def _table(requests: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.arange(requests + 1, dtype=torch.int32) * length
    return indptr, torch.zeros(requests * length, dtype=torch.int32)


def gqa_calls(arch: ArchConfig, tp: int, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    h, hk, d = arch.num_heads // tp, max(1, arch.num_kv_heads // tp), arch.head_dim
    k_cache, v_cache = _pool(hk, d, dtype), _pool(hk, d, dtype)

    def decode() -> None:
        q = torch.zeros(4, hk, h // hk, d, dtype=dtype)
        triton_attention.paged_decode(q, k_cache, v_cache, *_table(4, 8), 0.1, splits=2)

    def extend() -> None:
        q = torch.zeros(40, h, d, dtype=dtype)
        chunks = torch.tensor([[0, 20, 4], [20, 20, 0]], dtype=torch.int32)
        blocks = triton_attention.extend_blocks([20, 20])
        indptr, indices = _table(2, 24)
        triton_attention.paged_extend(q, k_cache, v_cache, indptr, indices, chunks, *blocks, 0.1)

    def rope() -> None:
        q = torch.zeros(4, h, d, dtype=dtype)
        k, v = torch.zeros(4, hk, d, dtype=dtype), torch.zeros(4, hk, d, dtype=dtype)
        cos = sin = torch.zeros(4, 1, d, dtype=dtype)
        norm = torch.ones(d, dtype=dtype)
        norms = (norm, norm, 1e-6) if arch.qk_norm else None
        slots = torch.zeros(4, dtype=torch.long)
        triton_rope.norm_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, norms)

    return {"decode": decode, "extend": extend, "rope_store": rope}


def mla_calls(arch: ArchConfig, tp: int, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    m = arch.mla
    assert m is not None
    h, rank, rope = arch.num_heads // tp, m.kv_lora_rank, m.qk_rope_head_dim
    nope, dv = m.qk_nope_head_dim, m.v_head_dim
    latents = torch.zeros(64, rank + rope, dtype=dtype)

    def absorbed_decode() -> None:  # decode steps, and V3.2's over their chosen rows
        q = torch.zeros(4, 1, h, rank + rope, dtype=dtype)
        table = latents[None]
        triton_attention.paged_decode(q, table, table, *_table(4, 8), 0.1, splits=2, rope=rope)

    def expanded() -> None:
        up = torch.zeros(48, h, nope + dv, dtype=dtype)
        k_nope, v = up.split([nope, dv], -1)
        q = torch.zeros(40, h, nope + rope, dtype=dtype)
        out = torch.zeros(40, h, dv, dtype=dtype)
        spans = (ExpandedSpan(0, 20, 4, 0), ExpandedSpan(20, 20, 4, 24))
        block_m = triton_attention.expanded_block_m(dtype)
        tables = _expanded_tables(spans, 48, block_m)
        triton_attention.expanded_extend(q, k_nope, latents[:48, rank:], v, tables, 0.1, out)

    return {"absorbed_decode": absorbed_decode, "expanded_extend": expanded}


def _expanded_tables(spans: tuple[ExpandedSpan, ...], keys: int, block_m: int) -> tuple:
    from pipeserve.backends.triton_backend import expanded_tables

    return expanded_tables(spans, keys, torch.device("cpu"), block_m)


def norm_calls(arch: ArchConfig, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The layers' norms: the hidden state's (with the residual add too), and MLA's of the
    latent and the compressed query."""
    widths = {"": arch.hidden_size}
    if arch.mla is not None:
        widths["_kv_a"] = arch.mla.kv_lora_rank
        if arch.mla.q_lora_rank:
            widths["_q_a"] = arch.mla.q_lora_rank
    calls: dict[str, Callable[[], Any]] = {}
    for suffix, width in widths.items():
        x = torch.zeros(4, width, dtype=dtype)
        w = torch.ones(width, dtype=dtype)
        if triton_norm.fits(x, w):
            calls[f"rms_norm{suffix}"] = lambda x=x, w=w: triton_norm.rms_norm(x, w, 1e-6)
    x = torch.zeros(4, arch.hidden_size, dtype=dtype)
    w = torch.ones(arch.hidden_size, dtype=dtype)
    if triton_norm.fits(x, w):
        calls["add_rms_norm"] = lambda: triton_norm.add_rms_norm(x, x, w, 1e-6)
    return calls


def fp8_calls(arch: ArchConfig, tp: int) -> dict[str, Callable[[], Any]]:
    """The FP8 products of a checkpoint kept in FP8 (--fp8-weights keep): a column-parallel
    projection of the hidden state, for decode-sized and prompt-sized row counts, and the
    routed experts' grouped product."""
    k = arch.hidden_size
    n = max(128, arch.intermediate_size // tp)
    weight = torch.zeros(n, k, dtype=triton_fp8.FP8)
    scale = torch.ones(-(-n // 128), -(-k // 128))
    calls: dict[str, Callable[[], Any]] = {}
    for rows in (4, 256):
        x = torch.zeros(rows, k, dtype=BF16)
        calls[f"fp8_linear_{rows}"] = lambda x=x: triton_fp8.fp8_linear(x, weight, scale)
    if arch.num_experts:
        e, n_e = 4, max(128, arch.moe_intermediate_size)
        w_e = torch.zeros(e, n_e, k, dtype=triton_fp8.FP8)
        s_e = torch.ones(e, -(-n_e // 128), -(-k // 128))
        ends = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
        x = torch.zeros(32, k, dtype=BF16)
        calls["fp8_grouped"] = lambda: triton_fp8.fp8_grouped_linear(x, w_e, s_e, ends)
    return calls


@dataclass(frozen=True)
class Case:
    """A model as one rank of a layout computes it: its preset, tensor-parallel size, dtype."""

    preset: str
    tp: int = 1
    dtype: torch.dtype = BF16
    overrides: tuple[tuple[str, Any], ...] = ()  # config.json fields changed
    label: str = ""  # the name instead of the preset's

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.label or self.preset} tp{self.tp} {dtype}"

    def arch(self) -> ArchConfig:
        config = {**(CONFIG_PRESETS.get(self.preset) or PRESETS[self.preset])}
        config.update(self.overrides)
        return ArchConfig.from_dict({k: v for k, v in config.items() if k != "_init_std"})

    def calls(self, capability: int) -> dict[str, Callable[[], Any]]:
        arch = self.arch()
        attention = mla_calls if arch.mla is not None else gqa_calls
        calls = {**attention(arch, self.tp, self.dtype), **norm_calls(arch, self.dtype)}
        if arch.quantization is not None and capability >= FP8_CAPABILITY:
            calls.update(fp8_calls(arch, self.tp))
        return calls


KERNEL_TEST = (
    ("num_attention_heads", 32),
    ("num_key_value_heads", 8),
    ("head_dim", 128),
    ("hidden_size", 5120),
)
CASES = [
    Case("bench"),
    Case("bench-deepseek"),
    Case("bench-moe"),
    Case("qwen3-0.6b"),
    Case("qwen2.5-0.5b"),  # 7 heads a KV head: 128 rows a prompt program
    Case("llama-3.2-1b"),
    Case("deepseek-v3.1", tp=8),
    Case("deepseek-v3.1", tp=1),
    Case("qwen3-235b-a22b", tp=4),
    # what the CUDA tests run: the engine's tiny presets in float32 and bfloat16, and the
    # kernel tests' shapes (32 query heads over 8 KV heads of 128, hidden 5120) in each dtype
    *(Case(p, 1, F32) for p in ("tiny-llama", "tiny-qwen3", "tiny-deepseek-v3")),
    Case("tiny-deepseek-v3", 1, BF16),
    *(Case("bench", 1, dtype, KERNEL_TEST, "kernel-test") for dtype in (BF16, F16, F32)),
]


def compile_cases(cases: list[Case], capability: int) -> list[Compiled]:
    out: list[Compiled] = []
    where = ["", ""]
    with offline(capability, out, where):
        for case in cases:
            for call, run in case.calls(capability).items():
                where[:] = [case.name, call]
                before = len(out)
                run()
                if len(out) == before:
                    out.append(Compiled(case.name, call, "", "", 0, 0, 0, 0, 0, 0.0))
                    out[-1].error = "launched no kernel"
    return out


def problems(rows: list[Compiled], capability: int) -> list[str]:
    """What fails the run: a kernel that does not compile, or wants more shared memory than
    one block may have."""
    limit = SHARED_LIMIT.get(capability, min(SHARED_LIMIT.values()))
    found = [f"{r.case} {r.call}: {r.error}" for r in rows if r.error]
    found += [
        f"{r.case} {r.call}: {r.shared_bytes} bytes of shared memory, over {limit}"
        for r in rows
        if r.shared_bytes > limit
    ]
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    p.add_argument("--cases", nargs="*", default=None, help="presets (default: all cases)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cases = [c for c in CASES if args.cases is None or c.preset in args.cases]
    start = time.perf_counter()
    rows = compile_cases(cases, args.arch)
    for r in rows:
        figures = (
            f"{r.error}"
            if r.error
            else f"warps {r.num_warps} stages {r.num_stages} shared {r.shared_bytes:>6} B "
            f"regs {r.registers:>3} spill {r.spill_bytes:>5} B ({r.seconds:.1f} s)"
        )
        print(f"{r.case:<28} {r.call:<16} {r.kernel:<24} {figures}")
    found = problems(rows, args.arch)
    result = {
        "what": "Triton kernels of the engine compiled offline (no GPU) for compute capability "
        f"{args.arch}: shared memory, registers and spill stack per launch configuration",
        "triton": triton.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": [asdict(r) for r in rows],
        "problems": found,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for line in found:
        print("PROBLEM:", line)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
