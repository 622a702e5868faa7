"""The discrete-event executor's timing rules on a stub cost model: M equal micro-batches on
P equal stages leave (P - 1) / (P - 1 + M) of the makespan idle (a serialised pipeline leaves
(P - 1) / P), while each stage is busy without a gap from its first to its last forward; a
send overlaps the next forward but not the send after it (the commit point); a slow link
paces the pipeline."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch
from pipeserve.scheduler.data_parallel import BatchGroup
from pipeserve.sim.cost_model import StageCost
from pipeserve.sim.executor import SimClock, SimWorkers
from pipeserve.timeline import bubble_ratios, makespan_idle_share


class StubCost:
    """Every forward takes `t` on every stage, every send `s`."""

    def __init__(self, stages: int, t: float, s: float = 0.0) -> None:
        self.layout = SimpleNamespace(pp=stages)
        self.hw = SimpleNamespace(intra_node=SimpleNamespace(latency=0.0))
        self.t, self.s = t, s

    def forward(self, stage, works, two_batch=False, blocks=1) -> StageCost:
        cost = StageCost()
        cost.seconds["gemm"] = self.t
        return cost

    def send_parts(self, stage: int, tokens: int) -> tuple[float, float]:
        return self.s, 0.0

    def send_bytes(self, tokens: int) -> float:
        return 0.0


def group(i: int) -> BatchGroup:
    s = ReqSlice("r", [0] * 64, 64 * i, [], sample=False, chunk_index=i)
    return BatchGroup(i, [ScheduledBatch(i, [s])])


def run(stages: int, micro_batches: int, t: float = 1.0, s: float = 0.0) -> SimWorkers:
    workers = SimWorkers(StubCost(stages, t, s), SimClock(), host_overhead_s=0.0)
    for i in range(micro_batches):  # all launched at once: the pipeline is never starved
        workers.send_batch(group(i))
    return workers


@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 8), (4, 4), (4, 32), (8, 3)])
def test_makespan_idle_share_is_the_textbook_bubble(stages: int, micro_batches: int) -> None:
    events = run(stages, micro_batches).events
    expected = (stages - 1) / (stages - 1 + micro_batches)
    assert makespan_idle_share(events) == pytest.approx(expected)
    # the per-stage measure sees no bubble: each stage works without a gap once it starts
    assert bubble_ratios(events) == pytest.approx([0.0] * stages)


def test_a_serialised_pipeline_would_fail_the_bubble_test() -> None:
    """The measure tells a pipeline from stages taking turns: (P - 1) / P idle."""
    stages, m = 4, 8
    workers = run(stages, m)
    fwd = [e for e in workers.events if e.kind == "forward"]
    t = 0.0
    for e in sorted(fwd, key=lambda e: (e.batch_id, e.stage)):  # one forward at a time
        e.start, e.end, t = t, t + 1.0, t + 1.0
    assert makespan_idle_share(fwd) == pytest.approx((stages - 1) / stages)
    assert makespan_idle_share(fwd) != pytest.approx((stages - 1) / (stages - 1 + m))


def test_a_send_overlaps_the_next_forward_not_the_next_send() -> None:
    workers = run(2, 4, t=1.0, s=0.5)
    sends = sorted((e for e in workers.events if e.kind == "send"), key=lambda e: e.start)
    fwd0 = sorted(
        (e for e in workers.events if e.kind == "forward" and e.stage == 0), key=lambda e: e.start
    )
    for a, b in zip(sends, sends[1:], strict=False):
        assert b.start >= a.end  # one send on the link at a time
    for send, nxt in zip(sends, fwd0[1:], strict=False):
        assert nxt.start < send.end  # the next forward runs while the send is in flight
    fwd1 = sorted(
        (e for e in workers.events if e.kind == "forward" and e.stage == 1), key=lambda e: e.start
    )
    for send, f in zip(sends, fwd1, strict=True):
        assert f.start == pytest.approx(send.end)  # stage 1 starts when its input arrived


def test_a_slow_link_paces_the_pipeline() -> None:
    """Sends of 3 s behind forwards of 1 s: a send is posted only after the previous one
    completed, so stage 1 gets a micro-batch every 3 s."""
    workers = run(2, 5, t=1.0, s=3.0)
    starts = sorted(e.start for e in workers.events if e.kind == "forward" and e.stage == 1)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == pytest.approx([3.0] * 4)


def test_results_come_back_in_order_and_move_the_clock() -> None:
    workers = run(3, 4, t=2.0)
    clock = workers.clock
    ends = []
    for i in range(4):
        (result,) = workers.wait_results()
        assert result.batch_id == i
        ends.append(clock.now)
    assert ends == pytest.approx([6.0, 8.0, 10.0, 12.0])  # (3 + i) stage times of 2 s
