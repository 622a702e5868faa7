"""The discrete-event executor: what `PipelineLoop` drives in place of worker processes.

Each stage is a resource that runs its micro-batches in launch order; a boundary link is a
resource carrying one send at a time. The timing rules are those of a stage worker's loop
(distributed/worker.py): a stage starts micro-batch k when its input has arrived and it has
posted the send of k - 1; it posts the send of k once the forward of k is done and the send
of k - 1 has completed (the commit point), so one send overlaps the next forward; a send
takes latency + bytes / bandwidth on its link (cost_model.send_parts) and the next stage can
start when it has arrived and its ranks have re-gathered their TP shares (on their receiving
thread: the sender does not wait for that). The last stage reports to the scheduler, whose
clock moves to the result when the loop waits for it. A micro-batch's times are fixed when it
is launched: the stages and links are first-in first-out, so nothing launched later can
change them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pipeserve.scheduler.batch import BatchResult, ScheduledBatch
from pipeserve.scheduler.data_parallel import BatchGroup
from pipeserve.sim.cost_model import CostModel, SliceWork, StageCost
from pipeserve.timeline import Event

SIM_TOKEN = 0  # the token every simulated sample returns (requests ignore EOS)


class SimClock:
    """Simulated seconds; the scheduler reads it as its clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


@dataclass
class _Flight:
    group: BatchGroup
    result_at: float
    stage_times: list[float]


def slice_work(batch: ScheduledBatch) -> list[SliceWork]:
    return [SliceWork(s.prefix_len, s.num_tokens, s.is_decode, s.sample) for s in batch.slices]


class SimWorkers:
    """Stages and links in simulated time, behind the interface of `engine.workers.WorkerSet`
    that the loop uses (send_batch, wait_results, shutdown)."""

    def __init__(self, cost: CostModel, clock: SimClock, host_overhead_s: float) -> None:
        self.cost, self.clock, self.host_overhead_s = cost, clock, host_overhead_s
        stages = cost.layout.pp
        self.free_at = [0.0] * stages  # when a stage may start its next forward
        self.sent_at = [0.0] * stages  # when its last send completed
        self.inflight: deque[_Flight] = deque()
        self.events: list[Event] = []
        self.breakdown = StageCost()  # seconds by operator class, summed over stages
        self.forwards = 0
        self.split_forwards = 0  # micro-batches run as two halves (two-batch overlap)

    def send_batch(self, group: BatchGroup) -> None:
        self.clock.advance_to(self.clock.now + self.host_overhead_s)  # scheduling it
        works = [slice_work(b) for b in group.batches]
        two_batch = any(b.two_batch is not None for b in group.batches)
        blocks = group.batches[0].combine_blocks
        tokens = max(sum(w.tokens for w in ws) for ws in works)
        arrival = self.clock.now + self.cost.hw.intra_node.latency
        stage_times = []
        lead = next((b for b in group.batches if b.slices), group.batches[0])  # traced
        for stage in range(self.cost.layout.pp):
            cost = self.cost.forward(stage, works, two_batch, blocks)
            self.breakdown.add(cost)
            start = max(arrival, self.free_at[stage])
            end = start + cost.total
            stage_times.append(cost.total)
            self._record("forward", stage, start, end, lead)
            if stage == self.cost.layout.pp - 1:
                self.free_at[stage] = end
                break
            post = max(end, self.sent_at[stage])  # commit point: the previous send is done
            send, gather = self.cost.send_parts(stage, tokens)
            self.free_at[stage], self.sent_at[stage] = post, post + send
            arrival = post + send + gather  # the receiver re-gathers the TP shares
            self._record("send", stage, post, post + send, lead, self.cost.send_bytes(tokens))
        self.forwards += 1
        self.split_forwards += two_batch
        result_at = end + self.cost.hw.intra_node.latency
        self.inflight.append(_Flight(group, result_at, stage_times))

    def _record(
        self, kind: str, stage: int, start: float, end: float, b: ScheduledBatch, nbytes: float = 0
    ) -> None:
        ev = Event(kind, stage, 0, start, end, b.batch_id, nbytes=int(nbytes))
        ev.rids = [s.rid for s in b.slices]
        ev.chunks = [s.chunk_index for s in b.slices]
        ev.tokens = [s.num_tokens for s in b.slices]
        ev.prefix = [s.prefix_len for s in b.slices]
        self.events.append(ev)

    def wait_results(self) -> list[BatchResult]:
        flight = self.inflight.popleft()
        self.clock.advance_to(flight.result_at)
        return [_result(b, flight.stage_times) for b in flight.group.batches]

    def shutdown(self) -> None:
        self.inflight.clear()


def _result(batch: ScheduledBatch, stage_times: list[float]) -> BatchResult:
    samples = batch.num_samples
    return BatchResult(
        batch.batch_id,
        [SIM_TOKEN] * samples,
        [math.nan] * samples,
        [[math.nan] * len(s.logprob_targets) for s in batch.slices],
        [[] for _ in range(samples)],
        stage_times=list(stage_times),
    )
