"""DataParallelScheduler over real per-rank Schedulers (no model, no processes): which rank
takes a request (load, held KV, cached prefix), one micro-batch id for every rank's batch,
empty batches that carry released ids, future slots split by rank, and request ownership."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeserve.config import SchedulerConfig
from pipeserve.scheduler.batch import BatchResult
from pipeserve.scheduler.data_parallel import BatchGroup, DataParallelScheduler, rank_load
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler

EOS = 99
TOKEN = 7  # what the fake executor samples (never EOS)


def make_dp(
    ranks: int = 2, num_pages: int = 1024, page_size: int = 1, **flags: int | bool
) -> DataParallelScheduler:
    config = SchedulerConfig(**flags)  # type: ignore[arg-type]
    return DataParallelScheduler(
        [
            Scheduler(config, KVManager(num_pages, page_size, False), 1024, (EOS,))
            for _ in range(ranks)
        ]
    )


def make_req(rid: str, prompt: range | list[int], max_new_tokens: int = 16) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens))


def add(dp: DataParallelScheduler, rid: str, prompt: range | list[int], max_new: int = 16) -> int:
    """Add a request; the rank it went to."""
    dp.add_request(make_req(rid, prompt, max_new))
    return dp.owner[rid]


def results_for(group: BatchGroup, batch_id: int | None = None) -> list[BatchResult]:
    """What every rank's executor would answer: TOKEN for each sampling slice."""
    out = []
    for b in group.batches:
        n = b.num_samples
        bid = group.batch_id if batch_id is None else batch_id
        out.append(BatchResult(bid, [TOKEN] * n, [0.0] * n, [[] for _ in b.slices]))
    return out


def step(dp: DataParallelScheduler) -> tuple[BatchGroup, list[RequestUpdate]]:
    group = dp.schedule()
    assert group is not None
    return group, dp.process_result(group, results_for(group))


def run_until_idle(dp: DataParallelScheduler, max_steps: int = 100) -> list[RequestUpdate]:
    updates: list[RequestUpdate] = []
    for _ in range(max_steps):
        if not dp.has_work():
            return updates
        updates += step(dp)[1]
    raise AssertionError(f"not done after {max_steps} steps")


def rids(group: BatchGroup) -> list[list[str]]:
    return [[s.rid for s in b.slices] for b in group.batches]


