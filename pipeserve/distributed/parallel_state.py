"""Parallel state: created once per process, read through getters.

Layers never ask torch.distributed who they are; they ask this module. A single process is
the default state (every size 1, every layer on the one stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: range | None = None  # this stage's layers; None = all of them
    tp_group: Any = None  # torch.distributed group of this stage's TP ranks
    tp_ranks: tuple[int, ...] = (0,)  # global ranks of that group

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        """Global rank layout: `pp_rank * tp_size + tp_rank`."""
        return pp_rank * self.tp_size + tp_rank


_state = ParallelState()


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def get_parallel_state() -> ParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_size() -> int:
    return _state.pp_size


def is_first_stage() -> bool:
    return _state.is_first_stage


def is_last_stage() -> bool:
    return _state.is_last_stage


def stage_layers(num_layers: int) -> range:
    return _state.layers if _state.layers is not None else range(num_layers)
