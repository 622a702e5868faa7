"""One request's output as its client sees it, made in one place for the HTTP server and the
offline `Engine.generate`, so the two agree by construction.

The scheduler hands each generated token to the request's `OutputProcessor` as it appends
it (`add`): the token is detokenized once, by one step of the tokenizer's own incremental
decoder (`tokenizers`' DecodeStream: whole UTF-8 characters only, a character split over
tokens waits for its last byte), and the new text is fed once to the request's stop-string
matcher (stop_matcher.py), which tells the scheduler whether the request has stopped. The
engine then turns each update into the client's `StreamDelta` (`delta`): the text that may
be sent now, all of it but a tail that is or could still grow into a stop string, and at
the end everything up to the stop string (or through it, `include_stop_str_in_output`).

Tokens that decode to no text (special tokens, or bytes that never become a character)
are waited on for MAX_HELD_TOKENS tokens at most; their text is then taken as it decodes
(replacement characters), which keeps the decoder's window, and its work, bounded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pipeserve.scheduler.stop_matcher import StopMatcher, automaton_for

if TYPE_CHECKING:
    from pipeserve.scheduler.request import Req
    from pipeserve.scheduler.scheduler import RequestUpdate

MAX_HELD_TOKENS = 8  # tokens without text before their bytes are taken as they decode
CONTEXT_TOKENS = 4  # tokens a restarted decoder is given first (leading spaces, merges)


class TextStream(Protocol):
    def step(self, token_id: int) -> str | None: ...


class Detokenizer(Protocol):
    """What the processor needs of a tokenizer (pipeserve.tokenizer.Tokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self) -> TextStream: ...


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


class OutputProcessor:
    def __init__(
        self,
        rid: str,
        tokenizer: Detokenizer | None,
        stop: tuple[str, ...] = (),
        prompt_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        """`tokenizer` None (--skip-tokenizer-init, the simulator): token ids, no text."""
        self.rid, self.tokenizer = rid, tokenizer
        self.prompt_tokens, self.include_stop = prompt_tokens, include_stop
        self.matcher = StopMatcher(automaton_for(tuple(stop))) if stop and tokenizer else None
        self.ids: list[int] = []
        self.text = ""  # the text of the tokens so far (whole characters)
        self.sent = 0  # characters of it the deltas have carried
        self.completion_tokens = 0
        self._stream = tokenizer.decode_stream() if tokenizer is not None else None
        self._read = 0  # tokens whose text is in self.text

    @classmethod
    def of(cls, req: Req, tokenizer: Detokenizer | None) -> OutputProcessor:
        """The processor of a request, as its sampling parameters ask."""
        sp = req.sampling
        return cls(req.rid, tokenizer, sp.stop, len(req.input_ids), sp.include_stop_str_in_output)

    def add(self, token: int) -> str | None:
        """A generated token, in order: its text decoded and matched; the stop string the
        text has reached, if any (once matched, it stays)."""
        self.ids.append(token)
        if self._stream is None:
            return None
        piece = self._stream.step(token)
        if piece is not None:
            self._read = len(self.ids)
        elif len(self.ids) - self._read >= MAX_HELD_TOKENS:
            piece = self._take_held()
        if piece:
            self._extend(piece)
        return self.matched

    @property
    def matched(self) -> str | None:
        match = self.matcher.match if self.matcher is not None else None
        return None if match is None else match.stop

    def delta(self, u: RequestUpdate) -> StreamDelta:
        """The client's view of one update of this request (its tokens were `add`ed)."""
        self.completion_tokens += len(u.new_token_ids)
        done = u.finish_reason is not None
        if done and self._read < len(self.ids) and self._stream is not None:
            self._extend(self._take_held(final=True))  # a character cut off by the end
        end = self._end(done, u.matched_stop)
        text = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return StreamDelta(
            self.rid,
            text,
            u.new_token_ids,
            u.new_logprobs,
            u.new_top_logprobs,
            u.finish_reason,
            u.matched_stop,
            self.prompt_tokens,
            self.completion_tokens,
            u.cached_tokens,
            u.ttft,
            prefilled=u.prefilled,
        )

    def _extend(self, piece: str) -> None:
        self.text += piece
        if self.matcher is not None:
            self.matcher.feed(piece)

    def _end(self, done: bool, matched_stop: str | int | None) -> int:
        """How much of the text may be sent: before the end, all but a tail that is or could
        still grow into a stop string; at the end all of it, cut at the stop string that
        ended the request."""
        match = self.matcher.match if self.matcher is not None else None
        if match is not None and (not done or isinstance(matched_stop, str)):
            return match.end if self.include_stop else match.start
        if done or self.matcher is None:
            return len(self.text)
        return len(self.text) - self.matcher.held

    def _take_held(self, final: bool = False) -> str:
        """The text of the tokens the decoder holds, as they decode after the tokens before
        them (context). Unless `final`, a character still incomplete at the end (its last
        bytes may be on their way: at most 3 tokens) stays held. The decoder starts again
        after what was taken, given that context where it decodes whole (nothing of it comes
        out twice), then the tokens still held."""
        tok = self.tokenizer
        assert tok is not None
        start = self._read
        context = self.ids[max(0, start - CONTEXT_TOKENS) : start]
        held = self.ids[start:]
        before, after = tok.decode(context), tok.decode(context + held)
        take = len(held)
        if not final and after.endswith("\ufffd"):
            take = max(0, len(held) - 3)  # none ends whole: the last 3 may begin a character
            for keep in range(1, min(3, len(held)) + 1):
                if not tok.decode(context + held[: len(held) - keep]).endswith("\ufffd"):
                    take = len(held) - keep
                    break
            after = tok.decode(context + held[:take])
        piece = after[len(os.path.commonprefix([before, after])) :]
        self._read = start + take
        self._stream = tok.decode_stream()
        if not after.endswith("\ufffd"):  # else the new decoder would give it again
            for t in self.ids[max(0, self._read - CONTEXT_TOKENS) : self._read]:
                self._stream.step(t)
        for j in range(take, len(held)):  # the tokens still held go on in the new decoder
            late = self._stream.step(held[j])
            if late is not None:
                piece += late
                self._read = start + j + 1
        return piece
