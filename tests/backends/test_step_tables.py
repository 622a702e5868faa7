"""The decode steps' page table (backends/step_tables.py): built from slot runs, expanded,
narrowed to an indexer's choice, and read a group of steps at a time, each against the slots
listed one position at a time."""

from __future__ import annotations

import pytest
import torch

from pipeserve.backends.step_tables import (
    chosen_slots,
    decode_steps,
    expanded,
    padded_slots,
    step_table,
)
from pipeserve.scheduler.batch import runs_prefix

CPU = torch.device("cpu")
# (row, rows, prefix length, runs): three decode steps, a prompt chunk between them
SEGMENTS = [
    (0, 1, 4, [(10, 3), (40, 9)]),  # 5 positions: the runs cover more than the sequence
    (1, 6, 2, [(70, 8)]),
    (7, 1, 11, [(100, 2), (3, 1), (50, 9)]),  # 12 positions
    (8, 1, 0, [(90, 1)]),  # 1 position
]


def slots_of(runs: list[tuple[int, int]], n: int) -> list[int]:
    return [s + i for s, length in runs for i in range(length)][:n]


def decode_only() -> list[tuple[int, list[tuple[int, int]]]]:
    """The decode steps of SEGMENTS, each with the runs covering exactly its sequence."""
    return [(row, runs_prefix(r, prefix + 1)) for row, n, prefix, r in SEGMENTS if n == 1]


def test_decode_steps_list_each_step_s_slots_longest_first() -> None:
    table, order = decode_steps(decode_only(), CPU)
    steps = step_table(expanded(table))
    assert steps.rows.tolist() == [0, 7, 8]
    assert order == [1, 0, 2] and steps.order.tolist() == order
    want = [slots_of(r, prefix + 1) for _, n, prefix, r in SEGMENTS if n == 1]
    indptr, indices = steps.indptr.tolist(), steps.indices.tolist()
    assert [indices[indptr[i] : indptr[i + 1]] for i in range(3)] == want
    assert steps.groups == ((0, 3, 12),)  # padded to 12: 36 positions, twice their 18


def test_padded_slots_pad_a_group_with_minus_one() -> None:
    table = expanded(decode_steps(decode_only(), CPU)[0])
    assert table.kv_indptr is not None and table.kv_indices is not None
    got = padded_slots(torch.tensor([2, 0]), 6, table.kv_indptr, table.kv_indices)
    assert got.dtype == torch.int32
    assert got.tolist() == [[90, -1, -1, -1, -1, -1], [10, 11, 12, 40, 41, -1]]


@pytest.mark.parametrize("topk", [4, 8])
def test_chosen_slots_follow_positions_and_keep_short_steps_whole(topk: int) -> None:
    """A step over more than topk positions reads its chosen ones (-1: none); a step of at
    most topk positions reads all of them whatever was chosen."""
    table = expanded(decode_steps(decode_only(), CPU)[0])
    assert table.kv_indptr is not None and table.kv_indices is not None
    chosen = torch.full((3, topk), -1)
    chosen[0, :3] = torch.tensor([4, 0, 2])
    chosen[1, :4] = torch.tensor([11, 3, 0, 7])
    ptr, slots = chosen_slots(chosen, table.kv_indptr, table.kv_indices)
    assert ptr.tolist() == [i * topk for i in range(4)]
    rows = slots.view(3, topk).tolist()
    everything = [slots_of(r, p + 1) for _, n, p, r in SEGMENTS if n == 1]
    for i, (step, picked) in enumerate(zip(everything, chosen.tolist(), strict=True)):
        if len(step) <= topk:
            want = step + [-1] * (topk - len(step))
        else:
            want = [step[p] if p >= 0 else -1 for p in picked]
        assert rows[i] == want, i
