"""Single-batch overlap: inside one MoE layer, a transfer in flight while the rank computes.

Modes (`--single-batch-overlap-modes`, comma-separated):
- `combine-down`: the experts run in blocks of received rows and each block's combine is
  launched as soon as the block is computed (`Dispatcher.combine_blocks_a`), so the return of
  one block travels while the next is computed. Every rank must run as many blocks, so the
  scheduler decides per step (`combine_down_blocks`: blocks only for steps with at least
  `--single-batch-overlap-min-tokens` tokens on some rank; small decode steps would pay a
  transfer's latency per block) and the batch carries the count;
- `dispatch-shared`: the shared experts run while the dispatch is in flight;
- `combine-shared`: the shared experts run while the combine is in flight.
The shared experts run once, so the two shared modes exclude each other; given both,
dispatch-shared is used. Without single-batch overlap each transfer is waited for before the
next computation. On a CPU the launched collective runs on gloo's own threads while this
thread computes; on CUDA the same launch/wait halves sit on the communication stream.

The setting is process-wide, like the parallel state: the model runner sets it once, MoE
layers read it when they order their operations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeserve.config import ParallelConfig

MODES = ("combine-down", "dispatch-shared", "combine-shared")
DEFAULT_MODES = "combine-down,dispatch-shared"
DOWN_BLOCKS = 4  # combine-down: groups of received rows per MoE layer


@dataclass(frozen=True)
class SingleBatchOverlap:
    down_blocks: int = 1  # > 1: combine-down with this many blocks
    shared_after: str | None = None  # "dispatch_a" | "combine_a": where the shared experts run

    @classmethod
    def from_modes(cls, text: str) -> SingleBatchOverlap:
        modes = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise ValueError(
                f"--single-batch-overlap-modes {text!r}: give one or more of {', '.join(MODES)}"
            )
        shared = (
            "dispatch_a"
            if "dispatch-shared" in modes
            else "combine_a"
            if "combine-shared" in modes
            else None
        )
        return cls(DOWN_BLOCKS if "combine-down" in modes else 1, shared)

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> SingleBatchOverlap:
        if not parallel.enable_single_batch_overlap:
            return OFF
        return cls.from_modes(parallel.single_batch_overlap_modes)


OFF = SingleBatchOverlap()
# the running forward's setting and combine-down blocks (the scheduler decides those), set
# by its model runner for the forward's duration, on its thread
_setting: ContextVar[SingleBatchOverlap] = ContextVar("single_batch_overlap", default=OFF)
_step_blocks: ContextVar[int] = ContextVar("combine_down_blocks", default=1)


def combine_down_blocks(down_blocks: int, min_tokens: int, batch_tokens: list[int]) -> int:
    """The combine-down blocks of one step, the same on every rank: `down_blocks` when some
    rank's batch has at least `min_tokens` tokens, else 1 (a few rows per block would add a
    transfer's latency per block and hide nothing)."""
    return down_blocks if max(batch_tokens, default=0) >= min_tokens else 1


@contextmanager
def overlapping(setting: SingleBatchOverlap, blocks: int = 1) -> Iterator[None]:
    """`setting` and a step's combine-down blocks for the forward run inside."""
    tokens = _setting.set(setting), _step_blocks.set(blocks)
    try:
        yield
    finally:
        _setting.reset(tokens[0])
        _step_blocks.reset(tokens[1])


def get_step_blocks() -> int:
    return _step_blocks.get()


def get_single_batch_overlap() -> SingleBatchOverlap:
    return _setting.get()
