"""The per-process event ring: a server that records every micro-batch and never asks for
its timeline must not grow without bound (a 10-minute soak grew each worker ~6 MB/min with
a 200K-event ring). The communication log beside it, and the bench's numbers from both:
bytes per forward and waited seconds per kind of communication, on made-up events."""

from __future__ import annotations

import json

import pytest

from pipeserve import timeline
from pipeserve.timeline import (
    Event,
    Recorder,
    afd_bytes_per_step,
    afd_idle_shares,
    afd_in_node_bytes_per_step,
    comm_bytes_per_forward,
    drain_comm,
    exposed_comm_s,
    exposed_comm_share,
    record_comm,
    split_forward_share,
    write_trace,
)


def test_the_recorder_keeps_only_the_latest_events() -> None:
    rec = Recorder()
    for i in range(timeline.MAX_EVENTS + 500):
        rec.add("forward", float(i), float(i) + 0.5)
    events = rec.take()
    assert len(events) == timeline.MAX_EVENTS
    assert events[0].start == 500.0 and events[-1].start == timeline.MAX_EVENTS + 499
    assert timeline.MAX_EVENTS * 1500 <= 32 * 2**20  # ~1.4 KB per event of a 32-request batch


def test_comm_spans_keep_their_own_ring_and_never_evict_forwards() -> None:
    drain_comm()
    rec = Recorder(stage=2, tp_rank=1, comm=True)
    for i in range(timeline.MAX_EVENTS):
        rec.add("forward", float(i), float(i) + 0.5)
    for i in range(timeline.MAX_COMM_SPANS + 300):
        record_comm("dispatch_wait", float(i), layer=i % 7)
    record_comm("dispatch_launch", 0.0, layer=3, nbytes=1000, nbytes_recv=600)
    events = rec.take()
    forwards = [e for e in events if e.kind == "forward"]
    comm = [e for e in events if e.kind != "forward"]
    assert len(forwards) == timeline.MAX_EVENTS and forwards[0].start == 0.0
    assert len(comm) == timeline.MAX_COMM_SPANS  # the oldest 301 spans dropped
    assert comm[0].start == 301.0 and comm[0].layer == 301 % 7
    assert {(e.stage, e.tp_rank) for e in comm} == {(2, 1)}
    last = comm[-1]
    assert (last.kind, last.layer, last.nbytes, last.nbytes_recv) == (
        "dispatch_launch",
        3,
        1000,
        600,
    )
    assert rec.take() == []


def test_only_a_comm_recorder_drains_the_log() -> None:
    drain_comm()
    record_comm("tp_all_reduce", 1.0, nbytes=64)
    assert Recorder(stage=-1).take() == []
    assert [e.nbytes for e in Recorder(comm=True).take()] == [64]


def ev(kind: str, stage: int, rank: int, seconds: float = 0.0, nbytes: int = 0) -> Event:
    return Event(kind, stage, rank, 10.0, 10.0 + seconds, nbytes=nbytes)


def test_bytes_per_forward_take_the_busiest_rank_per_kind() -> None:
    events = (
        [ev("forward", 0, 0)] * 2
        + [ev("forward", 0, 1)] * 2
        + [ev("forward", 1, 0)] * 4
        + [ev("schedule", -1, 0), ev("tp_all_reduce", 5, 0, nbytes=10**6)]  # no forwards
        + [ev("tp_all_reduce", 0, 0, nbytes=100)] * 4
        + [ev("tp_all_reduce", 0, 1, nbytes=300)]
        + [ev("tp_all_reduce", 1, 0, nbytes=400)] * 2
        + [ev("send", 0, 0, nbytes=1000)] * 2
        + [ev("send", 0, 1, nbytes=n) for n in (1000, 1200)]
        + [ev("dispatch_launch", 0, 0, nbytes=n) for n in (30, 50)]
        + [ev("dispatch_launch", 0, 1, nbytes=100), ev("dispatch_wait", 0, 1, nbytes=999)]
        + [ev("combine_launch", 0, 0, nbytes=10), ev("combine_wait", 0, 0, nbytes=999)]
        + [ev("cp_kv_launch", 1, 0, nbytes=80), ev("cp_kv_wait", 1, 0, nbytes=999)]
        + [ev("cp_merge", 0, 1, nbytes=n) for n in (6, 6)]
        + [ev("cp_rows_fetch", 0, 0, nbytes=12), ev("cp_rows_fetch", 0, 1, nbytes=30)]
        + [ev("cp_hidden_gather", 0, 0, nbytes=4), ev("shard_linear_launch", 0, 1, nbytes=8)]
    )
    assert comm_bytes_per_forward(events) == {
        "tp_all_reduce": 200.0,
        "pp_boundary": 1100.0,
        "ep_dispatch": 50.0,
        "ep_combine": 5.0,
        "cp_kv": 20.0,
        "cp_merge": 6.0,
        "cp_fetch": 15.0,
        "cp_hidden": 2.0,
        "shard_linear": 4.0,
    }
    assert comm_bytes_per_forward([]) == dict.fromkeys(timeline.COMM_BYTES, 0.0)


