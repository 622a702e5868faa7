"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query's MLA attention may read.

Per token and layer it caches one key of `index_head_dim` values: LayerNorm(wk(x)), its first
qk_rope_head_dim channels roped half-split (see rotary.py). Queries are `index_n_heads` heads of
index_head_dim from wq_b over the MLA block's q_a_layernorm output, roped the same way. The score
of key t for query s (transformers' DeepseekV32Indexer, float32):

    score[s, t] = sum_h w[s, h] * ReLU(q[s, h] . k[t] * index_head_dim**-0.5),
    w = weights_proj(x) * index_n_heads**-0.5

over causally visible keys only (t <= position of s); later ones score -inf. Each query then keeps
its `index_topk` best keys, or every visible key when it sees fewer.

Precision: q and k in the run's dtype, every product exact and the sums in float32 (a bfloat16
run multiplies by vdpbf16ps on CPUs with AVX512-BF16, widens elsewhere; the head sum and w are
float32). DeepSeek's released kernels run the indexer in fp8; pipeserve does not, as CPUs have
no fp8 product and an fp8 rounding would move the selection away from transformers' reference,
which the parity tests hold it to.

Tie-break: scores are sums of ReLUs, so exact ties (0 most of all) are common. Among equal scores
the earlier position wins; -0.0 counts as 0.0. transformers' topk leaves this order unspecified.

Output: [tokens, index_topk] positions into each request's sequence (0 is its first token), as a
set in no particular order, -1 for none where a query sees fewer than index_topk tokens.
The attention then reads only those rows (mla.py: `MLAttention.sparse`, in latent space or on
up-projected keys); no [q_len, keys] mask is built. A request no longer than
index_topk keeps every visible position, and its scores are not computed.

On the native backend every segment of a batch is selected in one kernel call
(`select_segments`: the tasks of all of them share the threads); elsewhere segments are
selected one at a time (a prompt chunk's queries together, a block of them at a time). A
backend whose plan has a page table of the batch's decode steps (Triton's:
`AttentionBackend.latent_table`) has them selected all at once instead
(`decode_top_positions`): steps of similar length together, their keys gathered through the
table a block of positions at a time, and the tie rule kept by one topk over int64 keys of
score and position; no host sync, and launches per group of lengths, not per step.

Tensor parallelism: every projection is replicated (the indexer is small), so every rank caches
the same keys and selects the same tokens.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from pipeserve.backends.base import TORCH_KERNELS, DirectKernels, Kernel, StepTable
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.linear import ReplicatedLinear
from pipeserve.layers.rotary import apply_rotary_part
from pipeserve.models.arch import IndexerConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [tokens, 1, qk_rope_head_dim], as mla.Rope

K_NORM_EPS = 1e-6  # transformers' and DeepSeek's k_norm, whatever the config's eps
LOGIT_BLOCK_ELEMENTS = 2**26  # index scores: per-head float32 logits of one query block
SCORE_BLOCK_ELEMENTS = 2**24  # torch selection: a block of queries' float32 scores at most
# -inf's float32 bits (0xFF800000) in the order-preserving int32 of `keyed_top_positions`
UNSEEN_KEY = struct.unpack("<i", struct.pack("<f", float("-inf")))[0] ^ 0x7FFFFFFF


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in float32 and cast back."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.float(), self.bias.float()
        y = nn.functional.layer_norm(x.float(), w.shape, w, b, self.eps)
        return y.to(x.dtype)


