"""Attention-FFN disaggregation's micro-batches: request-boundary cuts of near-equal tokens,
empty parts where there are fewer requests than micro-batches, and the scheduler giving
every attention rank (idle ones too) the same number."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.batch_overlap.operations import State, execute
from pipeserve.batch_overlap.strategies import AFD_ATTENTION, forward_stages
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
def test_sizes_cut_at_request_boundaries(sizes: tuple[int, ...], n: int, want: list[int]) -> None:
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


# -- the attention side's grid and the FFN side's order -------------------------------------


class FakeLayer:
    """A MoE decoder layer's operations (or a dense layer's one) that log what they do."""

    def __init__(self, layer: int, moe: bool, log: list[tuple[str, int, int]]) -> None:
        self.layer, self.moe, self.log = layer, moe, log

    def operations(self) -> dict[str, Any]:
        if not self.moe:
            return {"layer": self._op("layer")}
        names = (
            "attention",
            "gate",
            "dispatch_a",
            "dispatch_b",
            "experts",
            "combine_a",
            "shared_experts",
            "combine_b",
            "output",
            "layer_output",
        )
        return {n: self._op(n) for n in names}

    def _op(self, name: str) -> Any:
        def op(state: State, **_: Any) -> dict[str, Any]:
            self.log.append((name, self.layer, state["mb"]))
            return {}

        return op


@pytest.mark.parametrize("n", [2, 3])
def test_the_attention_grid_dispatches_in_the_ffn_workers_order(n: int) -> None:
    """One dense layer, then three MoE layers: each MoE layer is one stage boundary; the
    attention side dispatches layer by layer, micro-batch by micro-batch (the order an FFN
    worker serves in), and waits for a micro-batch's partial sums only after the other
    micro-batches dispatched that layer (their attention runs while the FFN computes)."""
    log: list[tuple[str, int, int]] = []
    layers = [FakeLayer(0, False, log)] + [FakeLayer(i, True, log) for i in (1, 2, 3)]
    stages = forward_stages(layers, AFD_ATTENTION)
    assert len(stages) == 4  # three markers: one per MoE layer
    execute(stages, [State(mb=m) for m in range(n)], [{} for _ in range(n)], AFD_ATTENTION.delta)
    dispatched = [(layer, mb) for name, layer, mb in log if name == "dispatch_a"]
    assert dispatched == [(layer, mb) for layer in (1, 2, 3) for mb in range(n)]
    for layer in (1, 2, 3):
        waits = [i for i, e in enumerate(log) if e[:2] == ("combine_b", layer)]
        last_dispatch = max(i for i, e in enumerate(log) if e[:2] == ("dispatch_a", layer))
        assert min(waits) > last_dispatch
        # the shared experts run right before the wait (the routed ones are elsewhere)
        assert all(log[i - 1][0] == "shared_experts" for i in waits)
