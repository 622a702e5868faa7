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

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeserve.distributed.partition import kv_heads_of_rank

if TYPE_CHECKING:  # the plan is plain data (the scheduler carries it); only copy_pieces
    import torch  # touches tensors

    from pipeserve.mem_cache.kv_pool import KVPool

Rank = tuple[int, int]  # (pipeline stage, TP rank)


@dataclass(frozen=True)
class SideLayout:
    stage_layers: tuple[tuple[int, int], ...]  # [first, end) layers of each stage
    tp_size: int
    num_kv_heads: int  # the model's KV heads (ignored for the latent cache)
    latent: bool = False  # MLA: one latent row per token, whole on every TP rank

    @classmethod
    def of(cls, partition: list[int], tp_size: int, num_kv_heads: int, latent: bool) -> SideLayout:
        """The layout of a side whose stages hold `partition` layers each."""
        ends = [sum(partition[: i + 1]) for i in range(len(partition))]
        ranges = tuple(zip([0, *ends[:-1]], ends, strict=True))
        return cls(ranges, tp_size, num_kv_heads, latent)

    def check(self) -> None:
        """ValueError unless the stages cover layers 0.. in order and TP is positive."""
        starts = [0] + [b for _, b in self.stage_layers[:-1]]
        ordered = all(a == s and b > a for (a, b), s in zip(self.stage_layers, starts, strict=True))
        if not (self.stage_layers and ordered and self.tp_size >= 1 and self.num_kv_heads >= 1):
            raise ValueError(f"not a valid layout: {self}")

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


@dataclass(frozen=True)
class KVDestination:
    """Where one request's KV goes: the room the decode side opened, the receivers of its
    ranks in `layout.ranks()` order, and its layout."""

    room: str
    endpoints: tuple[str, ...]
    layout: SideLayout

    def wire_check(self) -> None:
        """ValueError unless this is a destination `from_json` accepts (`wire`)."""
        KVDestination.from_json(self.to_json())

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "room": self.room,
            "endpoints": list(self.endpoints),
            "stage_layers": [list(r) for r in lay.stage_layers],
            "tp_size": lay.tp_size,
            "num_kv_heads": lay.num_kv_heads,
            "latent": lay.latent,
        }

    @classmethod
    def from_json(
        cls,
        d: Any,
        hosts: tuple[str, ...] | None = None,
        max_stages: int | None = None,
        max_tp: int | None = None,
    ) -> KVDestination:
        """A destination that arrived over HTTP from a peer, checked like client input:
        ValueError names what is wrong. `hosts`: the addresses KV may go to (None: any);
        `max_stages` and `max_tp` bound the layout (a model's layers and attention heads:
        no real decode side has more), so planning it is bounded work."""
        try:
            room, endpoints = d["room"], d["endpoints"]
            raw_layers, tp_size, kv_heads, latent = (
                d["stage_layers"],
                d["tp_size"],
                d["num_kv_heads"],
                d["latent"],
            )
            typed = isinstance(room, str) and isinstance(endpoints, list)
            typed = typed and isinstance(raw_layers, list) and isinstance(latent, bool)
            typed = typed and type(tp_size) is int and type(kv_heads) is int
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV transfer destination: missing {exc}") from None
        if not typed:
            raise ValueError("malformed KV transfer destination: a field has the wrong type")
        if not ROOM_FORM.fullmatch(room):
            raise ValueError("malformed KV transfer destination: the room is not 32 hex digits")
        if max_stages is not None and not 0 < len(raw_layers) <= max_stages:
            raise ValueError(f"a KV transfer destination has 1 to {max_stages} stages")
        if max_tp is not None and not 0 < tp_size <= max_tp:
            raise ValueError(f"a KV transfer destination's tp_size is 1 to {max_tp}")
        try:
            layers = tuple((int(a), int(b)) for a, b in raw_layers)
        except (TypeError, ValueError):
            raise ValueError("malformed KV transfer destination: stage_layers") from None
        layout = SideLayout(layers, tp_size, kv_heads, latent)
        layout.check()
        if len(endpoints) != len(layers) * tp_size:  # not layout.ranks(): tp_size is untrusted
            raise ValueError("a KV transfer destination needs one endpoint per decode rank")
        for e in endpoints:
            check_endpoint(e, hosts)
        return cls(room, tuple(endpoints), layout)


ROOM_FORM = re.compile(r"[0-9a-f]{32}")


def check_endpoint(endpoint: Any, hosts: tuple[str, ...] | None) -> None:
    """ValueError unless `endpoint` is tcp://HOST:PORT with HOST among `hosts` (None: any).
    The message does not repeat the endpoint: a peer's input is not reflected."""
    m = ENDPOINT_FORM.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError("a KV transfer endpoint must be tcp://HOST:PORT")
    host = m["host"].strip("[]")
    if hosts is not None and host not in hosts:
        raise ValueError(
            "a KV transfer endpoint names a host this prefill server does not send to (see "
            "--disaggregation-decode-host)"
        )


ENDPOINT_FORM = re.compile(
    r"tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})"
)


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
