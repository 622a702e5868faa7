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
        posted = post_rows(self.afd, packed, plan.counts, hidden)
        rows = packed.shape[0]
        sent = Traffic(rows, 0, rows * layout.nbytes, 0)
        back = Traffic(0, rows, 0, rows * hidden.shape[1] * hidden.element_size())
        index = _gather_index(plan.token, plan.num_tokens, topk_ids.shape[1])
        combine = CombinePlan(plan.counts, (), index)
        pending = CombineHandle(tuple(posted.works), posted.returned, combine, hidden.dtype, back)
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
        assert handle.plan is not None, "this dispatcher's combine handles carry a plan"
        rows = handle.returned[handle.plan.gather_index]  # [n, slots, H]
        return rows.sum(dim=1, dtype=torch.float32).to(handle.dtype)


def _gather_index(token: torch.Tensor, num_tokens: int, slots: int) -> torch.Tensor:
    """[n, slots]: per token, the positions of its rows (row r belongs to token[r]), in
    ascending order, padded with R (the zero row after the R rows)."""
    rows = token.shape[0]
    index = torch.full((num_tokens, slots), rows, dtype=torch.long, device=token.device)
    if rows == 0:
        return index
    order = token.argsort(stable=True)  # rows grouped by token, ascending within one
    per_token = torch.bincount(token, minlength=num_tokens)
    first = torch.cumsum(per_token, 0) - per_token
    slot = torch.arange(rows, device=token.device) - first[token[order]]
    index[token[order], slot] = order
    return index
