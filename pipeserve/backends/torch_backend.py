"""The torch backend: attention over the paged KV cache in PyTorch ops, on any device.

Per request, the keys are: the cached prefix, read from the pool, and (for a prompt chunk)
the chunk itself, causally, straight from the fresh k/v. Long runs of consecutive slots are
read in place as views; the short, scattered rest is gathered into one tensor, so no
request's KV is copied whole.

- long prompt chunks on a CPU (`blockwise_prefill`): per KV head and block of queries, the
  scores against all key parts are written side by side into one buffer, softmaxed once, and
  multiplied back with each part's values (memory-bound at long prefixes).
- otherwise `attention_with_lse` per key part (torch_ops.py: a fused kernel returning the
  log-sum-exp; on CUDA PyTorch's flash/memory-efficient kernels or the chunked fallback), the
  parts merged exactly. Query heads of one KV head (GQA) are folded into the query length, so
  keys are never repeated.
- decode steps: one batched call over their short KV parts (padded gather + mask), plus
  per-request calls over long runs read in place.
- MLA's decode steps (`latent_decode`, absorbed: one key head of latent rows): gathered
  through a page table of the steps, a group of similar lengths at a time (one call each,
  padding masked); V3.2's steps over their chosen rows, all in one gathered call.
- MLA's expanded prompt chunks (`latent_prompts`): on a GPU all of a batch's in one call of
  PyTorch's packed variable-length flash kernel (FlashInfer's backend inherits it); on a CPU
  none (MLA attends chunk by chunk).

A kernel library that reads the same parts (FlashInfer, flashinfer_backend.py) subclasses
this backend and replaces `prompt_chunk` and `decode`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from pipeserve.backends.base import (
    AttentionBackend,
    ExpandedSpan,
    Segment,
    StepTable,
    per_head_keys,
)
from pipeserve.backends.step_tables import (
    TableSteps,
    chosen_slots,
    expanded,
    latent_steps,
    padded_slots,
    step_table,
)
from pipeserve.backends.torch_ops import (
    CUDA_OPS,
    HALF,
    SDPA,
    Attention,
    attention_with_lse,
    gathered_latent_attention,
    latent_over_parts,
)
from pipeserve.device import small_tensor
from pipeserve.layers.attention_parts import KVPart, gather_index, merge_partials, split_runs
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.scheduler.batch import Run, runs_prefix

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention

log = logging.getLogger(__name__)

BLOCKWISE_MIN_TOKENS = 64  # prompt chunks at least this long use the blockwise kernel
SCORE_BLOCK_ELEMENTS = 2**20  # bound on one score buffer (query rows x keys); ~L2-sized blocks
# MLA's decode steps: a group of similar lengths whose longest step has more positions than
# this is read in place a step at a time (views of its runs, a call or two a step) rather than
# gathered into one padded tensor (which writes and reads every row again). CPU: measured by
# benchmarks/mla_decode_gather.py (Zen 4, 2 threads, bench-deepseek, bfloat16, 32 steps:
# gathered 1.1-1.3x faster up to 384 positions, in place 1.2-1.4x faster from 512). Elsewhere
# an estimate until a GPU measures it (gpu_check's mla-decode-gather): at 64K positions of
# DeepSeek's 576-value rows a gather moves 75 MB a step and layer, on an H200 about the time of
# a step's launches
LATENT_GATHER_MAX_KEYS = {"cpu": 384}
LATENT_GATHER_MAX_KEYS_ELSEWHERE = 2**16


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
class GatherSteps:
    """All single-token steps of a batch: one batched call over their short KV parts
    (padded gather + mask), plus per-request calls over long runs read in place."""

    rows: torch.Tensor  # [b] token rows of the steps
    gather: torch.Tensor  # [b, n] slot ids of each step's short part (pad: 0)
    mask: torch.Tensor  # [b, 1, 1, n] additive: 0 real keys, -inf padding
    views: list[tuple[int, list[Run]]] = field(default_factory=list)  # (step, long runs)
    lengths: list[int] = field(default_factory=list)  # each step's real keys in `gather`


@dataclass
class TorchMeta:
    chunks: list[ChunkPlan]
    decode: GatherSteps | None


@dataclass
class TorchLatent:
    """MLA's batch on the torch backend: its decode steps as a page table with their length
    groups (`latent_decode`), the steps of groups too long to gather with their KV runs,
    read in place; and per set of expanded prompt chunks, the packed varlen kernel's inputs
    (their query rows, cumulative query and key lengths, the longest of each), made on the
    device by the first layer that runs them (`latent_prompts`)."""

    decode: TableSteps | None = None
    in_place: tuple[tuple[int, tuple[Run, ...]], ...] = ()  # (step, its runs)
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
        self.gather_max_keys = LATENT_GATHER_MAX_KEYS.get(kind, LATENT_GATHER_MAX_KEYS_ELSEWHERE)
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
        """A single-token step reads every key from the pool (its own was just written; it
        always lands in the gathered part, so no padded row is empty); a prompt chunk reads
        its prefix from the pool and attends to itself from the fresh k/v."""
        chunks: list[ChunkPlan] = []
        rows: list[int] = []
        shorts: list[list[Run]] = []
        views: list[tuple[int, list[Run]]] = []
        for q_start, q_len, prefix_len, runs in segments:
            long, short = split_runs(runs, prefix_len)
            if q_len > 1:
                gather = gather_index([short], device)[0][0] if short else None
                chunks.append(ChunkPlan(q_start, q_len, prefix_len, long, gather))
                continue
            short.append((last_slot(runs, prefix_len + 1), 1))
            if long:
                views.append((len(rows), long))
            rows.append(q_start)
            shorts.append(short)
        if not rows:
            return TorchMeta(chunks, None)
        row_ids = torch.tensor(rows, dtype=torch.long, device=device)
        gather, lengths = gather_index(shorts, device)
        keep = torch.arange(gather.shape[1], device=device)[None, :] < lengths[:, None]
        mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(
            ~keep, float("-inf")
        )
        counts = [sum(n for _, n in short) for short in shorts]
        return TorchMeta(
            chunks, GatherSteps(row_ids, gather, mask[:, None, None, :], views, counts)
        )

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
            steps = meta.decode.rows
            out[steps] = self.decode(layer, q[steps], k_cache, v_cache, meta.decode)
        for p in meta.chunks:
            rows = slice(p.q_start, p.q_start + p.q_len)
            assert fresh is not None, "a torch prompt chunk reads its fresh K/V"
            cached = cached_parts(k_cache, v_cache, p.views, p.gather)
            out[rows] = self.prompt_chunk(layer, q[rows], fresh[0][rows], fresh[1][rows], cached)

    def latent_plan(self, segments: list[Segment], device: torch.device) -> TorchLatent:
        """The decode steps' page table and length groups; a group whose longest step is
        over `gather_max_keys` positions (LATENT_GATHER_MAX_KEYS) is read in place, a step at
        a time (its runs kept on the host)."""
        if not any(n == 1 for _, n, _, _ in segments):
            return TorchLatent()
        steps, order = latent_steps(segments, device)
        runs = [tuple(runs_prefix(r, prefix + 1)) for _, n, prefix, r in segments if n == 1]
        long = [
            i
            for first, end, w in steps.groups
            if w > self.gather_max_keys
            for i in order[first:end]
        ]
        return TorchLatent(steps, tuple((i, runs[i]) for i in long))

    def after_copy(self, meta: Any) -> Any:
        if isinstance(meta, TorchLatent):
            return replace(meta, decode=expanded(meta.decode))
        return meta

    def latent_rows(self, meta: Any) -> torch.Tensor | None:
        return None if meta.decode is None else meta.decode.rows

    def latent_table(self, meta: Any) -> StepTable | None:
        return None if meta.decode is None else step_table(meta.decode)

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
        rows, gathered a group of similar lengths at a time (padding masked) or, in groups
        past `gather_max_keys`, read in place a step at a time; with an indexer's choice
        `chosen` [b, topk] (positions, -1 for none), over the chosen rows only, all steps
        gathered at once -> [b, heads, kv_lora_rank]."""
        p = meta.decode
        assert p is not None and p.kv_indptr is not None and p.kv_indices is not None
        q, rank = q[:, 0], cache.shape[1] - rope_dim
        if chosen is not None:
            slots = chosen_slots(chosen, p.kv_indptr, p.kv_indices)[1].view(chosen.shape)
            return gathered_latent_attention(q, cache, slots, rank, scale)
        out = q.new_empty(q.shape[0], q.shape[1], rank)
        for first, end, width in p.groups:
            if width <= self.gather_max_keys:
                steps = p.order[first:end]
                slots = padded_slots(steps, width, p.kv_indptr, p.kv_indices)
                out[steps] = gathered_latent_attention(q[steps], cache, slots, rank, scale)
        for i, runs in meta.in_place:
            parts = LatentSegment(0, 1, runs=runs).parts(cache)
            out[i] = latent_over_parts(q[i : i + 1], parts, scale)[0, :, :rank]
        return out

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
        plan: GatherSteps,
    ) -> torch.Tensor:
        """q [b, heads, d] of the steps -> [b, heads, d]."""
        b, hk, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        q = q.view(b, hk, layer.group, d)
        k = k_cache[:, plan.gather].transpose(0, 1)  # [b, hk, n, d]
        v = v_cache[:, plan.gather].transpose(0, 1)
        o, lse = self.dense(q, k, v, False, layer.scale, plan.mask)
        for i, views in plan.views:
            parts = [
                self.dense(
                    q[i : i + 1],
                    k_cache[None, :, s : s + n],
                    v_cache[None, :, s : s + n],
                    False,
                    layer.scale,
                )
                for s, n in views
            ]
            o[i] = merge_partials([*parts, (o[i : i + 1], lse[i : i + 1])])[0]
        return o.reshape(b, layer.num_heads, d)


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


def last_slot(runs: list[Run], num: int) -> int:
    """Slot of position num - 1."""
    for start, length in runs:
        if num <= length:
            return start + num - 1
        num -= length
    raise ValueError("KV runs are shorter than the sequence")


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
