"""SlotRuns: the batched kernels' page table, copied as runs of slots and expanded where the
runs are, equals the table of every position's slot built one position at a time."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from pipeserve.layers.attention_parts import SlotRuns
from pipeserve.scheduler.batch import Run

CPU = torch.device("cpu")
PAGE = 16

RAGGED: dict[str, list[list[Run]]] = {
    "several runs a sequence": [[(5, 3), (100, 2), (7, 1)], [(50, 4)], [(200, 9), (60, 2)]],
    "runs of one slot": [[(9, 1), (3, 1), (11, 1)], [(1, 1)], [(40, 1), (41, 1)]],
    "pages of 16": [
        [(PAGE * p, PAGE) for p in (7, 2, 30)] + [(PAGE * 5, 3)],
        [(PAGE * 9, 1)],
        [(PAGE * p, PAGE) for p in (11, 12)],
    ],
    "a sequence with no runs": [[(4, 2)], [], [(8, 1)]],
    "no sequences": [],
}


def positions_table(per_seq: list[list[Run]]) -> tuple[list[int], list[int]]:
    """(kv_indptr, kv_indices) built one position at a time."""
    lengths = [sum(n for _, n in runs) for runs in per_seq]
    slots = [start + i for runs in per_seq for start, n in runs for i in range(n)]
    return list(accumulate(lengths, initial=0)), slots


@pytest.mark.parametrize("case", RAGGED)
def test_expanded_runs_are_every_positions_slot(case: str) -> None:
    per_seq = RAGGED[case]
    runs = SlotRuns.build(per_seq, CPU)
    num_runs = sum(len(r) for r in per_seq)
    # what is copied: O(runs)
    assert runs.indptr.numel() == len(per_seq) + 1 and runs.runs_table.numel() == 2 * num_runs
    indptr, indices = runs.expand()
    assert indptr.dtype == indices.dtype == torch.int32
    assert (indptr.tolist(), indices.tolist()) == positions_table(per_seq)
    assert indices.numel() == runs.total
    # into a buffer of the caller's (a CUDA graph's): its head written, the rest untouched
    into = torch.full((runs.total + 3,), -7, dtype=torch.int32)
    runs.expand_into(into)
    assert into.tolist() == positions_table(per_seq)[1] + [-7] * 3


def test_runs_expand_on_the_device_they_were_moved_to() -> None:
    """Built on the host, moved, expanded there: the table has its full size on that device
    (meta: shapes only), with no host tensor of that size made."""
    per_seq = RAGGED["pages of 16"]
    runs = SlotRuns.build(per_seq, CPU)
    meta = runs.indptr.to("meta"), runs.runs_table.to("meta")
    moved = SlotRuns(*meta, runs.sequences, runs.runs, runs.total)
    indptr, indices = moved.expand()
    assert indptr.device.type == indices.device.type == "meta"
    assert indptr.shape == (len(per_seq) + 1,) and indices.shape == (runs.total,)
