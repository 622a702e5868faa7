"""The bytes attention-FFN disaggregation moves per link class (between nodes, inside an F
node), counted from the plans routing.py makes, so the routing harness
(benchmarks/afd_routing.py) and the benchmark count what a transport would send."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from pipeserve.disaggregation.afd.routing import (
    AfdTopology,
    DispatchMode,
    DispatchPlan,
    plan_dispatch,
    plan_forward,
)
from pipeserve.moe.dispatcher.all_to_all import ID_BYTES, WEIGHT_BYTES
from pipeserve.moe.dispatcher.placement import ExpertPlacement

COUNT_BYTES = 8  # one int64 row count per (sender, receiver) pair and step


@dataclass(frozen=True)
class Link:
    """Rows and bytes on one link class."""

    rows: int = 0
    nbytes: int = 0

    def __add__(self, other: Link) -> Link:
        return Link(self.rows + other.rows, self.nbytes + other.nbytes)


@dataclass(frozen=True)
class LinkTraffic:
    """What one A worker's step moves, per link class; in two-stage mode its rows' stage 2 and
    in-node combine are counted with it. The rows a worker keeps for itself (stage 2's local
    copies) are in no class. The counts messages (COUNT_BYTES per sender and receiver, a
    zero count included) are kept apart from the data rows: `counts_*` count values."""

    dispatch_between_nodes: Link = field(default_factory=Link)
    dispatch_inside_node: Link = field(default_factory=Link)
    combine_between_nodes: Link = field(default_factory=Link)
    combine_inside_node: Link = field(default_factory=Link)
    counts_between_nodes: Link = field(default_factory=Link)
    counts_inside_node: Link = field(default_factory=Link)
    local_copies: int = 0

    def __add__(self, other: LinkTraffic) -> LinkTraffic:
        return LinkTraffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def between_nodes(self) -> Link:
        """Data rows (dispatch and combine) between nodes, counts messages not included."""
        return self.dispatch_between_nodes + self.combine_between_nodes

    @property
    def inside_node(self) -> Link:
        return self.dispatch_inside_node + self.combine_inside_node


def dispatch_row_bytes(slots: int, hidden: int, dtype: torch.dtype) -> int:
    """A dispatch row: the hidden state, then one long id and one float32 weight per routing
    slot (direct mode: 1 slot, the others: k). Unpadded: a transport packing rows as the
    all-to-all dispatcher does aligns each to 8 bytes, at most 7 more."""
    return hidden * dtype.itemsize + slots * (ID_BYTES + WEIGHT_BYTES)


def count_traffic(
    topk_ids: torch.Tensor,
    a_rank: int,
    topology: AfdTopology,
    placement: ExpertPlacement,
    mode: DispatchMode | str,
    hidden: int,
    dtype: torch.dtype,
) -> LinkTraffic:
    """Rows and bytes A worker `a_rank`'s step moves, from the plans `plan_dispatch` (and in
    two-stage mode `plan_forward` on every destination) make for topk_ids [n, k]."""
    weights = torch.ones(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
    plan = plan_dispatch(topk_ids, weights, a_rank, topology, placement, mode)
    rows, slots = plan.ids.shape
    out_row = hidden * dtype.itemsize
    between = LinkTraffic(
        dispatch_between_nodes=Link(rows, rows * dispatch_row_bytes(slots, hidden, dtype)),
        combine_between_nodes=Link(rows, rows * out_row),
    )
    if plan.mode is not DispatchMode.TWO_STAGE:
        return between + LinkTraffic(counts_between_nodes=_counts(topology.num_ffn))
    forwarded, copies = _stage_two_rows(plan, topology, placement)
    peers = topology.ffn_nodes * (topology.ffn_per_node - 1)  # stage-2 counts receivers
    return between + LinkTraffic(
        dispatch_inside_node=Link(forwarded, forwarded * dispatch_row_bytes(slots, hidden, dtype)),
        combine_inside_node=Link(forwarded, forwarded * out_row),
        counts_between_nodes=_counts(topology.ffn_nodes),
        counts_inside_node=_counts(peers),
        local_copies=copies,
    )


def _counts(values: int) -> Link:
    return Link(values, values * COUNT_BYTES)


def _stage_two_rows(
    plan: DispatchPlan, topology: AfdTopology, placement: ExpertPlacement
) -> tuple[int, int]:
    """(rows forwarded to another worker of the node, local copies) over all of a two-stage
    plan's destinations."""
    forwarded = copies = 0
    for f in range(topology.num_ffn):
        rows = plan.rows_to(f)
        if rows.stop > rows.start:
            fwd = plan_forward(plan.ids[rows], plan.weights[rows], f, topology, placement)
            forwarded += fwd.row.shape[0] - fwd.local_copies
            copies += fwd.local_copies
    return forwarded, copies
