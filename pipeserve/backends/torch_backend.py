"""The torch backend: attention over the paged KV cache in PyTorch ops, on any device.

A prompt chunk's keys are its cached prefix, read from the pool, and the chunk itself,
causally, straight from the fresh k/v. Long runs of consecutive slots are read in place as
views; the short, scattered rest is gathered into one tensor, so no chunk's KV is copied
whole.

- long prompt chunks on a CPU (`blockwise_prefill`): per KV head and block of queries, the
  scores against all key parts are written side by side into one buffer, softmaxed once, and
  multiplied back with each part's values (memory-bound at long prefixes).
- otherwise `attention_with_lse` per key part (torch_ops.py: a fused kernel returning the
  log-sum-exp; on CUDA PyTorch's flash/memory-efficient kernels or the chunked fallback), the
  parts merged exactly. Query heads of one KV head (GQA) are folded into the query length, so
  keys are never repeated.
- decode steps (GQA's in `decode`, MLA's absorbed ones in `latent_decode`): through a page
  table of the steps (`StepPlan`), cut into groups of similar lengths. A group whose padded
  keys and values take less than GATHER_MAX_BYTES a step (a CPU's few hundred positions, a
  GPU's tens of thousands) is gathered for one call, padding masked: launches per group, not
  per request. Longer steps read their long runs in place,
  a step at a time. V3.2's steps attend over their chosen rows, all in one gathered call.
- MLA's expanded prompt chunks (`latent_prompts`): on a GPU all of a batch's in one call of
  PyTorch's packed variable-length flash kernel (FlashInfer's backend inherits it); on a CPU
  none (MLA attends chunk by chunk).

A kernel library that reads the same parts (FlashInfer, flashinfer_backend.py) subclasses
this backend and replaces `prompt_chunk` and `decode`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from pipeserve import envs
from pipeserve.backends.base import (
    AttentionBackend,
    ExpandedSpan,
    Segment,
    StepTable,
    per_head_keys,
)
from pipeserve.backends.step_tables import (
    UNEXPANDED,
    TableSteps,
    chosen_slots,
    decode_steps,
    expanded,
    padded_slots,
    step_runs,
    step_table,
)
from pipeserve.backends.torch_ops import (
    CUDA_OPS,
    GATHER_BLOCK_BYTES,
    HALF,
    SDPA,
    Attention,
    attention_with_lse,
    gathered_latent_attention,
    latent_over_parts,
    padding_mask,
)
from pipeserve.device import small_tensor
from pipeserve.layers.attention_parts import (
    VIEW_MIN_TOKENS,
    KVPart,
    gather_index,
    merge_partials,
    split_runs,
)
from pipeserve.scheduler.batch import Run

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention

log = logging.getLogger(__name__)

BLOCKWISE_MIN_TOKENS = 64  # prompt chunks at least this long use the blockwise kernel
SCORE_BLOCK_ELEMENTS = 2**20  # bound on one score buffer (query rows x keys); ~L2-sized blocks
# Decode steps: a group of similar lengths whose longest step's keys and values take this
# many bytes or more (GQA's keys and values; MLA's latent rows) is read in place a step at a
# time (views of its long runs, a call each) rather than gathered into one padded tensor for
# one call (which writes and reads every row again). CPU, Zen 4, 2 threads, bfloat16,
# benchmarks/decode_gather.py (32 steps of one run each, in place as the backend reads them:
# a run under VIEW_MIN_TOKENS gathered by itself): GQA (the bench preset, 1 KiB a position)
# 0.7-1.5x for the gather below 256 positions, 0.6-0.67x from 256 on, where a step is one
# call on its view; MLA (bench-deepseek, 576-byte rows) 1.1-2.7x up to 256 positions, 0.87-1.0x
# at 384-1K. End to end (`pipeserve bench --attention-backend torch`, against the path before,
# which gathered the short runs of all steps for one call and merged each step's views into
# it): 64 GQA requests of 1K 1.3-1.5x, of 128 0.96x (four rounds); 32 MLA requests of 256
# 1.45-1.76x. So 256 KiB: 256 of the bench preset's positions, 455 of bench-deepseek's.
# Elsewhere an estimate until a GPU measures it (gpu_check's decode-gather stage): at 64 MiB a
# step a gather costs about what a step's launches do on an H200
GATHER_MAX_BYTES = {"cpu": 2**18}
GATHER_MAX_BYTES_ELSEWHERE = 2**26


@dataclass
class ChunkPlan:
    """How a prompt chunk reads the cache: long slot runs of its prefix in place, the rest
    gathered."""

    q_start: int
    q_len: int
    prefix_len: int
    views: list[Run] = field(default_factory=list)  # long slot runs of the prefix, in place
    gather: torch.Tensor | None = None  # slot ids of the rest of the prefix


@dataclass
class StepPlan:
    """A batch's decode steps (GQA's or MLA's): their page table with length groups
    (`decode_steps`), and each step's KV runs on the host. A group whose steps are cheap to
    gather (`TorchBackend.gathers`) attends in one call over its gathered keys; the others'
    steps read their long runs in place, a step at a time (`in_place_parts`). What the
    batch's first layer makes of it is kept for the others (never carried by `replace`)."""

    table: TableSteps
    runs: tuple[tuple[Run, ...], ...]  # each step's, covering exactly its sequence
    order: tuple[int, ...]  # the steps longest first: table.order on the host
    starts: tuple[int, ...]  # where each step's slots start in the table: its indptr on the host
    split: dict[tuple[int, int], StepSplit] = field(default_factory=dict, init=False, repr=False)
    parts: dict[int, tuple[list[Run], torch.Tensor | None]] = field(
        default_factory=dict, init=False, repr=False
    )


