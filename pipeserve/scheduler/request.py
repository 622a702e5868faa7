"""Requests and their sampling parameters: plain Python state, no tensors."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from pipeserve.disaggregation.pd.kv_remap import KVDestination

if TYPE_CHECKING:
    from pipeserve.scheduler.output import OutputProcessor

GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (0, 2**63 - 1)
# Limits on what one request may ask for (the HTTP layer checks the same ones).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20  # most likely tokens whose logprobs one step may return
MAX_INT32 = 2**31 - 1  # bound of token ids and top_k (both become int32/float32 tensors)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before

    @property
    def greedy(self) -> bool:
        """Temperatures too small to sample stably (below 1e-5) count as greedy."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling parameters must be a dict, got {type(params).__name__}")
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = set(params) - known
        if unknown:
            names = ", ".join(sorted(map(str, unknown)))
            raise ValueError(f"unknown sampling parameter(s): {names}")
        if isinstance(params.get("stop"), str):
            params["stop"] = (params["stop"],)
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
            elif isinstance(params[key], list | tuple):
                params[key] = tuple(params[key])
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        """Raise ValueError naming the first field that is of the wrong type or out of range."""
        _check_types(self)
        _check_ranges(self)
        _check_stop_strings(self.stop)
        _check_stop_token_ids(self.stop_token_ids)


_NUMBER_FIELDS = {
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "max_new_tokens": int,
    "top_k": int,
}


def _check_types(sp: SamplingParams) -> None:
    for name, kind in _NUMBER_FIELDS.items():
        value = getattr(sp, name)
        ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if not ok or isinstance(value, bool):
            raise ValueError(
                f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}"
            )
    if not isinstance(sp.stop, tuple) or not isinstance(sp.stop_token_ids, tuple):
        raise ValueError("stop and stop_token_ids must be lists")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in sp.stop_token_ids):
        raise ValueError("stop_token_ids must be a list of integers")
    if sp.seed is not None and (not isinstance(sp.seed, int) or isinstance(sp.seed, bool)):
        raise ValueError(f"seed must be an integer, got {sp.seed!r}")
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if not isinstance(getattr(sp, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(sp, name)!r}")


def _check_ranges(sp: SamplingParams) -> None:
    seed_ok = sp.seed is None or SEED_RANGE[0] <= sp.seed <= SEED_RANGE[1]
    checks = [
        ("max_new_tokens", sp.max_new_tokens >= 0, "must be a non-negative integer"),
        ("temperature", _finite(sp.temperature) and sp.temperature >= 0, "must be >= 0"),
        ("top_p", 0 < sp.top_p <= 1, "must be in (0, 1]"),
        ("top_k", sp.top_k >= -1, "must be -1 (off) or a positive integer"),
        ("top_k", sp.top_k <= MAX_INT32, f"must be at most {MAX_INT32}"),
        ("min_p", 0 <= sp.min_p <= 1, "must be in [0, 1]"),
        ("seed", seed_ok, "must be in [0, 2**63 - 1]"),
    ]
    for name, ok, rule in checks:
        if not ok:
            raise ValueError(f"{name} {rule}, got {getattr(sp, name)!r}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _check_stop_strings(stop: tuple[str, ...]) -> None:
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError("stop must be a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one "
                f"of {len(s)}: {s[:20]!r}..."
            )
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"stop string {s!r} is not valid Unicode text (a lone surrogate at position "
                f"{exc.start}); send whole characters"
            ) from None


def _check_stop_token_ids(ids: tuple[int, ...]) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}")
    bad = next((t for t in ids if not 0 <= t <= MAX_INT32), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids must be token ids in [0, {MAX_INT32}], got {bad}")


class Status(Enum):
    WAITING = "waiting"  # queued, holds no KV
    PREFILL = "prefill"  # prompt being computed chunk by chunk
    RUNNING = "running"  # prompt scheduled in full; generating
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs: int = 0  # also return the k most likely tokens' logprobs at each step
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length", "stop", "abort", "error"
    matched_stop: str | int | None = None
    # KV cache (owned by the KV manager)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose KV is written or scheduled to be written
    cached_pages: int = 0  # leading pages shared with the radix tree
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    last_node: Any = None  # radix node the request holds a lock on
    # progress
    inflight: int = 0  # scheduled forwards whose results have not come back
    future_slot: int = 0  # overlap loop: ring slot that will hold the token in flight
    num_chunks: int = 0  # prefill chunks scheduled so far
    chunk_sizes: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # prefill/decode disaggregation, prefill side: where the prompt's KV is sent
    kv_dest: KVDestination | None = None
    # tokens -> the client's text and stop strings (the scheduler gives one if none is set)
    output: OutputProcessor | None = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def seq(self) -> list[int]:
        return self.input_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        n = len(self.input_ids)
        return self.input_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and len(self.prompt_logprobs) < len(self.input_ids) - 1

    def finish(
        self, reason: str, matched: str | int | None = None, at: float | None = None
    ) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.matched_stop = matched
        self.finish_time = time.perf_counter() if at is None else at