def test_exposed_time_counts_waits_and_the_blocking_launch() -> None:
    """Two ranks with 2 s of forwards each. The first stage's recv_wait (waiting for the
    scheduler) and a combine launch (which does not wait) are not exposed communication."""
    events = (
        [ev("forward", 0, 0, 1.0)] * 2
        + [ev("forward", 1, 0, 1.0)] * 2
        + [
            ev("recv_wait", 0, 0, 0.5),
            ev("send_wait", 0, 0, 0.2),
            ev("tp_all_reduce", 0, 0, 0.1),
            ev("tp_all_reduce", 0, 0, 0.1),
            ev("dispatch_launch", 0, 0, 0.05),
            ev("dispatch_wait", 0, 0, 0.15),
            ev("combine_launch", 0, 0, 0.3),
            ev("combine_wait", 0, 0, 0.1),
            ev("recv_wait", 1, 0, 0.4),
            ev("tp_all_reduce", 1, 0, 0.2),
            ev("dispatch_wait", 1, 0, 0.1),
            ev("combine_wait", 1, 0, 0.3),
            ev("recv_wait", -1, 0, 9.0),  # not a rank that ran forwards
            ev("cp_kv_launch", 0, 0, 0.3),  # posting: not waiting
            ev("cp_kv_exchange", 0, 0, 0.5),  # the whole span: partly hidden
            ev("cp_kv_wait", 0, 0, 0.1),
            ev("cp_merge", 1, 0, 0.2),
            ev("cp_rows_fetch", 0, 0, 0.08),  # blocking: all of it
            ev("cp_hidden_gather", 1, 0, 0.04),
            ev("shard_linear_launch", 0, 0, 0.3),
            ev("shard_linear_wait", 1, 0, 0.06),
        ]
    )
    want = {"tp_all_reduce": 0.2, "pp_boundary": 0.3, "ep_dispatch": 0.15, "ep_combine": 0.2,
            "cp_kv": 0.05, "cp_merge": 0.1, "cp_fetch": 0.04, "cp_hidden": 0.02,
            "shard_linear": 0.03}
    assert exposed_comm_s(events) == pytest.approx(want)
    assert exposed_comm_share(events) == pytest.approx({k: v / 2.0 for k, v in want.items()})
    assert exposed_comm_share([]) == dict.fromkeys(timeline.COMM_WAITS, 0.0)


def test_split_forward_share_counts_forwards_with_micro_batch_b_inside() -> None:
    """Rank (0, 0): 1 of 2 forwards ran B's operations; rank (0, 1): 2 of 2. A's operations
    alone and B's outside any forward do not count."""
    def op(rank: int, at: float, micro_batch: int) -> Event:
        return Event("op:experts", 0, rank, at, at + 0.1, micro_batch=micro_batch)

    events = [
        Event("forward", 0, 0, 0.0, 1.0), Event("forward", 0, 0, 2.0, 3.0),
        Event("forward", 0, 1, 0.0, 1.0), Event("forward", 0, 1, 2.0, 3.0),
        op(0, 0.5, 1), op(0, 2.5, 0), op(0, 1.5, 1),
        op(1, 0.2, 1), op(1, 2.2, 1),
    ]
    assert split_forward_share(events) == pytest.approx((0.5 + 1.0) / 2)
    assert split_forward_share([]) == 0.0


def test_the_overlap_chart_draws_three_micro_batches_and_the_ffn_worker(tmp_path) -> None:
    fwd = Event("forward", 0, 0, 0.0, 1.0)
    ops = [Event("op:attention", 0, 0, 0.1 * m, 0.1 * m + 0.05, micro_batch=m) for m in range(3)]
    ffn = [Event("forward", 0, 1, 0.0, 1.0), Event("dispatch_wait", 0, 1, 0.0, 0.2)]
    assert timeline._ffn_waits([fwd, *ops, *ffn], fwd) == [ffn[1]]
    path = tmp_path / "afd.png"
    assert timeline.draw_overlap([("3bo", [fwd, *ops, *ffn])], path) and path.stat().st_size


