"""The attention worker's side of attention-FFN disaggregation: its MoE layers hold no routed
experts, so dispatch sends every token to the FFN workers holding its experts (one row per
worker, or per expert in 'direct' mode) and posts the receives of their partial sums at once;
the experts step has no rows here, and combine waits for the partial sums and adds them per
token. The FFN side is disaggregation/afd/ffn_worker.py."""

from __future__ import annotations

import torch

from pipeserve.disaggregation.afd.routing import AfdTopology, DispatchMode, plan_dispatch
from pipeserve.disaggregation.afd.transport import post_rows
from pipeserve.distributed.parallel_state import AfdState
from pipeserve.moe.dispatcher.all_to_all import RowLayout
from pipeserve.moe.dispatcher.base import (
    CombineHandle,
    CombinePlan,
    Dispatched,
    Dispatcher,
    DispatchHandle,
    Traffic,
    gather_index,
    sum_returned,
)
from pipeserve.moe.dispatcher.placement import ExpertPlacement
from pipeserve.timeline import now, record_comm


class AfdDispatcher(Dispatcher):
    """`placement` spreads the experts over the FFN workers; this rank is attention worker
    `afd.rank`."""

    def __init__(self, placement: ExpertPlacement, afd: AfdState, layer: int = -1) -> None:
        super().__init__(placement, afd.rank, layer)
        self.afd = afd
        self.topology = AfdTopology.from_flags(afd.attention_size, afd.ffn_size, afd.ffn_nodes)
        self.mode = DispatchMode(afd.dispatch_mode)

    @property
    def local_experts(self) -> tuple[int, ...]:
        return ()

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        start = now()
        plan = plan_dispatch(
            topk_ids, topk_weights, self.rank, self.topology, self.placement, self.mode
        )
        layout = RowLayout(plan.ids.shape[1], hidden.shape[1], hidden.dtype)
        packed = layout.pack(plan.ids, plan.weights, hidden[plan.token])
        works, returned = post_rows(self.afd, packed, plan.counts, hidden)
        rows = packed.shape[0]
        sent = Traffic(rows, 0, rows * layout.nbytes, 0)
        back = Traffic(0, rows, 0, rows * hidden.shape[1] * hidden.element_size())
        index = gather_index(plan.token, plan.num_tokens, topk_ids.shape[1])
        combine = CombinePlan(plan.counts, (), index)
        pending = CombineHandle(tuple(works), returned, combine, hidden.dtype, back)
        nothing = hidden.new_empty((0, hidden.shape[1]))
        no_slots = topk_ids.new_empty((0, topk_ids.shape[1]))
        result = Dispatched(nothing, no_slots, no_slots.float(), None, pending)
        record_comm("dispatch_launch", start, self.layer, sent.bytes_sent, 0)
        return DispatchHandle((), result, sent)

    def dispatch_b(self, handle: DispatchHandle) -> Dispatched:
        return handle.result

    def combine_a(self, expert_out: torch.Tensor, dispatched: Dispatched) -> CombineHandle:
        if dispatched.pending is None:
            raise ValueError("combine got a dispatch result this dispatcher did not make")
        return dispatched.pending

    def combine_b(self, handle: CombineHandle) -> torch.Tensor:
        start = now()
        for work in handle.works:
            work.wait()
        record_comm("combine_wait", start, self.layer, 0, handle.traffic.bytes_recv)
        return sum_returned(handle)
