"""Prefill admission: queued requests enter under a token budget, long prompts in chunks.

At most one request is mid-prompt at a time (FCFS): its next chunk goes first in every
prefill batch, and while it is chunked no one else is admitted behind it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipeserve.scheduler.batch import ReqSlice
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, Status

# Admission keeps room for the decode tokens that running requests are still expected to
# produce: min(remaining max_new_tokens, CLIP) * RATIO each. Retraction handles misses.
DECODE_RESERVE_CLIP = 4096
DECODE_RESERVE_RATIO = 0.4

ChunkSizer = Callable[[Req], int]  # how many prompt tokens the next chunk of req may hold


class PrefillManager:
    def __init__(
        self, kv: KVManager, max_prefill_tokens: int, chunk_sizer: ChunkSizer | None
    ) -> None:
        """`chunk_sizer` None: no chunking; a prompt that does not fit the rest of the batch's
        budget waits for the next batch (alone in a batch, it may exceed the budget)."""
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_sizer = chunk_sizer
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None

    def schedule(self, room: int, decode_reserve: int) -> list[ReqSlice]:
        """Slices for one prefill batch; `room` = how many more requests may hold KV. With
        chunking, the whole batch holds at most one chunk's worth of tokens (the next chunk of
        the first request in line): the prompt that follows a finishing one fills the rest of
        that chunk instead of making the batch larger, so micro-batches stay even."""
        budget, slices = self.max_prefill_tokens, list[ReqSlice]()
        first = self.chunked or (self.waiting[0] if self.waiting else None)
        if first is not None and self.chunk_sizer is not None:
            budget = min(budget, self.chunk_sizer(first))
        if self.chunked is not None:
            s = self._next_chunk(self.chunked, budget)
            if s is None or self.chunked is not None:
                return [s] if s else []
            slices.append(s)
            budget -= s.num_tokens
        while self.waiting and room > 0 and budget > 0:
            req = self.waiting[0]
            self.kv.match_prefix(req)
            s = (
                self._next_chunk(req, budget, first=not slices)
                if self._fits(req, decode_reserve)
                else None
            )
            if s is None:
                self.kv.release(req, cache=False)
                break
            self.waiting.popleft()
            self.kv.record_admission(req)
            slices.append(s)
            room, budget = room - 1, budget - s.num_tokens
            if self.chunked is not None:
                break
        return slices

    def remaining_prompt_tokens(self) -> int:
        req = self.chunked
        return 0 if req is None else req.seq_len - req.kv_len

    def remove(self, req: Req) -> None:
        if self.chunked is req:
            self.chunked = None
        elif req in self.waiting:
            self.waiting.remove(req)

    def _fits(self, req: Req, decode_reserve: int) -> bool:
        need = req.seq_len - req.kv_len + self.remaining_prompt_tokens() + decode_reserve
        return need <= self.kv.available_tokens()

    def _next_chunk(self, req: Req, budget: int, first: bool = True) -> ReqSlice | None:
        remaining = req.seq_len - req.kv_len
        if self.chunk_sizer is not None:
            n = min(remaining, self.chunk_sizer(req), budget)
        else:
            n = remaining if remaining <= budget or first else 0
        if n <= 0 or not self.kv.allocate(req, n):
            return None
        start = req.kv_len
        req.kv_len += n
        final = req.kv_len == req.seq_len
        req.status = Status.RUNNING if final else Status.PREFILL
        self.chunked = None if final else req
        req.inflight += 1
        req.num_chunks += 1
        req.chunk_sizes.append(n)
        self.kv.cache_prefix(req)
        return ReqSlice(
            rid=req.rid,
            input_ids=req.seq[start : start + n],
            prefix_len=start,
            kv_runs=self.kv.kv_runs(req, req.kv_len),
            sample=final,
            sampling=req.sampling if final else None,
            return_logprob=req.return_logprob,
            top_logprobs=req.top_logprobs,
            logprob_targets=_logprob_targets(req, start, n),
            chunk_index=req.num_chunks - 1,
            kv_dest=req.kv_dest,
        )


def _logprob_targets(req: Req, start: int, n: int) -> list[int]:
    """Next-token ids of the chunk's leading positions whose prompt logprob is still owed."""
    if not req.wants_prompt_logprobs:
        return []
    end = min(start + n, len(req.input_ids) - 1)
    return req.input_ids[start + 1 : end + 1]
