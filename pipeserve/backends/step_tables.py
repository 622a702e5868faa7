"""A batch's decode steps as a page table of one slot per page, for the backends that read
the steps through one: Triton's kernels (GQA's and MLA's decode steps), and the torch
backend's (a padded gather per group of similar lengths).

The table is built on the host in O(runs + steps) as the steps' slot runs (`SlotRuns`) and
expanded where the runs are, after the runner's copy (`expanded`), so no host work grows with
the context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from pipeserve.backends.base import Segment, StepTable, length_groups
from pipeserve.layers.attention_parts import SlotRuns
from pipeserve.scheduler.batch import Run, runs_prefix


@dataclass
class TableSteps:
    """All single-token steps of a batch: each step's KV slots (int32) and where each step's
    start; as `slot_runs` (the two tables None) until `expanded`."""

    rows: torch.Tensor  # [b] token rows of the steps
    slot_runs: SlotRuns | None = None
    kv_indptr: torch.Tensor | None = None  # [b + 1] int32
    kv_indices: torch.Tensor | None = None  # int32: the slot of every position of each step
    # longest first, cut by length (`length_groups`: the torch backend's gathers and V3.2's
    # indexer read them; None for a CUDA graph's step)
    order: torch.Tensor | None = None
    groups: tuple[tuple[int, int, int], ...] = ()


T = TypeVar("T")

UNEXPANDED = "a plan's page table is still slot runs: use AttentionPlan.expanded()"
SLOT_BLOCK_ELEMENTS = 2**22  # padded_slots: positions made at a time (int64 temporaries)


def table_steps(steps: list[tuple[int, list[Run]]], device: torch.device) -> TableSteps:
    """(row, the runs covering exactly its sequence) per step -> their rows and page table
    of one slot per page, as slot runs."""
    rows = torch.tensor([row for row, _ in steps], dtype=torch.long, device=device)
    return TableSteps(rows, slot_runs=SlotRuns.build([runs for _, runs in steps], device))


def step_runs(segments: list[Segment]) -> list[tuple[int, list[Run]]]:
    """A batch's decode steps (its one-row segments) as (row, the runs covering exactly its
    sequence); ValueError where a step's runs are shorter than its sequence."""
    steps = []
    for row, n, prefix, runs in segments:
        if n == 1:
            covering = runs_prefix(runs, prefix + 1)
            if sum(m for _, m in covering) < prefix + 1:
                raise ValueError("KV runs are shorter than the sequence")
            steps.append((row, covering))
    return steps


def decode_steps(
    steps: list[tuple[int, list[Run]]], device: torch.device
) -> tuple[TableSteps, list[int]]:
    """A batch's decode steps, (row, the runs covering exactly its sequence) each, at least
    one, as a page table with their length order and groups (`length_groups`) -> (the table,
    that order on the host)."""
    order, groups = length_groups([sum(n for _, n in runs) for _, runs in steps])
    table = table_steps(steps, device)
    table.order, table.groups = torch.tensor(order, dtype=torch.long, device=device), groups
    return table, order


def expanded(plan: T) -> T:
    """A plan (TableSteps, Triton's ExtendPlan) whose page table is still its slot runs
    (`slot_runs`), with the table made where the runs are (kv_indptr, kv_indices); anything
    else (None, an expanded plan) as it is."""
    runs = getattr(plan, "slot_runs", None)
    if runs is None:
        return plan
    indptr, indices = runs.expand()
    return replace(plan, kv_indptr=indptr, kv_indices=indices, slot_runs=None)  # type: ignore[type-var]


def step_table(steps: TableSteps) -> StepTable:
    """The expanded steps as V3.2's indexer reads them."""
    if steps.order is None:  # graph_blocker keeps V3.2 off graphs; an indexer must not get here
        raise ValueError("a CUDA graph's decode steps carry no length order for an indexer")
    assert steps.kv_indptr is not None and steps.kv_indices is not None, UNEXPANDED
    return StepTable(steps.rows, steps.kv_indptr, steps.kv_indices, steps.order, steps.groups)


def chosen_slots(
    chosen: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode steps' page table narrowed to an indexer's choice: chosen [b, topk] positions
    (-1: none) of each step's sequence (indices[indptr[i]:indptr[i + 1]]) -> a table of topk
    slots per step, -1 where nothing is chosen. A step whose sequence is no longer than
    topk reads all of it (the choice would keep every position)."""
    b, topk = chosen.shape
    lengths = (indptr[1:] - indptr[:-1]).long()
    every = torch.arange(topk, device=chosen.device)[None, :].expand(b, topk)
    positions = torch.where((lengths <= topk)[:, None], every, chosen)
    table_ptr = torch.arange(b + 1, device=chosen.device, dtype=torch.int32) * topk
    return table_ptr, _slots_at(positions, indptr, indices).flatten()


def padded_slots(
    steps: torch.Tensor, width: int, indptr: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """The slots [len(steps), width] int32 of every position of the table's `steps` (indices
    into it), in order, -1 past each step's length (a group of steps of similar length); made
    SLOT_BLOCK_ELEMENTS at a time, whatever the group's size."""
    per = max(1, SLOT_BLOCK_ELEMENTS // width)
    blocks = []
    for i in range(0, steps.shape[0], per):
        block = steps[i : i + per]
        positions = torch.arange(width, device=steps.device)[None, :].expand(block.shape[0], width)
        blocks.append(_slots_at(positions, indptr[block], indices, indptr[block + 1]))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _slots_at(
    positions: torch.Tensor,
    starts: torch.Tensor,
    indices: torch.Tensor,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slots int32 of `positions` [n, k] (-1: none) of sequences that start at starts[:n]
    (or starts[:-1], ending at starts[1:], where `ends` is None) in `indices` (int32); -1 where
    a position is none or past its sequence."""
    if ends is None:
        starts, ends = starts[:-1], starts[1:]
    first = starts.long()[:, None]
    valid = (positions >= 0) & (positions < ends.long()[:, None] - first)
    flat = positions.clamp_min(0).add_(first).clamp_max_(indices.numel() - 1)
    return indices[flat].to(torch.int32).masked_fill_(~valid, -1)
