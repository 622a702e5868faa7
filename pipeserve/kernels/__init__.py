"""Native CPU kernels, compiled on first use with the machine's compiler and cached under
the pipeserve kernel cache directory (keyed by source, torch version, CPU and flags; the
target is this CPU unless PIPESERVE_CPU_MARCH names another). If compiling is impossible (no
compiler, no headers) callers fall back to the pure-torch paths, with a warning once;
PIPESERVE_NATIVE_KERNELS=0 forces the fallback."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from pipeserve import envs

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [
    HERE / n
    for n in (
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "prefill_attention_avx2.cpp",
        "shm_allreduce.cpp",
        "index_scores.cpp",
        "sparse_attention.cpp",
        "sparse_expanded.cpp",
        "skinny_linear.cpp",
        "rms_norm.cpp",
        "rope_store.cpp",
        "decode_stack.cpp",
        "bindings.cpp",
    )
]
HEADERS = [HERE / n for n in ("kernels.h", "prefill_common.h", "vec8.h", "bf16_pairs.h")]
CFLAGS = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


def cflags() -> list[str]:
    """The build's flags: CFLAGS with the target CPU (PIPESERVE_CPU_MARCH, default native)."""
    return [f"-march={envs.cpu_march()}", *CFLAGS]


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine()


def _key() -> str:
    return hashlib.sha256(
        b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
        + torch.__version__.encode()
        + _cpu_id().encode()
        + " ".join(cflags()).encode()
    ).hexdigest()[:16]


@cache
def native() -> ModuleType | None:
    if not envs.native_kernels_enabled():
        return None
    name = f"pipeserve_kernels_{_key()}"
    built = envs.kernel_cache_dir() / f"{name}.so"
    try:
        if not built.is_file():
            _build(name, built)
        return _import(name, built)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        log.warning(
            "native CPU kernels unavailable (%s); using the pure-torch attention path",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None


def _build(name: str, target: Path) -> None:
    """Compile in a directory of this process's own and publish the library with an atomic
    rename: processes building at once never wait on each other's lock, and a build killed
    half-way leaves nothing another process would trust or wait for."""
    from torch.utils.cpp_extension import load

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".build-{name}-") as tmp:
        load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_include_paths=[str(HERE)],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=tmp,
            verbose=False,
            is_python_module=False,  # built only; imported from its final place below
        )
        os.replace(Path(tmp) / f"{name}.so", target)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def warm_up() -> bool:
    """Compile now (e.g. before worker processes start) rather than on the first decode."""
    return native() is not None


__all__ = ["native", "warm_up"]
