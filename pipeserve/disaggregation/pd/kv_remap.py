"""Which pieces of a request's KV go from which prefill rank to which decode rank, when the
two sides run different layouts (prefill/decode disaggregation, spec 05).

A side's layout is its pipeline stages' layer ranges and its TP size: a TP rank holds a
contiguous range of KV heads of its stage's layers (a whole head replicated over
tp_size / num_kv_heads ranks when TP exceeds the KV heads: `kv_heads_of_rank`, as
QKVParallelLinear shards them), and MLA's latent cache is whole on every TP rank. `plan`
cuts every decode rank's needs (its layers x its heads) into pieces each held by one
prefill rank (of replicas, the lowest TP rank), so every byte travels once per decode rank
that needs it. `copy_pieces` carries a plan out between pools in one process: the reference
a transfer backend sends the same slices for, and what the tests check the plan with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeserve.layers.linear import kv_heads_of_rank
from pipeserve.mem_cache.kv_pool import KVPool

Rank = tuple[int, int]  # (pipeline stage, TP rank)


@dataclass(frozen=True)
class SideLayout:
    stage_layers: tuple[tuple[int, int], ...]  # [first, end) layers of each stage
    tp_size: int
    num_kv_heads: int  # the model's KV heads (ignored for the latent cache)
    latent: bool = False  # MLA: one latent row per token, whole on every TP rank

    def ranks(self) -> list[Rank]:
        return [(s, t) for s in range(len(self.stage_layers)) for t in range(self.tp_size)]

    def heads(self, tp_rank: int) -> tuple[int, int]:
        """[first, end) of the global KV heads a TP rank holds ((0, 1) for the latent)."""
        if self.latent:
            return (0, 1)
        return kv_heads_of_rank(self.num_kv_heads, self.tp_size, tp_rank)

    def holder(self, layer: int, head: int) -> Rank:
        """The lowest-ranked holder of one head of one layer."""
        stage = next(s for s, (a, b) in enumerate(self.stage_layers) if a <= layer < b)
        tp = next(t for t in range(self.tp_size) if self.heads(t)[0] <= head < self.heads(t)[1])
        return stage, tp


@dataclass(frozen=True)
class Piece:
    src: Rank
    dst: Rank
    layers: tuple[int, int]  # global [first, end)
    heads: tuple[int, int]  # global [first, end) KV heads ((0, 1): the latent)


def plan(src: SideLayout, dst: SideLayout) -> list[Piece]:
    """Pieces covering every decode rank's layers x heads, each from one prefill rank."""
    if src.latent != dst.latent or (not src.latent and src.num_kv_heads != dst.num_kv_heads):
        raise ValueError("prefill and decode sides serve different KV shapes")
    if src.stage_layers[-1][1] != dst.stage_layers[-1][1]:
        raise ValueError(
            f"prefill side has {src.stage_layers[-1][1]} layers, decode side "
            f"{dst.stage_layers[-1][1]}"
        )
    pieces: list[Piece] = []
    for stage, tp in dst.ranks():
        first, end = dst.stage_layers[stage]
        h0, h1 = dst.heads(tp)
        for a, b in src.stage_layers:
            layers = (max(a, first), min(b, end))
            if layers[0] >= layers[1]:
                continue
            head = h0
            while head < h1:  # runs of heads with one holder
                holder = src.holder(layers[0], head)
                stop = min(h1, src.heads(holder[1])[1])
                pieces.append(Piece(holder, (stage, tp), layers, (head, stop)))
                head = stop
    return pieces


def copy_pieces(
    pieces: list[Piece],
    src: SideLayout,
    dst: SideLayout,
    src_pools: dict[Rank, KVPool],
    dst_pools: dict[Rank, KVPool],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Carry out a plan for one request: its KV at `src_slots` on the prefill side goes to
    `dst_slots` on the decode side (the same positions, in order)."""
    for p in pieces:
        sp, dp = src_pools[p.src], dst_pools[p.dst]
        s_head0, d_head0 = src.heads(p.src[1])[0], dst.heads(p.dst[1])[0]
        for layer in range(*p.layers):
            if src.latent:
                pairs = [(sp.latent(layer), dp.latent(layer))]
                if sp.index_key_bufs:  # DeepSeek-V3.2's indexer keys
                    pairs.append((sp.index_keys(layer), dp.index_keys(layer)))
                for a, b in pairs:
                    b[dst_slots] = a[src_slots].to(b.device)
                continue
            hs = slice(p.heads[0] - s_head0, p.heads[1] - s_head0)
            hd = slice(p.heads[0] - d_head0, p.heads[1] - d_head0)
            for a, b in zip(sp.buffers(layer), dp.buffers(layer), strict=True):
                b[hd, dst_slots] = a[hs, src_slots].to(b.device)
