"""The one place a run's attention backend is chosen (`select_backend`, from --attention-backend,
the device, the dtype, the head dim, the layout's device count and batch-invariance), once per
model runner, and where another backend is registered (`register_backend`).

- auto on a CPU: the native kernels where they build (decode steps; prompt chunks too where a
  prefill kernel builds for the dtype and head dim, else on torch); else torch.
- auto on one CUDA device where triton imports: Triton, with prompt chunks over
  AUTO_TRITON_PROMPT_MAX_KEYS keys on the library kernels (FlashInfer where it imports, fits and
  runs, else torch's); on several devices, or without triton, the library kernels.
- native (CPU), torch, flashinfer (CUDA, float16/bfloat16), triton (CUDA; on a CPU only under
  TRITON_INTERPRET=1, for tests): that backend, or a ValueError saying why it cannot run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.backends.split import LongPromptSplit, PrefillDecodeSplit
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.backends.triton_backend import TritonBackend
from pipeserve.config import ATTENTION_BACKENDS, EngineConfig
from pipeserve.device import (
    native_decode_kernel,
    native_prefill_kernel,
    resolve_device,
    resolve_dtype,
)

if TYPE_CHECKING:
    from pipeserve.models.arch import ArchConfig

log = logging.getLogger(__name__)

HALF = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what FlashInfer's prebuilt kernels cover

# Under auto on CUDA, prompt chunks over more keys than this (cached prefix + the chunk) run on
# the library kernels (FlashInfer's or torch's flash) instead of the batched Triton kernel.
# Measured on an H200, bench preset, bf16 (benchmarks/results/gpu-check-h200-2026-11-28.md):
# a 128K prompt in 16K chunks took 4.85 s on the Triton kernel against 0.96 s on torch's flash
# (whose 128-row tiles read each key far fewer times than the Triton kernel's 16-row blocks);
# a 32K prompt in 2K chunks 0.370 s against 0.379 s; 64 prompts of 1K 0.23-0.41 s against
# 0.61 s (one launch per layer against a loop over the requests).
AUTO_TRITON_PROMPT_MAX_KEYS = 16384

# A backend registered by name: (device, dtype, head dim) -> the backend
Factory = Callable[[torch.device, torch.dtype, int], AttentionBackend]
REGISTERED: dict[str, Factory] = {}


def register_backend(name: str, factory: Factory) -> None:
    """Make `--attention-backend name` build its backend with `factory`."""
    if name in ATTENTION_BACKENDS and name not in REGISTERED:
        raise ValueError(f"attention backend {name!r} is built in")
    REGISTERED[name] = factory
    if name not in ATTENTION_BACKENDS:
        ATTENTION_BACKENDS.append(name)


def run_backend(config: EngineConfig, arch: ArchConfig) -> AttentionBackend:
    """The backend of a run of `arch` under `config` (its flags, device, dtype and layout),
    chosen once by whoever starts the run and handed to what sizes the pool and runs it."""
    m = config.model
    if m.enable_deterministic_inference and arch.mla is not None:
        raise ValueError(
            "--enable-deterministic-inference is not available for multi-head latent "
            f"attention ({arch.architecture}): its batch-invariant kernels are GQA's"
        )
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, arch.torch_dtype, m.device)
    devices = config.parallel.world_size
    deterministic = m.enable_deterministic_inference
    return select_backend(m.attention_backend, device, dtype, arch.head_dim, devices, deterministic)


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    devices: int = 1,
    deterministic: bool = False,
    load_flashinfer: Callable[[], ModuleType | None] | None = None,
) -> AttentionBackend:
    """The run's backend (see the module's docstring). `devices`: the layout's device count;
    `deterministic`: batch-invariant inference, which needs the native kernels for every step."""
    if name in REGISTERED:
        return REGISTERED[name](device, dtype, head_dim)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        )
    kind = device.type
    if deterministic:
        return _deterministic(name, kind, dtype, head_dim)
    if name == "triton" and triton_runs(name, kind):
        return TritonBackend()
    library = _library(name, kind, dtype, head_dim, load_flashinfer or import_flashinfer)
    if triton_runs(name, kind, devices):  # auto on one CUDA device
        return LongPromptSplit(TritonBackend(), library, AUTO_TRITON_PROMPT_MAX_KEYS)
    if name not in ("auto", "native") or kind != "cpu":
        return library
    if native_decode_kernel() is None:
        if name == "native":
            raise ValueError(
                "--attention-backend native: the native CPU kernel could not be built "
                "(see the warning above); use --attention-backend torch"
            )
        return library
    if head_dim % 16 == 0 and native_prefill_kernel(dtype) is not None:
        return NativeBackend()
    return PrefillDecodeSplit(library, NativeBackend())


def _deterministic(name: str, kind: str, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """The native kernels for every step, one-token prompt chunks on the prefill kernel."""
    missing = None
    if name not in ("auto", "native"):
        missing = f"--attention-backend {name} chose others (use auto)"
    elif kind != "cpu" or native_decode_kernel() is None:
        missing = "they could not be built here (see the warning above)"
    elif head_dim % 16:
        missing = f"head dim {head_dim} is not a multiple of 16"
    elif native_prefill_kernel(dtype) is None:
        missing = (
            f"no prefill kernel takes {str(dtype).removeprefix('torch.')} on this CPU (float32 "
            "needs AVX2 and FMA; bfloat16 AVX2 or AVX512-BF16)"
        )
    if missing is not None:
        raise ValueError(
            "--enable-deterministic-inference needs the native attention kernels for "
            f"prompts and decode steps, and {missing}"
        )
    return NativeBackend(deterministic=True)


def _library(
    name: str,
    kind: str,
    dtype: torch.dtype,
    head_dim: int,
    load: Callable[[], ModuleType | None],
) -> AttentionBackend:
    """The library kernels: FlashInfer where named, or under auto on CUDA where it imports,
    fits (float16/bfloat16, a head dim it was built for) and runs; else torch's."""
    if name == "native" and kind != "cpu":
        raise ValueError(
            f"--attention-backend native: the native kernels are compiled for the CPU (the "
            f"device is {kind}); use auto, torch or flashinfer"
        )
    if name == "flashinfer":
        return _flashinfer(_check_flashinfer(kind, dtype, head_dim, load), dtype, head_dim)
    fits = kind == "cuda" and dtype in HALF and head_dim in FLASHINFER_HEAD_DIMS
    module = load() if name == "auto" and fits else None
    if module is not None:
        try:
            return _flashinfer(module, dtype, head_dim)
        except ValueError as e:
            log.warning("%s: the torch attention kernels run instead", e)
    return TorchBackend(kind)


