"""The compiled RMSNorm (kernels/rms_norm.cpp) against the torch ops it replaces
(backends/base.py NormKernels): bitwise, float32 and bfloat16, with and without the residual
add, widths below, at and past torch's 8-lane vectors and its cascade of sums, any leading
shape, at each CPU capability whose sum order it copies; each row alone as in a batch; bad
input refused. And which runs use it: the native backend's float32 and bfloat16 norms, not a
deterministic run's, not rows torch may sum split, not where torch sums in another order."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pipeserve import device
from pipeserve.backends.base import TORCH_NORMS
from pipeserve.backends.native_backend import NativeBackend, NativeNorms
from pipeserve.device import native_norm_kernels

KERNELS = native_norm_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the native CPU kernels do not build")
EPS = 1e-6
# below the 8 lanes; around them; SmolLM2's, Qwen's; past the first level of torch's cascade
# of sums (2^4 groups of 4 vectors: 512 values) and several levels; long rows
WIDTHS = [1, 3, 7, 8, 9, 13, 31, 32, 33, 64, 100, 128, 511, 512, 513, 576, 896, 2047, 4096]
WIDTHS += [5120, 8200, 20000]


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, w


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)


def mismatches(dtype: torch.dtype, widths: list[int], seeds: int) -> list[tuple[int, int]]:
    """(width, seed) of every norm whose result is not bitwise the torch ops'."""
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    bad = []
    for h in widths:
        for seed in range(seeds):
            x, residual, w = data((3, h), dtype, seed)
            x = x * (1 + seed)  # magnitudes apart, so sums round differently per order
            out, summed = add_rms_norm(x, residual, w, EPS)
            want_out, want_sum = TORCH_NORMS.add_rms_norm(x, residual, w, EPS)
            same = torch.equal(out, want_out) and torch.equal(summed, want_sum)
            if not (same and torch.equal(rms_norm(x, w, EPS), TORCH_NORMS.rms_norm(x, w, EPS))):
                bad.append((h, seed))
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_bitwise_the_torch_ops(dtype: torch.dtype) -> None:
    assert mismatches(dtype, WIDTHS, seeds=4) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (2, 3, 13), (0, 64)])
def test_any_leading_shape_and_the_exact_norm(dtype: torch.dtype, shape) -> None:
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    x, residual, w = data(shape, dtype)
    got = rms_norm(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, TORCH_NORMS.rms_norm(x, w, EPS))
    out, summed = add_rms_norm(x, residual, w, EPS)
    want_out, want_sum = TORCH_NORMS.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(out, want_out) and torch.equal(summed, want_sum)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact(x, w), atol=tol, rtol=tol)


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_bitwise_at_torch_s_other_cpu_capabilities(capability: str) -> None:
    """torch picks its kernels by CPU capability (ATEN_CPU_CAPABILITY lowers it); the order
    of its sums must be the copied one at each capability the kernel is used at."""
    code = (
        "import torch, sys\n"
        "from tests.kernels import test_rms_norm as t\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
        "bad = [t.mismatches(d, t.WIDTHS, 2) for d in (torch.float32, torch.bfloat16)]\n"
        "print(bad)\n"
        "sys.exit(1 if any(bad) else 0)\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[0] == capability.upper()


def test_a_row_is_the_same_alone_and_in_a_batch() -> None:
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, w = data((40, 96), dtype)
        whole = rms_norm(x, w, EPS)
        assert torch.equal(torch.cat([rms_norm(x[i : i + 1], w, EPS) for i in range(40)]), whole)
        assert torch.equal(
            add_rms_norm(x[5:6], residual[5:6], w, EPS)[0],
            add_rms_norm(x, residual, w, EPS)[0][5:6],
        )


def test_bad_input_is_refused() -> None:
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    x, residual, w = data((4, 64), torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rms_norm(x.half(), w.half(), EPS)
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm(x, w.bfloat16(), EPS)
    with pytest.raises(RuntimeError, match="hidden"):
        rms_norm(x[:, :32], w, EPS)
    with pytest.raises(RuntimeError, match="residual"):
        add_rms_norm(x, residual[:2], w, EPS)


def test_the_native_backend_norms_with_it_unless_deterministic() -> None:
    backend = NativeBackend()
    assert isinstance(backend.norms, NativeNorms)
    calls = []
    kernel = backend.norms.native_add_rms_norm
    backend.norms.native_add_rms_norm = lambda *a: calls.append(a[0].dtype) or kernel(*a)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, residual, w = data((3, 64), dtype)
        out = backend.norms.add_rms_norm(x, residual, w, EPS)
        assert torch.equal(out[0], TORCH_NORMS.add_rms_norm(x, residual, w, EPS)[0])
    x, residual, w = data((3, 64), torch.float32)
    backend.norms.add_rms_norm(x.T.contiguous().T, residual, w, EPS)  # not contiguous: torch
    long_x, long_residual, long_w = data((1, 32768), torch.float32)
    backend.norms.add_rms_norm(long_x, long_residual, long_w, EPS)  # torch may split its sum
    assert calls == [torch.float32, torch.bfloat16]  # float16: torch's
    assert NativeBackend(deterministic=True).norms is TORCH_NORMS


def test_not_used_where_torch_sums_in_another_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another capability (ARM's SVE), or another architecture whatever it is called (aarch64's
    DEFAULT has vectors of 4 lanes): the torch ops."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
        assert device.native_norm_kernels() is None
        assert not isinstance(NativeBackend().norms, NativeNorms)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
        patch.setattr(platform, "machine", lambda: "aarch64")
        assert device.native_norm_kernels() is None
    assert device.native_norm_kernels() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_rows_are_the_torch_ops(dtype: torch.dtype) -> None:
    """A row holding a NaN or an inf gives the torch ops' values: NaN where they have NaN
    (torch's own casts disagree on a NaN's bits, scalar against vectorised), equal elsewhere;
    a NaN's row all NaN, an inf's row zeros but the inf, the other rows untouched."""
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    x, residual, w = data((4, 100), dtype)
    x[0, 5], x[1, 97], x[2, 3] = float("nan"), float("inf"), -float("inf")
    for ours, theirs in (
        (rms_norm(x, w, EPS), TORCH_NORMS.rms_norm(x, w, EPS)),
        (add_rms_norm(x, residual, w, EPS)[0], TORCH_NORMS.add_rms_norm(x, residual, w, EPS)[0]),
    ):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, equal_nan=True)
        assert ours[0].isnan().all() and not ours[3].isnan().any()
        assert ours[1].isnan().sum() == 1 and ours[1, 97].isnan()  # inf x 0; the rest 0
