"""RMSNorm for accelerators, in Triton: one launch for a norm, or for the pre-norm decoder's
residual add and the norm of its sum, where the eager ops take eight.

The rounding is that of pipeserve.layers.layernorm.RMSNorm: the sum rounded to the inputs'
dtype, the norm in float32, the normed row rounded to the dtype before the weight multiplies
it (in float32, rounded once). A program holds whole rows in registers: one (up to MAX_HIDDEN
values; `fits` says where the torch ops run instead), or several short ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384


@triton.jit
def rms_scale(x, n, eps):
    """What RMSNorm multiplies each row of x [rows, BLOCK] (n values, 0 past them) by: [rows,
    1] float32."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, 1, keep_dims=True) / n + eps)


@triton.jit
def rms_weighted(x, scale, w):
    """x (in its dtype) times its row's `scale`, rounded to the dtype (RMSNorm casts back
    before the weight), times the weight w -> float32 values of the dtype."""
    normed = (x.to(tl.float32) * scale).to(x.dtype).to(tl.float32)
    return (w.to(tl.float32) * normed).to(x.dtype).to(tl.float32)


@triton.jit(do_not_specialize=["rows", "sx", "sr", "so", "ss"])
def _rms_norm_kernel(
    X,
    RES,
    W,
    OUT,
    SUM,
    rows,
    sx,
    sr,
    so,
    ss,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr,
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    valid = (r < rows) & (c < N)
    x = tl.load(X + r * sx + c, mask=valid, other=0.0)
    if ADD:  # the residual stream: x + residual, rounded to the dtype as torch's add
        res = tl.load(RES + r * sr + c, mask=valid, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(SUM + r * ss + c, x, mask=valid)
    w = tl.load(W + c, mask=c < N, other=0.0)
    tl.store(OUT + r * so + c, rms_weighted(x, rms_scale(x, N, eps), w), mask=valid)


def fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the kernel computes this norm: one dtype and shape for x and the residual, rows
    contiguous and short enough for registers."""
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        return False
    same = x.dtype == weight.dtype and (residual is None or residual.dtype == x.dtype)
    return same and x.stride(-1) == 1 and x.shape[-1] == weight.numel() <= MAX_HIDDEN


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward: x [..., hidden] -> the same shape (see `fits`)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x.reshape(-1, x.shape[-1]), None, weight, out.view(-1, x.shape[-1]), None, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.add_and_norm: (norm(x + residual), x + residual), each like x (see `fits`)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out)
    n = x.shape[-1]
    _launch(
        x.reshape(-1, n), residual.reshape(-1, n), weight, out.view(-1, n), total.view(-1, n), eps
    )
    return out, total


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    total: torch.Tensor | None,
    eps: float,
) -> None:
    """x, residual, out, total: [rows, n]."""
    rows, n = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    per_program = min(16, max(1, 4096 // block))  # short rows: several to a program
    _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if total is None else total,
        rows,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        out.stride(0) if total is None else total.stride(0),
        eps,
        N=n,
        BLOCK=block,
        ROWS=per_program,
        ADD=residual is not None,
        num_warps=min(16, max(1, per_program * block // 512)),
    )
