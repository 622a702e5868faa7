"""Future token map for the overlap loop: batch N+1 is built before batch N's tokens exist.

Each sampled token of a launched batch gets a slot in a ring on the device; the next batch
feeds `-slot` as the input id, resolved on the compute stream at the start of its forward,
after batch N (earlier on the same in-order stream) has stored its tokens. Slot 0 is never
used, so every placeholder is negative.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeserve.device import overlap_schedule_pays, resolve_device, synchronize

if TYPE_CHECKING:
    from pipeserve.config import EngineConfig


class SlotRing:
    """Hands out ring slots 1..size-1 in order, wrapping around (the scheduler's half)."""

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError("the future token ring needs at least 2 slots")
        self.size = size
        self._next = 1

    def reserve(self, n: int) -> list[int]:
        """n consecutive slots (wrapping around, skipping 0)."""
        if n > self.size - 1:
            raise ValueError(f"{n} placeholders do not fit a ring of {self.size - 1} slots")
        out = []
        for _ in range(n):
            out.append(self._next)
            self._next = self._next + 1 if self._next + 1 < self.size else 1
        return out


class FutureMap(SlotRing):
    """The ring of tokens itself, on the device (the executor's half)."""

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size)
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        synchronize(device)  # zeroed before the compute stream (another stream) reads it

    def resolve(self, ids: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Replace every -slot by the token stored in that slot (`in_place`: in `ids`, a
        CUDA graph's input buffer)."""
        stored = self.tokens[(-ids).clamp(min=0)]
        return torch.where(ids < 0, stored, ids, out=ids if in_place else None)

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens[slots] = tokens


def ring_size(max_running_requests: int, context_len: int, chunk_size: int | None) -> int:
    """Room for every request that can be in flight, middle prefill chunks included."""
    max_chunks = -(-context_len // chunk_size) if chunk_size else 1
    return max_running_requests * (3 + max_chunks) + 1


def use_overlap_schedule(
    config: EngineConfig, in_process: bool, device: torch.device | None = None
) -> bool:
    """The one-stage loop: overlap where it pays on this device (device.py says where; the
    simulator names the device it simulates), unless --disable-overlap-schedule /
    --enable-overlap-schedule decide."""
    s = config.scheduler
    if s.disable_overlap_schedule or s.enable_overlap_schedule:
        return s.enable_overlap_schedule
    return overlap_schedule_pays(device or resolve_device(config.model.device), in_process)


def worker_ring_size(config: EngineConfig, context_len: int) -> int:
    """Ring size for worker processes: 0 unless the one-stage overlap loop feeds them
    placeholders (under PP the pipeline is the overlap; the two are not combined)."""
    s = config.scheduler
    if config.parallel.pp_size > 1 or not use_overlap_schedule(config, in_process=False):
        return 0
    return ring_size(s.max_running_requests, context_len, s.chunk_size)
