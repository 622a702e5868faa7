"""Request checks made before tokenizing or engine work: the model name, the engine's
health, the prompt against the context and the vocabulary, the token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeserve.scheduler.request import SamplingParams
from pipeserve.server import protocol as P
from pipeserve.server.errors import ApiError, unavailable

if TYPE_CHECKING:
    from pipeserve.server.state import ServerState


def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(
            404,
            f"model {name!r} not found; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def check_engine(state: ServerState) -> None:
    if state.client.failure is not None:
        raise unavailable(state.client.failure)


def check_prompt_size(state: ServerState, prompt: str | list[int]) -> None:
    """Reject a prompt that cannot fit the context before tokenizing or admitting it."""
    if isinstance(prompt, str):
        check_prompt_chars(state, len(prompt), "prompt")
    elif len(prompt) >= state.context_len:
        raise _context_exceeded(state, len(prompt), "prompt")


def check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    limit = P.MAX_PROMPT_CHARS_PER_TOKEN * state.context_len
    if chars > limit:
        raise ApiError(
            400,
            f"the prompt has {chars} characters; this model's maximum context length is "
            f"{state.context_len} tokens, which no text over {limit} characters fits "
            f"({P.MAX_PROMPT_CHARS_PER_TOKEN} characters per token)",
            param=param,
            code="context_length_exceeded",
        )


def _context_exceeded(state: ServerState, prompt_len: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"this model's maximum context length is {state.context_len} tokens, but the "
        f"prompt has {prompt_len} tokens",
        param=param,
        code="context_length_exceeded",
    )


def check_vocab(state: ServerState, ids: list[int]) -> None:
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
        )


def sampling_params(body: P._Request, max_new_tokens: int) -> SamplingParams:
    """The request's sampling parameters, validated here, where the request enters: from
    here on a typed value (the engine trusts its types and checks the model's limits)."""
    try:
        return SamplingParams.from_dict(body.sampling(max_new_tokens))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def max_new_tokens(
    state: ServerState, body: P._Request, prompt_len: int, default: int | None, prompt_param: str
) -> int:
    """The request's token budget, checked against the context before it reaches the engine."""
    ctx = state.context_len
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if prompt_len >= ctx:
        raise _context_exceeded(state, prompt_len, prompt_param)
    asked = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if asked is None:
        return min(default, ctx - prompt_len) if default is not None else ctx - prompt_len
    if prompt_len + asked > ctx:
        raise ApiError(
            400,
            f"this model's maximum context length is {ctx} tokens; the prompt has "
            f"{prompt_len} and max_tokens asks for {asked} more",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked
