"""Block-scaled FP8 matrix products in Triton, for FP8 checkpoints kept in FP8 on GPUs with fp8
matrix units (compute capability 8.9 and up; `--fp8-weights keep`).

The weight W [N, K] is the checkpoint's: float8_e4m3fn values and a float32 scale per 128 x
128 block (`scale_inv` [ceil(N / 128), ceil(K / 128)], partial blocks at the edges), so W[n, k]
= w[n, k] * scale_inv[n // 128, k // 128]. The activations are quantised on the fly, one scale
per 1 x 128 group of a row (the checkpoint's `activation_scheme: dynamic`): x[m, k] ~ a[m, k] *
a_scale[m, k // 128], a_scale = the group's largest magnitude / 448. Then

    y[m, n] = sum_g a_scale[m, g] * scale_inv[n // 128, g] * sum_{k in group g} a[m, k] w[n, k]

one fp8 dot product per 128-wide group, accumulated in float32 and scaled as it is added. The
quantisation of the activations is torch's (its float32 -> fp8 conversion rounds to nearest
even; Triton's interpreter does not, so the interpreter tests take the same path); the product
is one Triton kernel. A weight slice that starts inside a block (QKV's K and V rows) passes
`row_offset`, the slice's first row in the block grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128  # the checkpoints' block size, and the activations' group
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 values [M, K], float32 scales [M, ceil(K / 128)]): each 1 x 128 group
    (the last one partial) scaled so its largest magnitude is fp8's largest; an all-zero group
    gets a tiny scale, and its values stay 0."""
    m, k = x.shape
    groups = -(-k // GROUP)
    padded = x.float()
    if k % GROUP:
        padded = torch.nn.functional.pad(padded, (0, groups * GROUP - k))
    blocks = padded.view(m, groups, GROUP)
    scales = blocks.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scales[..., None]).to(FP8).view(m, groups * GROUP)
    return q[:, :k], scales


@triton.jit
def _add_group_products(
    acc, A, A_SCALE, m, m_ok, W, W_SCALE_ROWS, n, N, K, sa, sw, GROUPS: tl.constexpr
):
    """acc [rows, cols] plus rows m (where m_ok) of the quantised activations times weight
    rows n: one fp8 dot per 128-wide group, scaled by the rows' activation scales and the
    weight rows' block scales (W_SCALE_ROWS: each weight row's row of the scale grid)."""
    k = tl.arange(0, 128)
    for g in range(GROUPS):
        kk = g * 128 + k
        inside = kk[None, :] < K
        a = tl.load(A + m[:, None] * sa + kk[None, :], mask=m_ok[:, None] & inside, other=0.0)
        w = tl.load(W + n[:, None] * sw + kk[None, :], mask=(n[:, None] < N) & inside, other=0.0)
        a_scale = tl.load(A_SCALE + m * GROUPS + g, mask=m_ok, other=0.0)
        w_scale = tl.load(W_SCALE_ROWS + g, mask=n < N, other=0.0)
        part = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        acc += part * a_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "row_offset"])
def _fp8_gemm_kernel(
    A,
    A_SCALE,
    W,
    W_SCALE,
    BIAS,
    OUT,
    M,
    N,
    K,
    sa,
    sw,
    so,
    sws,
    row_offset,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = (n + row_offset) // 128  # each weight row's block row in the scale grid
    acc = _add_group_products(
        acc, A, A_SCALE, m, m < M, W, W_SCALE + w_rows * sws, n, N, K, sa, sw, GROUPS
    )
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = OUT + m[:, None] * so + n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_offset: int = 0,
) -> torch.Tensor:
    """x [..., K] (the compute dtype) times the block-quantised weight [N, K] (fp8) with its
    scale grid, plus bias -> [..., N] in x's dtype. `row_offset`: where weight's first row sits
    in the grid's blocks (scale_inv's first row covers rows [-row_offset % 128 ...)), for a
    slice of a larger weight."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    assert weight.dtype == FP8 and weight.shape[1] == k and weight.stride(1) == 1
    groups = -(-k // GROUP)
    assert scale_inv.shape[1] >= groups and scale_inv.stride(1) == 1
    assert scale_inv.shape[0] * GROUP >= row_offset % GROUP + n
    rows = x.reshape(-1, k)
    a, a_scale = quantize_groups(rows)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        a,
        a_scale.contiguous(),
        weight,
        scale_inv,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        out.stride(0),
        scale_inv.stride(0),
        row_offset % GROUP,
        GROUPS=groups,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
    )
    return out.view(*lead, n)


@triton.jit(do_not_specialize=["P", "E"])
def _fp8_grouped_kernel(
    A,
    A_SCALE,
    W,
    W_SCALE,
    ENDS,
    OUT,
    P,
    N,
    K,
    E,
    sa,
    swe,
    sw,
    sse,
    sws,
    so,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows sorted by expert (expert e's rows end at ENDS[e]; rows past the last end are left
    alone): each program's tile of rows is multiplied by the weights of every expert whose rows
    it meets, each expert's rows only."""
    m0 = tl.program_id(0) * BLOCK_M
    m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = tl.program_id(0).to(tl.int64) * 0  # an int64 scalar, as the ends it takes
    for e in range(E):
        end = tl.load(ENDS + e).to(tl.int64)
        if (start < end) & (start < m0 + BLOCK_M) & (end > m0):
            rows = (m >= start) & (m < end)
            scale_rows = W_SCALE + e * sse + (n // 128) * sws
            acc = _add_group_products(
                acc, A, A_SCALE, m, rows, W + e * swe, scale_rows, n, N, K, sa, sw, GROUPS
            )
        start = end
    last = tl.load(ENDS + E - 1).to(tl.int64)
    out = OUT + m[:, None] * so + n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=(m[:, None] < last) & (n[None, :] < N))


def fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Rows x [P, K] sorted by expert (expert e's rows end at ends[e], int32 on x's device)
    times their experts' block-quantised weights [E, N, K] (fp8) with scale grids [E, ceil(N /
    128), ceil(K / 128)] -> [P, N] in x's dtype; rows past ends[-1] are left as they were
    (uninitialised). No host read: the group ends stay on the device."""
    p, k = x.shape
    e, n = weight.shape[:2]
    assert weight.dtype == FP8 and weight.shape[2] == k and weight.stride(2) == 1
    groups = -(-k // GROUP)
    assert scale_inv.shape == (e, -(-n // GROUP), groups) and scale_inv.stride(2) == 1
    out = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p == 0 or n == 0 or e == 0:
        return out
    a, a_scale = quantize_groups(x)
    block_m, block_n = (16 if p <= 16 else 64), 64
    grid = (triton.cdiv(p, block_m), triton.cdiv(n, block_n))
    _fp8_grouped_kernel[grid](
        a,
        a_scale.contiguous(),
        weight,
        scale_inv,
        ends,
        out,
        p,
        n,
        k,
        e,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        scale_inv.stride(0),
        scale_inv.stride(1),
        out.stride(0),
        GROUPS=groups,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out
