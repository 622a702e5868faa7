"""The compiled RMSNorm (kernels/rms_norm.cpp) against the torch ops it replaces
(backends/base.py NormKernels) and float64: float32 and bfloat16, with and without the
residual add, widths not a multiple of the 8 lanes, any leading shape; each row alone as in
a batch; bad input refused. And which runs use it: the native backend's float32 norms, not a
deterministic run's (nor bfloat16 ones: see NativeNorms)."""

from __future__ import annotations

import pytest
import torch

from pipeserve.backends.base import TORCH_NORMS
from pipeserve.backends.native_backend import NativeBackend, NativeNorms
from pipeserve.device import native_norm_kernels

KERNELS = native_norm_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the native CPU kernels do not build")
EPS = 1e-6


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, w


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (2, 3, 13), (0, 64)])
def test_the_kernel_computes_the_torch_ops_norm(dtype: torch.dtype, shape) -> None:
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    x, residual, w = data(shape, dtype)
    got = rms_norm(x, w, EPS)
    want = TORCH_NORMS.rms_norm(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    out, summed = add_rms_norm(x, residual, w, EPS)
    want_out, want_sum = TORCH_NORMS.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(summed, want_sum)  # x + residual, rounded to the dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    else:  # the same roundings; a float32 sum in another order moves a value by 1 ulp at most
        for ours, theirs in ((got, want), (out, want_out)):
            ulp = 2.0 ** (torch.frexp(theirs.float()).exponent - 8).float()
            assert ((ours.float() - theirs.float()).abs() <= ulp).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact(x, w), atol=tol, rtol=tol)


def test_a_row_is_the_same_alone_and_in_a_batch() -> None:
    assert KERNELS is not None
    rms_norm, add_rms_norm = KERNELS
    x, residual, w = data((40, 96), torch.float32)
    whole = rms_norm(x, w, EPS)
    assert torch.equal(torch.cat([rms_norm(x[i : i + 1], w, EPS) for i in range(40)]), whole)
    assert torch.equal(
        add_rms_norm(x[5:6], residual[5:6], w, EPS)[0], add_rms_norm(x, residual, w, EPS)[0][5:6]
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


def test_the_native_backend_norms_float32_with_it_unless_deterministic() -> None:
    backend = NativeBackend()
    assert isinstance(backend.norms, NativeNorms)
    x, residual, w = data((3, 64), torch.float32)
    calls = []
    kernel = backend.norms.native_add_rms_norm
    backend.norms.native_add_rms_norm = lambda *a: calls.append(1) or kernel(*a)
    backend.norms.add_rms_norm(x, residual, w, EPS)
    backend.norms.add_rms_norm(x.T.contiguous().T, residual, w, EPS)  # not contiguous: torch
    backend.norms.add_rms_norm(x.half(), residual.half(), w.half(), EPS)  # float16: torch
    backend.norms.add_rms_norm(x.bfloat16(), residual.bfloat16(), w.bfloat16(), EPS)  # torch
    assert calls == [1]
    assert NativeBackend(deterministic=True).norms is TORCH_NORMS
