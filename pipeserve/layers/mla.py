"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

What a token caches, per layer: one row of `kv_lora_rank + qk_rope_head_dim` values, the normed
KV latent then the roped key part shared by all heads (in half-split order, see rotary.py). No
per-head K or V is ever stored; kv_b_proj turns a latent into every head's k_nope and v.

Two ways to attend to the cache, equal up to rounding:
- expanded (long prompt chunks): kv_b_proj up-projects each cached latent of the request to
  per-head [k_nope | v], for every chunk again (the cache holds only latents); keys are
  [k_nope | k_rope]; causal attention of the chunk over prefix + chunk. A batch's chunks are
  gathered and up-projected together, and attended in one launch where the backend has one
  (`expanded_chunks`).
- absorbed (decode steps and short chunks after a prefix; `absorb_max_queries` says where the
  two cost the same): kv_b_proj's key rows W_UK are folded into the
  query, q_nope·k_nope = (q_nope W_UK)·latent, and its value rows W_UV into the output,
  probs·v = (probs·latent) W_UV^T. Attention is then one shared key head whose key is the whole
  cache row and whose value is its latent part, so it reads only the cache. The dot products
  are the same numbers as expanded, so the softmax scale is that of qk_head_dim (with YaRN's
  mscale, `mla_softmax_scale`), not of the latent width.

DeepSeek-V3.2 (an indexer): a query whose request is longer than index_topk reads only the
positions its indexer chose, O(topk) work per query whatever the context (`sparse`), in one
of two forms: in latent space (`sparse_latent_attention`: the heads are the rows of a small
matrix product with each chosen latent row, read in place from the cache; decode steps,
short chunks, wide latents), or, on the compiled CPU kernels, on the up-projected keys of the
whole request (`sparse_expanded`: fewer multiply-adds per chosen pair, 3.4x at V3's widths,
for one up-projection per chunk; long chunks of models with few heads). No [q_len, length]
mask exists in either.

