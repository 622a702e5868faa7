"""Seconds of one forward of one pipeline stage, from the model's shapes and the hardware
(spec 06): per operator class the FLOPs and bytes a rank moves, each class taking
max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)), plus the collectives of
its layout (TP all-reduces, EP dispatch/combine, CP K/V all-gathers) and fixed overheads.

Operator classes:
- gemm: attention projections (MLA's query, latent and up-projection paths, the prefix it
  re-expands, V3.2's indexer projections), dense MLPs, the router, shared experts, the LM
  head for sampled rows;
- moe: the routed experts, `top_k` per token;
- attention: the kernel (QK^T and PV), causal inside a chunk, over the prefix in the cache.

A rank's share follows the engine: TP splits heads and projections, except MLA's q_a and
kv_a projections, V3.2's indexer and the router (replicated), and GQA's K/V heads down to
one per rank; EP gives each rank its own requests and 1/E of the experts (every rank waits
for the slowest at each MoE layer); CP gives each rank 1/N of a prompt chunk's tokens and
queries (zig-zag) while a decode step runs on every rank, each rank re-gathering the prefix
K/V it attends to and re-expanding MLA's prefix. Pure Python over ints: no tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeserve.layers.mla import absorb_max_queries
from pipeserve.models.arch import ArchConfig
from pipeserve.runner.kv_layout import kv_heads_per_rank, latent_widths
from pipeserve.sim import collectives
from pipeserve.sim.hardware import Efficiency, Hardware, Link

DTYPE_BYTES = {"fp8": 1.0, "bfloat16": 2.0, "float16": 2.0, "float32": 4.0}
COMPUTE = ("gemm", "moe", "attention")
CLASSES = (*COMPUTE, "tp_comm", "ep_comm", "cp_comm", "overhead")


class SliceWork(NamedTuple):
    """One request's share of a forward, as the cost model needs it."""

    prefix: int  # tokens already in the KV cache
    tokens: int  # tokens computed now
    decode: bool = False
    sample: bool = False


@dataclass(frozen=True)
class Precision:
    weights: str = "bfloat16"  # dtype of the projections' and experts' weights (fp8: e4m3)
    activations: str = "bfloat16"  # activations, the KV cache, the attention kernel

    def __post_init__(self) -> None:
        for d in (self.weights, self.activations):
            if d not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {d!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.weights]

    @property
    def act_bytes(self) -> float:
        return DTYPE_BYTES[self.activations]


@dataclass(frozen=True)
class SimLayout:
    """Where the ranks are: stage-major (rank = stage x width + index in the stage), nodes of
    `devices_per_node` consecutive ranks."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    devices_per_node: int = 8
    threads: int = 1  # CPU: torch threads per worker
    sharded_cp: bool = False  # the routed experts spread over the CP ranks

    @property
    def width(self) -> int:
        return self.tp * self.ep * self.cp

    @property
    def world(self) -> int:
        return self.width * self.pp

    @property
    def nnodes(self) -> int:
        return -(-self.world // self.devices_per_node)

    @property
    def expert_ranks(self) -> int:
        return self.cp if self.sharded_cp else self.ep

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def stage_group_link(self, hw: Hardware, stage: int) -> Link:
        """The link a collective among one stage's ranks runs over."""
        first = stage * self.width
        same = self.node(first) == self.node(first + self.width - 1)
        return hw.intra_node if same else hw.inter_node

    def boundary_link(self, hw: Hardware, stage: int) -> Link:
        """The link from stage `stage` to the next (rank i to rank i + width): between nodes
        if any pair's is (the slowest pair sets the pace)."""
        first = stage * self.width
        pairs = range(first, first + self.width)
        crosses = any(self.node(r) != self.node(r + self.width) for r in pairs)
        return hw.inter_node if crosses else hw.intra_node


