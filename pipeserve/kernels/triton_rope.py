"""A GQA layer's queries and keys made ready for attention, in Triton: the per-head RMSNorm
(Qwen3's q_norm and k_norm, where the model has them), the rotary embedding and the write of
the batch's keys and values into the paged pool, in one launch per layer however many requests
the batch holds, where the eager ops take a dozen (Llama) to some thirty (Qwen3).

q, k and v are the QKV projection's views ([tokens, heads, d], rows as strided as its output).
The rotary form is the half-split one (`rotate_half`) over the whole head, every GQA model's
here; cos and sin are the per-token tables the model builds once per forward (any frequency
scaling is in them). The roundings are the torch ops': the norm as RMSNorm's (triton_norm.py),
then each product of `x * cos + rotate_half(x) * sin` rounded to the dtype and their sum
rounded again (no fused multiply-add). One program per token: it writes the token's rotated
queries, and its keys and values to its slot of the pool ([kv_heads, slots, d]); no other
slot is touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeserve.kernels.triton_norm import rms_scale, rms_weighted

QKNorms = tuple[torch.Tensor, torch.Tensor, float]  # q_norm's and k_norm's weights [d], eps


@triton.jit
def _norm_rope(rows, norm_w, cos, sin, d, valid, eps, D: tl.constexpr, NORM: tl.constexpr):
    """Head rows at `rows` ([heads, 1] pointers; channels d [1, D_PAD], `valid` [heads,
    D_PAD]): normed (NORM) and rotated -> float32 values of their dtype."""
    twin = tl.where(d < D // 2, d + D // 2, d - D // 2)  # rotate_half's partner channel
    x = tl.load(rows + d, mask=valid, other=0.0)
    y = tl.load(rows + twin, mask=valid, other=0.0)
    if NORM:  # both with their row's one scale (y is x permuted)
        scale = rms_scale(x, D, eps)
        x = rms_weighted(x, scale, tl.load(norm_w + d, mask=d < D, other=0.0)).to(x.dtype)
        y = rms_weighted(y, scale, tl.load(norm_w + twin, mask=d < D, other=0.0)).to(y.dtype)
    dtype = x.dtype
    rotated = tl.where(d < D // 2, -y.to(tl.float32), y.to(tl.float32))
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (rotated * sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit(
    do_not_specialize=[
        "sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sc_t", "ss_t",
        "so_t", "so_h", "skc_h", "skc_s", "svc_h", "svc_s",
    ]
)  # fmt: skip
def _norm_rope_store_kernel(
    Q,
    K,
    V,
    COS,
    SIN,
    Q_NORM,
    K_NORM,
    SLOTS,
    Q_OUT,
    K_CACHE,
    V_CACHE,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sc_t,
    ss_t,
    so_t,
    so_h,
    skc_h,
    skc_s,
    svc_h,
    svc_s,
    eps,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)[None, :]
    cos = tl.load(COS + t * sc_t + d, mask=d < D, other=0.0).to(tl.float32)
    sin = tl.load(SIN + t * ss_t + d, mask=d < D, other=0.0).to(tl.float32)
    h = tl.arange(0, HEADS_PAD).to(tl.int64)[:, None]
    q_valid = (h < HEADS) & (d < D)
    q = _norm_rope(Q + t * sq_t + h * sq_h, Q_NORM, cos, sin, d, q_valid, eps, D, NORM)
    tl.store(Q_OUT + t * so_t + h * so_h + d, q, mask=q_valid)
    j = tl.arange(0, KV_PAD).to(tl.int64)[:, None]
    kv_valid = (j < KV_HEADS) & (d < D)
    slot = tl.load(SLOTS + t).to(tl.int64)
    k = _norm_rope(K + t * sk_t + j * sk_h, K_NORM, cos, sin, d, kv_valid, eps, D, NORM)
    tl.store(K_CACHE + j * skc_h + slot * skc_s + d, k, mask=kv_valid)
    v = tl.load(V + t * sv_t + j * sv_h + d, mask=kv_valid)
    tl.store(V_CACHE + j * svc_h + slot * svc_s + d, v, mask=kv_valid)


def fits(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: tuple[torch.Tensor, torch.Tensor],
    norms: QKNorms | None,
) -> bool:
    """Whether the kernel computes this layer's step: rotary over the whole head (of even
    width), one dtype for activations, tables, pool and norm weights, rows contiguous."""
    d = qkv[0].shape[-1]
    tensors = [*qkv, *rope, *cache, *(norms[:2] if norms else ())]
    same = all(t.dtype == qkv[0].dtype and t.stride(-1) == 1 for t in tensors)
    return same and all(t.shape[-1] == d for t in tensors) and d % 2 == 0


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: QKNorms | None = None,
) -> torch.Tensor:
    """q [tokens, heads, d], k/v [tokens, kv_heads, d] (last axis contiguous), cos/sin [tokens,
    1, d], slots [tokens]: each token's keys (normed, rotated) and values written to its slot
    of k/v_cache [kv_heads, slots, d] -> q normed and rotated [tokens, heads, d] (see `fits`)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    q_norm, k_norm, eps = norms if norms is not None else (q, q, 0.0)
    _norm_rope_store_kernel[(n,)](
        q,
        k,
        v,
        cos,
        sin,
        q_norm,
        k_norm,
        slots,
        out,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        eps,
        HEADS=heads,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS=kv_heads,
        KV_PAD=triton.next_power_of_2(kv_heads),
        D=d,
        D_PAD=triton.next_power_of_2(d),
        NORM=norms is not None,
        num_warps=min(8, max(1, triton.next_power_of_2(heads) * d // 1024)),
        enable_fp_fusion=False,  # the torch ops round x * cos before adding
    )
    return out