class StepSplit(NamedTuple):
    """A batch's steps for one size of rows and one limit: the gathered groups (their steps
    [g] and slots [g, width] int32, -1 past each step's length) and the steps read in place,
    longest first."""

    gathered: list[tuple[torch.Tensor, torch.Tensor]]
    in_place: list[int]


@dataclass
class TorchMeta:
    chunks: list[ChunkPlan]
    decode: StepPlan | None


@dataclass
class TorchLatent:
    """MLA's batch on the torch backend: its decode steps (`latent_decode`); and per set of
    expanded prompt chunks, the packed varlen kernel's inputs (their query rows, cumulative
    query and key lengths, the longest of each), made on the device by the first layer that
    runs them (`latent_prompts`)."""

    decode: StepPlan | None = None
    tables: dict[tuple[ExpandedSpan, ...], VarlenTables] = field(default_factory=dict)


class VarlenTables(NamedTuple):
    rows: torch.Tensor  # [queries] long: the chunks' query rows, chunk after chunk
    cum_q: torch.Tensor  # [chunks + 1] int32
    cum_k: torch.Tensor  # [chunks + 1] int32
    max_q: int
    max_k: int


class TorchBackend(AttentionBackend):
    """`dense`: attention_with_lse's kernel (PyTorch's for the device where None);
    `blockwise`: long prompt chunks as plain matmul blocks (faster on a CPU)."""

    name = "torch"

    def __init__(
        self, device: torch.device | str, dense: Attention | None = None, varlen: Any = None
    ) -> None:
        """varlen: a packed variable-length causal kernel with `_flash_attention_forward`'s
        signature for MLA's expanded prompt chunks (PyTorch's on CUDA where None; none on a
        CPU)."""
        kind = torch.device(device).type
        cpu = kind == "cpu"
        chosen = envs.decode_gather_max_bytes()
        default = GATHER_MAX_BYTES.get(kind, GATHER_MAX_BYTES_ELSEWHERE)
        self.gather_max_bytes = default if chosen is None else chosen
        self.dense: Attention = dense or (attention_with_lse if cpu else SDPA)
        self.blockwise = cpu
        self.varlen = varlen if varlen is not None or cpu else CUDA_OPS.flash_varlen
        self.varlen_refused = False

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> TorchMeta:
        """A single-token step reads every key from the pool (its own was just written),
        through the steps' page table (`StepPlan`); a prompt chunk reads its prefix from the
        pool and attends to itself from the fresh k/v."""
        chunks: list[ChunkPlan] = []
        for q_start, q_len, prefix_len, runs in segments:
            if q_len > 1:
                long, short = split_runs(runs, prefix_len)
                gather = gather_index([short], device)[0][0] if short else None
                chunks.append(ChunkPlan(q_start, q_len, prefix_len, long, gather))
        return TorchMeta(chunks, step_plan(segments, device))

    def attend(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        fresh: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor,
    ) -> None:
        if meta.decode is not None:
            steps = meta.decode.table.rows
            out[steps] = self.decode(layer, q[steps], k_cache, v_cache, meta.decode)
        for p in meta.chunks:
            rows = slice(p.q_start, p.q_start + p.q_len)
            assert fresh is not None, "a torch prompt chunk reads its fresh K/V"
            cached = cached_parts(k_cache, v_cache, p.views, p.gather)
            out[rows] = self.prompt_chunk(layer, q[rows], fresh[0][rows], fresh[1][rows], cached)

    def latent_plan(self, segments: list[Segment], device: torch.device) -> TorchLatent:
        return TorchLatent(step_plan(segments, device))

    def after_copy(self, meta: Any) -> Any:
        if meta.decode is None:
            return meta
        return replace(meta, decode=replace(meta.decode, table=expanded(meta.decode.table)))

    def latent_rows(self, meta: Any) -> torch.Tensor | None:
        return None if meta.decode is None else meta.decode.table.rows

    def latent_table(self, meta: Any) -> StepTable | None:
        return None if meta.decode is None else step_table(meta.decode.table)

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: Any,
        chosen: torch.Tensor | None,
        scale: float,
        rope_dim: int,
    ) -> torch.Tensor:
        """q [b, 1 key head, heads, latent width] of the decode steps over each step's latent
        rows, gathered a group of similar lengths at a time (padding masked) where `gathers`
        says so, else read in place a step at a time; with an indexer's choice `chosen` [b,
        topk] (positions, -1 for none), over the chosen rows only, all steps gathered at
        once -> [b, heads, kv_lora_rank]."""
        plan: StepPlan = meta.decode
        t = plan.table
        assert t.kv_indptr is not None and t.kv_indices is not None, UNEXPANDED
        q, rank = q[:, 0], cache.shape[1] - rope_dim
        if chosen is not None:
            slots = chosen_slots(chosen, t.kv_indptr, t.kv_indices)[1].view(chosen.shape)
            return gathered_latent_attention(q, cache, slots, rank, scale)
        out = q.new_empty(q.shape[0], q.shape[1], rank)
        split = self.split(plan, cache.shape[1] * cache.element_size())
        for steps, slots in split.gathered:
            out[steps] = gathered_latent_attention(q[steps], cache, slots, rank, scale)
        for i in split.in_place:
            views, rest = in_place_parts(plan, i)
            parts = [cache[s : s + n] for s, n in views]
            if rest is not None:
                parts.append(cache[rest])
            out[i] = latent_over_parts(q[i : i + 1], parts, scale)[0, :, :rank]
        return out

    def gathers(self, width: int, row_bytes: int) -> bool:
        """Whether a group of steps padded to `width` positions of `row_bytes` each is
        gathered for one call (else read in place a step at a time; GATHER_MAX_BYTES)."""
        return width * row_bytes < self.gather_max_bytes

    def split(self, plan: StepPlan, row_bytes: int) -> StepSplit:
        """The steps' groups that `gathers` (made once per batch, by its first layer) and
        the steps of the others."""
        key = (row_bytes, self.gather_max_bytes)
        made = plan.split.get(key)
        if made is not None:
            return made
        t = plan.table
        assert t.order is not None and t.kv_indptr is not None and t.kv_indices is not None
        gathered, in_place = [], list[int]()
        for first, end, width in t.groups:
            if self.gathers(width, row_bytes):
                steps = t.order[first:end]
                gathered.append((steps, padded_slots(steps, width, t.kv_indptr, t.kv_indices)))
            else:
                in_place += plan.order[first:end]
        made = plan.split[key] = StepSplit(gathered, in_place)
        return made

    def latent_prompts(
        self,
        meta: Any,
        q: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor],
        v: torch.Tensor,
        spans: tuple[ExpandedSpan, ...],
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """All the chunks in one call of the varlen kernel where it takes them (float16 or
        bfloat16, one head width up to 256, a multiple of 8: values zero-padded to the keys'
        width, which changes no output column); else False (chunk by chunk). A kernel that
        raises is not asked again in this process."""
        k_nope, k_rope = keys
        width, dv = q.shape[-1], v.shape[-1]
        if self.varlen is None or self.varlen_refused or q.dtype not in HALF:
            return False
        if width > 256 or width % 8 or dv > width:
            return False
        tables = meta.tables.get(spans)
        if tables is None:
            tables = meta.tables[spans] = varlen_tables(spans, q.device)
        k = per_head_keys(k_nope, k_rope)
        v = nn.functional.pad(v, (0, width - dv)) if dv < width else v
        rows, cum_q, cum_k, max_q, max_k = tables
        try:
            o = self.varlen(
                q[rows], k, v, cum_q, cum_k, max_q, max_k, 0.0, True, False, scale=scale
            )[0]
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            if "CUDA error" in str(e):  # the device's own failure, maybe an earlier kernel's
                raise
            log.warning("torch's varlen attention kernel refused MLA's prompt chunks: %s", e)
            self.varlen_refused = True
            return False
        out[rows] = o[..., :dv]
        return True

    def prompt_chunk(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: list[KVPart],
    ) -> torch.Tensor:
        """q [n, heads, d] of a chunk over its cached parts and causally over itself (k/v
        [n, kv_heads, d]) -> [n, heads, d]."""
        if self.blockwise and q.shape[0] >= BLOCKWISE_MIN_TOKENS:
            return blockwise_prefill(q, k, v, cached, layer.scale)
        return fused_prompt_chunk(layer, q, k, v, cached, self.dense)

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
    ) -> torch.Tensor:
        """q [b, heads, d] of the steps -> [b, heads, d]: a call per group of steps that
        `gathers` over their keys and values gathered (padding masked), a step at a time for
        the others (its long runs in place, the rest gathered, merged by log-sum-exp)."""
        b, hk, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        qg = q.view(b, hk, layer.group, d)  # a KV head's query heads as its query rows
        out = torch.empty_like(qg)
        split, scale = self.split(plan, 2 * hk * d * k_cache.element_size()), layer.scale
        for steps, slots in split.gathered:
            out[steps] = gathered_steps(qg[steps], k_cache, v_cache, slots, scale, self.dense)
        for i in split.in_place:
            parts = cached_parts(k_cache, v_cache, *in_place_parts(plan, i))
            partials = [self.dense(qg[i : i + 1], k[None], v[None], False, scale) for k, v in parts]
            out[i] = merge_partials(partials)[0]
        return out.view(b, layer.num_heads, d)


