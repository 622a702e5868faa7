"""Dispatch and combine planning for attention-FFN disaggregation: which rows an attention (A)
worker sends to which FFN (F) worker, how two-stage mode forwards them inside an F node, how
the expert outputs are reduced on their way back, and the bytes each link class carries.

Tensor logic only, no communication: a transport sends the rows of a `DispatchPlan` or
`ForwardPlan` in their order (grouped by destination worker); traffic.py counts what they
would move.

Rows a token with k experts turns into, per mode:
- direct: one per selected expert, to the expert's F worker (the spec's counting).
- direct-rank: one per distinct destination F worker, carrying that worker's share of the
  routing (DeepEP's deduplication; the rows of the expert-parallel all-to-all dispatcher).
- two-stage: stage 1, one per distinct destination F node, to the worker of that node with
  the A worker's local index; stage 2, that worker forwards the row to every worker of its
  node holding one of the row's experts (itself included, as a local copy). Stage 2 is
  planned from one source's rows alone, so what has arrived can be forwarded at once.

Combine returns one partial sum (the weighted sum over the worker's experts) per row a worker
computed; in two-stage mode the stage-1 worker first adds up its node's partials, so one
partial per (token, F node) crosses between nodes, and the A worker adds those."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

import torch

from pipeserve.moe.dispatcher.placement import ExpertPlacement


class DispatchMode(StrEnum):
    DIRECT = "direct"
    DIRECT_RANK = "direct-rank"
    TWO_STAGE = "two-stage"


@dataclass(frozen=True)
class AfdTopology:
    """A workers and F workers, never on the same node. F worker f is on F node
    f // ffn_per_node with local index f % ffn_per_node; A worker a has local index
    a % attention_per_node."""

    num_attention: int  # A workers (--afd-attention-size)
    ffn_nodes: int  # F nodes (--afd-ffn-nodes)
    ffn_per_node: int  # F workers per F node (--afd-ffn-size / --afd-ffn-nodes)
    attention_per_node: int | None = None  # A workers per node; None: all on one node

    def __post_init__(self) -> None:
        for what, value in (
            ("--afd-attention-size", self.num_attention),
            ("--afd-ffn-nodes", self.ffn_nodes),
            ("F workers per node (--afd-ffn-size / --afd-ffn-nodes)", self.ffn_per_node),
        ):
            if value < 1:
                raise ValueError(f"{what} is {value}; it must be at least 1")
        per = self.attention_per_node
        if per is not None and (per < 1 or self.num_attention % per):
            raise ValueError(
                f"--afd-attention-per-node {per} does not divide --afd-attention-size "
                f"{self.num_attention}: every attention node needs the same number of workers"
            )

    @classmethod
    def from_flags(
        cls,
        attention_size: int,
        ffn_size: int,
        ffn_nodes: int,
        attention_per_node: int | None = None,
    ) -> AfdTopology:
        """From the worker counts the flags give (F workers in all, not per node)."""
        if ffn_nodes < 1 or ffn_size % ffn_nodes:
            raise ValueError(
                f"--afd-ffn-nodes {ffn_nodes} does not divide --afd-ffn-size {ffn_size}: "
                "every F node needs the same number of workers"
            )
        return cls(attention_size, ffn_nodes, ffn_size // ffn_nodes, attention_per_node)

    @property
    def num_ffn(self) -> int:
        return self.ffn_nodes * self.ffn_per_node

    def node_of(self, f: int) -> int:
        self._check(f, self.num_ffn, "F worker", "--afd-ffn-size")
        return f // self.ffn_per_node

    def local_of(self, f: int) -> int:
        self._check(f, self.num_ffn, "F worker", "--afd-ffn-size")
        return f % self.ffn_per_node

    def attention_local(self, a: int) -> int:
        """A worker a's index within its own node."""
        self._check(a, self.num_attention, "attention worker", "--afd-attention-size")
        return a % (self.attention_per_node or self.num_attention)

    def stage_one_peer(self, a: int, node: int) -> int:
        """The F worker on `node` that A worker a's two-stage rows go to: the one with a's
        local index (modulo the F workers per node)."""
        self._check(node, self.ffn_nodes, "F node", "--afd-ffn-nodes")
        return node * self.ffn_per_node + self.attention_local(a) % self.ffn_per_node

    @staticmethod
    def _check(index: int, size: int, what: str, flag: str) -> None:
        if not 0 <= index < size:
            raise ValueError(f"{what} {index} does not exist: {flag} gives 0..{size - 1}")


