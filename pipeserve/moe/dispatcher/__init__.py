"""Expert-parallel dispatchers: one interface (base.py), an all-to-all backend and the
ep-size-1 pass-through, and the expert -> rank placement they share."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from pipeserve.moe.dispatcher.all_to_all import AllToAllDispatcher
from pipeserve.moe.dispatcher.base import (
    CombineHandle,
    CombinePlan,
    Dispatched,
    Dispatcher,
    DispatchHandle,
    Traffic,
)
from pipeserve.moe.dispatcher.local import LocalDispatcher
from pipeserve.moe.dispatcher.placement import ExpertPlacement

__all__ = [
    "AllToAllDispatcher",
    "CombineHandle",
    "CombinePlan",
    "DispatchHandle",
    "Dispatched",
    "Dispatcher",
    "ExpertPlacement",
    "LocalDispatcher",
    "Traffic",
    "make_dispatcher",
]


def make_dispatcher(
    placement: ExpertPlacement,
    rank: int = 0,
    group: ProcessGroup | None = None,
    layer: int = -1,
    counts_group: ProcessGroup | None = None,
) -> Dispatcher:
    """The dispatcher for this rank of the expert-parallel group. `layer` names its MoE layer
    in the timeline's communication spans; `counts_group` carries the counts exchange (None:
    `group`)."""
    if placement.ep_size == 1:
        return LocalDispatcher(placement.num_experts, layer)
    return AllToAllDispatcher(placement, rank, group, layer, counts_group)