def step_plan(segments: list[Segment], device: torch.device) -> StepPlan | None:
    """The decode steps (one-row segments) of a batch, or None where it has none."""
    steps = step_runs(segments)
    if not steps:
        return None
    table, order = decode_steps(steps, device)
    starts = accumulate((sum(n for _, n in runs) for _, runs in steps[:-1]), initial=0)
    return StepPlan(table, tuple(tuple(r) for _, r in steps), tuple(order), tuple(starts))


def in_place_parts(plan: StepPlan, i: int) -> tuple[list[Run], torch.Tensor | None]:
    """Step i's long runs (read in place, as views) and the slots of its short rest (one
    gather: read from the expanded table where the step's positions sit, no host read),
    made once per batch."""
    made = plan.parts.get(i)
    if made is None:
        views, rest = [], []
        indices, position = plan.table.kv_indices, plan.starts[i]
        assert indices is not None, UNEXPANDED
        for start, n in plan.runs[i]:
            if n >= VIEW_MIN_TOKENS:
                views.append((start, n))
            else:
                rest.append(indices[position : position + n])
            position += n
        made = plan.parts[i] = views, torch.cat(rest).long() if rest else None
    return made


def gathered_steps(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    dense: Attention,
) -> torch.Tensor:
    """Decode steps over their keys and values gathered from the pool: q [g, kv_heads,
    group, d]; the pool [kv_heads, slots, d]; slots [g, width] (-1 past a step's length) ->
    [g, kv_heads, group, d]; as many steps a call as GATHER_BLOCK_BYTES of them hold."""
    g, hk, _, d = q.shape
    width = slots.shape[1]
    per = max(1, GATHER_BLOCK_BYTES // (2 * hk * width * d * k_cache.element_size()))
    out = torch.empty_like(q)
    heads_first = q.transpose(0, 1)  # [kv_heads, g, group, d]: the gathers' own layout
    for i in range(0, g, per):
        block = slots[i : i + per]
        valid = block >= 0
        index = block.long().clamp_min(0)
        # [kv_heads, b, width, d], contiguous: the attention's batch dimensions are the KV
        # heads, then the steps (a CPU's fused kernel runs 1.5-2x slower on the transpose)
        k, v = k_cache[:, index], v_cache[:, index]
        mask = padding_mask(valid, q.dtype)
        if mask is not None:
            mask = mask[None, :, None, :]  # over the KV heads and their query rows
        o = dense(heads_first[:, i : i + per], k, v, False, scale, mask)[0]
        out[i : i + per] = o.transpose(0, 1)
    return out


def fused_prompt_chunk(
    layer: PagedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached: list[KVPart],
    dense: Attention = attention_with_lse,
) -> torch.Tensor:
    """A short prompt chunk: the fused kernel per cached part, then causally over itself."""
    n, h, hk, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    group = layer.group
    q_heads = q.transpose(0, 1).contiguous()  # [h, n, d]
    q_fold = q_heads.view(1, hk, group * n, d)  # GQA: a KV head's queries in a row
    parts = [dense(q_fold, kc[None], vc[None], False, layer.scale) for kc, vc in cached]
    kr = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, h, n, d]
    vr = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    o, lse = dense(q_heads[None], kr, vr, True, layer.scale)
    parts.append((o.reshape(1, hk, group * n, d), lse.reshape(1, hk, group * n)))
    o = merge_partials(parts)  # [1, hk, group * n, d]
    return o.reshape(h, n, d).transpose(0, 1)