@dataclass(frozen=True)
class DispatchPlan:
    """The rows one A worker sends in one step (stage 1 in two-stage mode), grouped by
    destination F worker (ascending), then by token (then by slot in direct mode). No row
    stays local: A workers hold no experts."""

    mode: DispatchMode
    num_tokens: int
    dest: torch.Tensor  # [R] long: the F worker each row goes to
    token: torch.Tensor  # [R] long: the row's token in the A worker's batch
    # [R, slots] long. direct (1 slot), direct-rank (k): the expert's index on `dest`;
    # two-stage (k): the global id of an expert on `dest`'s node. -1: no expert in that slot
    ids: torch.Tensor
    weights: torch.Tensor  # [R, slots] float32 routing weights; 0 where ids is -1
    counts: tuple[int, ...]  # rows per F worker: the per-source counts message

    def rows_to(self, f: int) -> slice:
        """The rows for F worker f (they are consecutive)."""
        start = sum(self.counts[:f])
        return slice(start, start + self.counts[f])


@dataclass(frozen=True)
class ForwardPlan:
    """Two-stage stage 2 on F worker `worker` for the stage-1 rows one source sent it: one row
    per (received row, distinct worker of the node holding one of its experts), grouped by
    destination worker (ascending; `worker` itself included: its local copies), then by
    received row."""

    worker: int
    local: int  # `worker`'s index within its node
    num_received: int
    dest: torch.Tensor  # [R2] long: the F worker (global index) each row goes to
    row: torch.Tensor  # [R2] long: the received row it forwards
    ids: torch.Tensor  # [R2, k] long: the expert's index on `dest`; -1: no expert
    weights: torch.Tensor  # [R2, k] float32; 0 where ids is -1
    counts: tuple[int, ...]  # rows per worker of the node, by local index

    def rows_to(self, local: int) -> slice:
        """The rows for the node's worker with local index `local` (they are consecutive)."""
        start = sum(self.counts[:local])
        return slice(start, start + self.counts[local])

    @property
    def local_copies(self) -> int:
        return self.counts[self.local]


@dataclass(frozen=True)
class _ExpertTables:
    """Per global expert id: its F worker, its index there, its F node, and itself."""

    worker: torch.Tensor
    local: torch.Tensor
    node: torch.Tensor
    identity: torch.Tensor


