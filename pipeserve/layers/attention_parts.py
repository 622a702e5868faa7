"""What the attention kernels exchange with the paged attention layer: parts of a request's
cached K/V, the plan of a batch's decode steps, and merging attention results over disjoint
key sets by their log-sum-exp. Imported by the layer and by every kernel backend, so neither
imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from pipeserve.scheduler.batch import Run

KVPart = tuple[torch.Tensor, torch.Tensor]  # k, v of some cached positions: [kv_heads, n, d]


@dataclass
class SlotRuns:
    """The batched kernels' page table of one slot per page (`kv_indptr` [n + 1], `kv_indices`
    [total], int32) as the runs of consecutive slots it is made of: built and copied in
    O(runs + sequences) however many positions they cover; `expand()` makes the table where
    `packed` is (on the device, after the runner's copy) without reading any value back."""

    # [n + 1 + 2 * runs] int64: kv_indptr, then each run's first slot less the position (over
    # all sequences) it starts at, then each run's length
    packed: torch.Tensor
    sequences: int  # n
    runs: int
    total: int  # positions of all sequences: the table's size, known on the host

    @classmethod
    def build(cls, per_seq: list[list[Run]], device: torch.device) -> SlotRuns:
        """Sequences' KV runs (first slot, length), in order within each sequence."""
        runs = [run for seq in per_seq for run in seq]
        firsts = list(accumulate((n for _, n in runs), initial=0))  # where each starts; the total
        bounds = accumulate((len(seq) for seq in per_seq), initial=0)  # each sequence's first
        indptr = [firsts[b] for b in bounds]
        shifts = [start - first for (start, _), first in zip(runs, firsts, strict=False)]
        packed = indptr + shifts + [n for _, n in runs]
        t = torch.tensor(packed, dtype=torch.long, device=device)
        return cls(t, len(per_seq), len(runs), firsts[-1])

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr, kv_indices) on `packed`'s device."""
        return self.packed[: self.sequences + 1].to(torch.int32), self.slots().to(torch.int32)

    def slots(self) -> torch.Tensor:
        """Every position's slot, all sequences in order ([total] int64, on `packed`'s
        device)."""
        shifts, lengths = self.packed[self.sequences + 1 :].split([self.runs, self.runs])
        slots = torch.repeat_interleave(shifts, lengths, output_size=self.total)
        return slots.add_(torch.arange(self.total, device=slots.device))


@dataclass
class DecodePlan:
    """All single-token steps of a batch. With the native kernel (or the batched Triton one):
    every step's runs of KV slots, read in one pass. Otherwise: one batched call over their
    short KV parts (padded gather + mask), plus per-request calls over long runs read in
    place."""

    rows: torch.Tensor  # [b] token rows of the steps
    gather: torch.Tensor | None = None  # [b, n] slot ids of each step's short part (pad: 0)
    mask: torch.Tensor | None = None  # [b, 1, 1, n] additive: 0 real keys, -inf padding
    views: list[tuple[int, list[Run]]] = field(default_factory=list)  # (step, long runs)
    runs: torch.Tensor | None = None  # native: [r, 2] (first slot, length), steps in order
    offsets: torch.Tensor | None = None  # native: [b + 1] where each step's runs start
    lengths: list[int] = field(default_factory=list)  # each step's real keys in `gather`
    # the batched Triton kernel: each step's KV slots (int32) and where each step's start;
    # as `slot_runs` (these None) until `AttentionPlan.expanded()`
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    slot_runs: SlotRuns | None = None


@dataclass
class ExtendPlan:
    """All prompt chunks of a batch for the batched accelerator kernel (one launch per layer):
    each chunk's KV slots (its prefix and itself, in order), its rows and positions, and the
    launch's blocks of query rows (pipeserve/kernels/triton_attention.py)."""

    chunks: torch.Tensor  # [c, 3] int32: (first row, rows, prefix length)
    block_chunk: torch.Tensor  # [blocks] int32: the chunk of each block of query rows
    block_first: torch.Tensor  # [blocks] int32: its first row within the chunk
    # the page table: as `slot_runs` (the others None) until `AttentionPlan.expanded()`
    slot_runs: SlotRuns | None = None
    kv_indptr: torch.Tensor | None = None  # [c + 1] int32: where each chunk's slots start
    kv_indices: torch.Tensor | None = None  # int32: the slot of every position of each chunk


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
