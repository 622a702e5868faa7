"""Data-parallel attention: one scheduler per attention rank, one micro-batch id for all.

Under expert parallelism (--ep-size E) a pipeline stage has E ranks. Each holds the whole
attention (and dense layers), its own KV cache and its own requests; the routed experts are
split over them, so every MoE layer moves tokens between the E ranks. This front keeps a
`Scheduler` per attention rank (its KV pool, radix cache and chunking), gives each new request
to one rank for its whole life, and at every step builds one batch per rank under a shared
micro-batch id. A rank with nothing to do gets an empty batch: it still runs the step, which
for it is its experts' share of the others' tokens (every rank must issue the same collectives
in the same order). With one rank this is a thin wrapper of one scheduler (TP and PP layouts).

Which rank takes a request: the one where it adds least to the work in hand, counting a
rank's load as the prompt tokens it has still to compute plus the KV tokens its live requests
hold (what a decode step reads), and the request's own cost there as its prompt less the prefix
that rank has cached. Ties go to the rank with fewer requests, then the lower rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pipeserve.batch_overlap.single_batch import combine_down_blocks
from pipeserve.batch_overlap.two_batch import plan_split
from pipeserve.disaggregation.afd.micro_batches import micro_batch_sizes
from pipeserve.scheduler.batch import BatchResult, ScheduledBatch, TwoBatchSplit
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler


@dataclass
class BatchGroup:
    """One micro-batch: a batch per attention rank, all under `batch_id` (empty: idle)."""

    batch_id: int
    batches: list[ScheduledBatch]

    @property
    def num_samples(self) -> int:
        return sum(b.num_samples for b in self.batches)


def rank_load(s: Scheduler) -> int:
    """Tokens of work a rank has in hand: prompt tokens still to compute, and KV tokens held
    by its requests (cached pages nobody holds do not count: they can be evicted)."""
    kv = s.kv
    evictable = kv.tree.evictable_pages if kv.tree else 0
    held = (kv.allocator.capacity - kv.allocator.num_free - evictable) * kv.page_size
    queued = sum(r.seq_len - r.kv_len for r in s.prefill.waiting)
    return queued + s.prefill.remaining_prompt_tokens() + held


def plan_two_batch(batches: list[ScheduledBatch], threshold: float, min_tokens: int = 0) -> None:
    """Split every rank's batch for two-batch overlap, or none of them: the ranks' MoE layers
    exchange tokens, so all must run the same micro-batches and the same strategy (decode
    only when every rank's batch is decode steps). No split unless some rank's batch has at
    least `min_tokens` tokens: each micro-batch reads every weight again, which a small step
    (a decode step of a few dozen requests) pays for with little communication to hide."""
    if max((b.num_tokens for b in batches), default=0) < min_tokens:
        return
    splits = [plan_split(b.slices, threshold) for b in batches]
    if any(s is None for s in splits):
        return
    decode = all(s.decode for s in splits if s is not None)
    for b, s in zip(batches, splits, strict=True):
        assert s is not None
        b.two_batch = TwoBatchSplit(s.index, s.tokens, decode)


class DataParallelScheduler:
    def __init__(
        self,
        ranks: list[Scheduler],
        two_batch_threshold: float | None = None,
        combine_down: tuple[int, int] = (1, 0),
        two_batch_min_tokens: int = 0,
        micro_batches: int = 1,
    ) -> None:
        """`two_batch_threshold`: plan two-batch overlap with this token-distribution
        threshold (None: off), in steps where some rank has `two_batch_min_tokens` tokens or
        more. `micro_batches`: attention-FFN disaggregation runs every rank's batch as this
        many micro-batches. `combine_down`: (blocks, min tokens) of single-batch overlap's
        combine-down mode (blocks 1: off)."""
        if not ranks:
            raise ValueError("data-parallel attention needs at least one scheduler")
        self.ranks = ranks
        self.two_batch_threshold = two_batch_threshold
        self.two_batch_min_tokens = two_batch_min_tokens
        self.micro_batches = micro_batches  # attention-FFN disaggregation's, per step
        self.combine_down = combine_down
        self.owner: dict[str, int] = {}  # request id -> attention rank, while it lives
        self._batch_ids = itertools.count()

    # -- requests -----------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        if req.rid in self.owner:
            raise ValueError(f"request id {req.rid!r} is already in use")
        rank = self.pick_rank(req)
        self.ranks[rank].add_request(req)
        self.owner[req.rid] = rank

    def pick_rank(self, req: Req) -> int:
        if len(self.ranks) == 1:
            return 0

        def cost(rank: int) -> tuple[int, int, int]:
            s = self.ranks[rank]
            new = len(req.input_ids) - s.kv.cached_prefix_tokens(req.input_ids)
            return rank_load(s) + new, len(s.reqs), rank

        return min(range(len(self.ranks)), key=cost)

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        self.ranks[0].check_request(prompt_len, max_new_tokens)  # every rank has the same pool

    def abort(self, rid: str) -> RequestUpdate | None:
        rank = self.owner.pop(rid, None)
        return None if rank is None else self.ranks[rank].abort(rid)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.ranks)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.ranks)

    # -- micro-batches ------------------------------------------------------------------

    def schedule(self, max_inflight: int = 0) -> BatchGroup | None:
        """Every rank's next batch under one id; None when no rank has work."""
        found = [s.schedule(max_inflight) for s in self.ranks]
        if all(b is None for b in found):
            return None
        batch_id = next(self._batch_ids)
        batches = [
            s.empty_batch() if b is None else b for s, b in zip(self.ranks, found, strict=True)
        ]
        for s, b in zip(self.ranks, batches, strict=True):
            s.renumber(b, batch_id)
        if self.two_batch_threshold is not None:
            plan_two_batch(batches, self.two_batch_threshold, self.two_batch_min_tokens)
        # two-batch overlap already hides the combine: blocks would only add transfers
        # (measured across a 1 Gbit/s link: TBO + blocks 1.18x, TBO alone 1.39x)
        split = any(b.two_batch is not None for b in batches)
        tokens = [] if split else [b.num_tokens for b in batches]
        blocks = combine_down_blocks(*self.combine_down, tokens)
        for b in batches:
            b.combine_blocks = blocks
            if self.micro_batches > 1:
                b.micro_batches = micro_batch_sizes(b.slices, self.micro_batches)
        return BatchGroup(batch_id, batches)

    def assign_future_slots(self, group: BatchGroup, slots: list[int]) -> None:
        """`slots` holds one slot per sampled token of the group, in rank order."""
        start = 0
        for s, b in zip(self.ranks, group.batches, strict=True):
            s.assign_future_slots(b, slots[start : start + b.num_samples])
            start += b.num_samples

    def process_result(self, group: BatchGroup, results: list[BatchResult]) -> list[RequestUpdate]:
        """`results`: each rank's result of the group, in rank order."""
        updates: list[RequestUpdate] = []
        for rank, (s, b, r) in enumerate(zip(self.ranks, group.batches, results, strict=True)):
            if r.batch_id != group.batch_id:
                raise RuntimeError(
                    f"attention rank {rank} returned the result of micro-batch {r.batch_id}, "
                    f"expected {group.batch_id}"
                )
            updates += s.process_result(b, r)
        for u in updates:
            if u.finish_reason is not None:
                self.owner.pop(u.rid, None)
        return updates
