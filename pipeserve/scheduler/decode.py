"""Decode steps for running requests, with retraction when KV pages run out."""

from __future__ import annotations

from collections.abc import Callable

from pipeserve.scheduler.batch import ReqSlice
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, Status


class DecodeManager:
    def __init__(self, kv: KVManager, on_retract: Callable[[Req], None]) -> None:
        self.kv = kv
        self.running: list[Req] = []  # prompt fully scheduled, in admission order
        self.on_retract = on_retract
        self.num_retracted = 0

    def schedule(self, max_reqs: int, max_inflight: int = 0) -> list[ReqSlice]:
        """One decode step for every ready request (at most `max_reqs`). A request is ready
        when at most `max_inflight` of its forwards are still out (the overlap loop feeds
        the token of the one in flight as a future placeholder)."""
        slices: list[ReqSlice] = []
        for req in list(self.running):
            if len(slices) >= max_reqs:
                break
            if req.status is not Status.RUNNING or req.inflight > max_inflight:
                continue
            if req.inflight and not req.future_slot:
                continue  # in flight, and its token has no placeholder to stand for it
            if len(req.output_ids) + req.inflight >= req.sampling.max_new_tokens:
                continue  # the tokens in flight already reach max_new_tokens
            if self._make_room(req):
                slices.append(self._step(req))
        return slices

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)

    def decode_reserve(self, clip: int, ratio: float) -> int:
        """Tokens the running requests are still expected to need."""
        left = (min(r.sampling.max_new_tokens - len(r.output_ids), clip) for r in self.running)
        return int(sum(max(n, 0) for n in left) * ratio)

    def _step(self, req: Req) -> ReqSlice:
        pos = req.kv_len
        token = req.token_at(pos) if pos < req.seq_len else -req.future_slot
        req.kv_len += 1
        req.inflight += 1
        return ReqSlice(
            rid=req.rid,
            input_ids=[token],
            prefix_len=pos,
            kv_runs=self.kv.kv_runs(req, req.kv_len),
            sample=True,
            sampling=req.sampling,
            return_logprob=req.return_logprob,
            top_logprobs=req.top_logprobs,
        )

    def _make_room(self, req: Req) -> bool:
        """Allocate the next token's page, retracting the most recently admitted idle
        requests while memory is short. False if `req` itself had to go."""
        while not self.kv.allocate(req, 1):
            victim = next((r for r in reversed(self.running) if r.inflight == 0), None)
            if victim is None:
                return False
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req, cache=True)
        req.status = Status.WAITING
        self.num_retracted += 1
        self.on_retract(req)
