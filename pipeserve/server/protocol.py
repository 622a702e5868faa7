"""OpenAI-compatible request bodies (validated by pydantic; nothing is ever unpickled) and
response builders.

Every string of a body must be encodable as UTF-8 (JSON can carry lone surrogates, which
the tokenizer and the engine cannot take). A field pipeserve does not implement is an error,
except the OpenAI fields in `IGNORED_FIELDS` (accepted, no effect) and those in
`NO_OP_VALUES` given a value that asks for nothing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeserve.scheduler.request import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# OpenAI allows 4 stop strings; the engine checks the same bounds (and its matcher's work
# per token does not grow with their number)
MAX_STOP_CHARS = MAX_STOP_STRING_CHARS
# No tokenizer packs real text tighter than ~16 characters per token, so a prompt longer
# than this many characters per context token cannot fit: rejected before tokenizing it.
MAX_PROMPT_CHARS_PER_TOKEN = 16

# OpenAI fields accepted with any value and no effect.
IGNORED_FIELDS = frozenset({"user", "metadata", "service_tier", "parallel_tool_calls"})
# OpenAI fields pipeserve does not implement, accepted only with a value that asks for nothing.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "best_of": (None, 1),
    "suffix": (None,),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
# The same for the fields of one chat message.
MESSAGE_IGNORED_FIELDS = frozenset({"name", "tool_call_id"})
MESSAGE_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "tool_calls": (None, []),
    "function_call": (None,),
    "refusal": (None,),
}


class FieldError(ValueError):
    """A request field that is rejected with its own message (`param`: its dotted path)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        """Reject strings UTF-8 cannot encode and unsupported fields; drop accepted no-ops."""
        _check_utf8(data)
        if not isinstance(data, dict):
            return data
        data = _drop_accepted(data, cls.model_fields, IGNORED_FIELDS, NO_OP_VALUES, "")
        if isinstance(data.get("messages"), list):
            data["messages"] = [_screen_message(m, i) for i, m in enumerate(data["messages"])]
        return data

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise FieldError(
                "stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise FieldError(
                "stop",
                f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed",
            )
        return stop

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def sampling(self, max_new_tokens: int) -> dict[str, Any]:
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop_list(),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def include_progress(self) -> bool:
        """pipeserve's `stream_options.include_progress`: a `prefill.progress` chunk after each
        prompt chunk but the last (what a client of a prompt of minutes waits on)."""
        return bool(self.stream_options and self.stream_options.get("include_progress"))


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def _check_utf8(body: Any) -> None:
    """Raise FieldError for the first string (or dict key) of `body` that UTF-8 cannot
    encode, i.e. one holding a lone surrogate."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:  # no recursion: a deeply nested body cannot exhaust the stack
        path, value = todo.pop()
        if isinstance(value, str):
            _check_string(path, value, "")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_string(path, key, "a key of ")
                todo.append((_join(path, key), item))
        elif isinstance(value, list):
            todo += [(_join(path, i), item) for i, item in enumerate(value)]


def _check_string(path: str, s: Any, what: str) -> None:
    if not isinstance(s, str) or s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = path or "body"
        raise FieldError(
            where,
            f"{what}{where} is not valid Unicode: it holds the lone surrogate "
            f"\\u{ord(s[exc.start]):04x} at index {exc.start} (send UTF-8 text; a surrogate "
            "must be half of a pair)",
        ) from None


def _screen_message(message: Any, index: int) -> Any:
    if not isinstance(message, dict):
        return message
    fields, where = ChatMessage.model_fields, f"messages.{index}."
    message = _drop_accepted(message, fields, MESSAGE_IGNORED_FIELDS, MESSAGE_NO_OP_VALUES, where)
    if isinstance(message.get("content"), list):
        for i, part in enumerate(message["content"]):
            if isinstance(part, dict):
                _drop_accepted(part, TextPart.model_fields, frozenset(), {}, f"{where}content.{i}.")
    return message


def _join(path: str, key: Any) -> str:
    part = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{path}.{part}" if path else part


def _drop_accepted(
    data: dict[str, Any],
    known: Iterable[str],
    ignored: frozenset[str],
    no_ops: Mapping[str, tuple[Any, ...]],
    where: str,
) -> dict[str, Any]:
    """`data` without the accepted fields that have no effect; FieldError for a field that
    is unknown or asks for something pipeserve does not do."""
    known = set(known)
    for name, value in data.items():
        if name in known or name in ignored:
            continue
        if name in no_ops and value not in no_ops[name]:
            allowed = " or ".join(_json_text(v) for v in no_ops[name])
            raise FieldError(
                where + name,
                f"{where}{name}={_json_text(value)[:80]} is not supported by pipeserve "
                f"(accepted only as {allowed}, which has no effect)",
            )
        if name not in no_ops:
            raise FieldError(
                where + name,
                f"unsupported field {where + name!r}: pipeserve does not implement it; "
                "remove it from the request",
            )
    return {k: v for k, v in data.items() if k in known}


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
