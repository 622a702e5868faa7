"""One request's place in a batch for latent (MLA) attention: its rows in the batch and the
cache slots of all its positions. Its own module, so the attention layer, its indexer and the
batch builder all import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeserve.layers.attention import split_runs


@dataclass(frozen=True)
class LatentSegment:
    """One request's tokens in a batch and where all its positions live in the latent cache."""

    q_start: int  # row of its first token in the batch
    q_len: int  # its new tokens (a prompt chunk, or 1 for a decode step)
    slots: torch.Tensor  # [prefix_len + q_len] long: the cache slot of each position, in order
    # (first slot, length) runs of those slots, in order, where known: one run is read as a
    # view, several as views of their long runs (`parts`); unknown: gathered by `slots`
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def prefix_len(self) -> int:
        return self.slots.shape[0] - self.q_len

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_start + self.q_len)

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots[self.prefix_len :]

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """The rows of all its positions, [prefix_len + q_len, width]: a view when they are
        one run of slots, else a gathered copy."""
        if len(self.runs) == 1:
            start = self.runs[0][0]
            return cache[start : start + self.slots.shape[0]]
        return cache[self.slots]

    def parts(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """The same rows as `read`, in parts whose order is not kept: each long run of slots
        as a view, the short rest gathered into one tensor (what a query seeing every position,
        a decode step, can attend to part by part)."""
        if len(self.runs) <= 1:
            return [self.read(cache)]
        views, short = split_runs(list(self.runs), self.slots.shape[0])
        parts = [cache[start : start + n] for start, n in views]
        if short:
            rows = [torch.arange(s, s + n, device=cache.device) for s, n in short]
            parts.append(cache[torch.cat(rows)])
        return parts