Tensor parallelism: q_b_proj (or q_proj) and kv_b_proj are column-parallel over heads, o_proj
row-parallel; the latent projection and its norm are replicated, so every rank caches the same
rows (a TP group could share one cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from pipeserve import envs
from pipeserve.backends.base import (
    TORCH_KERNELS,
    AttentionPlan,
    DirectKernels,
    ExpandedSpan,
    Kernel,
    StepTable,
    per_head_keys,
)
from pipeserve.backends.torch_ops import (
    additive_mask,
    attention_with_lse,
    gathered_latent_attention,
    latent_over_parts,
)
from pipeserve.distributed.parallel_state import get_tp_size
from pipeserve.layers.attention_parts import merge_partials
from pipeserve.layers.indexer import Indexer, causal_top_positions
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.layernorm import RMSNorm
from pipeserve.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from pipeserve.layers.rotary import RopeScaling, apply_rotary, apply_rotary_part, mla_softmax_scale
from pipeserve.models.arch import IndexerConfig, MLAConfig
from pipeserve.op_profile import region

if TYPE_CHECKING:
    from pipeserve.context_parallel.attention import CpPlan

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [tokens, 1, qk_rope_head_dim]
# The compiled prefill kernel's speed over the fused kernel's (what absorbed attention runs on)
# per FLOP, one CPU core: benchmarks/mla_paths.py measured the crossover at 40-66 new tokens
# (bench-deepseek, prefixes 2K-32K), half the multiply-add count's 85.
NATIVE_EXPANDED_SPEEDUP = 2
# expanded prompt chunks: the per-head keys and values of the chunks up-projected together
# (chunks beyond it go in further groups; a longer chunk alone, as it always was). The CPU
# paths hold the up-projection beside them too, about twice this
EXPANDED_GROUP_BYTES = 2**28
# V3.2's two forms on the compiled CPU kernels, in multiply-adds of the latent kernel
# (sparse_attention.cpp): one of the expanded kernel (sparse_expanded.cpp) costs about this many
# (each reads a key or value of its own where a latent row serves every head; benchmarks/
# v32_kernels.py: 2-2.5 in float32 on Zen 3, 1.75 at 8 heads of 96/64 and 2.2 at 16 of 192/128
# in the two kernels' bfloat16 vdpbf16ps forms on Zen 4; one weight serves both, as neither
# benchmark config's choice changes between 1.8 and 2.5), one of the up-projection (a matrix
# product) this many (0.4 and 0.45)
SPARSE_EXPANDED_MAC = 2.5
UP_PROJECTION_MAC = 0.4
Mode = Literal["auto", "expanded", "absorbed"]  # auto: the cheaper (MLAttention.absorbs)
NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm ignore the config's rms_norm_eps


def latent_width(mla: MLAConfig) -> int:
    """Values one token caches per layer."""
    return mla.kv_lora_rank + mla.qk_rope_head_dim


class MLAttention(nn.Module):
    """Parameters under DeepSeek-V3's checkpoint names (q_a_proj, q_a_layernorm, q_b_proj or
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; V3.2: indexer.*).

    With an `indexer` config (DeepSeek-V3.2's sparse attention) every query attends only to
    the `topk` positions its indexer selects (`sparse`); a request whose queries see at most
    topk positions attends causally to all of them, as the selection would keep them all."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mla: MLAConfig,
        rope_scaling: RopeScaling | None,
        dtype: torch.dtype,
        bias: bool = False,  # the config's attention_bias (q_a, kv_a and o projections)
        indexer: IndexerConfig | None = None,
    ) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = divide(num_heads, get_tp_size(), "number of attention heads")  # local
        self.scale = mla_softmax_scale(mla.qk_head_dim, rope_scaling)
        self.absorb_max_queries = absorb_max_queries(mla)
        self._init_query(hidden_size, num_heads, bias, dtype)
        self._init_latent(hidden_size, num_heads, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * mla.v_head_dim, hidden_size, bias, dtype)
        self.indexer = (
            Indexer(hidden_size, mla.q_lora_rank, indexer, dtype) if indexer is not None else None
        )

    def _init_query(self, hidden: int, heads: int, bias: bool, dtype: torch.dtype) -> None:
        rank, out = self.mla.q_lora_rank, heads * self.mla.qk_head_dim
        self.q_proj = None if rank else ColumnParallelLinear(hidden, out, False, dtype)
        self.q_a_proj = ReplicatedLinear(hidden, rank, bias, dtype) if rank else None
        self.q_a_layernorm = RMSNorm(rank, NORM_EPS, dtype) if rank else None
        self.q_b_proj = ColumnParallelLinear(rank, out, False, dtype) if rank else None

    def _init_latent(self, hidden: int, heads: int, bias: bool, dtype: torch.dtype) -> None:
        m = self.mla
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent_width(m), bias, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, NORM_EPS, dtype)
        per_head = m.qk_nope_head_dim + m.v_head_dim
        # read as a matrix by the absorbed attention and the up-projection: never kept in fp8
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, heads * per_head, False, dtype, fp8=False
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        mode: Mode = "auto",
        index_cache: torch.Tensor | None = None,
        kernels: DirectKernels = TORCH_KERNELS,
        batched: AttentionPlan | None = None,
        new_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [tokens, hidden]; cache [slots, latent_width] of this layer (index_cache [slots,
        index_head_dim] with an indexer), written at each segment's new slots, then read at
        all its slots -> [tokens, hidden], all-reduced. kernels: the run backend's compiled
        kernels (expanded prompt chunks on its dense prefill kernel, V3.2's selection and
        sparse attention on its own; the torch ops where it has none). batched: a backend's
        plan of the decode steps for its batched latent decode (Triton: one absorbed launch
        for all of them; torch: a call per group of similar lengths; with an indexer, over each
        step's chosen rows), and of the prompt chunks it
        attends on up-projected keys in one launch (`latent_prompts`). new_slots: every token's slot
        [tokens] (the batch's write slots), written in one op instead of segment by segment
        (what a CUDA graph's decode step, whose segments are not kept, relies on)."""
        with region("mla.query"):
            q_latent = self.query_latent(x)
            q = self.query(x, rope, q_latent)
        new = self.latent(x, rope)
        if new_slots is not None:
            cache[new_slots] = new
        else:
            for seg in segments:
                cache[seg.new_slots] = new[seg.rows]
        steps = None if batched is None else batched.backend.latent_rows(batched.meta)
        table = self.step_table(batched, steps)
        positions = self.index_positions(
            x, q_latent, rope, index_cache, segments, new_slots, kernels, table
        )
        selected = self.selections(positions, segments)
        out = x.new_empty(x.shape[0], self.num_heads, self.mla.v_head_dim)
        if batched is not None and steps is not None:
            chosen = None if positions is None else positions[steps]
            out[steps] = self.absorbed_batch(q[steps], cache, batched, chosen)
            kept = [i for i, seg in enumerate(segments) if seg.q_len != 1]
            segments, selected = [segments[i] for i in kept], [selected[i] for i in kept]
        prefill = kernels.prefill(x.dtype)
        latent = []  # the requests that attend to their choice in latent space: one call
        dense = []  # the prompt chunks that attend causally on up-projected keys: at once
        in_full = []  # decode steps over all their positions, on a compiled kernel: one call
        whole = kernels.sparse_latent is not None and q.dtype in (torch.float32, torch.bfloat16)
        for seg, chosen in zip(segments, selected, strict=True):
            if chosen is not None:
                if self.sparse_expands(seg.q_len, seg.length, kernels, q.dtype):
                    out[seg.rows] = self.sparse(q[seg.rows], seg, cache, chosen, kernels)
                else:
                    latent.append((seg, chosen))
            elif self.absorbs(mode, seg, prefill):
                if whole and seg.q_len == 1:
                    in_full.append(seg)
                else:
                    out[seg.rows] = self.absorbed(q[seg.rows], seg, cache)
            else:
                dense.append(seg)
        if dense:
            self.expanded_chunks(q, cache, dense, out, prefill, batched)
        if latent:  # a batch's decode steps above all
            rows, o = self.sparse_latent_rows(q, latent, cache, kernels)
            out[rows] = o
        if in_full:
            rows, o = self.latent_steps(q, in_full, cache, kernels)
            out[rows] = o
        return self.o_proj(out.flatten(1))  # [tokens, heads * v_head_dim]

    def forward_context_parallel(
        self,
        x: torch.Tensor,
        rope: Rope,
        plan: CpPlan,
        layer_id: int,
        cache: torch.Tensor,
        index_cache: torch.Tensor | None,
        kernels: DirectKernels = TORCH_KERNELS,
    ) -> torch.Tensor:
        """`forward` of this rank's tokens under context parallelism (x: its rows). The
        latent rows go first, so their exchange with the other CP ranks runs while the
        queries are projected; then every request's rows of all its positions are here (a
        cache row is small: MLA re-gathers its prefix rather than merging partial results),
        and each of this rank's blocks of queries attends to the positions before it. With
        V3.2's indexer only the rows its queries chose travel (`_sparse_context_parallel`)."""
        if self.indexer is not None:
            assert index_cache is not None
            return self._sparse_context_parallel(
                x, rope, plan, layer_id, cache, index_cache, kernels
            )

        def write(slots: torch.Tensor, rows: torch.Tensor) -> None:
            cache[slots] = rows

        with region("cp.launch"):
            exchange = plan.launch_rows(layer_id, self.latent(x, rope), lambda s: cache[s])
        with region("mla.query"):
            q = self.query(x, rope, self.query_latent(x))
        with region("cp.finish"):
            plan.finish(exchange, layer_id, write)
        out = x.new_empty(x.shape[0], self.num_heads, self.mla.v_head_dim)
        for seg in plan.segments:
            latents = plan.segment_rows(seg, exchange)  # [prefix + length, width]
            self._attend_blocks(q, out, latents, seg.query_blocks(), kernels)
        return self.o_proj(out.flatten(1))

    def _sparse_context_parallel(
        self,
        x: torch.Tensor,
        rope: Rope,
        plan: CpPlan,
        layer_id: int,
        cache: torch.Tensor,
        index_cache: torch.Tensor,
        kernels: DirectKernels,
    ) -> torch.Tensor:
        """V3.2 under context parallelism: every position's index key is exchanged (each
        query scores them all, so its top-k is the global one), so are the chunks' latent
        rows (every rank writes those of the pages it holds), and of each prefix only the
        latent rows this rank's queries chose (a decode step's topk, a block of queries'
        union), asked of the ranks holding them (`CpPlan.fetch`): no rank gathers a prefix's
        latent rows whole."""
        assert self.indexer is not None
        indexer, topk = self.indexer, self.indexer.config.topk

        def write_keys(slots: torch.Tensor, rows: torch.Tensor) -> None:
            index_cache[slots] = rows

        def write_rows(slots: torch.Tensor, rows: torch.Tensor) -> None:
            cache[slots] = rows

        with region("cp.launch"):
            keys = plan.launch_rows(layer_id, indexer.keys(x, rope), lambda s: index_cache[s])
            chunks = plan.launch_chunk(layer_id, self.latent(x, rope))
        with region("mla.query"):
            q_latent = self.query_latent(x)
            q = self.query(x, rope, q_latent)
            assert q_latent is not None
            index_q, index_w = indexer.queries(q_latent, rope), indexer.head_weights(x)
        with region("cp.finish"):
            plan.finish(keys, layer_id, write_keys)
            plan.finish(chunks, layer_id, write_rows)
        blocks, wanted = [], []
        for seg in plan.segments:
            index_keys = plan.segment_rows(seg, keys)  # [prefix + length, index_head_dim]
            chosen: list[torch.Tensor | None] = []
            need = [torch.empty(0, dtype=torch.long, device=x.device)]
            for first, end, rows in seg.query_blocks():
                picked = None  # a block that sees no more than topk reads all it sees
                if end > topk:
                    picked = causal_top_positions(
                        index_q[rows],
                        index_w[rows],
                        index_keys[:end],
                        first,
                        indexer.scale,
                        topk,
                        kernels,
                    )
                    need.append(picked[(picked >= 0) & (picked < seg.prefix)])
                else:
                    need.append(torch.arange(min(end, seg.prefix), device=x.device))
                chosen.append(picked)
            blocks.append(chosen)
            wanted.append(torch.cat(need).unique())
        with region("cp.fetch"):
            fetched = plan.fetch(layer_id, wanted, lambda s: cache[s])
        out = x.new_empty(x.shape[0], self.num_heads, self.mla.v_head_dim)
        for seg, chosen, want, rows in zip(plan.segments, blocks, wanted, fetched, strict=True):
            # the rows no query here chose stay unset: the attention reads none of them (a
            # reused buffer, valid until the next segment's)
            shape = (seg.prefix + seg.length, cache.shape[1])
            latents = plan.ctx.buffers.get("latents", shape, cache.dtype, cache.device)
            latents[want] = rows
            latents[seg.prefix :] = plan.chunk_rows(seg, chunks)
            self._attend_blocks(q, out, latents, seg.query_blocks(), kernels, chosen)
        return self.o_proj(out.flatten(1))

    def _attend_blocks(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        latents: torch.Tensor,
        blocks: list[tuple[int, int, torch.Tensor]],
        kernels: DirectKernels,
        chosen: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Context parallelism's blocks of one request's queries (first position, end
        position, their rows), each over `latents` [0, end) (the request's rows by
        position), into out[rows]: over its chosen positions where `chosen` gives them, else
        absorbed or on keys up-projected once for all the blocks."""
        prefill = kernels.prefill(q.dtype)
        expanded: ExpandedKeys | None = None
        # the blocks not over chosen positions read [0, end): up-projected that far at most
        dense = max(
            (end for i, (_, end, _) in enumerate(blocks) if not chosen or chosen[i] is None),
            default=0,
        )
        for i, (first, end, rows) in enumerate(blocks):
            seg_view = LatentSegment(0, end - first, runs=((0, end),), device=q.device)
            picked = None if chosen is None else chosen[i]
            if picked is not None:
                out[rows] = self.sparse(q[rows], seg_view, latents, picked, kernels)
            elif self.absorbs("auto", seg_view, prefill):
                out[rows] = self.absorbed(q[rows], seg_view, latents)
            else:
                if expanded is None:
                    expanded = ExpandedKeys(*self.expand(latents[:dense]), prefill)
                out[rows] = expanded.attend(q[rows], first, end, self.scale)

    def absorbs(self, mode: Mode, seg: LatentSegment, prefill: Kernel | None = None) -> bool:
        """Whether a segment without an indexer's choice attends in latent space: "auto" takes
        the cheaper form (see `absorb_max_queries`), expanded on a compiled dense `prefill`
        kernel being the faster per FLOP."""
        if mode != "auto":
            return mode == "absorbed"
        limit = self.absorb_max_queries // (NATIVE_EXPANDED_SPEEDUP if prefill else 1)
        return seg.prefix_len > 0 and seg.q_len <= limit

    def query_latent(self, x: torch.Tensor) -> torch.Tensor | None:
        """The compressed query, q_a_layernorm's output [tokens, q_lora_rank] (what V3.2's
        indexer reads); None without query compression."""
        if self.q_a_proj is None:
            return None
        assert self.q_a_layernorm is not None
        return self.q_a_layernorm(self.q_a_proj(x))

    def query(
        self, x: torch.Tensor, rope: Rope, q_latent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[tokens, heads, qk_head_dim]: per head [q_nope | roped q_rope]."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.query_latent(x) if q_latent is None else q_latent)
        q = q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim)
        m = self.mla
        return apply_rotary_part(q, *rope, start=m.qk_nope_head_dim, interleaved=m.rope_interleave)

    def latent(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """What the tokens cache: [tokens, latent_width], [normed latent | roped k_rope]."""
        m = self.mla
        c, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_rope = apply_rotary(k_rope[:, None], *rope, interleaved=m.rope_interleave)[:, 0]
        return torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)

    def index_positions(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor | None,
        rope: Rope,
        index_cache: torch.Tensor | None,
        segments: list[LatentSegment],
        new_slots: torch.Tensor | None = None,
        kernels: DirectKernels = TORCH_KERNELS,
        table: StepTable | None = None,
    ) -> torch.Tensor | None:
        """With an indexer, the positions [tokens, topk] each query may read (its choice, -1
        for none; writes the segments' index keys, at `new_slots` where given; the decode
        steps of `table` selected at once); None without one."""
        if self.indexer is None:
            return None
        if index_cache is None or q_latent is None:
            raise ValueError("an MLA layer with an indexer needs its index key cache")
        return self.indexer(x, q_latent, rope, index_cache, segments, new_slots, kernels, table)

    def step_table(
        self, batched: AttentionPlan | None, steps: torch.Tensor | None
    ) -> StepTable | None:
        """With an indexer and a batched plan of decode steps (`steps`: their rows) that has
        a page table of them, that table (the indexer selects them all at once); else
        None."""
        if self.indexer is None or batched is None or steps is None:
            return None
        return batched.backend.latent_table(batched.meta)

    def selections(
        self, positions: torch.Tensor | None, segments: list[LatentSegment]
    ) -> list[torch.Tensor | None]:
        """Per segment, the positions [q_len, topk] each query may read (the indexer's choice,
        -1 for none), or None for plain causal attention (no query sees more than topk)."""
        if positions is None or self.indexer is None:
            return [None] * len(segments)
        topk = self.indexer.config.topk
        return [positions[seg.rows] if seg.length > topk else None for seg in segments]

    def expanded_chunks(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        out: torch.Tensor,
        prefill: Kernel | None = None,
        batched: AttentionPlan | None = None,
    ) -> None:
        """Prompt chunks attending causally to all their positions on up-projected keys
        (q [tokens, heads, qk_head_dim] of the batch): the chunks' cached rows read in one
        gather and up-projected in one product, then attended in one launch where the
        batch's backend has one (`latent_prompts`), else chunk by chunk over views of the
        one expansion (on a compiled dense `prefill` kernel where given); as many chunks at
        a time as EXPANDED_GROUP_BYTES of keys and values hold, a longer chunk alone. Writes
        the chunks' rows of out [tokens, heads, v_head_dim]."""
        m = self.mla
        per_row = self.num_heads * (m.qk_head_dim + m.v_head_dim) * q.element_size()
        budget = EXPANDED_GROUP_BYTES // per_row  # positions
        group: list[LatentSegment] = []
        rows = 0
        for seg in segments:
            if group and rows + seg.length > budget:
                self._expanded_group(q, cache, group, out, prefill, batched)
                group, rows = [], 0
            group.append(seg)
            rows += seg.length
        self._expanded_group(q, cache, group, out, prefill, batched)

    def _expanded_group(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        out: torch.Tensor,
        prefill: Kernel | None,
        batched: AttentionPlan | None,
    ) -> None:
        """`expanded_chunks` of chunks up-projected together."""
        if len(segments) == 1:
            kv = segments[0].read(cache)  # a view where its slots are one run
        else:
            kv = cache[torch.cat([seg.slots for seg in segments])]
        k_nope, v, k_rope = self.up_project(kv)
        spans, first = [], 0
        for seg in segments:
            spans.append(ExpandedSpan(seg.q_start, seg.q_len, seg.prefix_len, first))
            first += seg.length
        if batched is not None:
            with region("attention.kernel"):
                keys = (k_nope, k_rope)
                args = (batched.meta, q, keys, v, tuple(spans), self.scale, out)
                if batched.backend.latent_prompts(*args):
                    return
        width = head_width(q.shape[-1], v.shape[-1], prefill)  # padded once for all chunks
        q, k, v = _pad(q, width), _pad(self.keys(k_nope, k_rope), width), _pad(v, width)
        dv = self.mla.v_head_dim
        for seg, span in zip(segments, spans, strict=True):
            rows = slice(span.first_key, span.first_key + seg.length)
            with region("attention.kernel"):
                o = causal_attention(
                    q[seg.rows], k[rows], v[rows], seg.prefix_len, self.scale, prefill
                )
            out[seg.rows] = o[..., :dv]

    def up_project(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached rows [L, latent_width] -> views k_nope [L, heads, qk_nope_head_dim] and v
        [L, heads, v_head_dim] of one up-projection, and k_rope [L, qk_rope_head_dim] (the
        rows' own, shared by the heads)."""
        m, h = self.mla, self.num_heads
        c, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        with region("mla.up_projection"):
            up = self.kv_b_proj(c).view(kv.shape[0], h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = up.split([m.qk_nope_head_dim, m.v_head_dim], -1)
        return k_nope, v, k_rope

    def expand(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [L, latent_width] -> per-head keys [L, heads, qk_head_dim] (k_nope,
        then the shared k_rope) and values [L, heads, v_head_dim]."""
        k_nope, v, k_rope = self.up_project(kv)
        return self.keys(k_nope, k_rope), v

    def keys(self, k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Per-head keys [L, heads, qk_head_dim] (`per_head_keys`)."""
        with region("mla.expand_keys"):
            return per_head_keys(k_nope, k_rope)

    def sparse(
        self,
        q: torch.Tensor,
        seg: LatentSegment,
        cache: torch.Tensor,
        chosen: torch.Tensor,
        kernels: DirectKernels = TORCH_KERNELS,
        keys_read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V3.2: the segment's queries over the positions their indexer chose, `chosen` [n,
        topk] (-1 for none), and no others, in the cheaper form (`sparse_expands`): on the
        up-projected keys of the request, or in latent space on its cache rows (`absorbed`),
        on the `kernels` where they have them. keys_read counts the (query, position) pairs
        read. q [n, heads, qk_head_dim] -> [n, heads, v_head_dim]."""
        if self.sparse_expands(seg.q_len, seg.length, kernels, q.dtype):
            return self.sparse_expanded(q, seg.read(cache), chosen, kernels, keys_read)
        return self.absorbed(q, seg, cache, chosen, kernels, keys_read)

    def sparse_latent_rows(
        self,
        q: torch.Tensor,
        parts: list[tuple[LatentSegment, torch.Tensor]],
        cache: torch.Tensor,
        kernels: DirectKernels = TORCH_KERNELS,
        keys_read: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sparse` in latent space for several requests at once (a batch's decode steps):
        parts: (segment, its chosen positions [q_len, topk]) -> (their rows [m] of q [tokens,
        heads, qk_head_dim], in the parts' order; the output [m, heads, v_head_dim]). Each
        query reads its chosen cache rows only, all queries in one call of the kernel and
        one absorption each way."""
        device = q.device
        rows = torch.cat(
            [torch.arange(seg.q_start, seg.q_start + seg.q_len, device=device) for seg, _ in parts]
        )
        slots = torch.cat([seg.chosen_slots(chosen) for seg, chosen in parts])
        return rows, self._over_chosen(q[rows], cache, slots, kernels, keys_read)

    def latent_steps(
        self,
        q: torch.Tensor,
        steps: list[LatentSegment],
        cache: torch.Tensor,
        kernels: DirectKernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode steps in latent space over every position of their requests, all in one call
        of the kernels' `sparse_latent` (each step's slots, padded with -1 to the longest):
        `absorbed` for all of them, one absorption each way -> (their rows [b] of q, in the
        steps' order; the output [b, heads, v_head_dim])."""
        rows = torch.tensor([seg.q_start for seg in steps], device=q.device)
        slots = nn.utils.rnn.pad_sequence(
            [seg.slots for seg in steps], batch_first=True, padding_value=-1
        )
        return rows, self._over_chosen(q[rows], cache, slots, kernels, None)

    def _over_chosen(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        kernels: DirectKernels,
        keys_read: torch.Tensor | None,
    ) -> torch.Tensor:
        """Absorbed attention of q [n, heads, qk_head_dim] over the cache rows `slots` [n,
        topk] each (-1: none) -> [n, heads, v_head_dim]: one key head shared by all heads, its
        value the whole row, of which the latent part is kept (no copy of the cache to cut
        the rope part off first)."""
        q_cat = self.latent_query(q)
        rank = self.mla.kv_lora_rank
        with region("attention.kernel"):
            o = sparse_latent_attention(
                q_cat, cache, slots, rank, self.scale, kernels.sparse_latent, keys_read
            )
        return self.values_out(o)

    def sparse_expands(
        self, q_len: int, length: int, kernels: DirectKernels, dtype: torch.dtype
    ) -> bool:
        """Whether `q_len` queries of a request of `length` positions attend to their chosen
        positions on up-projected keys: on a compiled kernel (`kernels.sparse_expanded`, the
        native backend's), when up-projecting every
        position (once per segment) and then (qk_head_dim + v_head_dim) multiply-adds per
        chosen pair and head cost less than 2 * kv_lora_rank + qk_rope_head_dim per pair in
        latent space, each form's multiply-adds weighed by its speed (SPARSE_EXPANDED_MAC,
        UP_PROJECTION_MAC). Long prompt chunks of a model with few heads expand; decode steps
        and short chunks, and wide latents or heads (DeepSeek-V3.2's own widths), stay latent.
        PIPESERVE_SPARSE_ATTENTION_FORM=latent|expanded overrides the rule."""
        if dtype not in (torch.float32, torch.bfloat16) or self.indexer is None:
            return False
        form = envs.sparse_attention_form()
        if form == "latent" or kernels.sparse_expanded is None:
            return False
        if form == "expanded":
            return True
        m = self.mla
        pairs = q_len * min(self.indexer.config.topk, length)
        up = length * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) * UP_PROJECTION_MAC
        expanded = up + pairs * (m.qk_head_dim + m.v_head_dim) * SPARSE_EXPANDED_MAC
        return expanded < pairs * (2 * m.kv_lora_rank + m.qk_rope_head_dim)

    def sparse_expanded(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        chosen: torch.Tensor,
        kernels: DirectKernels,
        keys_read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sparse` on up-projected keys: kv [L, latent_width] cached rows of positions [0, L),
        all up-projected (no per-head copy of k_rope: the kernel reads the shared one from the
        rows), then each query's heads over its chosen positions only
        (`kernels.sparse_expanded`, pipeserve/kernels/sparse_expanded.cpp)."""
        kernel = kernels.sparse_expanded
        assert kernel is not None, "sparse_expands chose a kernel the backend does not have"
        k_nope, v, k_rope = self.up_project(kv)
        counter = torch.zeros(1, dtype=torch.long) if keys_read is None else keys_read
        with region("attention.kernel"):
            return kernel(q, k_nope, v, k_rope, chosen, self.scale, counter)

    def absorbed(
        self,
        q: torch.Tensor,
        seg: LatentSegment,
        cache: torch.Tensor,
        chosen: torch.Tensor | None = None,
        kernels: DirectKernels = TORCH_KERNELS,
        keys_read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `expanded_chunks`, attending in latent space: only cache rows are read, and with an
        indexer's choice `chosen` [n, topk] (positions, -1 for none) only the chosen rows, in
        place (`sparse_latent_attention`, on `kernels.sparse_latent` where it is there;
        keys_read counts them). q [n, heads, qk_head_dim] -> [n, heads, v_head_dim]."""
        if chosen is not None:
            return self._over_chosen(q, cache, seg.chosen_slots(chosen), kernels, keys_read)
        q_cat = self.latent_query(q)  # one key head shared by all heads, as `_over_chosen`
        if seg.q_len == 1:
            o = latent_over_parts(q_cat, seg.parts(cache), self.scale)
        else:
            kv = seg.read(cache)[:, None]
            o = causal_attention(q_cat, kv, kv, seg.prefix_len, self.scale)
        return self.values_out(o[..., : self.mla.kv_lora_rank])

    def absorbed_batch(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        plan: AttentionPlan,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`absorbed` for every decode step of a batch at once on the plan's backend (one
        absorption each way; the backend's `latent_decode` between):
        q [b, heads, qk_head_dim] over each step's latent rows, or with an indexer's choice
        `chosen` [b, topk] (positions, -1 for none) over the chosen rows only
        -> [b, heads, v_head_dim]."""
        q_cat = self.latent_query(q)[:, None]  # [b, 1 key head, heads, W]
        rope = self.mla.qk_rope_head_dim
        o = plan.backend.latent_decode(q_cat, cache, plan.meta, chosen, self.scale, rope)
        return self.values_out(o)  # o: [b, heads, rank]

    def latent_query(self, q: torch.Tensor) -> torch.Tensor:
        """Absorbed attention's query: q [n, heads, qk_head_dim] -> [n, heads, latent_width],
        its nope part taken into latent space by W_UK, its rope part kept."""
        m = self.mla
        w_uk, _ = self.absorbed_weights()
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, heads, rank]
        return torch.cat([q_latent, q_rope], dim=-1)

    def values_out(self, o: torch.Tensor) -> torch.Tensor:
        """Absorbed attention's output over latent values [n, heads, rank], up-projected by
        W_UV -> [n, heads, v_head_dim]."""
        _, w_uv = self.absorbed_weights()
        return torch.matmul(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK [heads, qk_nope_head_dim, rank] and
        W_UV [heads, v_head_dim, rank] (rows are head-major [k_nope | v] per head)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        return w_uk, w_uv


class ExpandedKeys:
    """A request's up-projected keys and values [L, heads, d] over all its positions, for
    several blocks of its queries (context parallelism: a rank's zig-zag blocks): expanded
    once, and for a compiled dense `prefill` kernel padded and laid out head-major once."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, prefill: Kernel | None) -> None:
        self.k, self.v = k, v
        self.dv = v.shape[-1]
        self.prefill = prefill
        self.pools: tuple[torch.Tensor, torch.Tensor, int] | None = None
        if prefill is not None:
            width = head_width(k.shape[-1], self.dv, prefill)
            with region("mla.key_pools"):
                k_pool, v_pool = (_pad(t, width).transpose(0, 1).contiguous() for t in (k, v))
            self.pools = (k_pool, v_pool, width)

    def attend(
        self,
        q: torch.Tensor,
        first: int,
        end: int,
        scale: float,
    ) -> torch.Tensor:
        """Queries of positions [first, end) over positions [0, end) -> [n, heads, dv]."""
        with region("attention.kernel"):
            if self.pools is None:
                return causal_attention(q, self.k[:end], self.v[:end], first, scale)
            k_pool, v_pool, width = self.pools
            kernel = self.prefill
            assert kernel is not None
            runs = torch.tensor([[0, end]], dtype=torch.long)  # the kernel is CPU-only
            out = kernel(_pad(q, width).contiguous(), k_pool, v_pool, runs, first, scale)
            return out[..., : self.dv]


def absorb_max_queries(mla: MLAConfig) -> int:
    """The longest segment for which absorbed attention costs fewer multiply-adds than expanded,
    per head: expanded pays kv_lora_rank * (qk_nope_head_dim + v_head_dim) to up-project each
    cached position once per segment; absorbed pays 2 * kv_lora_rank - qk_nope_head_dim -
    v_head_dim more per (query, key) pair (latent-width keys and values instead of per-head
    ones). bench-deepseek: 85 (DeepSeek-V3: 170). benchmarks/mla_paths.py measured the
    crossover on a CPU core at 64-150 new tokens for prefixes of 2K-32K with both forms on the
    same fused kernel, so the count is used as it is; with expanded on the compiled prefill
    kernel, see NATIVE_EXPANDED_SPEEDUP. With no prefix there is nothing to re-expand and
    expanded always wins."""
    m = mla
    per_pair = 2 * m.kv_lora_rank - m.qk_nope_head_dim - m.v_head_dim
    return m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) // max(per_pair, 1)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    prefill: Kernel | None = None,
) -> torch.Tensor:
    """q [n, h, d]; k [L, hk, d], v [L, hk, dv] with hk = h or 1 (one head shared by all);
    key j is position j, query i position prefix_len + i, reading keys 0 .. prefix_len + i
    -> [n, h, dv]. Runs a fused softmax-attention kernel: with per-head keys, the compiled
    dense `prefill` kernel where given (the native backend's, for q's dtype), else
    `attention_with_lse`. Both want one head width: the narrower of q/k and v is zero-padded,
    which changes no score and no output column."""
    n, h, d = q.shape
    dv = v.shape[-1]
    kernel = prefill if k.shape[1] == h else None
    width = head_width(d, dv, kernel)
    q, k, v = _pad(q, width), _pad(k, width), _pad(v, width)
    if kernel is not None:
        out = _native_prefill(kernel, q, k, v, prefix_len, scale)
    elif k.shape[1] == 1:
        out = _shared_key_head(q, k, v, prefix_len, scale)
    else:
        out = _prefix_then_chunk(q, k, v, prefix_len, scale)
    return out[..., :dv]


def head_width(d: int, dv: int, kernel: Kernel | None) -> int:
    """The one head width `causal_attention` runs q/k (width d) and v (dv) at: the wider of
    the two, for a compiled kernel rounded up to its multiple of 16."""
    return -(-max(d, dv) // 16) * 16 if kernel else max(d, dv)


def sparse_latent_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    rank: int,
    scale: float,
    kernel: Kernel | None = None,
    keys_read: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's sparse attention in latent space: each query's heads over its own
    chosen rows only. q [n, h, W] (absorbed queries); rows [N, W] (the latent cache, or a
    view whose rows are contiguous: keys are whole rows, values their first `rank` values);
    slots [n, topk] (the rows each query reads, -1 for none) -> [n, h, rank]. The work is
    O(n * topk) whatever the context is, and no [n, L] mask exists: a compiled `kernel` where
    given (the native backend's, pipeserve/kernels/sparse_attention.cpp; the Triton
    backend's, kernels/triton_attention.py: `sparse_latent`) reads the rows in place; else
    the chosen rows are gathered for a block of queries at a time
    (`gathered_latent_attention`).
    keys_read: an int64 counter [1] the (query, row) pairs read are
    added to."""
    if kernel is not None and q.dtype in (torch.float32, torch.bfloat16) and rows.dtype == q.dtype:
        counter = (
            torch.zeros(1, dtype=torch.long, device=q.device) if keys_read is None else keys_read
        )
        return kernel(q, rows, slots, rank, scale, counter)
    return gathered_latent_attention(q, rows, slots, rank, scale, keys_read)


def _shared_key_head(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """All query heads against one key head: the heads are folded into the query rows (row
    i * h + head), so the cache rows are read once for every head. The prefix is one unmasked
    call and only the chunk's own keys take a mask, [n * h, n], never one of
    [n * h, prefix_len + n]."""
    n, h, d = q.shape
    rows, kh, vh = q.reshape(1, 1, n * h, d), _heads_first(k), _heads_first(v)
    if n == 1:
        out, _ = attention_with_lse(rows, kh, vh, False, scale)
        return out[0, 0].reshape(n, h, -1)
    own = additive_mask(_causal(n, n, 0, q.device).repeat_interleave(h, dim=0), q.dtype)
    chunk = slice(prefix_len, prefix_len + n)
    parts = [attention_with_lse(rows, kh[:, :, chunk], vh[:, :, chunk], False, scale, own)]
    if prefix_len:
        prefix = (kh[:, :, :prefix_len], vh[:, :, :prefix_len])
        parts.append(attention_with_lse(rows, *prefix, False, scale))
    return merge_partials(parts)[0, 0].reshape(n, h, -1)


def _prefix_then_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Causal attention as two kernel calls merged by their log-sum-exp: the queries over the
    whole prefix (nothing masked) and over their own chunk (causal, top-left aligned)."""
    qh, kh, vh = (_heads_first(t) for t in (q, k, v))
    parts = [attention_with_lse(qh, kh[:, :, prefix_len:], vh[:, :, prefix_len:], True, scale)]
    if prefix_len:
        prefix = (kh[:, :, :prefix_len], vh[:, :, :prefix_len])
        parts.append(attention_with_lse(qh, *prefix, False, scale))
    return merge_partials(parts)[0].transpose(0, 1)


def _native_prefill(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """A paged prefill kernel over the freshly expanded keys and values, laid out as a
    one-run pool [h, L, d]."""
    k_pool, v_pool = (t.transpose(0, 1).contiguous() for t in (k, v))
    runs = torch.tensor([[0, k.shape[0]]], dtype=torch.long)  # the kernel is CPU-only
    return kernel(q.contiguous(), k_pool, v_pool, runs, prefix_len, scale)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[n, h, d] -> [1, h, n, d], the kernel's layout."""
    return t.transpose(0, 1)[None]


def _causal(n: int, length: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """[n, length] bool: query i (position prefix_len + i) may read keys 0..prefix_len + i."""
    return torch.ones(n, length, dtype=torch.bool, device=device).tril(prefix_len)


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else nn.functional.pad(t, (0, width - t.shape[-1]))
