"""The offline API: `Engine(model_path, **flags).generate(...)`."""

from __future__ import annotations

import gc
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from pipeserve import kernels
from pipeserve.config import EngineConfig, SettingsError, is_refusal
from pipeserve.device import (
    fp8_gemm_unavailable,
    release_cached_memory,
    resolve_device,
    resolve_dtype,
    warn_if_emulated,
    with_compute_dtype,
)
from pipeserve.disaggregation.pd.kv_remap import SideLayout
from pipeserve.engine.backend import Backend, InProcessBackend, WorkerBackend
from pipeserve.mem_cache.host_reservations import Reservation
from pipeserve.mem_cache.host_tier import claim_bytes, with_host_memory
from pipeserve.models.arch import ArchConfig
from pipeserve.models.resolve import resolve_model_path
from pipeserve.runner.kv_layout import kv_bytes_per_token
from pipeserve.scheduler.output import OutputProcessor
from pipeserve.scheduler.request import MAX_TOP_LOGPROBS, Req, SamplingParams
from pipeserve.scheduler.scheduler import RequestUpdate
from pipeserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: Req
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    cached_tokens: int = 0
    ttft: float | None = None
    chunk_sizes: list[int] = field(default_factory=list)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    text: str = ""  # what the server would have streamed: the same output processor's

    def apply(self, u: RequestUpdate) -> None:
        assert self.req.output is not None
        self.text += self.req.output.delta(u).text
        self.output_ids += u.new_token_ids
        self.output_logprobs += u.new_logprobs
        if u.ttft is not None:
            self.ttft, self.cached_tokens = u.ttft, u.cached_tokens
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = u.prompt_logprobs
        if u.finish_reason is not None:
            self.finish_reason, self.matched_stop = u.finish_reason, u.matched_stop
            self.chunk_sizes = u.chunk_sizes or []
            self.error = u.error


