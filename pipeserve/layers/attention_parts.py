"""What attention backends share: parts of a request's cached K/V, page tables as slot runs,
and merging attention results over disjoint key sets by their log-sum-exp."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pipeserve.scheduler.batch import Run

KVPart = tuple[torch.Tensor, torch.Tensor]  # k, v of some cached positions: [kv_heads, n, d]
VIEW_MIN_TOKENS = 256  # shorter runs are cheaper to gather than to attend to separately


@dataclass
class SlotRuns:
    """The batched kernels' page table of one slot per page (`kv_indptr` [n + 1], `kv_indices`
    [total], int32) as the runs of consecutive slots it is made of: built and copied in
    O(runs + sequences) however many positions they cover; `expand()` makes the table where
    the runs are (on the device, after the runner's copy) without reading any value back.
    `indptr` is already the table's `kv_indptr` (a CUDA graph reads it where it was copied
    to); `expand_into` writes `kv_indices` into a buffer of the caller's."""

    indptr: torch.Tensor  # [n + 1] int32: where each sequence's slots start in kv_indices
    # [2 * runs] int64: each run's first slot less the position (over all sequences) it
    # starts at, then each run's length
    runs_table: torch.Tensor
    sequences: int  # n
    runs: int
    total: int  # positions of all sequences: the table's size, known on the host

    @classmethod
    def build(cls, per_seq: list[list[Run]], device: torch.device) -> SlotRuns:
        """Sequences' KV runs (first slot, length), in order within each sequence."""
        runs = [run for seq in per_seq for run in seq]
        firsts = list(accumulate((n for _, n in runs), initial=0))  # where each starts; the total
        bounds = accumulate((len(seq) for seq in per_seq), initial=0)  # each sequence's first
        indptr = torch.tensor([firsts[b] for b in bounds], dtype=torch.int32, device=device)
        shifts = [start - first for (start, _), first in zip(runs, firsts, strict=False)]
        table = torch.tensor(shifts + [n for _, n in runs], dtype=torch.long, device=device)
        return cls(indptr, table, len(per_seq), len(runs), firsts[-1])

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr, kv_indices) on the runs' device."""
        return self.indptr, self.slots().to(torch.int32)

    def expand_into(self, indices: torch.Tensor) -> None:
        """kv_indices written into indices[:total] (an int32 buffer at least that long)."""
        torch.add(self._shifts(), self._positions(), out=indices[: self.total])

    def slots(self) -> torch.Tensor:
        """Every position's slot, all sequences in order ([total] int64, on the runs'
        device)."""
        return self._shifts().add_(self._positions())

    def _shifts(self) -> torch.Tensor:
        """Each position's run's shift (its slot less its position)."""
        shifts, lengths = self.runs_table.split([self.runs, self.runs])
        return torch.repeat_interleave(shifts, lengths, output_size=self.total)

    def _positions(self) -> torch.Tensor:
        return torch.arange(self.total, device=self.runs_table.device)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention over disjoint key sets: weights exp(lse_i - lse_total)."""
    return merge_partials_lse(parts)[0]


def merge_partials_lse(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials` and the merged log-sum-exp (to merge the result again later)."""
    if len(parts) == 1:
        return parts[0]
    lse_all = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lse_all, dim=0)
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    for (o, _), lse in zip(parts, lse_all, strict=True):
        out += o.float() * torch.exp(lse - total)[..., None]
    return out.to(parts[0][0].dtype), total


def split_runs(runs: list[Run], num: int) -> tuple[list[Run], list[Run]]:
    """Positions [0, num) of a request's KV as long runs (read in place) and short runs
    (gathered)."""
    views: list[Run] = []
    short: list[Run] = []
    left = num
    for start, length in runs:
        if left == 0:
            break
        n = min(length, left)
        (views if n >= VIEW_MIN_TOKENS else short).append((start, n))
        left -= n
    return views, short


def gather_index(
    groups: list[list[Run]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids of each group's runs, one row per group, padded with slot 0: ([groups, width],
    lengths [groups]). A handful of tensor ops however many tokens the runs cover."""
    starts = [s for g in groups for s, _ in g]
    counts = [n for g in groups for _, n in g]
    lengths = [sum(n for _, n in g) for g in groups]

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    run_len, seg_len = t(counts), t(lengths)
    total = int(seg_len.sum())
    pos = torch.arange(total, device=device)
    run_first = torch.cumsum(run_len, 0) - run_len  # position where each run begins
    slots = torch.repeat_interleave(t(starts) - run_first, run_len) + pos
    seg_first = torch.cumsum(seg_len, 0) - seg_len
    row = torch.repeat_interleave(torch.arange(len(groups), device=device), seg_len)
    out = torch.zeros(len(groups), max(lengths, default=0), dtype=torch.long, device=device)
    out[row, pos - seg_first[row]] = slots
    return out, seg_len
