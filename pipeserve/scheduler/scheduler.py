"""The scheduler: admits requests, builds each batch, and folds results back into requests.

Pure Python over ints and request objects. Each event loop (plain, overlap, pipeline)
drives the same three calls: `schedule()` -> executor -> `process_result()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeserve.config import SchedulerConfig
from pipeserve.scheduler.batch import BatchResult, ReqSlice, Run, ScheduledBatch
from pipeserve.scheduler.decode import DecodeManager
from pipeserve.scheduler.dynamic_chunking import OnlineRefit
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.output import Detokenizer, OutputProcessor
from pipeserve.scheduler.prefill import (
    DECODE_RESERVE_CLIP,
    DECODE_RESERVE_RATIO,
    ChunkSizer,
    PrefillManager,
)
from pipeserve.scheduler.request import Req, Status

log = logging.getLogger(__name__)


@dataclass
class RequestUpdate:
    """What changed for one request in one step (the unit streamed to the front end)."""

    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_logprobs: list[float] | None = None  # complete, sent once
    cached_tokens: int = 0
    ttft: float | None = None  # seconds from arrival to the first token, sent once
    chunk_sizes: list[int] | None = None  # prefill chunk sizes, sent at the end
    error: str | None = None  # with finish_reason "error": what went wrong
    error_kind: str = "engine"  # "invalid": the request itself (a client error, HTTP 400)
    prefilled: int | None = None  # after a prompt chunk that samples nothing: prompt tokens
    # in the cache so far, cached prefix included (a long prompt's progress)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        context_len: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: Detokenizer | None = None,
        chunk_sizer: ChunkSizer | None = None,
        max_batch_reqs: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`tokenizer`: what a request's output processor decodes its tokens with (None: no
        text, no stop strings); `clock`: what first-token and finish times are read from (the
        simulator's clock is simulated time; requests' arrival times must be on the same
        clock)."""
        self.config = config
        self.clock = clock
        self.kv = kv
        self.context_len = context_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_batch_reqs = max_batch_reqs or config.max_running_requests
        chunk = config.chunk_size
        if chunk_sizer is None and chunk is not None:
            chunk_sizer = lambda _: chunk  # noqa: E731
        self.prefill = PrefillManager(kv, config.max_prefill_tokens, chunk_sizer)
        self.refit: OnlineRefit | None = None  # online refinement of the chunk cost model
        self.stage_busy: list[float] = []  # forward seconds per pipeline stage, cumulative
        self.decode = DecodeManager(kv, on_retract=self.prefill.waiting.appendleft)
        self.reqs: dict[str, Req] = {}
        self._released: list[str] = []
        # batch id -> the requests its slices were made for: a result goes to those objects,
        # not to whatever request holds their id by then (an id reused after an abort)
        self._batch_reqs: dict[int, list[Req]] = {}
        self._batch_ids = itertools.count()

    # -- requests -----------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.check_request(len(req.input_ids), req.sampling.max_new_tokens)
        self._give_output(req)
        self.reqs[req.rid] = req
        self.prefill.waiting.append(req)

    def _give_output(self, req: Req) -> None:
        """The request's output processor, unless its caller gave it one: the scheduler
        hands it every token (it detokenizes and matches stop strings)."""
        if req.output is None:
            req.output = OutputProcessor.of(req, self.tokenizer)

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len + max_new_tokens > self.context_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context length {self.context_len}"
            )
        if prompt_len + max_new_tokens > self.kv.capacity_tokens:
            raise ValueError(
                f"request needs {prompt_len + max_new_tokens} KV tokens but the pool holds "
                f"{self.kv.capacity_tokens}; raise --max-total-tokens or --mem-fraction-static"
            )

    def abort(self, rid: str) -> RequestUpdate | None:
        """Stop a request wherever it is; its pages are freed now."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        return self._finish(req, "abort")

    def has_work(self) -> bool:
        return bool(self.reqs)

    @property
    def num_running(self) -> int:
        return len(self.decode.running) + (self.prefill.chunked is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.prefill.waiting)

    # -- scheduling ---------------------------------------------------------------------

    def schedule(self, max_inflight: int = 0) -> ScheduledBatch | None:
        """The next batch: prefill work first (admission and chunks), decode steps when there
        is none (or alongside, with --enable-mixed-chunk)."""
        room = self.config.max_running_requests - self.num_running
        reserve = self.decode.decode_reserve(DECODE_RESERVE_CLIP, DECODE_RESERVE_RATIO)
        slices = self.prefill.schedule(min(room, self.max_batch_reqs), reserve)
        self.decode.running.extend(self.reqs[s.rid] for s in slices if s.sample)
        if not slices or self.config.enable_mixed_chunk:
            left = self.max_batch_reqs - len(slices)
            slices += self.decode.schedule(left, max_inflight)
        return self._new_batch(slices) if slices else None

    def empty_batch(self) -> ScheduledBatch:
        """A batch with no work, for a data-parallel attention rank that sits a step out while
        its peers run one; it carries the requests released since the last batch."""
        return self._new_batch([])

    def _new_batch(self, slices: list[ReqSlice]) -> ScheduledBatch:
        batch = ScheduledBatch(next(self._batch_ids), slices, self._released)
        batch.cache_ops = self.kv.take_cache_ops()
        self._released = []
        if slices:
            self._batch_reqs[batch.batch_id] = [self.reqs[s.rid] for s in slices]
        return batch

    def renumber(self, batch: ScheduledBatch, batch_id: int) -> None:
        """Give one of this scheduler's batches another id (a micro-batch id shared with other
        schedulers) before it is launched."""
        if batch.batch_id in self._batch_reqs:
            self._batch_reqs[batch_id] = self._batch_reqs.pop(batch.batch_id)
        batch.batch_id = batch_id

    def set_chunking(self, sizer: ChunkSizer | None, refit: OnlineRefit | None = None) -> None:
        """Switch the chunk-size policy (fixed, dynamic, dynamic with online refit)."""
        self.prefill.chunk_sizer = sizer
        self.refit = refit

    def assign_future_slots(self, batch: ScheduledBatch, slots: list[int]) -> None:
        """Overlap loop: where each sampled token of `batch` will be found before it is
        processed (the next batch feeds -slot in its place)."""
        sampling = [s for s in batch.slices if s.sample]
        for s, slot in zip(sampling, slots, strict=True):
            s.future_slot = slot
            req = self.reqs.get(s.rid)
            if req is not None:
                req.future_slot = slot

    # -- prefill/decode disaggregation, decode side ---------------------------------------

    def reserve_transfer(self, req: Req) -> list[Run] | None:
        """Pages for the prompt of a request another server prefills (its KV is written
        there by the transfer); where they are, or None while memory is short. Until
        `start_decoding` the request is not this scheduler's: it only holds the pages."""
        n = len(req.input_ids)
        reserve = self.decode.decode_reserve(DECODE_RESERVE_CLIP, DECODE_RESERVE_RATIO)
        if n + reserve > self.kv.available_tokens() or not self.kv.allocate(req, n):
            self.kv.release(req, cache=False)
            return None
        req.kv_len = n
        return self.kv.kv_runs(req, n)

    def drop_transfer(self, req: Req) -> None:
        """Free the pages of a reserved request that will not decode here."""
        self.kv.release(req, cache=False)

    def start_decoding(
        self, req: Req, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> RequestUpdate:
        """A reserved request whose prompt KV has arrived, with the first token the prefill
        side sampled: it runs from here like one this scheduler prefilled."""
        self._give_output(req)
        self.reqs[req.rid] = req
        req.status = Status.RUNNING
        self.decode.running.append(req)
        return self._append_token_or_fail(req, token, logprob, top)

    # -- results ------------------------------------------------------------------------

    def process_result(self, batch: ScheduledBatch, result: BatchResult) -> list[RequestUpdate]:
        for i, t in enumerate(result.stage_times):
            if i == len(self.stage_busy):
                self.stage_busy.append(0.0)
            self.stage_busy[i] += t
        chunk = batch.single_prompt_chunk
        if self.refit is not None and chunk is not None and result.stage_times:
            self.refit.observe(chunk.prefix_len, chunk.num_tokens, max(result.stage_times))
        updates: list[RequestUpdate] = []
        tops = result.top_logprobs or [[] for _ in result.next_token_ids]
        samples = iter(zip(result.next_token_ids, result.output_logprobs, tops, strict=True))
        owners = self._batch_reqs.pop(batch.batch_id, None)
        for i, (s, prompt_lps) in enumerate(zip(batch.slices, result.prompt_logprobs, strict=True)):
            token, logprob, top = next(samples) if s.sample else (None, None, None)
            req = self.reqs.get(s.rid)
            if req is None or (owners is not None and req is not owners[i]):
                continue  # finished or aborted while this batch was in flight
            req.inflight -= 1
            if s.future_slot and req.future_slot == s.future_slot:
                req.future_slot = 0
            req.prompt_logprobs.extend(prompt_lps)
            if token is not None:
                assert logprob is not None and top is not None
                updates.append(self._append_token_or_fail(req, token, logprob, top))
            elif not s.is_decode:
                updates.append(RequestUpdate(req.rid, prefilled=s.prefix_len + s.num_tokens))
        return updates

    def _append_token_or_fail(
        self, req: Req, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> RequestUpdate:
        """A failure while folding in one request's token (detokenizing, stop matching)
        finishes that request with an error; the others carry on."""
        try:
            return self._append_token(req, token, logprob, top)
        except Exception as exc:
            log.exception("request %s failed while processing its token %d", req.rid, token)
            update = self._finish(req, "error")
            update.error = f"internal error while processing the request's output: {exc!r}"
            return update

    def _append_token(
        self, req: Req, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> RequestUpdate:
        update = RequestUpdate(req.rid)
        if req.first_token_time is None:
            req.first_token_time = self.clock()
            update.ttft = req.first_token_time - req.arrival_time
            update.cached_tokens = req.cached_tokens
            if req.return_logprob:
                update.prompt_logprobs = list(req.prompt_logprobs)
        if req.sampling.max_new_tokens == 0:  # prompt-only request (e.g. for logprobs)
            return self._merge(update, self._finish(req, "length"))
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        update.new_token_ids, update.new_logprobs = [token], [logprob]
        if req.top_logprobs:
            update.new_top_logprobs = [top]
        reason = self._stop_reason(req, token)
        if reason is not None:
            update = self._merge(update, self._finish(req, *reason))
        return update

    def _stop_reason(self, req: Req, token: int) -> tuple[str, str | int | None] | None:
        sp = req.sampling
        # every token goes to the output processor (a stop token's text, if it has any, is
        # the client's, as the text of all generated tokens is)
        matched = req.output.add(token) if req.output is not None else None
        if (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids:
            return "stop", token
        if matched is not None:
            return "stop", matched
        if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= self.context_len:
            return "length", None
        return None

    def _finish(self, req: Req, reason: str, matched: str | int | None = None) -> RequestUpdate:
        req.finish(reason, matched, self.clock())
        self.prefill.remove(req)
        self.decode.remove(req)
        if req.pages or req.last_node is not None:
            self.kv.release(req, cache=True)
        del self.reqs[req.rid]
        self._released.append(req.rid)
        return RequestUpdate(
            req.rid, finish_reason=reason, matched_stop=matched, chunk_sizes=req.chunk_sizes
        )

    @staticmethod
    def _merge(update: RequestUpdate, final: RequestUpdate) -> RequestUpdate:
        update.finish_reason, update.matched_stop = final.finish_reason, final.matched_stop
        update.chunk_sizes = final.chunk_sizes
        return update