class Engine:
    def __init__(self, model_path: str | None = None, **flags: Any) -> None:
        """Raises SettingsError when a start-up check refuses the settings (the flags, the
        model, the layout: `is_refusal`), its message saying what to change."""
        try:
            self._start(model_path, flags)
        except ValueError as exc:
            if isinstance(exc, SettingsError) or not is_refusal(exc):
                raise
            raise SettingsError(str(exc)) from exc

    def _start(self, model_path: str | None, flags: dict[str, Any]) -> None:
        config = with_compute_dtype(EngineConfig.from_flags(model_path=model_path, **flags))
        self.config = with_host_memory(config)
        # the RAM this run will fill, claimed for the host's other pipeserve runs to see
        claim = claim_bytes(self.config)
        what = self.config.model.model_path or "the built-in model"
        self._ram_claim = Reservation(claim, what) if claim else None
        try:
            self._start_backend()
        except BaseException:
            if self._ram_claim is not None:
                self._ram_claim.release()
            raise

    def _start_backend(self) -> None:
        m = self.config.model
        self.model_path = resolve_model_path(m.model_path, m.dtype)
        self.arch = ArchConfig.load(self.model_path)
        compute = resolve_dtype(m.dtype, self.arch.torch_dtype, m.device)
        warn_if_emulated(compute, resolve_device(m.device))
        if m.fp8_weights == "keep":
            reason = fp8_gemm_unavailable(resolve_device(m.device))
            if reason is not None:
                raise ValueError(f"--fp8-weights keep {reason}; use --fp8-weights dequantize")
        if self.arch.quantization is not None:
            kept = "kept in fp8 where the layer allows it" if m.fp8_weights == "keep" else None
            log.info(
                "%s, %s",
                self.arch.quantization.describe(),
                kept or f"dequantised to {str(compute).removeprefix('torch.')} at load",
            )
        self.tokenizer = load_tokenizer(self.config.model, self.model_path)
        self.context_len = self.arch.context_length(self.config.model.context_length)
        if resolve_device(self.config.model.device).type == "cpu":
            kernels.warm_up()  # build once here, before worker processes would each try
        kind = WorkerBackend if self.config.parallel.uses_workers else InProcessBackend
        self.backend: Backend = kind(
            self.config, self.arch, self.model_path, self.tokenizer, self.context_len
        )
        self._log_kv_cache()
        # What exists now (an in-process model, its runner, the tokenizer) lives until
        # shutdown: the collector's full passes no longer walk it (each took ~90 ms in a
        # decode of the built-in model, a stall of one token in ~200); shutdown thaws it.
        # Start-up's garbage goes first, not frozen with the rest
        gc.collect()
        gc.freeze()

    def _log_kv_cache(self) -> None:
        dtype = resolve_dtype(
            self.config.model.dtype, self.arch.torch_dtype, self.config.model.device
        )
        per_layer = kv_bytes_per_token(self.arch, 1, self.config.parallel.tp_size, dtype)
        stats = self.backend.stats()
        ranks = stats["attention_ranks"]
        log.info(
            "KV cache: %s, %d bytes per token and layer on each rank; %d tokens%s",
            "latent (MLA)" if self.arch.mla is not None else "per-head K/V",
            per_layer,
            stats["kv_pages_total"] // ranks * self.config.cache.page_size,
            f" on each of {ranks} data-parallel attention ranks" if ranks > 1 else "",
        )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and give back everything this engine put on its device (KV
        pool, weights, the future-token ring, the allocator's cached blocks), so the next
        engine of this process finds the memory free, though this object may live on. Calls
        after the first do nothing; using the engine after it raises."""
        backend = self.backend
        if isinstance(backend, _ShutDown):
            return
        self.backend = cast(Backend, _ShutDown())
        try:
            backend.shutdown()
        finally:
            if self._ram_claim is not None:
                self._ram_claim.release()
            del backend  # the last reference: pool, model and loop go with it
            gc.unfreeze()  # what startup froze can be collected again
            gc.collect()  # the backend's reference cycles (scheduler <-> chunking hooks)
            release_cached_memory(resolve_device(self.config.model.device))

    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts)."""
        single, token_lists = self._inputs(prompt, input_ids)
        params = self._sampling(sampling_params, len(token_lists))
        reqs = [
            Req(uuid.uuid4().hex, ids, sp, return_logprob)
            for ids, sp in zip(token_lists, params, strict=True)
        ]
        for req in reqs:
            self.validate(req)
        outputs = self.run(reqs)
        return outputs[0] if single else outputs

    def run(self, reqs: list[Req]) -> list[dict[str, Any]]:
        """Submit requests and step until all have finished."""
        pending = {r.rid: _Pending(r) for r in reqs}
        for req in reqs:
            if req.output is None:
                req.output = OutputProcessor.of(req, self.tokenizer)
            req.arrival_time = time.perf_counter()
            self.backend.submit(req)
        left = len(reqs)
        while left:
            for u in self.backend.step():
                p = pending.get(u.rid)
                if p is None:
                    continue
                p.apply(u)
                left -= u.finish_reason is not None
        return [self._result(pending[r.rid]) for r in reqs]

    def kv_layout(self) -> SideLayout:
        """How this engine's ranks hold KV (prefill/decode disaggregation maps between two)."""
        a = self.arch
        tp = self.config.parallel.tp_size
        return SideLayout.of(self.backend.partition, tp, a.num_kv_heads, a.mla is not None)

    def validate(self, req: Req) -> None:
        """Everything that could reject the request, checked before any request of a call is
        submitted (so a bad one never leaves its siblings queued)."""
        vocab = self.arch.vocab_size
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need the tokenizer (--skip-tokenizer-init is on); use stop_token_ids"
            )
        req.sampling.validate()  # the engine's own line of defence (a NaN would fail a step)
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if req.input_ids:  # min and max: C loops (a 1M-token prompt)
            low, high = min(req.input_ids), max(req.input_ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.backend.scheduler.check_request(len(req.input_ids), req.sampling.max_new_tokens)

    def _inputs(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            if self.tokenizer is None:
                raise ValueError("--skip-tokenizer-init: give token ids (input_ids), not text")
            return single, [self.tokenizer.encode(t) for t in texts]
        single = not input_ids or isinstance(input_ids[0], int)
        lists = [input_ids] if single else input_ids
        if not all(isinstance(t, int) for ids in lists for t in ids):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        return single, [list(ids) for ids in lists]

    @staticmethod
    def _sampling(params: Any, n: int) -> list[SamplingParams]:
        if isinstance(params, list):
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(p) for p in params]
        return [SamplingParams.from_dict(params)] * n

    def _result(self, p: _Pending) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text": None if self.tokenizer is None else p.text,
            "output_ids": p.output_ids,
            "meta_info": {
                "id": p.req.rid,
                "prompt_tokens": len(p.req.input_ids),
                "completion_tokens": len(p.output_ids),
                "cached_tokens": p.cached_tokens,
                "finish_reason": p.finish_reason,
                "matched_stop": p.matched_stop,
                "ttft_s": p.ttft,
                "chunk_sizes": p.chunk_sizes,
                **({"error": p.error} if p.error is not None else {}),
            },
        }
        if p.req.return_logprob:
            out["prompt_logprobs"] = p.prompt_logprobs
            out["output_logprobs"] = p.output_logprobs
        return out


class _ShutDown:
    """An engine's backend after `shutdown()`: every use says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the engine is shut down (engine.backend.{name} used after shutdown)")
