"""Two-batch overlap split rules and the two micro-batches, and the data-parallel agreement.
Pure Python over request slices."""

from __future__ import annotations

import pytest

from pipeserve.batch_overlap.two_batch import cut_slice, plan_split, split_batch
from pipeserve.scheduler.batch import (
    ReqSlice,
    ScheduledBatch,
    TwoBatchSplit,
    runs_prefix,
)
from pipeserve.scheduler.data_parallel import plan_two_batch
from pipeserve.scheduler.request import SamplingParams

T = 0.48  # the default --tbo-token-distribution-threshold


def decode(rid: str, prefix: int = 5) -> ReqSlice:
    return ReqSlice(
        rid,
        [-1],
        prefix,
        [(100, prefix + 1)],
        sample=True,
        sampling=SamplingParams(),
        chunk_index=-1,
        future_slot=7,
    )


def prefill(rid: str, n: int, prefix: int = 0, chunk: int = 0) -> ReqSlice:
    return ReqSlice(
        rid,
        list(range(1000, 1000 + n)),
        prefix,
        [(0, prefix + n)],
        sample=True,
        sampling=SamplingParams(temperature=0.0),
        chunk_index=chunk,
    )


def prefills(*sizes: int) -> list[ReqSlice]:
    return [prefill(f"r{i}", n) for i, n in enumerate(sizes)]


def tokens_of(slices: list[ReqSlice]) -> list[tuple[str, int]]:
    return [(s.rid, t) for s in slices for t in s.input_ids]


# -- decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "index"), [(2, 1), (3, 2), (4, 2), (5, 3), (8, 4)])
def test_a_decode_batch_is_split_in_half_a_gets_the_extra(n: int, index: int) -> None:
    slices = [decode(f"d{i}") for i in range(n)]
    assert plan_split(slices, T) == TwoBatchSplit(index, 0, True)
    a, b = split_batch(ScheduledBatch(3, slices, two_batch=plan_split(slices, T)))
    assert [s.rid for s in a.slices] == [f"d{i}" for i in range(index)]
    assert [s.rid for s in b.slices] == [f"d{i}" for i in range(index, n)]


def test_a_decode_split_ignores_the_threshold() -> None:
    slices = [decode(f"d{i}") for i in range(3)]
    assert plan_split(slices, 0.5) == TwoBatchSplit(2, 0, True)


def test_one_decode_request_is_not_split() -> None:
    assert plan_split([decode("d")], T) is None


def test_an_empty_batch_is_not_split() -> None:
    assert plan_split([], T) is None


# -- prefill ------------------------------------------------------------------------------


def test_prefill_takes_the_most_balanced_request_boundary() -> None:
    # boundaries after 10, 49, 52 tokens of 100: A 49, B 51 (a cut would give (2, 1))
    assert plan_split(prefills(10, 39, 3, 48), T) == TwoBatchSplit(2, 0, False)
    # boundaries after 3, 52 tokens of 100: A larger than B, within 1 - t
    assert plan_split(prefills(3, 49, 48), T) == TwoBatchSplit(2, 0, False)
    # boundaries after 49, 59, 79 tokens of 100
    assert plan_split(prefills(49, 10, 20, 21), T) == TwoBatchSplit(1, 0, False)
    # boundaries after 3, 8 (even), 12 tokens of 16
    assert plan_split(prefills(3, 5, 4, 4), T) == TwoBatchSplit(2, 0, False)


@pytest.mark.parametrize(
    ("sizes", "threshold", "expected"),
    [
        ((25, 75), 0.25, TwoBatchSplit(1, 0, False)),  # A's share exactly t
        ((24, 76), 0.25, TwoBatchSplit(1, 26, False)),  # just below t: cut
        ((75, 25), 0.25, TwoBatchSplit(1, 0, False)),  # exactly 1 - t
        ((76, 24), 0.25, TwoBatchSplit(0, 50, False)),  # just above 1 - t: cut
        ((48, 52), T, TwoBatchSplit(1, 0, False)),
        ((47, 53), T, TwoBatchSplit(1, 3, False)),
        ((52, 48), T, TwoBatchSplit(1, 0, False)),
        ((53, 47), T, TwoBatchSplit(0, 50, False)),
    ],
)
def test_prefill_threshold_edges(
    sizes: tuple[int, ...], threshold: float, expected: TwoBatchSplit
) -> None:
    assert plan_split(prefills(*sizes), threshold) == expected


