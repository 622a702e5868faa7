"""The PD transfer plan between layouts: every decode rank receives exactly its layers and
KV heads of a request (pages placed elsewhere on each side), from prefill ranks that hold
them, each piece once; checked against one whole-model KV for prefill PP2 -> decode PP1,
PP1 -> TP2, PP2 x TP2 -> PP1 x TP4 (KV heads replicated past 2), PP3 -> PP2 x TP2, and
MLA's latent cache (with V3.2's indexer keys) from PP2 to PP1 x TP2."""

from __future__ import annotations

import pytest
import torch

from pipeserve.disaggregation.pd.kv_remap import (
    KVDestination,
    Piece,
    SideLayout,
    copy_pieces,
    plan,
)
from pipeserve.mem_cache.kv_pool import KVPool

LAYERS, HEADS, DIM, PAGE, SLOTS = 6, 2, 4, 4, 64


def pools_for(side: SideLayout, whole: KVPool | None, slots: torch.Tensor | None) -> dict:
    """Each rank's pool; filled from `whole` at `slots` when given (the prefill side)."""
    out = {}
    for stage, tp in side.ranks():
        layers = range(*side.stage_layers[stage])
        if side.latent:
            pool = KVPool.latent_layout(
                SLOTS, layers, 6, torch.float32, torch.device("cpu"), PAGE, extra_width=3
            )
        else:
            h0, h1 = side.heads(tp)
            pool = KVPool(SLOTS, layers, h1 - h0, DIM, torch.float32, torch.device("cpu"), PAGE)
        for buf, _ in pool.slot_buffers():
            buf.fill_(float("nan"))  # nothing but the copies may write
        if whole is not None and slots is not None:
            for layer in layers:
                if side.latent:
                    pool.latent(layer)[slots] = whole.latent(layer)[slots]
                    pool.index_keys(layer)[slots] = whole.index_keys(layer)[slots]
                else:
                    for a, b in zip(whole.buffers(layer), pool.buffers(layer), strict=True):
                        b[:, slots] = a[h0:h1, slots]
        out[(stage, tp)] = pool
    return out


def whole_kv(latent: bool) -> KVPool:
    everything = range(LAYERS)
    if latent:
        pool = KVPool.latent_layout(
            SLOTS, everything, 6, torch.float32, torch.device("cpu"), PAGE, extra_width=3
        )
    else:
        pool = KVPool(SLOTS, everything, HEADS, DIM, torch.float32, torch.device("cpu"), PAGE)
    for buf, _ in pool.slot_buffers():
        buf.copy_(torch.randn(buf.shape))
    return pool


def split(*stages: int) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for n in stages:
        out.append((at, at + n))
        at += n
    return tuple(out)


