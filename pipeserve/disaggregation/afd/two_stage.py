"""Two-stage dispatch on an FFN worker (`--afd-dispatch-mode two-stage`). An attention worker
sends each token once per FFN node, to the node's worker with its own local index (stage 1;
the row carries the token's experts of that node, global ids). That worker forwards each
row to the workers of its node holding those experts (stage 2), source by source as the rows
arrive; every worker runs its experts on what it holds (its own copies and what its node
peers forwarded), returns the partial sums to the worker that forwarded them, and that one
adds them up per row (`combine_in_node`) and returns one partial sum per row to the attention
worker: one row per token and node crosses between nodes each way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed import Work

from pipeserve.disaggregation.afd.routing import (
    AfdTopology,
    ForwardPlan,
    combine_in_node,
    plan_forward,
)
from pipeserve.disaggregation.afd.transport import (
    COUNT_TAG,
    ROWS_TAG,
    Experts,
    irecv,
    isend,
)
from pipeserve.distributed.parallel_state import AfdState
from pipeserve.moe.dispatcher.all_to_all import RowLayout
from pipeserve.moe.dispatcher.placement import ExpertPlacement
from pipeserve.timeline import now, record_comm

FWD_COUNT_TAG, FWD_ROWS_TAG, FWD_PARTIAL_TAG = 3, 4, 5
FORWARD_KIND = "afd_in_node"  # trace spans of rows and partial sums sent inside the node


@dataclass
class Arrived:
    """One (layer, micro-batch) on this worker after stage 1 and the forwards it sent."""

    plans: list[ForwardPlan]  # per attention worker: its stage-1 rows' stage 2
    counts: list[int]  # stage-1 rows per attention worker
    own: list[torch.Tensor]  # per attention worker: this worker's own copies, packed
    works: list[Work] = field(default_factory=list)  # forwards in flight


class TwoStage:
    def __init__(
        self,
        afd: AfdState,
        placement: ExpertPlacement,
        layout: RowLayout,
        device: torch.device,
    ) -> None:
        self.afd, self.placement, self.layout, self.device = afd, placement, layout, device
        self.topology = AfdTopology.from_flags(afd.attention_size, afd.ffn_size, afd.ffn_nodes)
        self.local = self.topology.local_of(afd.rank)
        first = afd.rank - self.local
        self.node = [afd.global_rank(first + j) for j in range(self.topology.ffn_per_node)]

    def receive(self) -> Arrived:
        """Stage 1 from every attention worker, each source's rows forwarded as they come
        (the receiver thread runs this)."""
        a_size = self.afd.attention_size
        sizes = torch.empty(a_size, dtype=torch.long, device=self.device)
        for a in range(a_size):
            irecv(sizes[a : a + 1], a, self.afd.group, COUNT_TAG).wait()
        arrived = Arrived([], sizes.tolist(), [])
        for a, n in enumerate(arrived.counts):
            packed = self.layout.empty(n, self.device)
            if n:
                irecv(packed, a, self.afd.group, ROWS_TAG).wait()
            self._forward(packed, arrived)
        return arrived

    def _forward(self, packed: torch.Tensor, arrived: Arrived) -> None:
        start, sent = now(), 0
        ids, weights, hidden = self.layout.views(packed)
        plan = plan_forward(ids, weights, self.afd.rank, self.topology, self.placement)
        arrived.plans.append(plan)
        sizes = torch.tensor(plan.counts, dtype=torch.long, device=self.device)
        for j, peer in enumerate(self.node):
            part = plan.rows_to(j)
            rows = self.layout.pack(plan.ids[part], plan.weights[part], hidden[plan.row[part]])
            if j == self.local:
                arrived.own.append(rows)
                continue
            arrived.works.append(isend(sizes[j : j + 1], peer, self.afd.group, FWD_COUNT_TAG))
            if rows.shape[0]:
                arrived.works.append(isend(rows, peer, self.afd.group, FWD_ROWS_TAG))
                sent += rows.nbytes
        record_comm(FORWARD_KIND, start, -1, sent, 0)

    def serve(self, run: Experts, arrived: Arrived) -> tuple[torch.Tensor, list[Work]]:
        """Stage 2 on this worker and the combine inside the node: the partial sums of the
        stage-1 rows ([rows of every attention worker, in order, H]) for the attention
        workers, and the sends to the node peers still in flight."""
        peers = [j for j in range(len(self.node)) if j != self.local]
        got = {j: self._receive_forwarded(j) for j in peers}  # per peer: per source rows
        blocks = [*arrived.own, *(rows for j in peers for rows in got[j])]
        packed = torch.cat(blocks) if blocks else self.layout.empty(0, self.device)
        ids, weights, hidden = self.layout.views(packed)
        partials = run(hidden, weights, ids)
        sizes = [b.shape[0] for b in blocks]
        pieces = list(torch.split(partials, sizes)) if sizes else []
        own, works = pieces[: len(arrived.own)], []
        at, start, back = len(arrived.own), now(), 0
        for j in peers:  # the partial sums of what each peer forwarded, back to it
            for piece in pieces[at : at + len(got[j])]:
                if piece.shape[0]:
                    works.append(isend(piece, self.node[j], self.afd.group, FWD_PARTIAL_TAG))
                    back += piece.nbytes
            at += len(got[j])
        record_comm(FORWARD_KIND, start, -1, back, 0)
        stage_one = [
            combine_in_node(plan, self._returned(plan, own[a], peers, partials))
            for a, plan in enumerate(arrived.plans)
        ]
        for work in arrived.works:
            work.wait()
        empty = partials.new_empty((0, partials.shape[1]))
        return torch.cat(stage_one) if stage_one else empty, works

    def _receive_forwarded(self, j: int) -> list[torch.Tensor]:
        """Per attention worker, in order: the rows node peer j forwarded to this worker."""
        out = []
        for _ in range(self.afd.attention_size):
            size = torch.empty(1, dtype=torch.long, device=self.device)
            irecv(size, self.node[j], self.afd.group, FWD_COUNT_TAG).wait()
            rows = self.layout.empty(int(size), self.device)
            if rows.shape[0]:
                irecv(rows, self.node[j], self.afd.group, FWD_ROWS_TAG).wait()
            out.append(rows)
        return out

    def _returned(
        self, plan: ForwardPlan, own: torch.Tensor, peers: list[int], like: torch.Tensor
    ) -> torch.Tensor:
        """[R2, H] partial sums of one source's forwarded rows, in the plan's row order: this
        worker's own, then each peer's (received back)."""
        returned = like.new_empty((plan.row.shape[0], like.shape[1]))
        returned[plan.rows_to(self.local)] = own
        for j in peers:
            part = plan.rows_to(j)
            if part.stop > part.start:
                irecv(returned[part], self.node[j], self.afd.group, FWD_PARTIAL_TAG).wait()
        return returned
