"""Which expert-parallel rank holds each routed expert, and its index among that rank's
experts. Decided once (by the weight loader and parallel state) and read by the dispatcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Invariant: every expert sits on exactly one rank; on each rank its experts are numbered
    0.. in ascending global id (the order the rank's weight tensors stack them)."""

    ep_size: int
    rank_of: tuple[int, ...]  # global expert id -> ep rank
    local_index: tuple[int, ...]  # global expert id -> index among its rank's experts

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Consecutive blocks of experts per rank; when `ep_size` does not divide
        `num_experts`, the first `num_experts % ep_size` ranks hold one expert more."""
        if num_experts < ep_size or ep_size < 1:
            raise ValueError(
                f"{num_experts} experts cannot be spread over an expert-parallel size of "
                f"{ep_size}: every rank needs at least one expert"
            )
        base, extra = divmod(num_experts, ep_size)
        sizes = [base + (r < extra) for r in range(ep_size)]
        return cls.from_table([r for r, size in enumerate(sizes) for _ in range(size)], ep_size)

    @classmethod
    def from_table(cls, rank_of: Sequence[int], ep_size: int) -> ExpertPlacement:
        """An explicit table: `rank_of[e]` is the ep rank holding global expert `e`."""
        bad = [(e, r) for e, r in enumerate(rank_of) if not 0 <= r < ep_size]
        if bad:
            e, r = bad[0]
            raise ValueError(
                f"expert placement puts expert {e} on rank {r}, but the expert-parallel "
                f"size is {ep_size}: give ranks 0..{ep_size - 1}"
            )
        seen = [0] * ep_size
        local = []
        for r in rank_of:
            local.append(seen[r])
            seen[r] += 1
        return cls(ep_size, tuple(rank_of), tuple(local))

    @property
    def num_experts(self) -> int:
        return len(self.rank_of)

    def experts_on(self, rank: int) -> tuple[int, ...]:
        """Global ids of the experts `rank` holds, in local-index order."""
        return tuple(e for e, r in enumerate(self.rank_of) if r == rank)

    def lookup(self, device: torch.device) -> torch.Tensor:
        """[2, num_experts] long on `device`: row 0 the rank, row 1 the local index."""
        return torch.tensor([self.rank_of, self.local_index], dtype=torch.long, device=device)