def triton_runs(backend: str, device_type: str, devices: int = 1) -> bool:
    """Whether the batched Triton kernels run (decode steps, and the prompt chunks the rule
    above leaves them): --attention-backend triton (ValueError where it cannot run), or auto
    on one CUDA device where triton imports (measured fastest there: decode steps replay CUDA
    graphs, 64 requests 21-27K tok/s against torch's eager steps at ~0.2K on an H200; a
    layout of several devices, whose steps are not captured and where the Triton path has
    not run, keeps the library kernels). On a CPU, triton runs only in its interpreter
    (TRITON_INTERPRET=1: the tests' way to run the engine's Triton path without a GPU)."""
    if backend == "auto":
        if device_type != "cuda" or devices != 1:
            return False
        error = _triton_import_error()
        if error is not None:
            log.info("triton does not import (%s): the torch attention kernels run", error)
        return error is None
    if backend != "triton":
        return False
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != "cuda" and not (device_type == "cpu" and interpreted):
        raise ValueError(
            f"--attention-backend triton runs on CUDA devices (the device is {device_type}; "
            "on a CPU only under TRITON_INTERPRET=1, for tests); use auto or torch"
        )
    error = _triton_import_error()
    if error is not None:
        raise ValueError(
            f"--attention-backend triton: triton does not import ({error}); use auto or torch"
        )
    return True


def _triton_import_error() -> str | None:
    """Why triton does not import, or None where it does."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def _check_flashinfer(
    device_type: str, dtype: torch.dtype, head_dim: int, load: Callable[[], ModuleType | None]
) -> ModuleType:
    if device_type != "cuda":
        raise ValueError(
            f"--attention-backend flashinfer needs a CUDA device (the device is {device_type}); "
            "use --attention-backend auto or torch"
        )
    if dtype not in HALF:
        raise ValueError(
            f"--attention-backend flashinfer runs float16/bfloat16 models, not {dtype}; "
            "use --dtype bfloat16 or --attention-backend torch"
        )
    if head_dim not in FLASHINFER_HEAD_DIMS:
        raise ValueError(
            f"--attention-backend flashinfer: head dim {head_dim} is not one FlashInfer's "
            f"kernels are built for ({FLASHINFER_HEAD_DIMS}); use --attention-backend torch"
        )
    module = load()
    if module is None:
        raise ValueError(
            "--attention-backend flashinfer: the flashinfer package does not import (pip "
            "install flashinfer-python, built for this torch and CUDA); or use "
            "--attention-backend torch"
        )
    return module


def _flashinfer(module: ModuleType, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """FlashInfer's kernels, after one tiny call where a GPU is present (an installed package
    may lack kernels for this GPU, or the compiler its JIT needs)."""
    from pipeserve.backends.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(module)
    if torch.cuda.is_available():
        x = torch.zeros(1, 1, head_dim, dtype=dtype, device="cuda")
        try:
            backend.attend_part(x, x, x, "NHD", True, 1.0)
        except Exception as e:  # whatever its build or JIT raises
            raise ValueError(
                f"--attention-backend flashinfer: its kernel does not run here ({e}); use "
                "--attention-backend torch"
            ) from e
    return backend


def import_flashinfer() -> ModuleType | None:
    """The flashinfer module, or None where it is not installed or does not load."""
    try:
        import flashinfer
    except (ImportError, OSError, RuntimeError) as e:
        log.info("flashinfer does not import (%s): the torch attention kernels run", e)
        return None
    return flashinfer
