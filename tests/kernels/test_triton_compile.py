"""Every Triton kernel the engine launches compiles for an H100/H200 (compute capability 9.0)
on this machine, with no GPU: benchmarks/triton_compile.py calls the kernels' wrappers as
the presets' layers do and compiles each launch as a GPU would (Triton's own specialisation,
ptxas). Each fits one block's shared memory and spills no registers: what the tile rules
(triton_attention.decode_tiles, extend_tiles and the heads a program takes) are chosen for,
with triton pinned (pyproject.toml) as several launches sit at 254-255 registers."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_compile.py"
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@functools.cache
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("triton_compile", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.slow


def needs_nvidia_tools() -> None:
    missing = [name for name in ("ptxas", "cuobjdump") if not (NVIDIA_BIN / name).exists()]
    if missing:
        pytest.skip(f"triton's NVIDIA backend has no {', '.join(missing)} here")


@pytest.fixture(scope="module")
def compiled() -> list:
    needs_nvidia_tools()
    return tool().compile_cases(tool().CASES, 90)


def test_every_launch_compiles_within_shared_memory(compiled: list) -> None:
    t = tool()
    assert t.problems(compiled, 90) == []
    kernels = {row.kernel for row in compiled}
    assert kernels == {fn for _, fn in t.KERNELS}  # every kernel the engine launches
    calls = {(row.case, row.call) for row in compiled}
    assert ("deepseek-v3.1 tp1 bfloat16", "absorbed_decode") in calls  # 128 heads share one
    assert len(calls) == len(compiled)  # one launch a call


def test_no_launch_spills_registers(compiled: list) -> None:
    spilled = [f"{r.case} {r.call}: {r.spill_bytes} B" for r in compiled if r.spill_bytes]
    assert spilled == []


def test_a_kernel_too_large_for_a_block_is_reported() -> None:
    """The check can fail: MLA's decode with all of DeepSeek-V3's 128 heads in one program
    (as before the heads were split) asks for more shared memory than an H100 block has."""
    needs_nvidia_tools()
    t = tool()
    from pipeserve.kernels import triton_attention

    case = t.Case("deepseek-v3.1", tp=1)
    saved = triton_attention.DECODE_MAX_HEADS
    kernel = triton_attention._decode_kernel
    caches, devices = kernel.device_caches, list(kernel.device_caches)
    triton_attention.DECODE_MAX_HEADS = 128
    try:
        rows = t.compile_cases([case], 90)
    finally:
        triton_attention.DECODE_MAX_HEADS = saved
    found = t.problems(rows, 90)
    assert len(found) == 1 and "absorbed_decode" in found[0] and "shared memory" in found[0]
    # the kernel is itself again, with no binary for the offline target left in its caches
    assert triton_attention._decode_kernel is kernel and kernel.device_caches is caches
    assert list(caches) == devices