@lru_cache(maxsize=16)
def _tables(
    placement: ExpertPlacement, topology: AfdTopology, device: torch.device
) -> _ExpertTables:
    worker, local = placement.lookup(device)
    identity = torch.arange(placement.num_experts, device=device)
    return _ExpertTables(worker, local, worker // topology.ffn_per_node, identity)


def _split(
    ids: torch.Tensor,
    weights: torch.Tensor,
    group_of: torch.Tensor,
    carried: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One output row per (input row, distinct group among its experts), grouped by group then
    input row, carrying `carried[e]` and the weight of each of its experts e in that group, -1
    and 0 in the other slots. Slots with id -1 hold no expert. Returns (group, input row,
    ids, weights) of the output rows."""
    valid = ids >= 0
    safe = ids.clamp(min=0)
    group = torch.where(valid, group_of[safe], groups)  # [R, slots]; `groups`: no expert
    to = torch.zeros((ids.shape[0], groups + 1), dtype=torch.bool, device=ids.device)
    to.scatter_(1, group, True)
    dest, row = to[:, :groups].t().nonzero(as_tuple=True)  # by group, then row
    here = group[row] == dest[:, None]
    out_ids = torch.where(here, carried[safe[row]], -1)
    return dest, row, out_ids, torch.where(here, weights[row], 0.0)


def _check_routing(
    ids: torch.Tensor,
    weights: torch.Tensor,
    topology: AfdTopology,
    placement: ExpertPlacement,
    empty_slots: bool,
) -> None:
    """Shapes, placement size and the expert ids' range (-1 allowed where `empty_slots`)."""
    if ids.dim() != 2 or weights.shape != ids.shape:
        raise ValueError(
            f"expert ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
            "[rows, k]"
        )
    if placement.ep_size != topology.num_ffn:
        raise ValueError(
            f"the expert placement spreads experts over {placement.ep_size} ranks but the AFD "
            f"topology has {topology.num_ffn} F workers; place them over the F workers"
        )
    given = ids[ids >= 0] if empty_slots else ids
    if given.numel() and not 0 <= int(given.min()) <= int(given.max()) < placement.num_experts:
        raise ValueError(
            f"expert ids range over {int(given.min())}..{int(given.max())} but the placement "
            f"has experts 0..{placement.num_experts - 1}"
        )


def plan_dispatch(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    a_rank: int,
    topology: AfdTopology,
    placement: ExpertPlacement,
    mode: DispatchMode | str,
) -> DispatchPlan:
    """The rows A worker `a_rank` sends for its tokens' routing (topk_ids [n, k] long global
    expert ids, topk_weights [n, k]); in two-stage mode, stage 1."""
    mode = DispatchMode(mode)
    _check_routing(topk_ids, topk_weights, topology, placement, empty_slots=False)
    peer = topology.attention_local(a_rank) % topology.ffn_per_node
    t = _tables(placement, topology, topk_ids.device)
    weights = topk_weights.float()
    if mode is DispatchMode.DIRECT:
        k = topk_ids.shape[1]
        slots = (topk_ids.reshape(-1, 1), weights.reshape(-1, 1))
        dest, row, ids, w = _split(*slots, t.worker, t.local, topology.num_ffn)
        token = torch.div(row, k, rounding_mode="floor")
    elif mode is DispatchMode.DIRECT_RANK:
        dest, token, ids, w = _split(topk_ids, weights, t.worker, t.local, topology.num_ffn)
    else:
        node, token, ids, w = _split(topk_ids, weights, t.node, t.identity, topology.ffn_nodes)
        dest = node * topology.ffn_per_node + peer
    counts = torch.bincount(dest, minlength=topology.num_ffn).tolist()
    return DispatchPlan(mode, topk_ids.shape[0], dest, token, ids, w, tuple(counts))


def plan_forward(
    ids: torch.Tensor,
    weights: torch.Tensor,
    worker: int,
    topology: AfdTopology,
    placement: ExpertPlacement,
) -> ForwardPlan:
    """Stage 2 on F worker `worker` for the stage-1 rows one source sent it (ids [R, k] global
    expert ids of this node's experts, -1 elsewhere; weights [R, k]), as `plan_dispatch`
    made them. Needs nothing from other sources."""
    node, first = topology.node_of(worker), worker - topology.local_of(worker)
    _check_routing(ids, weights, topology, placement, empty_slots=True)
    t = _tables(placement, topology, ids.device)
    strays = (ids >= 0) & (t.node[ids.clamp(min=0)] != node)
    if strays.any():
        expert = int(ids[strays][0])
        raise ValueError(
            f"F worker {worker} on F node {node} got a stage-1 row with expert {expert} of F "
            f"node {int(t.node[expert])}; a two-stage row carries only its node's experts"
        )
    local_worker = t.worker - first  # in 0..ffn_per_node-1 for this node's experts
    dest, row, out_ids, w = _split(
        ids, weights.float(), local_worker, t.local, topology.ffn_per_node
    )
    counts = torch.bincount(dest, minlength=topology.ffn_per_node).tolist()
    return ForwardPlan(
        worker, worker - first, ids.shape[0], dest + first, row, out_ids, w, tuple(counts)
    )


def weighted_partials(
    outputs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """An F worker's partial sum per row: outputs [R, slots, H] (slot j: the row's hidden state
    through the expert in slot j), ids and weights [R, slots] as the row carries them ->
    [R, H] float32 sum of weight * output over the slots holding an expert (id >= 0); the
    outputs of the other slots are ignored, whatever they hold."""
    held = (ids >= 0)[..., None]
    return torch.where(held, outputs.float() * weights.float()[..., None], 0.0).sum(dim=1)


def reduce_rows(partials: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size, H] float32: out[i] is the sum of partials[r] ([R, H]) over the rows r with
    index[r] == i."""
    out = partials.new_zeros((size, partials.shape[1]), dtype=torch.float32)
    return out.index_add_(0, index, partials.float())


def combine_in_node(plan: ForwardPlan, returned: torch.Tensor) -> torch.Tensor:
    """Two-stage combine on the stage-1 worker: the partials back from its node's workers
    ([R2, H], in `plan`'s row order, its own local copies' included) -> one partial per
    received row, [num_received, H], in `returned`'s dtype (summed in float32)."""
    _check_returned(returned, plan.row.shape[0], "forwarded")
    return reduce_rows(returned, plan.row, plan.num_received).to(returned.dtype)


def combine_at_attention(plan: DispatchPlan, returned: torch.Tensor) -> torch.Tensor:
    """The A worker's combine: the partials back from the F workers ([R, H], in `plan`'s row
    order) -> the routed experts' output per token, [num_tokens, H], in `returned`'s dtype
    (summed in float32)."""
    _check_returned(returned, plan.token.shape[0], "dispatched")
    return reduce_rows(returned, plan.token, plan.num_tokens).to(returned.dtype)


def _check_returned(returned: torch.Tensor, rows: int, what: str) -> None:
    if returned.dim() != 2 or returned.shape[0] != rows:
        raise ValueError(
            f"combine got partials of shape {tuple(returned.shape)} for {rows} {what} rows; "
            "give one [H] partial per row, in the plan's row order"
        )
