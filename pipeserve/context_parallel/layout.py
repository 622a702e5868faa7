"""Where context parallelism keeps the KV cache: pages striped over the CP ranks.

The scheduler allocates pages from one numbering, `cp_size` times as many as one rank's pool
holds (less the padding pages), and page g (g >= 1) lives on CP rank (g - 1) % N as that
rank's page (g - 1) // N + 1 (local page 0 stays every rank's zeroed padding target). A run of
consecutive pages, which the allocator prefers, is therefore spread evenly over the ranks,
and its pages on one rank are consecutive there too: every request's KV is split N ways
whatever its length, and each rank still reads its share in long runs.

Storage is decoupled from the compute split on purpose: per layer every rank gets the whole
chunk's K/V from the exchange, so it writes the positions of the pages it owns whichever rank
computed them, and a prefix cached under one split (another chunk size, another request) is
read alike under any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeserve.layers.attention_parts import gather_index
from pipeserve.scheduler.batch import Run, runs_prefix


def global_pages(local_pages: int, cp_size: int) -> int:
    """Pages of the scheduler's numbering over `cp_size` pools of `local_pages` each (page 0
    of each is padding; the numbering keeps one page 0)."""
    return cp_size * (local_pages - 1) + 1


@dataclass(frozen=True)
class PageStriping:
    cp_size: int
    rank: int
    page_size: int

    @staticmethod
    def slots_of(runs: list[Run], num: int, device: torch.device) -> torch.Tensor:
        """[num] long: the (global) slot of each position in [0, num) along `runs`."""
        used = runs_prefix(runs, num)
        if sum(n for _, n in used) != num:
            raise ValueError(f"KV runs cover fewer than {num} positions")
        return gather_index([used], device)[0][0]

    def owners(self, slots: torch.Tensor) -> torch.Tensor:
        """The CP rank holding each global slot."""
        return torch.div(slots, self.page_size, rounding_mode="floor").sub(1) % self.cp_size

    def local_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Each global slot's slot in its owner's pool."""
        page = torch.div(slots, self.page_size, rounding_mode="floor")
        offset = slots % self.page_size
        local_page = torch.div(page - 1, self.cp_size, rounding_mode="floor") + 1
        return local_page * self.page_size + offset

    def owned(
        self, runs: list[Run], start: int, end: int, device: torch.device, rank: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, local slots) of the positions in [start, end) whose pages rank `rank`
        (default: this one) holds, ascending."""
        rank = self.rank if rank is None else rank
        slots = self.slots_of(runs, end, device)[start:]
        mine = self.owners(slots) == rank
        positions = torch.arange(start, end, device=device)[mine]
        return positions, self.local_slots(slots[mine])


def runs_of(slots: torch.Tensor) -> list[Run]:
    """Ascending-position slots as runs of consecutive slots."""
    if slots.numel() == 0:
        return []
    breaks = torch.nonzero(slots.diff() != 1).flatten() + 1
    edges = [0, *breaks.tolist(), slots.numel()]
    firsts = slots[edges[:-1]].tolist()
    return [(f, e - b) for f, b, e in zip(firsts, edges[:-1], edges[1:], strict=True)]