@pytest.mark.parametrize("sizes", [(24, 76), (76, 24), (3, 40, 2), (1, 1, 1, 30), (9, 2, 1, 1)])
def test_a_two_chunk_split_gives_a_exactly_half_the_tokens(sizes: tuple[int, ...]) -> None:
    slices = prefills(*sizes)
    split = plan_split(slices, T)
    assert split is not None and not split.decode and split.tokens > 0
    a, b = split_batch(ScheduledBatch(0, slices, two_batch=split))
    total = sum(sizes)
    assert a.num_tokens == total // 2
    assert b.num_tokens == total - total // 2


@pytest.mark.parametrize(("n", "tokens"), [(2, 1), (7, 3), (10, 5), (1001, 500)])
def test_a_single_request_is_cut_in_the_middle(n: int, tokens: int) -> None:
    assert plan_split(prefills(n), T) == TwoBatchSplit(0, tokens, False)


def test_a_batch_of_one_token_is_not_split() -> None:
    assert plan_split(prefills(1), T) is None


def test_a_cut_on_a_requests_first_token_is_a_boundary() -> None:
    # 2 of 5 tokens at the only boundary is below t; A's half (5 // 2 = 2) ends right there
    assert plan_split(prefills(2, 3), T) == TwoBatchSplit(1, 0, False)
    assert plan_split(prefills(1, 2), T) == TwoBatchSplit(1, 0, False)


def test_a_mixed_batch_uses_the_prefill_rule() -> None:
    slices = [decode("d0"), decode("d1"), prefill("p", 10, chunk=1)]
    # the decode rule would give (2, 0, True); 2 of 12 tokens at the best boundary: cut at 6
    assert plan_split(slices, T) == TwoBatchSplit(2, 4, False)
    balanced = [decode(f"d{i}") for i in range(4)] + [prefill("p", 4, chunk=0)]
    assert plan_split(balanced, T) == TwoBatchSplit(4, 0, False)


# -- split_batch and cut_slice --------------------------------------------------------------


def long_slice() -> ReqSlice:
    """Chunk 2 of a request: 10 tokens after a 4-token prefix, KV over three runs."""
    return ReqSlice(
        "long",
        list(range(50, 60)),
        4,
        [(100, 5), (200, 3), (300, 6)],
        sample=True,
        sampling=SamplingParams(temperature=0.5, seed=3),
        return_logprob=True,
        top_logprobs=2,
        logprob_targets=list(range(51, 61)),
        chunk_index=2,
        future_slot=9,
    )


def test_cut_slice_head() -> None:
    s = long_slice()
    head, _ = cut_slice(s, 3)
    assert head.rid == "long"
    assert head.input_ids == [50, 51, 52]
    assert head.prefix_len == 4
    assert head.kv_runs == runs_prefix(s.kv_runs, 7) == [(100, 5), (200, 2)]
    assert head.sample is False
    assert head.sampling is None
    assert head.return_logprob is False
    assert head.top_logprobs == 0
    assert head.future_slot == 0
    assert head.logprob_targets == [51, 52, 53]
    assert head.chunk_index == 2


def test_cut_slice_tail() -> None:
    s = long_slice()
    _, tail = cut_slice(s, 3)
    assert tail.rid == "long"
    assert tail.input_ids == list(range(53, 60))
    assert tail.prefix_len == 7
    assert tail.kv_runs == s.kv_runs
    assert tail.sample is True
    assert tail.sampling == SamplingParams(temperature=0.5, seed=3)
    assert tail.return_logprob is True
    assert tail.top_logprobs == 2
    assert tail.future_slot == 9
    assert tail.logprob_targets == list(range(54, 61))
    assert tail.chunk_index == 2


def test_cut_slice_leaves_the_original_alone() -> None:
    s = long_slice()
    cut_slice(s, 3)
    assert s == long_slice()


def test_cut_slice_with_fewer_targets_than_tokens() -> None:
    s = prefill("p", 6)
    s.logprob_targets = [1, 2, 3, 4, 5]  # the last position's next token is not known yet
    head, tail = cut_slice(s, 4)
    assert (head.logprob_targets, tail.logprob_targets) == ([1, 2, 3, 4], [5])


@pytest.mark.parametrize("n", [0, 10, -1, 11])
def test_cut_slice_outside_the_slice_raises(n: int) -> None:
    with pytest.raises(ValueError):
        cut_slice(long_slice(), n)


