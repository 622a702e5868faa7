"""Expert-parallel dispatch and combine over `torch.distributed.all_to_all_single` with split
sizes: gloo on CPU, NCCL on GPUs; nothing here depends on the device.

Dispatch sends each token once per destination rank (the ranks holding any of its top-k
experts), with that rank's local expert ids and routing weights; combine sends each row's
weighted expert output back, and the token's owner sums the rows from all its ranks.

Each half logs its span (timeline.record_comm) with the layer id; launches carry the bytes
of their Traffic."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

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

ID_BYTES, WEIGHT_BYTES = 8, 4  # long local ids, float32 weights


@dataclass(frozen=True)
class RowLayout:
    """Dispatch moves one byte row per (destination rank, token): the token's local expert ids
    (long), then its routing weights (float32), then its hidden state, padded to 8 bytes so
    each part is an aligned view. One transfer carries all three."""

    k: int
    hidden_size: int
    dtype: torch.dtype

    @property
    def hidden_at(self) -> int:
        size = self.dtype.itemsize
        return -(-self.k * (ID_BYTES + WEIGHT_BYTES) // size) * size

    @property
    def nbytes(self) -> int:
        end = self.hidden_at + self.hidden_size * self.dtype.itemsize
        align = max(ID_BYTES, self.dtype.itemsize)
        return -(-end // align) * align

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, self.nbytes), dtype=torch.uint8, device=device)

    def pack(self, ids: torch.Tensor, weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[R, nbytes] rows of ids [R, k] (long), weights [R, k] and hidden [R, H]."""
        packed = self.empty(hidden.shape[0], hidden.device)
        dst_ids, dst_weights, dst_hidden = self.views(packed)
        dst_ids.copy_(ids)
        dst_weights.copy_(weights)
        dst_hidden.copy_(hidden)
        return packed

    def views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local ids [R, k] long, weights [R, k] float32, hidden [R, H]) sharing `packed`."""
        k, at = self.k, self.hidden_at
        ids = packed[:, : k * ID_BYTES].view(torch.long)
        weights = packed[:, k * ID_BYTES : k * (ID_BYTES + WEIGHT_BYTES)].view(torch.float32)
        end = at + self.hidden_size * self.dtype.itemsize
        return ids, weights, packed[:, at:end].view(self.dtype)


class AllToAllDispatcher(Dispatcher):
    """`rank` is this process's rank in `group` (None: the default group), whose size must be
    the placement's expert-parallel size. `counts_group` (None: `group`) has the same ranks
    and carries only the counts exchange, so that exchange does not queue behind data
    transfers still in flight on `group` (another micro-batch's, under two-batch overlap)."""

    def __init__(
        self,
        placement: ExpertPlacement,
        rank: int,
        group: ProcessGroup | None = None,
        layer: int = -1,
        counts_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(placement, rank, layer)
        self.group = group
        self.counts_group = group if counts_group is None else counts_group
        self._check_group(self.group)
        self._check_group(self.counts_group)
        self._lookups: dict[torch.device, torch.Tensor] = {}  # immutable once built

    def _check_group(self, group: ProcessGroup | None) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (self.placement.ep_size, self.rank):
            raise ValueError(
                f"the dispatcher was given rank {self.rank} of an expert-parallel size of "
                f"{self.placement.ep_size}, but its process group has this process as rank "
                f"{rank} of {size}; build the placement and rank from the ep group"
            )

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        """Blocks on the counts exchange only (ep_size integers, on `counts_group`): the data
        transfer needs its receive sizes when launched. That exchange is launched first and
        runs while the send rows are packed; the data transfer (one, of packed rows) is
        launched without waiting. (Waiting for the counts in dispatch_b would leave the whole
        data transfer to the wait half; launching the data from a completion callback would
        issue collectives from another thread, out of the order all ranks must share.)

        Its "dispatch_launch" span is the whole call: the counts wait is exposed, and so is
        the packing it overlaps."""
        start = now()
        to = self._destinations(topk_ids)
        counts = to.sum(dim=1)  # [ep] long, rows per destination rank
        recv_counts = torch.empty_like(counts)
        counts_work = self._all_to_all(recv_counts, counts, None, None, self.counts_group)
        layout = RowLayout(topk_ids.shape[1], hidden.shape[1], hidden.dtype)
        packed, index = self._outgoing(hidden, topk_ids, topk_weights.float(), to, layout)
        counts_work.wait()
        send, recv = counts.tolist(), recv_counts.tolist()
        received = layout.empty(sum(recv), hidden.device)
        work = self._all_to_all(received, packed, recv, send)
        ids, weights, rows = layout.views(received)
        result = Dispatched(rows, ids, weights, CombinePlan(tuple(send), tuple(recv), index))
        handle = DispatchHandle((work,), result, self._traffic(send, recv, layout.nbytes))
        self._record("dispatch_launch", start, handle.traffic)
        return handle

    def dispatch_b(self, handle: DispatchHandle) -> Dispatched:
        start = now()
        for work in handle.works:
            work.wait()
        record_comm("dispatch_wait", start, self.layer)
        return handle.result

    def combine_a(self, expert_out: torch.Tensor, dispatched: Dispatched) -> CombineHandle:
        """Launches without waiting: its "combine_launch" span is not exposed communication."""
        start = now()
        plan = self._plan_of(expert_out, dispatched)
        returned = self._return_buffer(plan, expert_out)
        work = self._all_to_all(
            returned[:-1], expert_out.contiguous(), plan.send_counts, plan.recv_counts
        )
        row_bytes = expert_out.shape[1] * expert_out.element_size()
        traffic = self._traffic(plan.recv_counts, plan.send_counts, row_bytes)
        self._record("combine_launch", start, traffic)
        return CombineHandle((work,), returned, plan, dispatched.hidden.dtype, traffic)

    def combine_blocks_a(
        self,
        run_rows: Callable[[torch.Tensor], torch.Tensor],
        dispatched: Dispatched,
        blocks: int,
    ) -> CombineHandle:
        """Group b holds the b-th share of every source rank's received rows, so each token's
        owner knows which of its rows come back in which group. The owner lays the returned
        rows out group-major (group 0 from every rank, then group 1, ...): each group's
        transfer fills one contiguous range, and the gather index is renumbered to match."""
        plan = self._plan_of(dispatched.hidden, dispatched)
        returned = self._return_buffer(plan, dispatched.hidden)
        sent, row_bytes = returned.shape[0] - 1, returned.shape[1] * returned.element_size()
        works, order, at = [], [], 0
        for b in range(blocks):
            rows = _block_rows(plan.recv_counts, b, blocks, returned.device)
            back = [_share(n, b, blocks) for n in plan.recv_counts]  # rows to return to each
            mine = [_share(n, b, blocks) for n in plan.send_counts]  # rows back from each
            out = run_rows(rows).to(returned.dtype).contiguous()
            start = now()
            works.append(self._all_to_all(returned[at : at + sum(mine)], out, mine, back))
            self._record("combine_launch", start, self._traffic(back, mine, row_bytes))
            order.append(_block_rows(plan.send_counts, b, blocks, returned.device))
            at += sum(mine)
        position = torch.empty(sent + 1, dtype=torch.long, device=returned.device)
        position[torch.cat(order)] = torch.arange(sent, device=returned.device)
        position[sent] = sent
        regrouped = replace(plan, gather_index=position[plan.gather_index])
        traffic = self._traffic(plan.recv_counts, plan.send_counts, row_bytes)
        return CombineHandle(tuple(works), returned, regrouped, dispatched.hidden.dtype, traffic)

    @staticmethod
    def _return_buffer(plan: CombinePlan, like: torch.Tensor) -> torch.Tensor:
        """[S + 1, H] in `like`'s dtype: the rows coming back, then the all-zero row the
        gather index pads with."""
        sent = sum(plan.send_counts)
        returned = like.new_empty((sent + 1, like.shape[1]))
        returned[sent].zero_()
        return returned

    def combine_b(self, handle: CombineHandle) -> torch.Tensor:
        start = now()
        for work in handle.works:
            work.wait()
        record_comm("combine_wait", start, self.layer)
        return sum_returned(handle)

    def _lookup(self, device: torch.device) -> torch.Tensor:
        if device not in self._lookups:
            self._lookups[device] = self.placement.lookup(device)
        return self._lookups[device]

    def _destinations(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[ep, n] bool: which ranks each token goes to."""
        ep, n = self.placement.ep_size, topk_ids.shape[0]
        dest = self._lookup(topk_ids.device)[0][topk_ids]  # [n, k]
        to = torch.zeros((n, ep), dtype=torch.bool, device=topk_ids.device)
        return to.scatter_(1, dest, True).t()

    def _outgoing(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: torch.Tensor,
        to: torch.Tensor,
        layout: RowLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed send rows, by destination rank then token, and the combine's gather
        index ([n, min(k, ep)], see CombinePlan). A slot whose expert is on another rank
        carries local id -1 and weight 0."""
        rank, token = to.nonzero(as_tuple=True)  # [S] each, by rank then token
        lookup = self._lookup(topk_ids.device)
        ids = topk_ids[token]  # [S, k]
        here = lookup[0][ids] == rank[:, None]
        packed = layout.empty(token.numel(), hidden.device)
        local_ids, local_weights, rows = layout.views(packed)
        local_ids.copy_(torch.where(here, lookup[1][ids], -1))
        local_weights.copy_(torch.where(here, weights[token], 0.0))
        torch.index_select(hidden, 0, token, out=rows)
        slots = min(topk_ids.shape[1], self.placement.ep_size)
        return packed, gather_index(token, topk_ids.shape[0], slots)

    def _plan_of(self, expert_out: torch.Tensor, dispatched: Dispatched) -> CombinePlan:
        if dispatched.plan is None:
            raise ValueError(
                "combine got a dispatch result without a plan (made by another dispatcher)"
            )
        if expert_out.shape[0] != dispatched.hidden.shape[0]:
            raise ValueError(
                f"combine got {expert_out.shape[0]} expert output rows for "
                f"{dispatched.hidden.shape[0]} dispatched rows; give one row per received row"
            )
        return dispatched.plan

    def _all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None,
        input_splits: Sequence[int] | None,
        group: ProcessGroup | None = None,
    ) -> Work:
        """Launch on `group` (None: the data group); None splits: equal parts."""
        out_splits = None if output_splits is None else list(output_splits)
        in_splits = None if input_splits is None else list(input_splits)
        return dist.all_to_all_single(
            output,
            input,
            out_splits,
            in_splits,
            group=self.group if group is None else group,
            async_op=True,
        )

    def _record(self, kind: str, start: float, traffic: Traffic) -> None:
        record_comm(kind, start, self.layer, traffic.bytes_sent, traffic.bytes_recv)

    def _traffic(self, sent: Sequence[int], recv: Sequence[int], row_bytes: int) -> Traffic:
        rows_out, rows_in = sum(sent) - sent[self.rank], sum(recv) - recv[self.rank]
        return Traffic(rows_out, rows_in, rows_out * row_bytes, rows_in * row_bytes)


def _share(n: int, block: int, blocks: int) -> int:
    """Rows of group `block` among n rows cut into `blocks` near-equal consecutive groups."""
    return n * (block + 1) // blocks - n * block // blocks


def _block_rows(
    counts: Sequence[int], block: int, blocks: int, device: torch.device
) -> torch.Tensor:
    """Indices, in a buffer holding `counts[i]` rows per rank i one rank after another, of
    group `block`'s rows of every rank, in rank order."""
    parts, start = [], 0
    for n in counts:
        lo = start + n * block // blocks
        parts.append(torch.arange(lo, lo + _share(n, block, blocks), device=device))
        start += n
    return torch.cat(parts)
