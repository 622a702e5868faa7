"""Native CPU kernels, compiled on first use with the machine's compiler and cached under
the pipeserve cache directory (keyed by source, torch version and CPU). If compiling is
impossible (no compiler, no headers) callers fall back to the pure-torch paths, with a
warning once; PIPESERVE_NATIVE_KERNELS=0 forces the fallback."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from pipeserve import envs

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("decode_attention.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine()


@cache
def native() -> ModuleType | None:
    if not envs.native_kernels_enabled():
        return None
    from torch.utils.cpp_extension import load

    key = hashlib.sha256(
        SOURCE.read_bytes()
        + torch.__version__.encode()
        + _cpu_id().encode()
        + " ".join(CFLAGS).encode()
    ).hexdigest()[:16]
    build = envs.kernel_cache_dir() / key
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(
            name=f"pipeserve_kernels_{key}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        log.warning(
            "native CPU kernels unavailable (%s); using the pure-torch attention path",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None


def warm_up() -> bool:
    """Compile now (e.g. before worker processes start) rather than on the first decode."""
    return native() is not None


__all__ = ["native", "warm_up", "os"]