def varlen_tables(spans: tuple[ExpandedSpan, ...], device: torch.device) -> VarlenTables:
    """The varlen kernel's inputs for chunks placed by `spans` (keys one chunk after another,
    each chunk's queries the last of its positions: the kernel's bottom-right causal mask)."""
    rows = [r for s in spans for r in range(s.q_start, s.q_start + s.q_len)]
    cum_q, cum_k = [0], [0]
    for s in spans:
        assert s.first_key == cum_k[-1], "the chunks' keys are one after another, in order"
        cum_q.append(cum_q[-1] + s.q_len)
        cum_k.append(cum_k[-1] + s.prefix_len + s.q_len)
    packed = small_tensor(cum_q + cum_k, torch.int32, device)
    c = len(spans) + 1
    max_q = max(s.q_len for s in spans)
    max_k = max(s.prefix_len + s.q_len for s in spans)
    row_ids = small_tensor(rows, torch.long, device)
    return VarlenTables(row_ids, packed[:c], packed[c:], max_q, max_k)


def cached_parts(
    k_cache: torch.Tensor, v_cache: torch.Tensor, views: list[Run], gather: torch.Tensor | None
) -> list[KVPart]:
    parts = [(k_cache[:, s : s + n], v_cache[:, s : s + n]) for s, n in views]
    if gather is not None:
        parts.append((k_cache[:, gather], v_cache[:, gather]))
    return parts


