"""Attention-FFN disaggregation's micro-batches: request-boundary cuts of near-equal tokens,
empty parts where there are fewer requests than micro-batches, and the scheduler giving
every attention rank (idle ones too) the same number."""

from __future__ import annotations

import pytest

from pipeserve.config import SchedulerConfig
from pipeserve.disaggregation.afd.micro_batches import micro_batch_sizes, split_micro_batches
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch
from pipeserve.scheduler.data_parallel import DataParallelScheduler
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.scheduler.scheduler import Scheduler


def chunk(rid: str, n: int) -> ReqSlice:
    return ReqSlice(rid, list(range(n)), 0, [(0, n)], sample=True, sampling=SamplingParams())


def slices(*sizes: int) -> list[ReqSlice]:
    return [chunk(f"r{i}", n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    ("sizes", "n", "want"),
    [
        ((1,) * 6, 3, [2, 2, 2]),  # decode steps: equal request counts
        ((1,) * 7, 3, [2, 2, 3]),
        ((1, 1), 3, [0, 1, 1]),  # fewer requests than micro-batches: empty parts
        ((), 3, [0, 0, 0]),  # an idle rank still runs three
        ((512,), 3, [0, 0, 1]),  # one chunk is not cut
        ((10, 10, 40), 2, [2, 1]),  # a cut where the tokens reach half
        ((30, 30, 30), 3, [1, 1, 1]),
        ((5, 5), 1, [2]),
    ],
)
def test_sizes_cut_at_request_boundaries(sizes: tuple[int, ...], n: int,
                                         want: list[int]) -> None:
    assert micro_batch_sizes(slices(*sizes), n) == want


def test_split_keeps_the_order_and_every_slice() -> None:
    batch = ScheduledBatch(5, slices(3, 4, 5, 6), micro_batches=[1, 0, 3])
    parts = split_micro_batches(batch)
    assert [[s.rid for s in p.slices] for p in parts] == [["r0"], [], ["r1", "r2", "r3"]]
    assert {p.batch_id for p in parts} == {5}


def test_every_rank_gets_the_same_number_of_micro_batches() -> None:
    ranks = [Scheduler(SchedulerConfig(), KVManager(256, 1, False), 256, (0,)) for _ in range(2)]
    dp = DataParallelScheduler(ranks, micro_batches=3)
    dp.add_request(Req("a", list(range(10)), SamplingParams(max_new_tokens=2)))
    group = dp.schedule()
    assert group is not None
    assert [b.micro_batches for b in group.batches] == [[0, 0, 1], [0, 0, 0]]
