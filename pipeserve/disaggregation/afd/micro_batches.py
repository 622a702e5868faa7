"""Attention-FFN disaggregation's micro-batches: every attention worker runs each step as N
micro-batches whose layers interleave (the strategy `AFD_ATTENTION`), so the FFN workers run
one micro-batch's experts while the attention workers compute the next one's attention.

A batch is cut at request boundaries into N parts of near-equal tokens; a part may be empty
(fewer requests than micro-batches, or one long prompt chunk), and an empty part still runs
its stages and sends its empty rows, so the FFN workers see N micro-batches of every layer
from every attention worker, in the order the attention workers dispatch them: layer by
layer, micro-batch by micro-batch."""

from __future__ import annotations

from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch


def micro_batch_sizes(slices: list[ReqSlice], n: int) -> list[int]:
    """Slices per micro-batch (n of them, in order): micro-batch i ends at the first request
    boundary where the tokens so far reach i + 1 n-ths of the total."""
    total = sum(s.num_tokens for s in slices)
    sizes, done, start = [], 0, 0
    for i in range(1, n):
        goal = total * i / n
        end = start
        while end < len(slices) and done + slices[end].num_tokens <= goal:
            done += slices[end].num_tokens
            end += 1
        sizes.append(end - start)
        start = end
    sizes.append(len(slices) - start)
    return sizes


def split_micro_batches(batch: ScheduledBatch) -> list[ScheduledBatch]:
    """The batch's micro-batches, for the forward (sampling reads the whole batch)."""
    parts, start = [], 0
    for size in batch.micro_batches:
        parts.append(ScheduledBatch(batch.batch_id, batch.slices[start : start + size]))
        start += size
    return parts
