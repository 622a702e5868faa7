"""Attention over the paged KV cache.

Per request, the keys are: the cached prefix, read from the pool, and (for a prompt chunk)
the chunk itself, causally, straight from the fresh k/v. Long runs of consecutive slots
are read in place as views; the short, scattered rest is gathered into one tensor, so no
request's KV is copied whole.

Kernels (which ones run is decided once per model runner: `NativeKernels`, and for the other
steps its `backend`, see pipeserve/layers/attention_backends.py):
- native (CPU, compiled, see pipeserve/kernels): prompt chunks in bfloat16 or float32 read
  their whole KV along the request's slot runs in one flash-style pass that stays in cache
  and uses every thread (`device.native_prefill_kernel`: AVX512-BF16 or AVX2); decode steps
  likewise (`paged_decode_attention`).
- a kernel library (FlashInfer on CUDA): its own prompt-chunk and decode kernels per KV part.
- long prompt chunks on a CPU otherwise (`blockwise_prefill`): per KV head and block of
  queries, the scores against all key parts are written side by side into one buffer,
  softmaxed once, and multiplied back with each part's values (memory-bound at long prefixes).
- otherwise: the backend's `attention_with_lse` per key part (a fused kernel returning the
  log-sum-exp; on CUDA PyTorch's flash/memory-efficient kernels or the chunked fallback), the
  parts merged exactly. Query heads of one KV head (GQA) are folded into the query length, so
  keys are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from torch import nn

from pipeserve.device import native_decode_kernel, native_prefill_kernel
from pipeserve.layers.attention_backends import AttentionKernels, default_kernels
from pipeserve.layers.attention_parts import (
    DecodePlan,
    ExtendPlan,
    KVPart,
    SlotRuns,
    merge_partials,
)
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.scheduler.batch import Run, runs_prefix

VIEW_MIN_TOKENS = 256  # shorter runs are cheaper to gather than to attend to separately
BLOCKWISE_MIN_TOKENS = 64  # prompt chunks at least this long use the blockwise kernel
SCORE_BLOCK_ELEMENTS = 2**20  # bound on one score buffer (query rows x keys); ~L2-sized blocks
UNEXPANDED = "a batched plan's page table is still slot runs: use AttentionPlan.expanded()"


@dataclass(frozen=True)
class NativeKernels:
    """Which steps run the compiled CPU kernels, and which kernels run the others (decided
    once per model runner)."""

    decode: bool = False
    prefill: bool = False
    deterministic: bool = False  # one-token prompt chunks run the prefill kernel too
    backend: AttentionKernels | None = None  # the other steps; None: PyTorch's, per device
    batched: bool = False  # accelerators: the Triton kernels, one launch for all steps
    # batched: a batch with a prompt chunk over more keys (prefix + chunk) runs on `backend`
    batched_prompt_max_keys: int | None = None

    def for_batch(self, segments: list[tuple[int, int, int, list[Run]]]) -> NativeKernels:
        """The kernels of one batch of (q_start, q_len, prefix_len, kv_runs) segments: these,
        or with a prompt chunk over more than batched_prompt_max_keys keys the backend's
        kernels for the whole batch (its norms, rotary and KV writes the torch ops)."""
        limit = self.batched_prompt_max_keys
        if not self.batched or limit is None:
            return self
        if any(q_len > 1 and prefix + q_len > limit for _, q_len, prefix, _ in segments):
            return replace(self, batched=False, batched_prompt_max_keys=None)
        return self


TORCH_KERNELS = NativeKernels()  # every step on the torch kernels


@dataclass
class ChunkPlan:
    """How a prompt chunk reads the cache; built once per batch, used by every layer. The
    native kernel reads `runs`; the torch kernels read `views` and `gather`."""

    q_start: int
    q_len: int
    prefix_len: int
    views: list[Run] = field(default_factory=list)  # long slot runs of the prefix, in place
    gather: torch.Tensor | None = None  # slot ids of the rest of the prefix
    runs: torch.Tensor | None = None  # native: [r, 2] runs of positions [0, prefix + q_len)


@dataclass
class AttentionPlan:
    chunks: list[ChunkPlan]
    decode: DecodePlan | None
    kernels: AttentionKernels | None = None  # the runner's choice; None: PyTorch's, per device
    extend: ExtendPlan | None = None  # batched: every prompt chunk, for one launch

    def expanded(self) -> AttentionPlan:
        """This plan with the batched kernels' page tables made from their slot runs, where
        those are (after the runner's copy: on the device, with no host work per position)."""
        return replace(self, decode=_expanded(self.decode), extend=_expanded(self.extend))


Tabled = TypeVar("Tabled", DecodePlan, ExtendPlan)


def _expanded(plan: Tabled | None) -> Tabled | None:
    if plan is None or plan.slot_runs is None:
        return plan
    indptr, indices = plan.slot_runs.expand()
    return replace(plan, kv_indptr=indptr, kv_indices=indices, slot_runs=None)


def split_runs(runs: list[Run], num: int) -> tuple[list[Run], list[Run]]:
    """Positions [0, num) of a request's KV as long runs (read in place) and short runs
    (gathered)."""
    views: list[Run] = []
    short: list[Run] = []
    left = num
    for start, length in runs:
        if left == 0:
            break
        n = min(length, left)
        (views if n >= VIEW_MIN_TOKENS else short).append((start, n))
        left -= n
    return views, short


def gather_index(
    groups: list[list[Run]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids of each group's runs, one row per group, padded with slot 0: ([groups, width],
    lengths [groups]). A handful of tensor ops however many tokens the runs cover."""
    starts = [s for g in groups for s, _ in g]
    counts = [n for g in groups for _, n in g]
    lengths = [sum(n for _, n in g) for g in groups]

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    run_len, seg_len = t(counts), t(lengths)
    total = int(seg_len.sum())
    pos = torch.arange(total, device=device)
    run_first = torch.cumsum(run_len, 0) - run_len  # position where each run begins
    slots = torch.repeat_interleave(t(starts) - run_first, run_len) + pos
    seg_first = torch.cumsum(seg_len, 0) - seg_len
    row = torch.repeat_interleave(torch.arange(len(groups), device=device), seg_len)
    out = torch.zeros(len(groups), max(lengths, default=0), dtype=torch.long, device=device)
    out[row, pos - seg_first[row]] = slots
    return out, seg_len


def plan_attention(
    segments: list[tuple[int, int, int, list[Run]]],
    device: torch.device,
    dtype: torch.dtype,
    native: NativeKernels = TORCH_KERNELS,
    prompt_segments: frozenset[int] = frozenset(),
) -> AttentionPlan:
    """segments: (q_start, q_len, prefix_len, kv_runs) per request; `prompt_segments`: which
    of them are prompt chunks (matters for one-token chunks in deterministic mode, which
    take the prompt kernel so a prompt token is computed alike however it was chunked).
    A single-token step reads
    every key from the pool (its own was just written; it always lands in the gathered part,
    so no padded row is empty); a prompt chunk reads its prefix from the pool and attends to
    itself from the fresh k/v."""
    if native.batched:
        return batched_plan(segments, device, native).expanded()
    chunks: list[ChunkPlan] = []
    rows: list[int] = []
    shorts: list[list[Run]] = []
    views: list[tuple[int, list[Run]]] = []
    steps: list[list[Run]] = []  # native: each step's runs (its prefix and itself, exactly)
    step_lens: list[int] = []
    for i, (q_start, q_len, prefix_len, runs) in enumerate(segments):
        as_chunk = native.deterministic and i in prompt_segments
        if q_len == 1 and native.decode and not as_chunk:
            rows.append(q_start)
            steps.append(runs)
            step_lens.append(prefix_len + 1)
            continue
        if (q_len > 1 or as_chunk) and native.prefill:
            table = torch.tensor(runs, dtype=torch.long).view(-1, 2)
            chunks.append(ChunkPlan(q_start, q_len, prefix_len, runs=table))
            continue
        long, short = split_runs(runs, prefix_len)
        if q_len > 1:
            gather = gather_index([short], device)[0][0] if short else None
            chunks.append(ChunkPlan(q_start, q_len, prefix_len, long, gather))
            continue
        short.append((_last_slot(runs, prefix_len + 1), 1))
        if long:
            views.append((len(rows), long))
        rows.append(q_start)
        shorts.append(short)
    if not rows:
        return AttentionPlan(chunks, None, native.backend)
    row_ids = torch.tensor(rows, dtype=torch.long, device=device)
    if native.decode:
        offsets = [0]
        for step in steps:
            offsets.append(offsets[-1] + len(step))
        flat = torch.tensor([r for step in steps for r in step], dtype=torch.long).view(-1, 2)
        ends = torch.tensor(offsets, dtype=torch.long)
        covered = torch.cat([flat.new_zeros(1), flat[:, 1].cumsum(0)])[ends]
        if not torch.equal(covered.diff(), torch.tensor(step_lens)):  # the kernel reads them all
            raise ValueError("a decode step's KV runs do not cover exactly its sequence")
        decode = DecodePlan(row_ids, runs=flat, offsets=ends)
        return AttentionPlan(chunks, decode, native.backend)
    gather, lengths = gather_index(shorts, device)
    keep = torch.arange(gather.shape[1], device=device)[None, :] < lengths[:, None]
    mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    counts = [sum(n for _, n in short) for short in shorts]
    decode = DecodePlan(row_ids, gather, mask[:, None, None, :], views, lengths=counts)
    return AttentionPlan(chunks, decode, native.backend)


def batched_plan(
    segments: list[tuple[int, int, int, list[Run]]], device: torch.device, native: NativeKernels
) -> AttentionPlan:
    """The batched kernels' plan: the slots of each step's and each chunk's sequence (its
    prefix and its new tokens, which the layer writes first) as int32 page tables of one slot
    per page, read by every layer. Built on `device` (the host when the runner copies the
    batch) in O(runs + requests), with the tables as their slot runs: `expanded()` makes them
    (after the copy, on the device)."""
    from pipeserve.kernels.triton_attention import extend_blocks

    steps: list[tuple[int, list[Run]]] = []
    chunks: list[tuple[int, int, int, list[Run]]] = []
    for q_start, q_len, prefix_len, kv_runs in segments:
        covering = runs_prefix(kv_runs, prefix_len + q_len)
        if q_len == 1:
            steps.append((q_start, covering))
        else:
            chunks.append((q_start, q_len, prefix_len, covering))
    decode = batched_decode_plan(steps, device) if steps else None
    extend = None
    if chunks:
        table = torch.tensor([c[:3] for c in chunks], dtype=torch.int32, device=device)
        block_chunk, block_first = extend_blocks([c[1] for c in chunks])
        slots = SlotRuns.build([c[3] for c in chunks], device)
        extend = ExtendPlan(table, block_chunk.to(device), block_first.to(device), slots)
    return AttentionPlan([], decode, native.backend, extend)


def batched_decode_plan(steps: list[tuple[int, list[Run]]], device: torch.device) -> DecodePlan:
    """The batched Triton kernel's decode steps: (row, the runs covering exactly its sequence)
    each -> their rows and page table of one slot per page, as slot runs (see `batched_plan`)."""
    rows = torch.tensor([row for row, _ in steps], dtype=torch.long, device=device)
    return DecodePlan(rows, slot_runs=SlotRuns.build([runs for _, runs in steps], device))


def _last_slot(runs: list[Run], num: int) -> int:
    """Slot of position num - 1."""
    for start, length in runs:
        if num <= length:
            return start + num - 1
        num -= length
    raise ValueError("KV runs are shorter than the sequence")


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KVPool,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d]."""
        k_cache, v_cache = pool.buffers(self.layer_id)
        k_cache[:, out_slots] = k.transpose(0, 1)
        v_cache[:, out_slots] = v.transpose(0, 1)
        return self.attend(q, pool, plan, (k, v))

    def attend(
        self,
        q: torch.Tensor,
        pool: KVPool,
        plan: AttentionPlan,
        fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention over a pool that holds the batch's new keys and values already: q
        [tokens, heads, d] -> [tokens, heads * d]. `fresh`: those keys and values [tokens,
        kv_heads, d], which the torch kernels' prompt chunks read (a batched plan has none)."""
        k_cache, v_cache = pool.buffers(self.layer_id)
        kernels = plan.kernels or default_kernels(q)
        out = torch.empty_like(q)
        if plan.extend is not None:
            from pipeserve.kernels.triton_attention import paged_extend

            e = plan.extend
            assert e.kv_indptr is not None and e.kv_indices is not None, UNEXPANDED
            tables = (e.kv_indptr, e.kv_indices, e.chunks, e.block_chunk, e.block_first)
            paged_extend(q, k_cache, v_cache, *tables, self.scale, out=out)
        if plan.decode is not None:
            steps = plan.decode.rows
            out[steps] = self._decode(q[steps], k_cache, v_cache, plan.decode, kernels)
        for p in plan.chunks:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.runs is not None:
                prefill = native_prefill_kernel(q.dtype)
                assert prefill is not None
                out[rows] = prefill(q[rows], k_cache, v_cache, p.runs, p.prefix_len, self.scale)
                continue
            assert fresh is not None, "a torch kernels' prompt chunk reads its fresh K/V"
            k, v = fresh[0][rows], fresh[1][rows]
            cached = _cached_parts(k_cache, v_cache, p.views, p.gather)
            out[rows] = self._prompt_chunk(q[rows], k, v, cached, kernels)
        return out.flatten(1)  # [tokens, heads * head_dim], also for no tokens

    def _prompt_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: list[KVPart],
        kernels: AttentionKernels,
    ) -> torch.Tensor:
        if kernels.paged is not None:
            return kernels.paged.prompt_chunk(q, k, v, cached, self.scale)
        if kernels.blockwise_prompts and q.shape[0] >= BLOCKWISE_MIN_TOKENS:
            return blockwise_prefill(q, k, v, cached, self.scale)
        return self._fused(q, k, v, cached, kernels)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        kernels: AttentionKernels,
    ) -> torch.Tensor:
        b, hk, d = q.shape[0], self.num_kv_heads, self.head_dim
        assert plan.slot_runs is None, UNEXPANDED
        if plan.kv_indices is not None:
            from pipeserve.kernels.triton_attention import paged_decode

            assert plan.kv_indptr is not None
            q = q.reshape(b, hk, self.group, d)
            o = paged_decode(q, k_cache, v_cache, plan.kv_indptr, plan.kv_indices, self.scale)
            return o.reshape(b, self.num_heads, d)
        if plan.runs is not None:
            kernel = native_decode_kernel()
            assert kernel is not None and plan.offsets is not None
            q = q.reshape(b, hk, self.group, d)  # GQA: the group's queries share their KV head
            o = kernel(q.contiguous(), k_cache, v_cache, plan.runs, plan.offsets, self.scale)
            return o.reshape(b, self.num_heads, d)
        if kernels.paged is not None:
            return kernels.paged.decode(q, k_cache, v_cache, plan, self.scale)
        q = q.view(b, hk, self.group, d)
        assert plan.gather is not None
        k = k_cache[:, plan.gather].transpose(0, 1)  # [b, hk, n, d]
        v = v_cache[:, plan.gather].transpose(0, 1)
        attend = kernels.attention_with_lse
        o, lse = attend(q, k, v, False, self.scale, plan.mask)
        for i, views in plan.views:
            parts = [
                attend(
                    q[i : i + 1],
                    k_cache[None, :, s : s + n],
                    v_cache[None, :, s : s + n],
                    False,
                    self.scale,
                )
                for s, n in views
            ]
            o[i] = merge_partials([*parts, (o[i : i + 1], lse[i : i + 1])])[0]
        return o.reshape(b, self.num_heads, d)

    def _fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: list[KVPart],
        kernels: AttentionKernels | None = None,
    ) -> torch.Tensor:
        """A short prompt chunk: fused kernel per cached part, then causally over itself."""
        n, h, hk, d = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        attend = (kernels or default_kernels(q)).attention_with_lse
        q_heads = q.transpose(0, 1).contiguous()  # [h, n, d]
        q_fold = q_heads.view(1, hk, self.group * n, d)  # GQA: a KV head's queries in a row
        parts = [attend(q_fold, kc[None], vc[None], False, self.scale) for kc, vc in cached]
        kr = k.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]  # [1, h, n, d]
        vr = v.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]
        o, lse = attend(q_heads[None], kr, vr, True, self.scale)
        parts.append((o.reshape(1, hk, self.group * n, d), lse.reshape(1, hk, self.group * n)))
        o = merge_partials(parts)  # [1, hk, group * n, d]
        return o.reshape(h, n, d).transpose(0, 1)