def test_cut_slice_of_a_decode_step_raises() -> None:
    s = decode("d")
    s.input_ids = [-1, -2]  # even with room to cut
    with pytest.raises(ValueError):
        cut_slice(s, 1)


def test_split_batch_two_chunk_keeps_the_token_order() -> None:
    slices = [prefill("p0", 3), long_slice(), prefill("p2", 4)]
    batch = ScheduledBatch(11, slices, two_batch=TwoBatchSplit(1, 3, False))
    a, b = split_batch(batch)
    assert (a.batch_id, b.batch_id) == (11, 11)
    assert [s.rid for s in a.slices] == ["p0", "long"]
    assert [s.rid for s in b.slices] == ["long", "p2"]
    assert tokens_of(a.slices) + tokens_of(b.slices) == tokens_of(slices)
    assert a.slices[1] == cut_slice(long_slice(), 3)[0]
    assert b.slices[0] == cut_slice(long_slice(), 3)[1]
    # B's part of the cut request attends to A's part as prefix
    assert b.slices[0].prefix_len == a.slices[1].prefix_len + a.slices[1].num_tokens


def test_split_batch_at_a_boundary_keeps_the_slices() -> None:
    slices = prefills(3, 5, 4, 4)
    a, b = split_batch(ScheduledBatch(0, slices, two_batch=TwoBatchSplit(2, 0, False)))
    assert a.slices == slices[:2] and b.slices == slices[2:]
    assert tokens_of(a.slices) + tokens_of(b.slices) == tokens_of(slices)


@pytest.mark.parametrize(
    "slices",
    [
        prefills(24, 76),
        prefills(7),
        prefills(3, 40, 2),
        [decode("d0"), decode("d1"), prefill("p", 10, chunk=1)],
        [decode(f"d{i}") for i in range(5)],
    ],
)
def test_planned_splits_concatenate_to_the_original(slices: list[ReqSlice]) -> None:
    split = plan_split(slices, T)
    a, b = split_batch(ScheduledBatch(0, slices, two_batch=split))
    assert a.slices and b.slices
    assert tokens_of(a.slices) + tokens_of(b.slices) == tokens_of(slices)
    assert a.num_samples + b.num_samples == ScheduledBatch(0, slices).num_samples


# -- data-parallel agreement ----------------------------------------------------------------


@pytest.mark.parametrize("other", [[], [decode("d")], prefills(1)])
def test_no_rank_splits_unless_every_rank_can(other: list[ReqSlice]) -> None:
    batches = [ScheduledBatch(0, prefills(10, 10)), ScheduledBatch(0, other)]
    plan_two_batch(batches, T)
    assert [b.two_batch for b in batches] == [None, None]


def test_a_decode_rank_beside_a_prefill_rank_uses_the_prefill_strategy() -> None:
    batches = [
        ScheduledBatch(0, [decode(f"d{i}") for i in range(4)]),
        ScheduledBatch(0, prefills(10, 30)),
    ]
    plan_two_batch(batches, T)
    assert batches[0].two_batch == TwoBatchSplit(2, 0, False)
    assert batches[1].two_batch == TwoBatchSplit(1, 10, False)


def test_all_decode_ranks_use_the_decode_strategy() -> None:
    batches = [
        ScheduledBatch(0, [decode(f"d{i}") for i in range(3)]),
        ScheduledBatch(0, [decode(f"e{i}") for i in range(2)]),
    ]
    plan_two_batch(batches, T)
    assert [b.two_batch for b in batches] == [TwoBatchSplit(2, 0, True), TwoBatchSplit(1, 0, True)]


def test_all_prefill_ranks_each_get_their_own_split() -> None:
    batches = [ScheduledBatch(0, prefills(10, 10)), ScheduledBatch(0, prefills(7))]
    plan_two_batch(batches, T)
    assert [b.two_batch for b in batches] == [
        TwoBatchSplit(1, 0, False),
        TwoBatchSplit(0, 3, False),
    ]


@pytest.mark.parametrize(("min_tokens", "split"), [(0, True), (20, True), (21, False)])
def test_steps_split_only_when_some_rank_has_min_tokens(min_tokens: int, split: bool) -> None:
    """The busiest rank (20 tokens) decides for all: the 4-token decode rank splits with it."""
    batches = [
        ScheduledBatch(0, [decode(f"d{i}") for i in range(4)]),
        ScheduledBatch(0, prefills(10, 10)),
    ]
    plan_two_batch(batches, T, min_tokens)
    assert [b.two_batch is not None for b in batches] == [split, split]