def blockwise_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: list[KVPart], scale: float
) -> torch.Tensor:
    """Causal attention of a prompt chunk over its cached prefix parts and itself.
    q [n, h, d], k/v [n, hk, d] (the chunk), cached parts [hk, len_i, d] -> [n, h, d].

    Computed in float32 whatever the storage: bfloat16 scores (|s| ~ 10 rounded to 0.03)
    measured 2-3x the attention error of PyTorch's fused kernel on the built-in model
    (issue 48), and a CPU without native bf16 multiplies float32 faster anyway. A KV head's
    cached keys and values are widened once for all its query blocks."""
    n, h, d = q.shape
    hk = k.shape[1]
    group = h // hk
    prefix = sum(kc.shape[1] for kc, _ in cached)
    qb = max(16, min(128, SCORE_BLOCK_ELEMENTS // (group * (prefix + n))))
    f32 = torch.float32
    qs = q.to(f32) * scale
    kt, vt = k.transpose(0, 1).to(f32), v.transpose(0, 1).to(f32)  # [hk, n, d]
    future = torch.ones(qb, qb, dtype=torch.bool, device=q.device).triu(1)
    future = future.repeat_interleave(group, dim=0)  # rows are (query, head) pairs
    out = torch.empty_like(q)
    for j in range(hk):
        keys = [kc[j].to(f32) for kc, _ in cached]
        values = [vc[j].to(f32) for _, vc in cached]
        heads = slice(j * group, (j + 1) * group)
        for s in range(0, n, qb):
            e = min(s + qb, n)
            rows = qs[s:e, heads].reshape((e - s) * group, d)
            scores = torch.empty(rows.shape[0], prefix + e, dtype=f32, device=q.device)
            offset = 0
            for kc in keys:
                torch.matmul(rows, kc.T, out=scores[:, offset : offset + kc.shape[0]])
                offset += kc.shape[0]
            torch.matmul(rows, kt[j, :e].T, out=scores[:, prefix:])
            scores[:, prefix + s :].masked_fill_(future[: rows.shape[0], : e - s], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs[:, prefix:], vt[j, :e])
            offset = 0
            for vc in values:
                o += torch.matmul(probs[:, offset : offset + vc.shape[0]], vc)
                offset += vc.shape[0]
            out[s:e, heads] = o.view(e - s, group, d)
    return out
