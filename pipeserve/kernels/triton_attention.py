"""Batched paged attention for accelerators, in Triton: a fixed number of kernel launches per
layer however many requests a batch holds.

Both kernels read the pool in place ([kv_heads, slots, head_dim] per layer) through a page
table of one slot per page, built once per step and shared by every layer (on the device,
from the runs of slots the host copies: `SlotRuns`): `kv_indices` holds every position's
slot, request after request, and `kv_indptr` [n + 1] where each request's positions start
(so its length too). Any placement of a request's KV reads the same way (the allocator's
long runs, pages of 16, scattered slots), in one pipelined loop over blocks of positions.

- `paged_decode`: one query token per request. A program takes one request, one KV head with
  its query heads, up to DECODE_MAX_HEADS of them (GQA: the group's rows share every K/V
  load), and one of `splits` equal shares of the request's keys (split-KV: enough programs
  for a long context and a small batch); the shares' partial results merge by their
  log-sum-exp. With `rope` > 0 the key rows are [d | rope] wide and the values their first
  d columns: MLA's absorbed attention over the latent cache (one KV head shared by all
  heads).
- `paged_extend`: prompt chunks, each attending to its cached prefix and, causally, to itself
  (its own K/V are in the pool already: the layer writes them first). A program takes 16 of
  one chunk's query rows times up to EXTEND_MAX_HEADS of a KV head's query heads, so all
  chunks of a batch are one launch.
  `expanded_extend` runs the same kernel over MLA's up-projected keys and values instead of
  a pool (read through an index of their rows): keys [k_nope | k_rope] with the rope part
  one tensor shared by the heads, values of their own width, 64 query rows of one head a
  program (32 in float32).

Scores and the softmax run in float32 (float32 inputs multiply in IEEE float32, not TF32).
Launch-dependent integers (strides, split counts) are not specialised on, so a new batch
size never compiles a new variant on the serving path. `TRITON_INTERPRET=1` runs both on CPU
tensors (the tests do, against float64 references).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

# Tiles: what compiles for sm_90 without spilling registers (benchmarks/triton_compile.py
# compiles every launch offline; GPU timings of the MLA and wide-group tiles are owed)
BLOCK_N = 64  # keys per step of a program (fewer for wide rows: decode_tiles, extend_tiles)
EXTEND_BLOCK_M = 16  # extend: query rows per program (times its heads of the group)
# expanded_extend (MLA: one head per key head): query rows per program, with its three tiles
# of keys (k_nope, k_rope, values) as many as spill nothing at DeepSeek-V3's widths (float32's
# tiles take twice the registers and shared memory: half as many rows)
EXPANDED_BLOCK_M = 64
MAX_SPLITS = 16
Tiles = tuple[int, int, int]  # a program's keys a step, warps, pipeline stages
# decode: query heads of one KV head a program takes at most (MLA's heads all share one: at
# DeepSeek-V3's 128 a program of all of them wants 279 KB of shared memory, over an H100's
# 227 KB; benchmarks/triton_compile.py)
DECODE_MAX_HEADS = 64
EXTEND_MAX_HEADS = 8  # extend: query heads of one KV head a program takes at most


@triton.jit
def _scores(q, k, FP32: tl.constexpr):
    """q [rows, d] . k [keys, d]^T in float32."""
    if FP32:  # noqa: SIM108 (a constexpr branch: one of them is compiled)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _online_softmax_step(s, v, valid, scale, m_i, l_i, acc, FP32: tl.constexpr):
    """One block of scores `s` [rows, keys] into a running softmax (m_i: max, l_i: sum, acc:
    weighted values); `valid` [rows, keys] says which scores count."""
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
def _load_kv(k_head, v_head, sk_s, sv_s, row, keys, d, dm):
    """Rows `row` ([keys, 1] int64 slots) of one KV head's K and V: [keys, d], rows past
    `keys` and columns past `dm` read as 0."""
    mask = keys[:, None] & dm[None, :]
    k = tl.load(k_head + row * sk_s + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_head + row * sv_s + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit(
    do_not_specialize=[
        "sq_b", "sq_h", "sq_g", "sk_h", "sk_s", "sv_h", "sv_s",
        "so_b", "so_h", "so_g", "so_s", "sl_b", "sl_h", "sl_g", "splits",
    ]
)  # fmt: skip
def _decode_kernel(
    Q,
    K,
    V,
    KV_INDPTR,
    KV_INDICES,
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
    splits,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    FP32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1) // HEAD_BLOCKS  # the KV head; its group's heads HEADS at a time
    split = tl.program_id(2)
    k_head = K + h.to(tl.int64) * sk_h
    v_head = V + h.to(tl.int64) * sv_h
    g = (tl.program_id(1) % HEAD_BLOCKS) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, D_PAD)
    gm, dm = g < GROUP, d < D
    q_rows = Q + b * sq_b + h * sq_h + g[:, None] * sq_g
    q = tl.load(q_rows + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    if ROPE > 0:
        e = tl.arange(0, ROPE_PAD)
        em = e < ROPE
        q_rope = tl.load(q_rows + D + e[None, :], mask=gm[:, None] & em[None, :], other=0.0)
    start = tl.load(KV_INDPTR + b)
    length = tl.load(KV_INDPTR + b + 1) - start
    share = tl.cdiv(length, splits)
    lo = split * share
    hi = tl.minimum(lo + share, length)
    m_i = tl.full([HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, D_PAD], tl.float32)
    for p0 in range(lo, hi, BLOCK):
        at = p0 + tl.arange(0, BLOCK)
        slot = tl.load(KV_INDICES + start + at, mask=at < hi, other=-1)
        keys = slot >= 0  # -1: no key (a sparse selection's padding)
        row = slot.to(tl.int64)[:, None]
        k, v = _load_kv(k_head, v_head, sk_s, sv_s, row, keys, d, dm)
        s = _scores(q, k, FP32)
        if ROPE > 0:  # MLA: the rows' rope columns score too; values are the latent part
            k_rope_mask = keys[:, None] & em[None, :]
            k_rope = tl.load(k_head + row * sk_s + D + e[None, :], mask=k_rope_mask, other=0.0)
            s += _scores(q_rope, k_rope, FP32)
        valid = gm[:, None] & keys[None, :]
        m_i, l_i, acc = _online_softmax_step(s, v, valid, scale, m_i, l_i, acc, FP32)
    some = l_i > 0
    out = acc / tl.where(some, l_i, 1.0)[:, None]
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    o_ptr = O_PART + b * so_b + h * so_h + g[:, None] * so_g + split * so_s + d[None, :]
    tl.store(o_ptr, out, mask=gm[:, None] & dm[None, :])
    tl.store(LSE_PART + b * sl_b + h * sl_h + g * sl_g + split, lse, mask=gm)


@triton.jit(
    do_not_specialize=[
        "sq_t", "sq_h", "sk_h", "sk_s", "skr_h", "skr_s", "sv_h", "sv_s", "so_t", "so_h",
    ]
)  # fmt: skip
def _extend_kernel(
    Q,
    K,
    K_ROPE,
    V,
    OUT,
    KV_INDPTR,
    KV_INDICES,
    CHUNKS,
    BLOCK_CHUNK,
    BLOCK_FIRST,
    scale,
    sq_t,
    sq_h,
    sk_h,
    sk_s,
    skr_h,
    skr_s,
    sv_h,
    sv_s,
    so_t,
    so_h,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1) // HEAD_BLOCKS  # the KV head; its group's heads HEADS at a time
    k_head = K + h.to(tl.int64) * sk_h
    v_head = V + h.to(tl.int64) * sv_h
    kr_head = K_ROPE + h.to(tl.int64) * skr_h
    c = tl.load(BLOCK_CHUNK + pid)
    m0 = tl.load(BLOCK_FIRST + pid)
    q_start = tl.load(CHUNKS + 3 * c)
    q_len = tl.load(CHUNKS + 3 * c + 1)
    prefix = tl.load(CHUNKS + 3 * c + 2)
    rows = tl.arange(0, BLOCK_M * HEADS)
    i = m0 + rows // HEADS  # the row's query within its chunk
    in_group = (tl.program_id(1) % HEAD_BLOCKS) * HEADS + rows % HEADS  # its head's place
    head = h * GROUP + in_group
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    rm = (i < q_len) & (in_group < GROUP)
    dm, dvm = d < D, dv < DV
    token = (q_start + i).to(tl.int64)[:, None]  # a long prompt's rows pass 2^31 elements
    q_rows = Q + token * sq_t + head[:, None] * sq_h
    q = tl.load(q_rows + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    if ROPE > 0:
        e = tl.arange(0, ROPE_PAD)
        em = e < ROPE
        q_rope = tl.load(q_rows + D + e[None, :], mask=rm[:, None] & em[None, :], other=0.0)
    q_pos = prefix + i  # each query's position: it sees keys at positions <= this
    end = prefix + tl.minimum(m0 + BLOCK_M, q_len)  # keys any row of the block sees
    start = tl.load(KV_INDPTR + c)
    m_i = tl.full([BLOCK_M * HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, DV_PAD], tl.float32)
    for p0 in range(0, end, BLOCK):
        at = p0 + tl.arange(0, BLOCK)
        keys = at < end
        row = tl.load(KV_INDICES + start + at, mask=keys, other=0).to(tl.int64)[:, None]
        k = tl.load(k_head + row * sk_s + d[None, :], mask=keys[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_head + row * sv_s + dv[None, :], mask=keys[:, None] & dvm[None, :], other=0.0)
        valid = rm[:, None] & keys[None, :] & (at[None, :] <= q_pos[:, None])
        s = _scores(q, k, FP32)
        if ROPE > 0:  # MLA's expanded keys: a rope part of their own, shared by the heads
            k_rope = tl.load(
                kr_head + row * skr_s + e[None, :], mask=keys[:, None] & em[None, :], other=0.0
            )
            s += _scores(q_rope, k_rope, FP32)
        m_i, l_i, acc = _online_softmax_step(s, v, valid, scale, m_i, l_i, acc, FP32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = OUT + token * so_t + head[:, None] * so_h + dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=rm[:, None] & dvm[None, :])


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_launch(group: int, d: int, dtype: torch.dtype) -> tuple[int, int, Tiles]:
    """A decode launch's query heads a program, its blocks of them per KV head (of `group`),
    and its default tiles, for values `d` wide."""
    heads = min(_pow2(group, 16), DECODE_MAX_HEADS)
    return heads, -(-group // heads), decode_tiles(heads, _pow2(d, 16), dtype == torch.float32)


def extend_launch(
    group: int, d: int, dv: int, rope: int, block_m: int, dtype: torch.dtype
) -> tuple[int, int, Tiles]:
    """An extend launch's query heads a program, its blocks of them per KV head (of `group`),
    and its default tiles, for keys `d` (+ `rope`) and values `dv` wide and `block_m` rows of
    each head a program."""
    heads = min(_pow2(group), EXTEND_MAX_HEADS)
    width = max(_pow2(d, 16), _pow2(dv, 16)) + (_pow2(rope, 16) if rope else 0)
    tiles = extend_tiles(block_m * heads, width, dtype == torch.float32)
    return heads, -(-group // heads), tiles


def decode_tiles(heads: int, d_pad: int, fp32: bool = False) -> Tiles:
    """(keys a step, warps, pipeline stages) of a decode program of `heads` query heads over
    values `d_pad` wide: the largest that compile without spilling registers for sm_90
    (benchmarks/triton_compile.py; Triton 3.6). Head dims up to 128 in 16-bit, as measured on
    an H200; MLA's latent widths (256, 512) take fewer keys a step and, at 512, eight warps;
    float32 (products in IEEE float32, not on the tensor cores) eight warps from 128."""
    if fp32:
        return (BLOCK_N, 4, 2) if d_pad < 128 else (BLOCK_N // 2, 8, 2)
    if d_pad <= 128:
        return BLOCK_N, 4, 3
    if d_pad <= 256:
        return BLOCK_N // 2, 4, 3
    return (BLOCK_N // 2 if heads <= 16 else BLOCK_N // 4), 8, 3


def decode_splits(num_requests: int, per_request: int, device: torch.device) -> int:
    """Shares per request's keys: enough programs to fill the device twice over, at most
    MAX_SPLITS (each share costs a partial result to merge); `per_request`: the programs a
    request's share takes (its KV heads times their blocks of query heads)."""
    if device.type != "cuda":
        return 1
    programs = 2 * _multiprocessors(device)
    return max(1, min(MAX_SPLITS, -(-programs // max(1, num_requests * per_request))))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    splits: int | None = None,
    rope: int = 0,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """q [b, kv_heads, group, d + rope] (one token per request) over each request's KV slots
    (`kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, int32 on q's device; -1: no key, as a
    sparse selection pads) of k/v_cache [kv_heads, slots, d (+ rope for k)] -> [b, kv_heads,
    group, d]. `rope` > 0: the keys' last `rope` columns score too (MLA: k_cache = v_cache =
    the latent cache, one head). `tiles`: (keys a step, warps, stages) instead of
    `decode_tiles`' (benchmarks/triton_tiles.py times them)."""
    b, hk, group, width = q.shape
    d = width - rope
    heads, blocks, default = decode_launch(group, d, q.dtype)
    keys, warps, stages = tiles or default
    splits = splits or decode_splits(b, hk * blocks, q.device)
    o_part = torch.empty(b, hk, group, splits, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, hk, group, splits, dtype=torch.float32, device=q.device)
    if b:
        _decode_kernel[(b, hk * blocks, splits)](
            q,
            k_cache,
            v_cache,
            kv_indptr,
            kv_indices,
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
            splits,
            GROUP=group,
            HEADS=heads,
            HEAD_BLOCKS=blocks,
            D=d,
            D_PAD=_pow2(d, 16),
            ROPE=rope,
            ROPE_PAD=_pow2(rope, 16) if rope else 1,
            BLOCK=keys,
            FP32=q.dtype == torch.float32,
            num_warps=warps,
            num_stages=stages,
        )
    if splits == 1:
        return o_part[:, :, :, 0].to(q.dtype)
    lse = torch.logsumexp(lse_part, dim=-1, keepdim=True)  # the shares' partials merged
    weights = torch.exp(lse_part - lse).nan_to_num_(0.0)  # a request with no key: zeros
    return (o_part * weights[..., None]).sum(dim=3).to(q.dtype)


SPARSE_PARTIAL_BYTES = 2**28  # sparse_latent: the launch's float32 partial outputs at most


def sparse_latent(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    rank: int,
    scale: float,
    counter: torch.Tensor,
) -> torch.Tensor:
    """DeepSeek-V3.2's sparse attention in latent space, each query over its own chosen rows
    (the signature of layers/mla.py's `sparse_latent_attention` kernels): q [n, heads, W]
    absorbed queries; rows [N, W] the latent cache (values: their first `rank` columns);
    slots [n, topk] the rows each query reads, -1 for none -> [n, heads, rank]. Each query is
    one decode step whose page table is its choice (`paged_decode`, one program per query):
    n * topk rows read, whatever the context; queries go a block at a time so the float32
    partials stay under SPARSE_PARTIAL_BYTES. counter [1] int64 on q's device gains the
    (query, row) pairs read (no host sync)."""
    n, heads, width = q.shape
    topk = slots.shape[1]
    out = q.new_empty(n, heads, rank)
    per = max(1, SPARSE_PARTIAL_BYTES // (heads * rank * 4))  # a launch this long: 1 split
    table = rows[None]  # one key head: [latent | rope] rows, values their latent part
    for first in range(0, n, per):
        chosen = slots[first : first + per]
        b = chosen.shape[0]
        indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * topk
        indices = chosen.to(torch.int32).flatten()
        qb = q[first : first + per, None]
        o = paged_decode(qb, table, table, indptr, indices, scale, rope=width - rank)
        out[first : first + per] = o[:, 0]
    counter += (slots >= 0).sum()
    return out


def extend_blocks(
    q_lens: list[int], block_m: int = EXTEND_BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The extend launch's programs along axis 0: (chunk index, first query row) of each
    block of `block_m` rows of each chunk (int32, on the host)."""
    pairs = [(c, m) for c, n in enumerate(q_lens) for m in range(0, n, block_m)]
    chunk = torch.tensor([c for c, _ in pairs], dtype=torch.int32)
    first = torch.tensor([m for _, m in pairs], dtype=torch.int32)
    return chunk, first


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    chunks: torch.Tensor,
    chunk: torch.Tensor,
    first: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Prompt chunks: q [tokens, heads, d]; chunk c's queries are rows [q_start, q_start +
    q_len) at positions prefix_len.. of its KV (slots kv_indices[kv_indptr[c]:], covering its
    prefix and itself). `chunks` [c, 3] int32 contiguous: (q_start, q_len, prefix_len);
    `chunk` and `first`: the blocks of `extend_blocks`. Writes the chunks' rows of `out`
    (default a new [tokens, heads, d]). `tiles`: as `paged_decode` takes them, instead of
    `extend_tiles`'."""
    out = torch.empty_like(q) if out is None else out
    tables = (kv_indptr, kv_indices, chunks, chunk, first)
    _extend(q, k_cache, k_cache, v_cache, out, tables, scale, 0, EXTEND_BLOCK_M, tiles)
    return out


def expanded_block_m(dtype: torch.dtype) -> int:
    """`expanded_extend`'s query rows per program for q of `dtype` (its tables' blocks)."""
    return EXPANDED_BLOCK_M // 2 if dtype == torch.float32 else EXPANDED_BLOCK_M


def expanded_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    scale: float,
    out: torch.Tensor,
    tiles: Tiles | None = None,
) -> None:
    """MLA's expanded prompt chunks in one launch, over keys and values up-projected for them
    (not a pool): q [tokens, heads, d + rope] ([q_nope | q_rope]); k [keys, heads, d] (k_nope),
    k_rope [keys, rope] (shared by the heads), v [keys, heads, dv], any row strides (views of
    one up-projection); `tables` as `paged_extend` takes them, kv_indices naming rows of k.
    Writes the chunks' rows of out [tokens, heads, dv]. `tables`' blocks are of
    `expanded_block_m(q.dtype)` query rows."""
    heads_first = (k.transpose(0, 1), k_rope[None], v.transpose(0, 1))
    rope = k_rope.shape[-1]
    _extend(q, *heads_first, out, tables, scale, rope, expanded_block_m(q.dtype), tiles)


def _extend(
    q: torch.Tensor,
    k: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    scale: float,
    rope: int,
    block_m: int,
    tiles: Tiles | None = None,
) -> None:
    """The extend launch: k [kv_heads, rows, d], k_rope [kv_heads or 1, rows, rope] (read
    only where rope > 0), v [kv_heads, rows, dv]; q [tokens, heads, d + rope]; `tables`'
    blocks of `block_m` query rows (`extend_blocks`)."""
    kv_indptr, kv_indices, chunks, chunk, first = tables
    h, hk = q.shape[1], k.shape[0]
    group = h // hk
    d, dv = q.shape[2] - rope, v.shape[2]
    heads, blocks, default = extend_launch(group, d, dv, rope, block_m, q.dtype)
    keys, warps, stages = tiles or default
    d_pad, dv_pad, rope_pad = _pow2(d, 16), _pow2(dv, 16), _pow2(rope, 16) if rope else 1
    if not chunk.numel():
        return
    _extend_kernel[(chunk.numel(), hk * blocks)](
        q,
        k,
        k_rope,
        v,
        out,
        kv_indptr,
        kv_indices,
        chunks,
        chunk,
        first,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k_rope.stride(0) if k_rope.shape[0] > 1 else 0,
        k_rope.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEADS=heads,
        HEAD_BLOCKS=blocks,
        D=d,
        D_PAD=d_pad,
        DV=dv,
        DV_PAD=dv_pad,
        ROPE=rope,
        ROPE_PAD=rope_pad,
        BLOCK_M=block_m,
        BLOCK=keys,
        FP32=q.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
    )


def extend_tiles(rows: int, width: int, fp32: bool = False) -> Tiles:
    """(keys a step, warps, pipeline stages) of an extend program of `rows` query rows whose
    query/key rows are `width` wide padded: the largest that compile without spilling
    registers for sm_90 (benchmarks/triton_compile.py; Triton 3.6). Widths up to 64 in 16-bit
    as measured on an H200 (eight warps from 128 rows); float32 from 128 wide 16 keys a step,
    unpipelined."""
    many = rows >= 128 or rows * width > 64 * 128  # eight warps
    if fp32:
        return (BLOCK_N, 8 if many else 4, 2) if width < 128 else (BLOCK_N // 4, 4, 1)
    return (BLOCK_N if width <= 64 else BLOCK_N // 2), 8 if many else 4, 3
