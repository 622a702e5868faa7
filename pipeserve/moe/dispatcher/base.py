"""The expert-parallel dispatcher interface and the plain data it hands around.

A MoE layer calls `dispatch_a` (launch) ... `dispatch_b` (wait), runs its local experts on
the rows it got, then `combine_a` (launch) ... `combine_b` (wait). Between a launch and its
wait the caller may compute something else (the other micro-batch under two-batch overlap,
the shared experts under single-batch overlap)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipeserve.moe.dispatcher.placement import ExpertPlacement

if TYPE_CHECKING:
    from torch.distributed import Work


@dataclass(frozen=True)
class Traffic:
    """What one launch moves between this rank and the other ranks, from tensor sizes. The
    slice a rank sends itself is a local copy and is not counted, nor is the counts exchange."""

    rows_sent: int
    rows_recv: int
    bytes_sent: int
    bytes_recv: int


NO_TRAFFIC = Traffic(0, 0, 0, 0)


@dataclass(frozen=True)
class CombinePlan:
    """How the rows a dispatch moved find their way back; kept by `Dispatched` for combine."""

    send_counts: tuple[int, ...]  # rows this rank sent to each rank (one per token and rank)
    recv_counts: tuple[int, ...]  # rows this rank received from each rank
    # [n, slots] long: per token, the rows combine returns for it, in rank order; padded with
    # sum(send_counts), the index of an all-zero row
    gather_index: torch.Tensor


@dataclass(frozen=True)
class Dispatched:
    """What this rank must compute. Received rows are grouped by source rank (0, 1, ...) and,
    within a source, in that source's token order; a token arrives once on every rank that
    holds at least one of its experts, carrying only that rank's share of its routing."""

    hidden: torch.Tensor  # [R, H], the dtype the tokens were dispatched in
    local_ids: torch.Tensor  # [R, k] long: this rank's local expert index; -1: expert elsewhere
    weights: torch.Tensor  # [R, k] float32 routing weights; 0 where local_ids is -1
    plan: CombinePlan | None  # None when nothing moved (expert-parallel size 1)
    # a combine already under way: under attention-FFN disaggregation the experts run on the
    # FFN workers, whose partial sums are awaited from the dispatch on (this rank gets no rows)
    pending: CombineHandle | None = None


@dataclass(frozen=True)
class DispatchHandle:
    """A launched dispatch; the tensors of `result` are valid once `dispatch_b` returns."""

    works: tuple[Work, ...]
    result: Dispatched
    traffic: Traffic


@dataclass(frozen=True)
class CombineHandle:
    """A launched combine; `combine_b` reduces `returned` once the transfer is complete."""

    works: tuple[Work, ...]
    # [S + 1, H] with a plan: the expert outputs back from each rank in send order, then a zero
    # row; without a plan: the combined result itself, [n, H]
    returned: torch.Tensor
    plan: CombinePlan | None
    dtype: torch.dtype  # of the dispatched tokens; combine_b returns this dtype
    traffic: Traffic


class Dispatcher(ABC):
    """Moves each token to the ranks holding its experts and their outputs back to it.

    Launch halves return a handle without waiting for the data; wait halves complete it. An
    instance keeps no buffers between calls, so each micro-batch may own one and several
    launches may be in flight together; every rank must issue the launches of all instances
    on a group in the same order (a collective's place in that order is its identity).
    `layer` names the MoE layer in the communication spans a dispatcher logs (-1: none)."""

    def __init__(self, placement: ExpertPlacement, rank: int, layer: int = -1) -> None:
        self.placement = placement
        self.rank = rank
        self.layer = layer

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's experts; local expert index i is `local_experts[i]`."""
        return self.placement.experts_on(self.rank)

    @abstractmethod
    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        """hidden [n, H], topk_ids [n, k] long global expert ids, topk_weights [n, k]."""

    @abstractmethod
    def dispatch_b(self, handle: DispatchHandle) -> Dispatched: ...

    @abstractmethod
    def combine_a(self, expert_out: torch.Tensor, dispatched: Dispatched) -> CombineHandle:
        """expert_out [R, H]: per received row, its local experts' outputs, already weighted
        and summed."""

    @abstractmethod
    def combine_b(self, handle: CombineHandle) -> torch.Tensor:
        """[n, H] in the dispatched dtype: per original token, in the original order, the sum
        over every rank of what that rank returned for it."""

    def combine_blocks_a(
        self,
        run_rows: Callable[[torch.Tensor], torch.Tensor],
        dispatched: Dispatched,
        blocks: int,
    ) -> CombineHandle:
        """Single-batch overlap of the experts with their combine: compute the expert outputs
        of the received rows in `blocks` groups (`run_rows(row indices) -> [rows, H]`) and
        launch each group's return as soon as it is computed, so it travels while the next
        group is computed. `combine_b` completes it. Here: one group, then `combine_a`."""
        rows = torch.arange(dispatched.hidden.shape[0], device=dispatched.hidden.device)
        return self.combine_a(run_rows(rows), dispatched)

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        return self.dispatch_b(self.dispatch_a(hidden, topk_ids, topk_weights))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self.combine_b(self.combine_a(expert_out, dispatched))


def gather_index(token: torch.Tensor, num_tokens: int, slots: int) -> torch.Tensor:
    """[num_tokens, slots] long: per token, the positions of its rows (row r belongs to token
    `token[r]`), ascending, padded with R (the index of the zero row after the R rows)."""
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


def sum_returned(handle: CombineHandle) -> torch.Tensor:
    """A completed combine with a plan: per token, the sum (in float32) of the rows that came
    back for it, in the dispatched dtype."""
    assert handle.plan is not None, "combine handles with rows to sum carry a plan"
    rows = handle.returned[handle.plan.gather_index]  # [n, slots, H]
    return rows.sum(dim=1, dtype=torch.float32).to(handle.dtype)