# -- which rank takes a request -----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 6, 10])
def test_equal_requests_alternate_over_the_ranks(n: int) -> None:
    dp = make_dp()
    owners = [add(dp, f"r{i}", range(100 * i, 100 * i + 8)) for i in range(n)]
    assert owners == [i % 2 for i in range(n)]
    assert [len(s.reqs) for s in dp.ranks] == [n // 2, n // 2]


def test_a_rank_with_a_long_queued_prompt_gets_fewer_new_requests() -> None:
    dp = make_dp()
    assert add(dp, "long", range(1000, 1200)) == 0
    owners = Counter(add(dp, f"s{i}", range(100 * i, 100 * i + 10)) for i in range(10))
    # rank 1's queue reaches 100 tokens, still below rank 0's 200
    assert owners == {1: 10}


def test_a_rank_midway_through_a_chunked_prompt_counts_what_is_left() -> None:
    dp = make_dp(chunked_prefill_size=16)
    assert add(dp, "long", range(1000, 1200)) == 0
    group, _ = step(dp)
    assert rids(group) == [["long"], []]
    assert dp.ranks[0].prefill.chunked is not None  # 184 prompt tokens to go, 16 held
    owners = [add(dp, f"s{i}", range(100 * i, 100 * i + 10)) for i in range(5)]
    assert owners == [1] * 5


def test_a_rank_whose_live_requests_hold_much_kv_is_avoided() -> None:
    dp = make_dp(chunked_prefill_size=-1)
    assert add(dp, "big", range(1000, 1120), max_new=100) == 0
    step(dp)  # its whole prompt is computed: it holds 120 KV tokens and waits for nothing
    assert not dp.ranks[0].prefill.waiting and dp.ranks[0].prefill.chunked is None
    assert rank_load(dp.ranks[0]) >= 120
    owners = [add(dp, f"s{i}", range(100 * i, 100 * i + 10)) for i in range(3)]
    assert owners == [1, 1, 1]  # although rank 1 now has more requests


def test_load_ties_go_to_the_rank_with_fewer_requests() -> None:
    dp = make_dp()
    owners = [add(dp, "a", range(0, 3)), add(dp, "b", range(100, 108))]
    owners.append(add(dp, "c", range(200, 205)))
    assert owners == [0, 1, 0]  # 8 queued tokens each, in two requests on rank 0, one on rank 1
    assert add(dp, "d", range(300, 304)) == 1


def test_a_request_goes_where_its_prefix_is_cached() -> None:
    dp = make_dp(page_size=4)
    warm_prompt = list(range(1000, 1032))
    assert add(dp, "filler", range(500, 532), max_new=2) == 0
    assert add(dp, "warm", warm_prompt, max_new=2) == 1
    run_until_idle(dp)
    # Cached pages nobody holds can be evicted: they are no load, so the ranks are even.
    assert [rank_load(s) for s in dp.ranks] == [0, 0]
    assert [len(s.reqs) for s in dp.ranks] == [0, 0]
    prompt = warm_prompt[:24] + list(range(2000, 2008))
    assert [s.kv.cached_prefix_tokens(prompt) for s in dp.ranks] == [0, 24]
    assert add(dp, "new", prompt) == 1
    req = dp.ranks[1].reqs["new"]
    group, updates = step(dp)
    assert rids(group) == [[], ["new"]]
    assert req.cached_tokens == 24
    assert group.batches[1].slices[0].prefix_len == 24
    assert [u.cached_tokens for u in updates if u.rid == "new"] == [24]


# -- micro-batches --------------------------------------------------------------------------


def test_schedule_gives_every_rank_one_id_and_idle_ranks_their_released_ids() -> None:
    dp = make_dp()
    for _ in range(3):  # the ranks' own batch counters now differ; the group's id must win
        dp.ranks[1].empty_batch()
    assert add(dp, "a", range(0, 8), max_new=100) == 0
    assert add(dp, "b", range(100, 104), max_new=1) == 1
    assert add(dp, "c", range(200, 204), max_new=100) == 1

    first, updates = step(dp)
    assert rids(first) == [["a"], ["b", "c"]]
    assert [b.batch_id for b in first.batches] == [first.batch_id] * 2
    assert [(u.rid, u.finish_reason) for u in updates if u.finish_reason] == [("b", "length")]
    abort = dp.abort("c")
    assert abort is not None and abort.finish_reason == "abort"

    second, _ = step(dp)
    assert rids(second) == [["a"], []]  # rank 1 has nothing to run but still takes the step
    assert [b.batch_id for b in second.batches] == [second.batch_id] * 2
    assert [b.released for b in second.batches] == [[], ["b", "c"]]
    third, _ = step(dp)
    assert [b.released for b in third.batches] == [[], []]  # released ids go out once
    assert first.batch_id < second.batch_id < third.batch_id

    dp.abort("a")
    assert not dp.has_work()
    assert dp.schedule() is None


def test_future_slots_are_split_by_rank_in_slice_order() -> None:
    dp = make_dp()
    assert add(dp, "a", range(0, 8)) == 0
    assert add(dp, "b", range(100, 108)) == 1
    assert add(dp, "c", range(200, 204)) == 0  # loads tie at 12: fewer requests, lower rank
    group = dp.schedule()
    assert group is not None
    assert rids(group) == [["a", "c"], ["b"]]
    assert group.num_samples == 3
    dp.assign_future_slots(group, [11, 12, 13])
    slots = [[s.future_slot for s in b.slices] for b in group.batches]
    assert slots == [[11, 12], [13]]
    reqs = {**dp.ranks[0].reqs, **dp.ranks[1].reqs}
    assert {rid: r.future_slot for rid, r in reqs.items()} == {"a": 11, "c": 12, "b": 13}


def test_future_slots_skip_slices_that_sample_nothing() -> None:
    dp = make_dp(chunked_prefill_size=8)
    assert add(dp, "a", range(0, 20)) == 0
    assert add(dp, "b", range(100, 104)) == 1
    assert add(dp, "c", range(200, 204)) == 1
    group = dp.schedule()
    assert group is not None and rids(group) == [["a"], ["b", "c"]]
    assert group.batches[0].num_samples == 0  # a middle prompt chunk
    dp.assign_future_slots(group, [5, 6])
    slots = [[s.future_slot for s in b.slices] for b in group.batches]
    assert slots == [[0], [5, 6]]


# -- results and ownership ----------------------------------------------------------------


def test_a_result_of_another_micro_batch_is_refused_naming_the_rank() -> None:
    dp = make_dp()
    add(dp, "a", range(0, 8))
    add(dp, "b", range(100, 108))
    group = dp.schedule()
    assert group is not None
    results = results_for(group)
    results[1] = results_for(group, batch_id=group.batch_id + 1)[1]
    with pytest.raises(RuntimeError, match=f"attention rank 1 .* expected {group.batch_id}"):
        dp.process_result(group, results)


def test_a_finished_request_is_forgotten_and_its_id_can_be_reused() -> None:
    dp = make_dp()
    add(dp, "x", range(0, 8), max_new=1)
    _, updates = step(dp)
    assert [u.finish_reason for u in updates] == ["length"]
    assert "x" not in dp.owner
    assert not dp.has_work()
    add(dp, "x", range(100, 108))  # no "already in use"
    assert "x" in dp.owner


def test_an_id_reused_while_its_aborted_batch_is_in_flight_gets_only_its_own_tokens() -> None:
    """One rank: "x" is aborted with its batch in flight (renumbered to the group's id) and
    a new "x" arrives on the same rank: the old batch's token is not folded into it."""
    dp = make_dp(ranks=1)
    add(dp, "x", range(0, 8), max_new=4)
    group = dp.schedule()
    assert group is not None
    dp.abort("x")
    add(dp, "x", range(100, 108), max_new=4)
    assert dp.process_result(group, results_for(group)) == []
    new = dp.ranks[0].reqs["x"]
    assert new.output_ids == [] and new.inflight == 0
    updates = run_until_idle(dp)
    assert [t for u in updates for t in u.new_token_ids] == [TOKEN] * 4


def test_a_live_request_id_cannot_be_added_twice() -> None:
    dp = make_dp()
    assert add(dp, "x", range(0, 8)) == 0
    # The copy would go to rank 1, whose own scheduler has never seen "x".
    with pytest.raises(ValueError, match="'x' is already in use"):
        dp.add_request(make_req("x", range(100, 108)))
    assert dp.owner == {"x": 0}
    assert [list(s.reqs) for s in dp.ranks] == [["x"], []]


def test_abort_of_an_unknown_id_returns_none() -> None:
    dp = make_dp()
    assert dp.abort("nobody") is None
    add(dp, "x", range(0, 8), max_new=1)
    run_until_idle(dp)
    assert dp.abort("x") is None  # already finished


def test_abort_goes_to_the_owning_rank_and_frees_its_pages() -> None:
    dp = make_dp()
    assert add(dp, "a", range(0, 8)) == 0
    assert add(dp, "b", range(100, 108)) == 1
    step(dp)
    kv = dp.ranks[1].kv
    assert kv.allocator.num_free < kv.allocator.capacity
    update = dp.abort("b")
    assert update is not None and (update.rid, update.finish_reason) == ("b", "abort")
    assert "b" not in dp.owner and not dp.ranks[1].reqs
    assert kv.allocator.num_free + kv.tree.evictable_pages == kv.allocator.capacity  # type: ignore[union-attr]
    assert rank_load(dp.ranks[1]) == 0
    assert list(dp.ranks[0].reqs) == ["a"] and rank_load(dp.ranks[0]) > 0


def test_every_rank_gets_the_same_combine_blocks() -> None:
    """Single-batch overlap's combine-down: the block count is one decision for the step (each
    block is a collective every rank must join), from the largest rank batch."""
    for prompt, blocks in ((30, 4), (10, 1)):
        dp = make_dp()
        dp.combine_down = (4, 20)
        add(dp, "r", range(prompt))
        group = dp.schedule()
        assert group is not None and [b.combine_blocks for b in group.batches] == [blocks] * 2


def test_no_combine_blocks_in_a_step_that_two_batch_overlap_splits() -> None:
    dp = make_dp()
    dp.combine_down, dp.two_batch_threshold = (4, 20), 0.48
    assert [add(dp, "a", range(30)), add(dp, "b", range(100, 130))] == [0, 1]
    group = dp.schedule()
    assert group is not None and all(b.two_batch is not None for b in group.batches)
    assert [b.combine_blocks for b in group.batches] == [1, 1]
