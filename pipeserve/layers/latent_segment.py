"""One request's place in a batch for latent (MLA) attention: its rows in the batch and the
cache slots of all its positions. Its own module, so the attention layer, its indexer and the
batch builder all import it without importing each other."""

from __future__ import annotations

import torch

from pipeserve.layers.attention_parts import split_runs

Run = tuple[int, int]  # (first cache slot, number of slots)


class LatentSegment:
    """One request's tokens in a batch and where all its positions live in the latent cache:
    the slot of each position in order, given as a tensor (`slots`), or as its runs of
    consecutive slots alone, the tensor then made on `device` only if something reads it (a
    decode step reads its runs in place: no per-step work in the length of its context)."""

    def __init__(
        self,
        q_start: int,
        q_len: int,
        slots: torch.Tensor | None = None,
        runs: tuple[Run, ...] = (),
        device: torch.device | None = None,
    ) -> None:
        """slots: [prefix_len + q_len] long, or None for `runs`' slots. runs: the (first slot,
        length) runs of those slots in order, where known: one run is read as a view, several
        as views of their long runs (`parts`); unknown (empty): gathered by `slots`."""
        if slots is None and not runs:
            raise ValueError("a latent segment needs its slots or their runs")
        self.q_start, self.q_len, self.runs = q_start, q_len, runs
        self._slots, self._device = slots, device
        self.length = slots.shape[0] if slots is not None else sum(n for _, n in runs)

    def __repr__(self) -> str:
        return f"LatentSegment(q_start={self.q_start}, q_len={self.q_len}, runs={self.runs})"

    @property
    def slots(self) -> torch.Tensor:
        """[prefix_len + q_len] long: the cache slot of each position, in order."""
        if self._slots is None:
            self._slots = self._span(0, self.length)
        return self._slots

    def slots_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The cache slots of `positions` (any shape, values in [0, prefix_len + q_len)):
        with one run of slots, without making the slot of every position."""
        if self._slots is None and len(self.runs) == 1:
            return positions + self.runs[0][0]
        return self.slots[positions]

    def chosen_slots(self, chosen: torch.Tensor) -> torch.Tensor:
        """An indexer's choice of positions (any shape, -1 for none) -> their cache slots,
        -1 kept for none."""
        return torch.where(chosen >= 0, self.slots_at(chosen.clamp_min(0)), -1)

    def _span(self, first: int, end: int) -> torch.Tensor:
        """The slots of positions [first, end), from the runs."""
        ranges, start = [], 0  # start: the position of the run's first slot
        for slot, n in self.runs:
            lo, hi = max(first, start) - start, min(end, start + n) - start
            if lo < hi:
                ranges.append(torch.arange(slot + lo, slot + hi, device=self._device))
            start += n
        return ranges[0] if len(ranges) == 1 else torch.cat(ranges)

    @property
    def prefix_len(self) -> int:
        return self.length - self.q_len

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_start + self.q_len)

    @property
    def new_slots(self) -> torch.Tensor:
        """[q_len]: the slots its new tokens are written to."""
        if self._slots is None:
            return self._span(self.prefix_len, self.length)
        return self._slots[self.prefix_len :]

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """The rows of all its positions, [prefix_len + q_len, width]: a view when they are
        one run of slots, else a gathered copy."""
        if len(self.runs) == 1:
            start = self.runs[0][0]
            return cache[start : start + self.length]
        return cache[self.slots]

    def parts(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """The same rows as `read`, in parts whose order is not kept: each long run of slots
        as a view, the short rest gathered into one tensor (what a query seeing every position,
        a decode step, can attend to part by part)."""
        if len(self.runs) <= 1:
            return [self.read(cache)]
        views, short = split_runs(list(self.runs), self.length)
        parts = [cache[start : start + n] for start, n in views]
        if short:
            rows = [torch.arange(s, s + n, device=cache.device) for s, n in short]
            parts.append(cache[torch.cat(rows)])
        return parts
