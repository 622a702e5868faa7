"""Two-batch overlap: where a batch is cut into micro-batches A and B, and the two halves.

Pure Python over request slices (the scheduler plans the split, so every data-parallel rank
can agree on it; the model runner cuts the batch it received the same way).

- A decode batch: the requests are split in half (A gets the extra one).
- Otherwise (prompt chunks, possibly with decode steps): the request boundary that best
  balances the tokens. If even that leaves one side less than `threshold` of the tokens, one
  request is cut so that A gets exactly half: A takes its first part, B the rest, which
  attends to A's part as prefix (A runs each layer's attention before B does).
- A batch that cannot give both sides a token runs whole.
"""

from __future__ import annotations

from dataclasses import replace

from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch, TwoBatchSplit, runs_prefix


def plan_split(slices: list[ReqSlice], threshold: float) -> TwoBatchSplit | None:
    """Where to cut `slices` for two-batch overlap; None: too small to split."""
    decode = bool(slices) and all(s.is_decode for s in slices)
    if decode:
        return TwoBatchSplit((len(slices) + 1) // 2, 0, True) if len(slices) >= 2 else None
    total = sum(s.num_tokens for s in slices)
    if total < 2:
        return None
    index, left = balanced_boundary(slices)
    if index is not None and threshold <= left / total <= 1 - threshold:
        return TwoBatchSplit(index, 0, False)
    return half_split(slices, total)


def balanced_boundary(slices: list[ReqSlice]) -> tuple[int | None, int]:
    """The request boundary (0 < i < len) whose token counts are most even, and A's tokens
    there; (None, 0) for a single request."""
    total = sum(s.num_tokens for s in slices)
    best: tuple[int | None, int] = (None, 0)
    left = 0
    for i, s in enumerate(slices[:-1], start=1):
        left += s.num_tokens
        if best[0] is None or abs(2 * left - total) < abs(2 * best[1] - total):
            best = (i, left)
    return best


def half_split(slices: list[ReqSlice], total: int) -> TwoBatchSplit:
    """A gets exactly total // 2 tokens, cutting the request that holds the midpoint (a cut
    at a request's first token is a boundary)."""
    half, start = total // 2, 0
    for i, s in enumerate(slices):
        if start + s.num_tokens > half:
            return TwoBatchSplit(i, half - start, False)
        start += s.num_tokens
    raise AssertionError("the midpoint lies inside the batch")


def split_batch(batch: ScheduledBatch) -> tuple[ScheduledBatch, ScheduledBatch]:
    """Micro-batches A and B of a batch with a `two_batch` split, for the forward (sampling
    reads the whole batch); both keep the batch id."""
    split = batch.two_batch
    assert split is not None, "the batch has no two-batch split"
    a, b = batch.slices[: split.index], batch.slices[split.index :]
    if split.tokens:
        head, tail = cut_slice(b[0], split.tokens)
        a, b = [*a, head], [tail, *b[1:]]
    return ScheduledBatch(batch.batch_id, a), ScheduledBatch(batch.batch_id, b)


def cut_slice(s: ReqSlice, n: int) -> tuple[ReqSlice, ReqSlice]:
    """A request's chunk cut after `n` tokens: the head computes them (and samples nothing),
    the tail the rest after a prefix n tokens longer. Prompt logprob targets go with their
    positions."""
    if not 0 < n < s.num_tokens or s.is_decode:
        raise ValueError(f"cannot cut a {s.num_tokens}-token slice after {n} tokens")
    head = ReqSlice(
        s.rid,
        s.input_ids[:n],
        s.prefix_len,
        runs_prefix(s.kv_runs, s.prefix_len + n),
        sample=False,
        logprob_targets=s.logprob_targets[:n],
        chunk_index=s.chunk_index,
    )
    tail = replace(
        s,
        input_ids=s.input_ids[n:],
        prefix_len=s.prefix_len + n,
        logprob_targets=s.logprob_targets[n:],
    )
    return head, tail
