"""Per-request output assembly on the engine side: text deltas from token ids (whole UTF-8
characters only), stop strings cut exactly (a possible start of a stop string is held back
until it is known not to be one), logprobs and usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.scheduler.scheduler import RequestUpdate
from pipeserve.scheduler.stop_matcher import StopMatcher, automaton_for
from pipeserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class StreamDelta:
    """What a client is sent for one step of one request."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    error: str | None = None
    error_kind: str = "invalid"  # "invalid": the request was rejected; "engine": the engine failed
    prefilled: int | None = None  # a long prompt's progress: prompt tokens computed so far


class OutputStream:
    def __init__(
        self, rid: str, tokenizer: Tokenizer | None, stop: tuple[str, ...], prompt_tokens: int
    ) -> None:
        """`tokenizer` None (--skip-tokenizer-init): deltas carry token ids, no text."""
        self.rid = rid
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.matcher = StopMatcher(automaton_for(stop)) if stop else None
        self.prompt_tokens = prompt_tokens
        self.emitted = 0
        self.completion_tokens = 0

    def apply(self, u: RequestUpdate) -> StreamDelta:
        self.completion_tokens += len(u.new_token_ids)
        delta = self._text(u)
        return StreamDelta(
            self.rid,
            delta,
            list(u.new_token_ids),
            list(u.new_logprobs),
            list(u.new_top_logprobs),
            u.finish_reason,
            u.matched_stop,
            self.prompt_tokens,
            self.completion_tokens,
            u.cached_tokens,
            u.ttft,
            prefilled=u.prefilled,
        )

    def _text(self, u: RequestUpdate) -> str:
        """The text this update adds that may be sent now."""
        if self.detok is None:
            return ""
        self.detok.add(u.new_token_ids)
        done = u.finish_reason is not None
        if done:
            self.detok.flush()
        text = self.detok.text
        end = self._end(text, done, u.matched_stop)
        delta = text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return delta

    def _end(self, text: str, done: bool, matched_stop: str | int | None) -> int:
        """How much of `text` may be sent: before the end, all but a tail that is or could
        still grow into a stop string; at the end, all of it, cut before the stop string
        that ended the request."""
        match = self.matcher.feed(text[self.matcher.fed :]) if self.matcher else None
        if done and isinstance(matched_stop, str):
            if match is not None:
                return match.start
            return text.index(matched_stop) if matched_stop in text else len(text)
        if done or self.matcher is None:
            return len(text)
        return match.start if match is not None else len(text) - self.matcher.held
