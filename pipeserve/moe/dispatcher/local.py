"""Expert-parallel size 1: every expert is on this rank and nothing moves, so MoE layers keep
one code path whatever the parallel layout."""

from __future__ import annotations

import torch

from pipeserve.moe.dispatcher.base import (
    NO_TRAFFIC,
    CombineHandle,
    Dispatched,
    Dispatcher,
    DispatchHandle,
)
from pipeserve.moe.dispatcher.placement import ExpertPlacement


class LocalDispatcher(Dispatcher):
    """Dispatch hands the tokens back as they are (local ids are the global ids); combine
    returns its input. Nothing moves, so no communication spans are logged."""

    def __init__(self, num_experts: int, layer: int = -1) -> None:
        super().__init__(ExpertPlacement.contiguous(num_experts, 1), 0, layer)

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        result = Dispatched(hidden, topk_ids, topk_weights.float(), None)
        return DispatchHandle((), result, NO_TRAFFIC)

    def dispatch_b(self, handle: DispatchHandle) -> Dispatched:
        return handle.result

    def combine_a(self, expert_out: torch.Tensor, dispatched: Dispatched) -> CombineHandle:
        return CombineHandle((), expert_out, None, dispatched.hidden.dtype, NO_TRAFFIC)

    def combine_b(self, handle: CombineHandle) -> torch.Tensor:
        return handle.returned.to(handle.dtype)
