"""Batched paged attention for accelerators, in Triton: a fixed number of kernel launches per
layer however many requests a batch holds.

Both kernels read the pool in place ([kv_heads, slots, head_dim] per layer) through the same
metadata the native CPU kernels take, built once per step and shared by every layer: each
request's KV as runs of consecutive slots (`runs` [R, 2]: first slot, length; `offsets`
[n + 1]: where each request's runs start). A page table is the special case of runs one page
long; the allocator keeps a request's KV in few long runs, so a program walks a handful of
runs and loads whole rows of consecutive slots.

- `paged_decode`: one query token per request. A program takes one request, one KV head with
  all its query heads (GQA: the group's rows share every K/V load) and one of `splits` equal
  shares of the request's keys (split-KV: enough programs for a long context and a small
  batch); the shares' partial results merge by their log-sum-exp.
- `paged_extend`: prompt chunks, each attending to its cached prefix and, causally, to itself
  (its own K/V are in the pool already: the layer writes them first). A program takes a block
  of one chunk's query rows times the group's heads, so all chunks of a batch are one launch.

Scores and the softmax run in float32 (float32 inputs multiply in IEEE float32, not TF32).
`TRITON_INTERPRET=1` runs both on CPU tensors (the tests do, against float64 references).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per step of a program
EXTEND_BLOCK_M = 16  # extend: query rows per program (times the group's heads)


@triton.jit
def _online_softmax_step(q, k, v, valid, scale, m_i, l_i, acc, FP32: tl.constexpr):
    """One block of keys into a running softmax (m_i: max, l_i: sum, acc: weighted values);
    `valid` [rows, keys] says which scores count."""
    if FP32:  # noqa: SIM108 (a constexpr branch: one of them is compiled)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32:  # noqa: SIM108
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _load_kv(K, V, sk_s, sv_s, slot, keys, d, dm):
    """Rows `slot` of one KV head's K and V ([keys, d]; rows past `keys` and columns past
    `dm` read as 0)."""
    mask = keys[:, None] & dm[None, :]
    row = slot.to(tl.int64)[:, None]  # a large pool's offsets pass 2^31 elements
    k = tl.load(K + row * sk_s + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + row * sv_s + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    RUNS,
    OFFSETS,
    O_PART,
    LSE_PART,
    scale,
    sq_b,
    sq_h,
    sq_g,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    so_b,
    so_h,
    so_g,
    so_s,
    sl_b,
    sl_h,
    sl_g,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    FP32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    hk_off, hv_off = h.to(tl.int64) * sk_h, h.to(tl.int64) * sv_h
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gm, dm = g < GROUP, d < D
    q_ptr = Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :]
    q = tl.load(q_ptr, mask=gm[:, None] & dm[None, :], other=0.0)
    r0 = tl.load(OFFSETS + b)
    r1 = tl.load(OFFSETS + b + 1)
    total = 0
    for r in range(r0, r1):
        total += tl.load(RUNS + 2 * r + 1)
    share = tl.cdiv(total, SPLITS)
    lo = split * share
    hi = tl.minimum(lo + share, total)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    pos = 0  # the position of run r's first slot
    for r in range(r0, r1):
        first = tl.load(RUNS + 2 * r)
        n = tl.load(RUNS + 2 * r + 1)
        a = tl.maximum(lo, pos)
        e = tl.minimum(hi, pos + n)
        for p0 in range(a, e, BLOCK):
            at = p0 + tl.arange(0, BLOCK)
            keys = at < e
            k, v = _load_kv(K + hk_off, V + hv_off, sk_s, sv_s, first + at - pos, keys, d, dm)
            valid = gm[:, None] & keys[None, :]
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid, scale, m_i, l_i, acc, FP32)
        pos += n
    some = l_i > 0
    out = acc / tl.where(some, l_i, 1.0)[:, None]
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    o_ptr = O_PART + b * so_b + h * so_h + g[:, None] * so_g + split * so_s + d[None, :]
    tl.store(o_ptr, out, mask=gm[:, None] & dm[None, :])
    tl.store(LSE_PART + b * sl_b + h * sl_h + g * sl_g + split, lse, mask=gm)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    OUT,
    RUNS,
    OFFSETS,
    Q_START,
    Q_LEN,
    PREFIX,
    BLOCK_CHUNK,
    BLOCK_FIRST,
    scale,
    sq_t,
    sq_h,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    so_t,
    so_h,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk_off, hv_off = h.to(tl.int64) * sk_h, h.to(tl.int64) * sv_h
    c = tl.load(BLOCK_CHUNK + pid)
    m0 = tl.load(BLOCK_FIRST + pid)
    q_start = tl.load(Q_START + c)
    q_len = tl.load(Q_LEN + c)
    prefix = tl.load(PREFIX + c)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    i = m0 + rows // GROUP_PAD  # the row's query within its chunk
    head = h * GROUP + rows % GROUP_PAD
    d = tl.arange(0, D_PAD)
    rm = (i < q_len) & (rows % GROUP_PAD < GROUP)
    dm = d < D
    token = (q_start + i).to(tl.int64)[:, None]  # a long prompt's rows pass 2^31 elements
    q_ptr = Q + token * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr, mask=rm[:, None] & dm[None, :], other=0.0)
    q_pos = prefix + i  # each query's position: it sees keys at positions <= this
    end = prefix + tl.minimum(m0 + BLOCK_M, q_len)  # keys any row of the block sees
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], tl.float32)
    r0 = tl.load(OFFSETS + c)
    r1 = tl.load(OFFSETS + c + 1)
    pos = 0
    for r in range(r0, r1):
        first = tl.load(RUNS + 2 * r)
        n = tl.load(RUNS + 2 * r + 1)
        e = tl.minimum(end, pos + n)
        for p0 in range(pos, e, BLOCK):
            at = p0 + tl.arange(0, BLOCK)
            keys = at < e
            k, v = _load_kv(K + hk_off, V + hv_off, sk_s, sv_s, first + at - pos, keys, d, dm)
            valid = rm[:, None] & keys[None, :] & (at[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid, scale, m_i, l_i, acc, FP32)
        pos += n
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = OUT + token * so_t + head[:, None] * so_h + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def decode_splits(num_requests: int, kv_heads: int, device: torch.device) -> int:
    """Shares per request's keys: enough programs to fill the device twice over, at most 16
    (each share costs a partial result to merge)."""
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, -(-programs // max(1, num_requests * kv_heads))))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """q [b, kv_heads, group, d] (one token per request) over each request's KV runs in
    k/v_cache [kv_heads, slots, d] -> [b, kv_heads, group, d]. `runs` [R, 2] and `offsets`
    [b + 1] int32 on q's device (the native CPU decode kernel's signature)."""
    b, hk, group, d = q.shape
    splits = splits or decode_splits(b, hk, q.device)
    o_part = torch.empty(b, hk, group, splits, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, hk, group, splits, dtype=torch.float32, device=q.device)
    if b:
        _decode_kernel[(b, hk, splits)](
            q,
            k_cache,
            v_cache,
            runs,
            offsets,
            o_part,
            lse_part,
            scale,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            o_part.stride(3),
            lse_part.stride(0),
            lse_part.stride(1),
            lse_part.stride(2),
            GROUP=group,
            GROUP_PAD=_pow2(group, 16),
            D=d,
            D_PAD=_pow2(d, 16),
            BLOCK=BLOCK_N,
            SPLITS=splits,
            FP32=q.dtype == torch.float32,
        )
    if splits == 1:
        return o_part[:, :, :, 0].to(q.dtype)
    lse = torch.logsumexp(lse_part, dim=-1, keepdim=True)  # the shares' partials merged
    weights = torch.exp(lse_part - lse)
    return (o_part * weights[..., None]).sum(dim=3).to(q.dtype)


def extend_blocks(q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The extend launch's programs along axis 0: (chunk index, first query row) of each
    block of EXTEND_BLOCK_M rows of each chunk (int32, on the host)."""
    pairs = [(c, m) for c, n in enumerate(q_lens) for m in range(0, n, EXTEND_BLOCK_M)]
    chunk = torch.tensor([c for c, _ in pairs], dtype=torch.int32)
    first = torch.tensor([m for _, m in pairs], dtype=torch.int32)
    return chunk, first


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: torch.Tensor,
    offsets: torch.Tensor,
    chunks: torch.Tensor,
    chunk: torch.Tensor,
    first: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prompt chunks: q [tokens, heads, d]; chunk c's queries are rows [q_start, q_start +
    q_len) at positions prefix_len.. of its KV (runs offsets[c]..offsets[c + 1], covering its
    prefix and itself). `chunks` [c, 3] int32: (q_start, q_len, prefix_len); `chunk` and
    `first`: the blocks of `extend_blocks`. Writes the chunks' rows of `out` (default a new
    [tokens, heads, d])."""
    t, h, d = q.shape
    hk = k_cache.shape[0]
    group = h // hk
    out = torch.empty_like(q) if out is None else out
    q_start, q_len, prefix = chunks.t().contiguous()  # one int32 row each
    if chunk.numel():
        _extend_kernel[(chunk.numel(), hk)](
            q,
            k_cache,
            v_cache,
            out,
            runs,
            offsets,
            q_start,
            q_len,
            prefix,
            chunk,
            first,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            out.stride(0),
            out.stride(1),
            GROUP=group,
            GROUP_PAD=_pow2(group),
            D=d,
            D_PAD=_pow2(d, 16),
            BLOCK_M=EXTEND_BLOCK_M,
            BLOCK=BLOCK_N,
            FP32=q.dtype == torch.float32,
        )
    return out