CASES = {
    "pp2->pp1": (SideLayout(split(3, 3), 1, HEADS), SideLayout(split(6), 1, HEADS)),
    "pp1->tp2": (SideLayout(split(6), 1, HEADS), SideLayout(split(6), 2, HEADS)),
    "pp2tp2->tp4": (SideLayout(split(2, 4), 2, HEADS), SideLayout(split(6), 4, HEADS)),
    "pp3->pp2tp2": (SideLayout(split(2, 2, 2), 1, HEADS), SideLayout(split(1, 5), 2, HEADS)),
    "mla pp2->pp1tp2": (
        SideLayout(split(4, 2), 1, HEADS, latent=True),
        SideLayout(split(6), 2, HEADS, latent=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_decode_rank_gets_exactly_its_kv(case: str) -> None:
    src, dst = CASES[case]
    whole = whole_kv(src.latent)
    src_slots = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 40, 41])  # a request's positions
    dst_slots = torch.tensor([44, 45, 46, 47, 4, 5, 6, 7, 12, 13])
    src_pools = pools_for(src, whole, src_slots)
    dst_pools = pools_for(dst, None, None)
    pieces = plan(src, dst)
    copy_pieces(pieces, src, dst, src_pools, dst_pools, src_slots, dst_slots)
    for (stage, tp), pool in dst_pools.items():
        h0, h1 = dst.heads(tp)
        for layer in range(*dst.stage_layers[stage]):
            if dst.latent:
                pairs = [
                    (whole.latent(layer)[src_slots], pool.latent(layer)[dst_slots]),
                    (whole.index_keys(layer)[src_slots], pool.index_keys(layer)[dst_slots]),
                ]
            else:
                pairs = [
                    (a[h0:h1, src_slots], b[:, dst_slots])
                    for a, b in zip(whole.buffers(layer), pool.buffers(layer), strict=True)
                ]
            for want, got in pairs:
                assert torch.equal(want, got), (case, stage, tp, layer)
    # every (decode rank, layer, head) comes in exactly one piece, from a rank holding it
    seen: dict[tuple, Piece] = {}
    for p in pieces:
        for layer in range(*p.layers):
            for head in range(*p.heads):
                key = (p.dst, layer, head)
                assert key not in seen, (p, seen.get(key))
                seen[key] = p
                stage, tp = p.src
                assert src.stage_layers[stage][0] <= layer < src.stage_layers[stage][1]
                assert src.heads(tp)[0] <= head < src.heads(tp)[1]
    need = sum(
        (dst.stage_layers[s][1] - dst.stage_layers[s][0]) * (dst.heads(t)[1] - dst.heads(t)[0])
        for s, t in dst.ranks()
    )
    assert len(seen) == need


def test_replicated_heads_come_from_the_lowest_rank() -> None:
    src = SideLayout(split(6), 4, HEADS)  # heads 0, 0, 1, 1
    assert [src.heads(t) for t in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    pieces = plan(src, SideLayout(split(6), 1, HEADS))
    assert [(p.src, p.heads) for p in pieces] == [((0, 0), (0, 1)), ((0, 2), (1, 2))]


def test_sides_of_different_models_are_refused() -> None:
    with pytest.raises(ValueError, match="layers"):
        plan(SideLayout(split(6), 1, HEADS), SideLayout(split(4), 1, HEADS))
    with pytest.raises(ValueError, match="KV shapes"):
        plan(SideLayout(split(6), 1, 2), SideLayout(split(6), 1, 4))


def destination(**change: object) -> dict:
    dest = KVDestination("0" * 32, ("tcp://127.0.0.1:5000",) * 2, CASES["pp1->tp2"][1])
    return {**dest.to_json(), **change}


ALLOWED = ("127.0.0.1", "10.0.0.7")


def test_a_destination_from_a_peer_is_checked_like_client_input() -> None:
    """The prefill side checks what a decode server (or whoever calls /pd/prefill) names:
    endpoint schemes and hosts, a layout no larger than the model allows (a tp_size of
    16000 is refused before any planning), the room's form; messages do not repeat the
    peer's values."""
    limits = {"hosts": ALLOWED, "max_stages": LAYERS, "max_tp": 8}
    good = KVDestination.from_json(destination(), **limits)
    assert good.endpoints == ("tcp://127.0.0.1:5000",) * 2
    ten = KVDestination.from_json(destination(endpoints=["tcp://10.0.0.7:1"] * 2), **limits)
    assert ten.endpoints[0] == "tcp://10.0.0.7:1"
    bad = {
        "tp_size": (destination(tp_size=16000, endpoints=["tcp://127.0.0.1:1"] * 16000), "tp_size"),
        "stages": (destination(stage_layers=[[i, i + 1] for i in range(LAYERS + 1)]), "stages"),
        "scheme": (destination(endpoints=["foo://bar"] * 2), "tcp://HOST:PORT"),
        "path": (destination(endpoints=["tcp://127.0.0.1:5/x"] * 2), "tcp://HOST:PORT"),
        "port": (destination(endpoints=["tcp://127.0.0.1:70000"] * 2), "tcp://HOST:PORT"),
        "host": (destination(endpoints=["tcp://169.254.169.254:80"] * 2), "does not send to"),
        "count": (destination(endpoints=["tcp://127.0.0.1:5000"]), "one endpoint per"),
        "room": (destination(room="../../x"), "32 hex digits"),
        "types": (destination(tp_size="2"), "wrong type"),
        "missing": ({"room": "0" * 32}, "missing"),
        "not a dict": ([1, 2], "missing"),
    }
    for what, (d, message) in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            KVDestination.from_json(d, **limits)
        assert "169.254" not in str(info.value), what