@dataclass
class StageCost:
    """Seconds of one stage's forward by class."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def add(self, other: StageCost, scale: float = 1.0) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] += v * scale


@dataclass
class Work:
    """FLOPs and bytes of one rank, per operator class."""

    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPUTE, 0.0))
    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPUTE, 0.0))

    def add(self, kind: str, flops: float, nbytes: float) -> None:
        self.flops[kind] += flops
        self.bytes[kind] += nbytes


class CostModel:
    """Forward seconds per stage for one model, hardware, layout and precision."""

    def __init__(
        self,
        arch: ArchConfig,
        hw: Hardware,
        layout: SimLayout,
        precision: Precision,
        partition: Sequence[int],
        shared_overlap: bool = False,
    ) -> None:
        """`shared_overlap`: single-batch overlap runs the shared experts while the dispatch
        (or the combine) is in flight."""
        if len(partition) != layout.pp:
            raise ValueError(f"partition {list(partition)} does not have {layout.pp} stages")
        self.arch, self.hw, self.layout, self.precision = arch, hw, layout, precision
        self.partition = list(partition)
        self.shared_overlap = shared_overlap
        starts = [sum(partition[:i]) for i in range(len(partition))]
        self.stage_layers = [range(s, s + n) for s, n in zip(starts, partition, strict=True)]
        self.stage_kinds = [self._layer_kinds(layers) for layers in self.stage_layers]
        self.eff: Efficiency = hw.efficiency_for(layout.threads, self.busy)
        self.absorb_limit = absorb_max_queries(arch.mla) if arch.mla else 0

    def _layer_kinds(self, layers: range) -> list[tuple[int, int]]:
        """(a layer of the kind, how many) for a stage's dense layers, then its MoE ones: all
        layers of a kind cost the same."""
        out = []
        for moe in (False, True):
            kind = [i for i in layers if self.arch.is_moe_layer(i) == moe]
            if kind:
                out.append((kind[0], len(kind)))
        return out

    @property
    def busy(self) -> bool:
        """CPU: every core is busy while a stage computes (several workers share the
        machine, emulated nodes included), which slows each of them."""
        return self.hw.kind == "cpu" and self.layout.world > 1

    def alone(self) -> CostModel:
        """The same model for a stage computing while every other rank idles, as the
        start-up profile times the stages one after another."""
        solo = copy.copy(self)
        solo.eff = self.hw.efficiency_for(self.layout.threads, False)
        return solo

    # -- shapes (multiply-adds per token on one rank) --------------------------------------

    def attention_weights(self) -> float:
        """One rank's attention projections."""
        a, tp, h = self.arch, self.layout.tp, self.arch.hidden_size
        if a.mla is None:  # q and o split; K and V down to one head per rank
            return 2 * h * a.q_size / tp + 2 * h * kv_heads_per_rank(a, tp) * a.head_dim
        m, heads, r = a.mla, a.num_heads, a.mla.q_lora_rank
        split = (r or h) * heads * m.qk_head_dim  # q_b_proj (or q_proj)
        split += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b_proj
        split += heads * m.v_head_dim * h  # o_proj
        replicated = h * r + h * (m.kv_lora_rank + m.qk_rope_head_dim)  # q_a, kv_a
        if a.indexer is not None:  # wq_b, wk, weights_proj
            i = a.indexer
            replicated += r * i.n_heads * i.head_dim + h * i.head_dim + h * i.n_heads
        return split / tp + replicated

    def mlp_weights(self, layer: int) -> float:
        """One rank's non-routed MLP: a dense MLP, or the router (replicated) and the shared
        experts."""
        a, tp, h = self.arch, self.layout.tp, self.arch.hidden_size
        if not a.is_moe_layer(layer):
            return 3 * h * a.intermediate_size / tp
        shared = a.routing.n_shared_experts if a.routing else 0
        return h * a.num_experts + shared * self.expert_weights / tp

    def dense_weights(self, layer: int) -> float:
        return self.attention_weights() + self.mlp_weights(layer)

    @property
    def expert_weights(self) -> float:
        """One routed expert, whole."""
        return 3 * self.arch.hidden_size * self.arch.moe_intermediate_size

    def kv_bytes_per_token_layer(self) -> float:
        """KV cache bytes one token takes in one layer on one rank (latent: replicated)."""
        a, b = self.arch, self.precision.act_bytes
        if a.mla is not None:
            return sum(latent_widths(a)) * b
        return 2 * kv_heads_per_rank(a, self.layout.tp) * a.head_dim * b

    def rank_tokens(self, batch: Sequence[SliceWork]) -> float:
        """Tokens one rank computes: 1/N of each prompt chunk's under CP, every decode step."""
        cp = self.layout.cp
        return sum(s.tokens if s.decode else s.tokens / cp for s in batch)

    # -- one forward ----------------------------------------------------------------------

    def forward(
        self,
        stage: int,
        batches: Sequence[Sequence[SliceWork]],
        two_batch: bool = False,
        combine_blocks: int = 1,
    ) -> StageCost:
        """One stage's forward of a micro-batch: `batches` holds each attention (EP) rank's
        slices (one list without EP). Every rank waits for the slowest at each MoE layer and
        each collective, so the stage takes the slowest rank's time, layer kind by layer
        kind. `two_batch`: each rank's batch runs as two micro-batches whose communication
        hides behind the other's compute. `combine_blocks` > 1: single-batch overlap's
        combine-down, each block's combine travelling while the next block computes."""
        out, layers = StageCost(), self.stage_layers[stage]
        routed = sum(self.rank_tokens(b) for b in batches) * self.layout.cp
        for layer, count in self.stage_kinds[stage]:
            ranks = [
                self._layer(layer, b, routed, stage, two_batch, combine_blocks) for b in batches
            ]
            out.add(max(ranks, key=lambda c: c.total), count)
        out.seconds["overhead"] += self.eff.layer_overhead_s * len(layers)
        out.seconds["overhead"] += self.eff.forward_overhead_s
        if stage == self.layout.pp - 1:
            samples = max((sum(s.sample for s in b) for b in batches), default=0)
            out.seconds["gemm"] += self.lm_head_s(samples)
        return out

    def layer_s(self, layer: int, batch: Sequence[SliceWork]) -> float:
        """Seconds of one layer for one rank's batch (stage 0's links)."""
        routed = self.rank_tokens(batch) * self.layout.cp
        return self._layer(layer, batch, routed, 0, False, 1).total

    def _layer(
        self,
        layer: int,
        batch: Sequence[SliceWork],
        routed_tokens: float,
        stage: int,
        two_batch: bool,
        combine_blocks: int,
    ) -> StageCost:
        cost = StageCost()
        work = self.work(layer, batch, routed_tokens)
        reads = 2 if two_batch else 1  # each half reads the weights again
        for kind in COMPUTE:
            nbytes = work.bytes[kind] * (1 if kind == "attention" else reads)
            cost.seconds[kind] = self._op_time(kind, work.flops[kind], nbytes)
        comm = self._comm(layer, batch, stage)
        self._overlap(comm, cost, layer, batch, two_batch, combine_blocks)
        cost.seconds.update(comm)
        return cost

    def work(self, layer: int, batch: Sequence[SliceWork], routed_tokens: float) -> Work:
        """FLOPs and bytes of one layer on one rank: `batch` is the rank's slices,
        `routed_tokens` the tokens of every rank of the stage (the experts' load under EP)."""
        work = Work()
        tokens = self.rank_tokens(batch)
        w = self.dense_weights(layer)
        work.add("gemm", 2 * tokens * w, w * self.precision.weight_bytes)
        for s in batch:
            self._attention(work, s)
        if self.arch.is_moe_layer(layer):
            self._experts(work, tokens, routed_tokens)
        return work

    def _attention(self, work: Work, s: SliceWork) -> None:
        """QK^T and PV of one slice in one layer on this rank (1/N of the queries under CP),
        and the KV it reads. MLA: absorbed (latent-width keys) for decode steps and short
        chunks after a prefix, as the engine picks (layers.mla.absorb_max_queries); else
        expanded, which up-projects every prefix latent again (gemm)."""
        a, lay = self.arch, self.layout
        L, x = s.prefix, s.tokens
        heads = a.num_heads / lay.tp
        pairs = x * (L + x / 2)
        read = pairs if a.indexer is None else _sparse_pairs(L, x, a.indexer.topk)
        if a.mla is None:
            flops = 4 * pairs * heads * a.head_dim
        elif s.decode or (L > 0 and x <= self.absorb_limit):
            m = a.mla
            flops = 2 * read * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        else:
            m = a.mla
            flops = 2 * read * heads * (m.qk_head_dim + m.v_head_dim)
            up = L * m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            work.add("gemm", 2 * up, 0.0)  # every rank re-expands the whole prefix
        if a.indexer is not None:
            flops += 2 * pairs * a.indexer.n_heads * (a.indexer.head_dim + 1)
        # a chunk's queries read the whole (re-gathered) prefix; a decode step its pages
        kv_read = (L + x) * self.kv_bytes_per_token_layer() / (lay.cp if s.decode else 1)
        work.add("attention", flops / lay.cp, kv_read)

    def _experts(self, work: Work, tokens: float, routed_tokens: float) -> None:
        """Routed experts on one rank. TP: the rank's tokens' top-k, a 1/T slice of each
        expert. EP (or sharded CP): the stage's tokens spread evenly over the ranks' experts
        (balanced routing)."""
        a, lay = self.arch, self.layout
        e_ranks = lay.expert_ranks
        seen = routed_tokens if e_ranks > 1 else tokens
        pairs = seen * a.num_experts_per_tok / e_ranks
        touched = (
            a.num_experts / e_ranks * (1 - (1 - a.num_experts_per_tok / a.num_experts) ** seen)
        )
        w = self.expert_weights / lay.tp
        work.add("moe", 2 * pairs * w, touched * w * self.precision.weight_bytes)

    def _op_time(self, kind: str, flops: float, nbytes: float, dtype: str | None = None) -> float:
        if flops == 0 and nbytes == 0:
            return 0.0
        if dtype is None:
            dtype = self.precision.activations if kind == "attention" else self.precision.weights
        threads = self.layout.threads
        compute = flops / (self.hw.peak(dtype, threads) * getattr(self.eff, kind))
        memory = nbytes / (self.hw.bandwidth(threads) * self.eff.memory)
        return max(compute, memory)

    def _comm(self, layer: int, batch: Sequence[SliceWork], stage: int) -> dict[str, float]:
        """Collectives of one layer on one rank: two TP all-reduces of the hidden states
        (after attention, after the MLP); EP dispatch and combine (each token once per
        destination rank holding one of its experts); CP: each prompt chunk's prefix and own
        K/V all-gathered (the re-gather every prompt chunk of MLA does, and GQA's where the
        compiled CPU kernel runs; decode steps merge partial results, a few bytes)."""
        a, lay, hw = self.arch, self.layout, self.hw
        b, tokens = self.precision.act_bytes, self.rank_tokens(batch)
        link = lay.stage_group_link(hw, stage)
        out = dict.fromkeys(("tp_comm", "ep_comm", "cp_comm"), 0.0)
        if lay.tp > 1:
            size = tokens * a.hidden_size * b
            out["tp_comm"] = 2 * collectives.ring_all_reduce_s(size, lay.tp, link)
        e_ranks = lay.expert_ranks
        if e_ranks > 1 and a.is_moe_layer(layer):
            dests = e_ranks * (1 - (1 - 1 / e_ranks) ** a.num_experts_per_tok)
            sent = tokens * dests * (e_ranks - 1) / e_ranks * a.hidden_size * b
            out["ep_comm"] = 2 * collectives.all_to_all_s(sent, e_ranks, link)
        if lay.cp > 1:
            kv = sum(s.prefix + s.tokens for s in batch if not s.decode)
            size = kv * self.kv_bytes_per_token_layer()
            out["cp_comm"] = collectives.ring_all_gather_s(size, lay.cp, link)
        return out

    def _overlap(
        self,
        comm: dict[str, float],
        cost: StageCost,
        layer: int,
        batch: Sequence[SliceWork],
        two_batch: bool,
        combine_blocks: int,
    ) -> None:
        """Take off `comm` what runs beside compute: two-batch overlap hides a half's
        TP/EP communication behind the other half's compute; single-batch overlap hides part
        of the dispatch/combine; CP's exchange is launched before the query projection."""
        compute = sum(cost.seconds[k] for k in COMPUTE)
        if two_batch:
            exchanged = comm["ep_comm"] + comm["tp_comm"]
            scale = 1 - min(compute, exchanged) / max(exchanged, 1e-30)
            comm["ep_comm"] *= scale
            comm["tp_comm"] *= scale
        elif comm["ep_comm"] > 0:
            tokens = self.rank_tokens(batch)
            comm["ep_comm"] -= self._single_batch_hidden(
                layer, tokens, comm["ep_comm"], cost.seconds["moe"], combine_blocks
            )
        if comm["cp_comm"] > 0:
            share = self.attention_weights() / self.dense_weights(layer)
            comm["cp_comm"] = max(0.0, comm["cp_comm"] - cost.seconds["gemm"] * share / 2)

    def _single_batch_hidden(
        self, layer: int, tokens: float, ep_comm: float, moe_s: float, blocks: int
    ) -> float:
        """Seconds of a MoE layer's dispatch and combine (half each) that single-batch
        overlap hides: the shared experts' time behind one of them, all blocks but the first
        of the experts behind the combine."""
        half, hidden = ep_comm / 2, 0.0
        if blocks > 1:
            hidden += min(half, moe_s * (1 - 1 / blocks))
        a = self.arch
        if self.shared_overlap and a.routing is not None and a.is_moe_layer(layer):
            w = a.routing.n_shared_experts * self.expert_weights / self.layout.tp
            hidden += min(half, self._op_time("gemm", 2 * tokens * w, 0.0))
        return hidden

    def lm_head_s(self, samples: int) -> float:
        """The final norm and LM head for the sampled rows (vocab split over TP; bf16)."""
        if samples == 0:
            return 0.0
        w = self.arch.hidden_size * self.arch.vocab_size / self.layout.tp
        dtype = self.precision.activations
        return self._op_time("gemm", 2 * samples * w, w * self.precision.act_bytes, dtype)

    # -- between stages -------------------------------------------------------------------

    def send_parts(self, stage: int, tokens: int) -> tuple[float, float]:
        """Stage -> stage + 1: (the point-to-point send, the next stage's re-gather). Each TP
        (and CP) rank sends its share of the rows of the hidden states and the residual; the
        next stage's ranks all-gather them inside their stage, on their receiving thread."""
        lay, hw = self.layout, self.hw
        send = collectives.p2p_s(self.send_bytes(tokens), lay.boundary_link(hw, stage))
        total = self.send_bytes(tokens) * lay.tp
        gather = collectives.ring_all_gather_s(total, lay.tp, lay.stage_group_link(hw, stage + 1))
        return send, gather

    def send_bytes(self, tokens: int) -> float:
        """Bytes each sending rank puts on the boundary link: its 1/T share of the rows (under
        CP its own 1/N of a chunk's)."""
        a, lay = self.arch, self.layout
        total = collectives.pp_send_bytes(tokens, a.hidden_size, self.precision.act_bytes)
        return total / lay.tp / lay.cp


def _sparse_pairs(prefix: int, tokens: int, topk: int) -> float:
    """DeepSeek-V3.2: (query, key) pairs when the query at position p reads min(p + 1, topk)
    keys, for positions prefix .. prefix + tokens - 1."""

    def upto(n: int) -> float:
        if n <= topk:
            return n * (n + 1) / 2
        return topk * (topk + 1) / 2 + (n - topk) * topk

    return upto(prefix + tokens) - upto(prefix)
