"""Parallel state: created once per process, read through getters.

Layers never ask torch.distributed who they are; they ask this module. A single process is
the default state (every size 1, every layer on the one stage).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def standalone() -> Iterator[None]:
    """Build a model as if it were the only process (e.g. to time a probe of its layers)."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield
    finally:
        _state = saved


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


@dataclass(frozen=True)
class StageLinks:
    """Point-to-point groups of this rank: to the same TP rank of the previous and next
    stage (a group per link, so sending and receiving never share one)."""

    prev_group: Any = None
    next_group: Any = None
    prev_rank: int | None = None
    next_rank: int | None = None


_links = StageLinks()


def get_stage_links() -> StageLinks:
    return _links


def set_stage_partition(partition: list[int]) -> ParallelState:
    """Fix this stage's layer range once the partition is agreed on."""
    from dataclasses import replace

    from pipeserve.distributed.partition import stage_ranges

    state = replace(_state, layers=stage_ranges(partition)[_state.pp_rank])
    set_parallel_state(state)
    return state


def init_parallel_groups(
    rank: int, tp_size: int, pp_size: int, backend: str, init_method: str, timeout_s: float
) -> ParallelState:
    """Join the process group and create every TP and stage-link group (all ranks create
    all groups, in the same order). Rank layout: pp_rank * tp_size + tp_rank."""
    import datetime

    import torch.distributed as dist

    global _links
    world = tp_size * pp_size
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group, tp_ranks = None, tuple[int, ...]((rank,))
    for stage in range(pp_size):
        ranks = [stage * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group, tp_ranks = group, tuple(ranks)
    links: dict[tuple[int, int], Any] = {}
    for stage in range(pp_size - 1):
        for t in range(tp_size):
            pair = (stage * tp_size + t, (stage + 1) * tp_size + t)
            links[pair] = dist.new_group(list(pair))
    prev_rank = rank - tp_size if pp_rank > 0 else None
    next_rank = rank + tp_size if pp_rank < pp_size - 1 else None
    _links = StageLinks(
        prev_group=links.get((prev_rank, rank)) if prev_rank is not None else None,
        next_group=links.get((rank, next_rank)) if next_rank is not None else None,
        prev_rank=prev_rank,
        next_rank=next_rank,
    )
    state = ParallelState(tp_rank, tp_size, pp_rank, pp_size, None, tp_group, tp_ranks)
    set_parallel_state(state)
    return state