def test_afd_bytes_per_step_and_idle_shares() -> None:
    """Two attention workers (ranks 0, 1) and one FFN worker (rank 2), two steps: bytes are
    what the attention workers sent and got back, per step; an attention worker idles in
    combine waits, the FFN worker in dispatch waits (its combine launches do not count)."""
    def span(kind: str, rank: int, start: float, end: float, sent: int = 0,
             back: int = 0) -> Event:
        return Event(kind, 0, rank, start, end, nbytes=sent, nbytes_recv=back)

    events = [span("forward", r, t, t + 1.0) for r in (0, 1, 2) for t in (0.0, 2.0)] + [
        span("dispatch_launch", 0, 0.1, 0.1, sent=100), span("combine_wait", 0, 0.2, 0.6, back=50),
        span("dispatch_launch", 1, 0.1, 0.1, sent=30), span("combine_wait", 1, 2.2, 2.3, back=20),
        span("dispatch_wait", 2, 0.0, 0.5), span("dispatch_wait", 2, 2.0, 2.25),
        span("combine_launch", 2, 0.6, 0.9, sent=70),
    ]
    assert afd_bytes_per_step(events, 2) == pytest.approx((100 + 50 + 30 + 20) / 2)
    assert afd_idle_shares(events, 2) == pytest.approx({0: 0.4 / 2, 1: 0.1 / 2, 2: 0.75 / 2})
    assert afd_bytes_per_step([], 2) == 0.0 and afd_idle_shares([], 2) == {}
    in_node = [span("afd_in_node", 2, 0.3, 0.3, sent=64), span("afd_in_node", 3, 0.4, 0.4, sent=16)]
    assert afd_in_node_bytes_per_step(events + in_node) == pytest.approx(80 / 2)
    assert afd_in_node_bytes_per_step(events) == 0.0
    ops = [Event("op:attention", 0, 0, 0.1, 0.4, micro_batch=0),
           Event("op:attention", 0, 0, 0.5, 0.6, micro_batch=1),
           Event("op:experts", 0, 2, 0.5, 0.9, micro_batch=1)]  # another rank: not counted
    assert timeline.micro_batch_seconds(events + ops, 2) == pytest.approx([0.3 / 2, 0.1 / 2])


def test_trace_names_and_args_carry_the_layer(tmp_path) -> None:
    span = Event("combine_wait", 0, 1, 1.0, 1.5, layer=12)
    write_trace([span, Event("forward", 0, 1, 0.5, 2.0)], tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    wait = next(t for t in trace if t.get("cat") == "combine_wait")
    assert wait["name"] == "combine_wait L12" and wait["args"]["layer"] == 12


def test_the_overlap_chart_shows_the_longest_forward_with_two_micro_batches(tmp_path) -> None:
    def ev(kind: str, start: float, end: float, mb: int = -1, stage: int = 0) -> Event:
        e = Event(kind, stage, 0, start, end, batch_id=1 if kind == "forward" else -1)
        e.micro_batch = mb
        return e

    plain = ev("forward", 0.0, 5.0)  # longer, but one micro-batch only
    split = ev("forward", 10.0, 12.0)
    events = [plain, ev("op:attention", 1.0, 2.0), split,
              ev("op:attention", 10.0, 10.5, 0), ev("dispatch_wait", 10.5, 11.0, 0),
              ev("op:attention", 10.5, 11.0, 1), ev("op:output", 11.0, 11.9, 1)]
    assert timeline.overlapped_forward(events) is split
    assert timeline.overlapped_forward([plain, ev("op:attention", 1.0, 2.0, 0)]) is None
    path = tmp_path / "overlap.png"
    assert timeline.draw_overlap([("tbo", events)], path) and path.stat().st_size > 0
    assert not timeline.draw_overlap([("plain", [plain])], tmp_path / "none.png")


def test_cp_kv_per_layer_splits_each_exchange_into_hidden_and_exposed() -> None:
    """Two forwards of one rank; layer 3's exchanges span 0.4 s in all, 0.1 s of it waited."""
    def at(kind: str, layer: int, seconds: float) -> Event:
        e = ev(kind, 0, 0, seconds)
        e.layer = layer
        return e

    events = [ev("forward", 0, 0, 1.0)] * 2 + [
        at("cp_kv_exchange", 3, 0.3), at("cp_kv_wait", 3, 0.1), at("cp_kv_exchange", 3, 0.1),
        at("cp_kv_exchange", 4, 0.2),
    ]
    got = timeline.cp_kv_per_layer(events)
    assert got.keys() == {3, 4}
    assert got[3]["span_s"] == pytest.approx(0.2) and got[3]["exposed_s"] == pytest.approx(0.05)
    assert got[3]["hidden_share"] == pytest.approx(0.75)
    assert got[4]["hidden_share"] == 1.0


def test_weight_bytes_per_device_takes_the_most_any_rank_held() -> None:
    def w(rank: int, held: int, expected: int) -> Event:
        e = ev("weights", 0, rank, nbytes=held)
        e.nbytes_recv = expected
        return e

    assert timeline.weight_bytes_per_device([w(0, 5, 6), w(1, 7, 6), w(0, 6, 6)]) == (7, 6)
    assert timeline.weight_bytes_per_device([ev("forward", 0, 0)]) == (0, 0)
