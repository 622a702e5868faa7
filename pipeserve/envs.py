"""Environment variables, read in one typed place."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def _bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def dynamic_chunking_smooth_factor() -> float:
    """PIPESERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR: default smoothing factor (0.75)."""
    return _float("PIPESERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR", 0.75)


def pp_layer_partition() -> str | None:
    """PIPESERVE_PP_LAYER_PARTITION: layers per stage when --pp-layer-partition is not given."""
    return os.environ.get("PIPESERVE_PP_LAYER_PARTITION") or None


def disable_consecutive_prefill_overlap() -> bool:
    """PIPESERVE_DISABLE_CONSECUTIVE_PREFILL_OVERLAP: favour TTFT between prefill batches."""
    return _bool("PIPESERVE_DISABLE_CONSECUTIVE_PREFILL_OVERLAP")


def cache_dir() -> Path:
    """PIPESERVE_CACHE_DIR: where built-in preset checkpoints are made once and kept."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pipeserve"
    return Path(os.environ.get("PIPESERVE_CACHE_DIR", default))


def profile_cache_enabled() -> bool:
    """PIPESERVE_PROFILE_CACHE=0 re-profiles dynamic chunking at every start."""
    return os.environ.get("PIPESERVE_PROFILE_CACHE", "1").strip() not in ("0", "false", "no")


def native_kernels_enabled() -> bool:
    """PIPESERVE_NATIVE_KERNELS=0 uses the pure-torch attention paths only."""
    return os.environ.get("PIPESERVE_NATIVE_KERNELS", "1").strip() not in ("0", "false", "no")


def ram_claims_dir() -> Path:
    """PIPESERVE_RESERVATIONS_DIR: where the pipeserve runs of this host write their claims of
    RAM (default: a directory per user under /dev/shm, else under the temporary directory)."""
    raw = os.environ.get("PIPESERVE_RESERVATIONS_DIR")
    if raw:
        return Path(raw)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pipeserve-ram-claims-{os.getuid()}"


def sparse_attention_form() -> str:
    """PIPESERVE_SPARSE_ATTENTION_FORM: DeepSeek-V3.2's sparse attention on CPU, `latent` (always
    in latent space) or `expanded` (on up-projected keys, wherever the compiled kernel is
    built); `auto` or unset: the cheaper by the layer's cost rule."""
    raw = os.environ.get("PIPESERVE_SPARSE_ATTENTION_FORM", "").strip().lower() or "auto"
    if raw not in ("auto", "latent", "expanded"):
        raise ValueError(
            f"PIPESERVE_SPARSE_ATTENTION_FORM={raw!r}: expected auto, latent or expanded"
        )
    return raw


def decode_gather_max_bytes() -> int | None:
    """PIPESERVE_DECODE_GATHER_MAX_BYTES: on the torch attention backend, a decode step whose
    keys and values take fewer bytes than this is gathered with its group for one call (longer
    steps read their runs in place, a call each; 0: every step); unset: the device's default."""
    raw = os.environ.get("PIPESERVE_DECODE_GATHER_MAX_BYTES", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(
            f"PIPESERVE_DECODE_GATHER_MAX_BYTES={raw!r}: expected a whole number of bytes"
        )
    return int(raw)


def cpu_native_bf16() -> bool | None:
    """PIPESERVE_CPU_BF16: 0 hides the CPU's native bfloat16 matmul from `--dtype best` (the
    float32 rule on any CPU), 1 claims it (the bfloat16 rule); unset: read the CPU's flags."""
    raw = os.environ.get("PIPESERVE_CPU_BF16", "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable PIPESERVE_CPU_BF16={raw!r} is not 0, 1 or auto")


def num_threads() -> int | None:
    """PIPESERVE_NUM_THREADS: the thread budget to split among local workers (default: all
    cores). --threads-per-worker overrides it."""
    raw = os.environ.get("PIPESERVE_NUM_THREADS")
    return int(raw) if raw else None


def cpu_march() -> str:
    """PIPESERVE_CPU_MARCH: the compiler's -march for the native CPU kernels (default native:
    this CPU's own). Another target builds that CPU's branches, e.g. znver3 (AVX2 and FMA,
    no AVX512) for a fleet of older machines, or to run an AMD Zen 3's kernels on a newer
    CPU; x86-64 the portable ones."""
    raw = os.environ.get("PIPESERVE_CPU_MARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", raw):
        raise ValueError(f"environment variable PIPESERVE_CPU_MARCH={raw!r} is not a -march name")
    return raw


def kernel_cache_dir() -> Path:
    """PIPESERVE_KERNEL_CACHE_DIR: where native kernels are built (kept apart from
    PIPESERVE_CACHE_DIR, so a throwaway model/profile cache does not force a rebuild)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pipeserve-kernels"
    return Path(os.environ.get("PIPESERVE_KERNEL_CACHE_DIR", default))


def gloo_socket_ifname() -> str | None:
    """GLOO_SOCKET_IFNAME: the interface gloo binds to (multi-node: picked from the route to
    --dist-init-addr when not set)."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or None


def dist_auth_key() -> str | None:
    """PIPESERVE_DIST_AUTH_KEY: the shared secret of a multi-node control plane, when
    --dist-auth-key is not given."""
    return os.environ.get("PIPESERVE_DIST_AUTH_KEY") or None


def pd_auth_key() -> str | None:
    """PIPESERVE_PD_AUTH_KEY: the shared secret of prefill/decode disaggregation (router,
    prefill and decode servers), when --disaggregation-auth-key is not given."""
    return os.environ.get("PIPESERVE_PD_AUTH_KEY") or None


def show_tracebacks() -> bool:
    """PIPESERVE_TRACEBACK=1: settings refused at start-up print the check's traceback (from
    the command, the engine process and the workers) besides its one-line message."""
    return _bool("PIPESERVE_TRACEBACK")


def torch_profiler_dir() -> Path | None:
    """PIPESERVE_TORCH_PROFILER_DIR: every model runner profiles its forwards per operation
    and writes a table and a trace here when it closes (see pipeserve/op_profile)."""
    raw = os.environ.get("PIPESERVE_TORCH_PROFILER_DIR")
    return Path(raw) if raw else None