class Indexer(nn.Module):
    """Parameters under transformers' checkpoint names: wq_b, wk, k_norm, weights_proj. The rotary
    width (qk_rope_head_dim) is that of the model's shared cos/sin tables passed to forward."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        config: IndexerConfig,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not q_lora_rank:
            raise ValueError("the V3.2 indexer reads the MLA query latent; q_lora_rank must be > 0")
        self.config = config
        self.scale = config.head_dim**-0.5
        heads, dim = config.n_heads, config.head_dim
        self.wq_b = ReplicatedLinear(q_lora_rank, heads * dim, False, dtype)
        self.wk = ReplicatedLinear(hidden_size, dim, False, dtype)
        self.k_norm = LayerNorm(dim, K_NORM_EPS, dtype)
        # float32, as transformers' _keep_in_fp32_modules asks (it honours that for float16
        # loads only; a bfloat16 transformers model computes these head weights in bfloat16)
        self.weights_proj = ReplicatedLinear(hidden_size, heads, False, torch.float32, fp8=False)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        new_slots: torch.Tensor | None = None,
        kernels: DirectKernels = TORCH_KERNELS,
        steps: StepTable | None = None,
    ) -> torch.Tensor:
        """x [tokens, hidden]; q_latent [tokens, q_lora_rank], MLA's q_a_layernorm output; cache
        [slots, index_head_dim] of this layer, written at each segment's new slots (at
        `new_slots`, every token's, in one op where given) -> [tokens, index_topk] long:
        selected positions of each token's request, -1 for none. kernels: the run backend's
        (its compiled selection where it has one). steps: the batch's decode steps as a page
        table, all of them selected at once (`decode_top_positions`: no host sync, launches
        per group of similar lengths, not per step); the other segments as `_select` does."""
        self.write_keys(x, rope, cache, segments, new_slots)
        if steps is None:
            return self._select(x, q_latent, rope, cache, segments, kernels)
        q, w = self.queries(q_latent, rope), self.head_weights(x)
        rows = steps.rows
        chosen = decode_top_positions(q[rows], w[rows], cache, steps, self.scale, self.config.topk)
        others = [seg for seg in segments if seg.q_len != 1]
        out = self._select(x, q_latent, rope, cache, others, kernels, (q, w))
        out[rows] = chosen
        return out

    def _select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        kernels: DirectKernels,
        qw: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Each segment's choice (its rows; -1 elsewhere): all segments in one call of the
        kernels' `index_topk_segments` where they have it (the native backend's), else one
        segment at a time; `qw`: the tokens' queries and head weights where made already."""
        topk = self.config.topk
        if (
            kernels.index_topk_segments is not None
            and any(s.length > topk for s in segments)
            and cache.dtype in (torch.float32, torch.bfloat16)
            and cache.is_contiguous()
        ):
            made = qw if qw is not None else (self.queries(q_latent, rope), self.head_weights(x))
            return select_segments(*made, cache, segments, self.scale, topk, kernels)
        q, w = qw if qw is not None else (None, None)
        parts = []  # each segment's choice, in the order of its rows
        ordered = sorted(segments, key=lambda seg: seg.q_start)
        for seg in ordered:
            if seg.length > topk:
                if q is None or w is None:
                    q, w = self.queries(q_latent, rope), self.head_weights(x)
                k = seg.read(cache)
                parts.append(
                    causal_top_positions(
                        q[seg.rows], w[seg.rows], k, seg.prefix_len, self.scale, topk, kernels
                    )
                )
            else:  # a request no longer than topk keeps every visible position: no scores
                every = torch.arange(topk, device=x.device)[None]
                last = seg.prefix_len + torch.arange(seg.q_len, device=x.device)[:, None]
                parts.append(torch.where(every <= last, every, -1))
        # a prompt chunk's [n, topk] is tens of MB: where the segments tile the tokens (always,
        # but for padded batches) one request's choice is returned as made, no fill and copy
        ends = [seg.q_start + seg.q_len for seg in ordered]
        if [seg.q_start for seg in ordered] == [0, *ends[:-1]] and ends[-1:] == [x.shape[0]]:
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        out = torch.full((x.shape[0], topk), -1, dtype=torch.long, device=x.device)
        for seg, part in zip(ordered, parts, strict=True):
            out[seg.rows] = part
        return out

    def write_keys(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        new_slots: torch.Tensor | None = None,
    ) -> None:
        """Caches the tokens' index keys at each segment's new slots (at `new_slots`, every
        token's, in one op where given)."""
        new = self.keys(x, rope)
        if new_slots is not None:
            cache[new_slots] = new
        else:
            for seg in segments:
                cache[seg.new_slots] = new[seg.rows]

    def scores(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        new_slots: torch.Tensor | None = None,
        kernel: Kernel | None = None,
    ) -> list[torch.Tensor]:
        """Writes the segments' keys to the cache (as `forward`) -> per segment its index
        scores [q_len, prefix_len + q_len] float32, -inf at positions after the query's (what
        `forward` selects from, formed here whole: for tests and tools; `kernel`: a compiled
        scores kernel, as `causal_index_scores`)."""
        self.write_keys(x, rope, cache, segments, new_slots)
        q, w = self.queries(q_latent, rope), self.head_weights(x)
        return [
            causal_index_scores(
                q[seg.rows], w[seg.rows], seg.read(cache), seg.prefix_len, self.scale, kernel
            )
            for seg in segments
        ]

    def queries(self, q_latent: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[tokens, n_heads, head_dim], the first qk_rope_head_dim channels roped half-split."""
        q = self.wq_b(q_latent).view(q_latent.shape[0], self.config.n_heads, self.config.head_dim)
        return apply_rotary_part(q, *rope, start=0, interleaved=False)

    def keys(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """What the tokens cache: [tokens, head_dim]."""
        k = self.k_norm(self.wk(x))[:, None]
        return apply_rotary_part(k, *rope, start=0, interleaved=False)[:, 0]

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, n_heads] float32, with transformers' n_heads**-0.5."""
        return self.weights_proj(x.float()) * self.config.n_heads**-0.5


def causal_index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    prefix_len: int,
    scale: float,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """q [n, heads, d], w [n, heads], k [L, d] (key j at position j, query i at prefix_len + i)
    -> [n, L] float32: sum over heads of w * ReLU(q.k * scale), -inf at future keys. On a
    compiled `kernel` where given (the native backend's, pipeserve/kernels/index_scores.cpp:
    the ReLU and the head sum fused in registers, future key blocks skipped); else the
    per-head logits are formed for a block of queries at a time, at most
    LOGIT_BLOCK_ELEMENTS of them, never all of [heads, n, L]."""
    if kernel is not None:
        q, k = _kernel_inputs(q, k)
        return kernel(q, w.float(), k, prefix_len, scale)
    n, heads = q.shape[:2]
    kt = k.float().t()
    block = max(1, LOGIT_BLOCK_ELEMENTS // max(1, heads * k.shape[0]))
    scores = torch.empty(n, k.shape[0], dtype=torch.float32, device=q.device)
    for s in range(0, n, block):
        scores[s : s + block] = _head_sum(q[s : s + block], w[s : s + block], kt, scale)
    future = torch.ones_like(scores, dtype=torch.bool).triu(prefix_len + 1)
    return scores.masked_fill_(future, float("-inf"))


def causal_top_positions(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    prefix_len: int,
    scale: float,
    topk: int,
    kernels: DirectKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """`top_positions` of `causal_index_scores`: q [n, heads, d], w [n, heads], k [L, d]
    -> [n, topk] long, each query's chosen positions (-1 for none). No [n, L] tensor exists:
    with the kernels' fused selection (the native backend's, index_scores.cpp: `index_topk`)
    a tile of queries is scored into its thread's scratch rows and selected there; else a
    block of queries at a time (at most SCORE_BLOCK_ELEMENTS scores) is scored over the keys
    up to its last query's position and selected as the two functions do."""
    if (kernel := kernels.index_topk) is not None:
        q, k = _kernel_inputs(q, k)
        return kernel(q, w.float(), k, prefix_len, scale, topk)
    n = q.shape[0]
    if n == 0:
        return torch.full((0, topk), -1, dtype=torch.long, device=q.device)
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, k.shape[0]))
    parts = []
    for first in range(0, n, block):  # a block's scores over the keys it sees, then its choice
        seen = prefix_len + min(n, first + block)
        rows = slice(first, first + block)
        scores = causal_index_scores(
            q[rows], w[rows], k[:seen], prefix_len + first, scale, kernels.index_scores
        )
        parts.append(top_positions(scores, topk))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def select_segments(
    q: torch.Tensor,
    w: torch.Tensor,
    cache: torch.Tensor,
    segments: list[LatentSegment],
    scale: float,
    topk: int,
    kernels: DirectKernels,
) -> torch.Tensor:
    """Every segment's `causal_top_positions` in one call of `kernels.index_topk_segments`:
    q [tokens, heads, d], w [tokens, heads] of the batch, cache [slots, d] (the layer's keys,
    contiguous, float32 or bfloat16) -> [tokens, topk], -1 in rows no segment holds. The
    kernel reads each segment longer than topk at its slots, given as runs (nothing is
    gathered here: a decode step's keys are packed by the task that scores them, bfloat16
    widened there on CPUs without AVX512-BF16, never a whole cache); the others keep every
    position they see, without keys or scores. The tasks of all the segments share the
    threads (a decode batch's steps are one call, not one per step)."""
    kernel = kernels.index_topk_segments
    assert kernel is not None
    table: list[tuple[int, int, int, int, int]] = []
    runs: list[torch.Tensor] = []
    first = 0  # the segment's first row of `runs`
    for seg in segments:
        if seg.length <= topk:
            table.append((seg.q_start, seg.q_len, seg.prefix_len, first, 0))
        elif seg.runs:
            runs.append(torch.tensor(seg.runs, dtype=torch.long).view(-1, 2))
            table.append((seg.q_start, seg.q_len, seg.prefix_len, first, len(seg.runs)))
        else:  # its slots alone: a run of one per position
            runs.append(torch.stack([seg.slots, torch.ones_like(seg.slots)], 1))
            table.append((seg.q_start, seg.q_len, seg.prefix_len, first, seg.length))
        first += table[-1][4]
    every = torch.cat(runs) if runs else torch.empty(0, 2, dtype=torch.long)
    rows = torch.tensor(table, dtype=torch.long).view(-1, 5)
    return kernel(q.to(cache.dtype), w.float(), cache, every, rows, scale, topk)


def _kernel_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the compiled kernels take them: both bfloat16 where both are (multiplied
    natively on CPUs with AVX512-BF16, widened inside the kernel elsewhere), else float32."""
    if q.dtype == k.dtype == torch.bfloat16:
        return q, k
    return q.float(), k.float()


def _head_sum(q: torch.Tensor, w: torch.Tensor, kt: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, d], w [n, heads], kt [d, L] float32 -> [n, L]."""
    logits = torch.matmul(q.float().transpose(0, 1), kt) * scale  # [heads, n, L]
    return torch.matmul(w[:, None, :], torch.relu(logits).transpose(0, 1))[:, 0]


def top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [n, L] (-inf: not visible) -> [n, topk] long: the positions of each row's topk
    highest finite scores, the earlier position first among equal scores at the boundary, in
    no particular order (a set: what the layer reads); -1 stands for none where a row has
    fewer than topk finite scores. A selection, not a sort: torch.topk keeps topk + 1 of
    each row in O(L); only where the (topk + 1)-th best ties the topk-th (ReLU sums tie at 0
    often) is the row's boundary resolved by position, in one more O(L) pass over that row."""
    n, length = scores.shape
    k = min(topk, length)
    if length > k:
        values, picked = torch.topk(scores, k + 1, dim=-1, sorted=False)
        low = torch.topk(values, 2, dim=-1, largest=False)  # the (k+1)-th and k-th best
        kept = torch.ones_like(picked, dtype=torch.bool).scatter_(1, low.indices[:, :1], False)
        picked = picked[kept].view(n, k)
        kth = low.values[:, 1:]
        # -0.0 == 0.0 here: comparisons see the tie a bitwise order would miss
        straddle = (low.values[:, 0] == kth[:, 0]) & (kth[:, 0] > float("-inf"))
        rows = straddle.nonzero()[:, 0]
        if rows.numel() == n:  # every row (no copy of the scores)
            picked = _earliest_at_boundary(scores, kth, k)
        elif rows.numel():
            picked[rows] = _earliest_at_boundary(scores[rows], kth[rows], k)
    else:
        picked = torch.arange(length, device=scores.device).expand(n, length)
    picked = picked.masked_fill(scores.gather(1, picked) == float("-inf"), -1)
    if k < topk:
        picked = nn.functional.pad(picked, (0, topk - k), value=-1)
    return picked


def decode_top_positions(
    q: torch.Tensor,
    w: torch.Tensor,
    cache: torch.Tensor,
    table: StepTable,
    scale: float,
    topk: int,
) -> torch.Tensor:
    """A batch's decode steps at once: q [b, heads, d], w [b, heads] of the table's steps
    (its order) -> [b, topk] long, what `top_positions` picks from each step's
    `causal_index_scores`. A group of steps of similar length at a time (`table.groups`):
    a group no longer than topk keeps every position, without scores; any other is scored
    padded to its longest step (`decode_index_scores`) and selected by
    `keyed_top_positions`. No host sync; the ops launched grow with the groups and the
    blocks of positions, not with the steps."""
    every = torch.arange(topk, device=q.device)[None]
    starts = table.indptr[:-1].long()
    lengths = table.indptr[1:].long() - starts
    out = torch.empty(q.shape[0], topk, dtype=torch.long, device=q.device)
    short = next((first for first, _, width in table.groups if width <= topk), None)
    for first, end, width in table.groups:
        if short is not None and first >= short:
            break
        steps = table.order[first:end]
        scores = decode_index_scores(
            q[steps], w[steps], cache, starts[steps], lengths[steps], table.indices, width, scale
        )
        out[steps] = keyed_top_positions(scores, topk)
    if short is not None:  # the shortest groups, longest first: each step keeps all it sees
        steps = table.order[short:]
        out[steps] = torch.where(every < lengths[steps][:, None], every, -1)
    return out


def decode_index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """Decode steps' index scores: step i's keys are the cache rows at slots
    indices[starts[i]:starts[i] + lengths[i]] (positions 0..len-1, its query at the last, so it
    sees them all); `width`: the longest len -> [b, width] float32, -inf past each step's
    length. The keys are gathered and scored a block of positions at a time, at most
    LOGIT_BLOCK_ELEMENTS floats of logits or of gathered keys."""
    b, heads, d = q.shape
    block = max(1, LOGIT_BLOCK_ELEMENTS // max(1, b * max(heads, d)))
    qf, wf = q.float(), w.float()
    last = max(0, indices.numel() - 1)
    scores = torch.empty(b, width, dtype=torch.float32, device=q.device)
    for first in range(0, width, block):
        span = torch.arange(first, min(width, first + block), device=q.device)[None]  # [1, c]
        keys = cache[indices[(starts[:, None] + span).clamp_max(last)].long()].float()  # [b, c, d]
        relu = torch.einsum("bhd,bcd->bhc", qf, keys).mul_(scale).relu_()
        scores[:, first : first + span.shape[1]] = torch.einsum("bh,bhc->bc", wf, relu)
    past = torch.arange(width, device=q.device)[None] >= lengths[:, None]
    return scores.masked_fill_(past, float("-inf"))


def keyed_top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """`top_positions` without a host sync: each score and its position made one int64 key
    (the score's bits in an order-preserving int32 above, the position reversed below), so
    that keys never tie and the earlier position wins among equal scores, and one topk over
    the keys. Its temporaries take about nine times the scores' memory: for decode steps,
    not long prompt chunks."""
    n, length = scores.shape
    k = min(topk, length)
    # NaN ranks as +inf (as torch.topk ranks it first, whatever its sign bit); -0.0 + 0.0 is
    # 0.0: one key for both zeros
    inf = float("inf")
    bits = (torch.nan_to_num(scores, nan=inf, posinf=inf, neginf=-inf) + 0.0).view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # signed int order = float order
    reversed_positions = length - 1 - torch.arange(length, device=scores.device)
    keys = (ordered << 32) | reversed_positions
    top = torch.topk(keys, k, dim=-1, sorted=False).values
    picked = length - 1 - (top & 0xFFFFFFFF)
    picked = picked.masked_fill((top >> 32) == UNSEEN_KEY, -1)
    if k < topk:
        picked = nn.functional.pad(picked, (0, topk - k), value=-1)
    return picked


def _earliest_at_boundary(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th best score `kth` [r, 1] ties scores outside the k best: every position
    above it and the earliest positions at it, k in all -> [r, k] positions, increasing."""
    above, at = scores > kth, scores == kth
    need = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    chosen = above | (at & (at.cumsum(-1, dtype=torch.int32) <= need))
    return chosen.nonzero()[:, 1].view(-1, k)