def _cached_parts(
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
    q [n, h, d], k/v [n, hk, d] (the chunk), cached parts [hk, len_i, d] -> [n, h, d]."""
    n, h, d = q.shape
    hk = k.shape[1]
    group = h // hk
    prefix = sum(kc.shape[1] for kc, _ in cached)
    qb = max(16, min(128, SCORE_BLOCK_ELEMENTS // (group * (prefix + n))))
    qs = q * scale
    kt, vt = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [hk, n, d]
    future = torch.ones(qb, qb, dtype=torch.bool, device=q.device).triu(1)
    future = future.repeat_interleave(group, dim=0)  # rows are (query, head) pairs
    out = torch.empty_like(q)
    for j in range(hk):
        heads = slice(j * group, (j + 1) * group)
        for s in range(0, n, qb):
            e = min(s + qb, n)
            rows = qs[s:e, heads].reshape((e - s) * group, d)
            scores = torch.empty(rows.shape[0], prefix + e, dtype=q.dtype, device=q.device)
            offset = 0
            for kc, _ in cached:
                torch.matmul(rows, kc[j].T, out=scores[:, offset : offset + kc.shape[1]])
                offset += kc.shape[1]
            torch.matmul(rows, kt[j, :e].T, out=scores[:, prefix:])
            scores[:, prefix + s :].masked_fill_(future[: rows.shape[0], : e - s], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs[:, prefix:], vt[j, :e])
            offset = 0
            for _, vc in cached:
                o += torch.matmul(probs[:, offset : offset + vc.shape[1]], vc[j])
                offset += vc.shape[1]
            out[s:e, heads] = o.view(e - s, group, d)
    return out
