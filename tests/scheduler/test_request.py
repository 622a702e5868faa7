"""SamplingParams.from_dict (the API's sampling options) and Req's derived state."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pipeserve.scheduler.request import Req, SamplingParams, Status


def test_defaults() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_lists_become_tuples_and_a_single_stop_string_is_wrapped() -> None:
    sp = SamplingParams.from_dict({"stop": "END", "stop_token_ids": [3, 4], "max_new_tokens": 0})
    assert sp.stop == ("END",)
    assert sp.stop_token_ids == (3, 4)
    assert sp.max_new_tokens == 0
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict({"stop": None, "stop_token_ids": None}) == SamplingParams()


@pytest.mark.parametrize(
    ("params", "greedy"),
    [({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"temperature": 0.7}, False)],
)
def test_greedy(params: dict[str, Any], greedy: bool) -> None:
    assert SamplingParams.from_dict(params).greedy is greedy


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter\\(s\\): max_tokens, topp"):
        SamplingParams.from_dict({"topp": 0.5, "max_tokens": 3})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be a non-negative integer, got -1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"temperature": math.inf}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 \\(off\\) or a positive integer, got -2"),
        ({"top_k": 2.0}, "top_k must be an integer, got 2.0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"stop": ""}, "stop must be a list of non-empty strings"),
        ({"stop": ["ok", 3]}, "stop must be a list of non-empty strings"),
        ({"seed": "7"}, "seed must be an integer"),
    ],
)
def test_invalid_values_are_rejected(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


@pytest.mark.parametrize("params", [{"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"min_p": 1.0}])
def test_boundary_values_are_accepted(params: dict[str, Any]) -> None:
    SamplingParams.from_dict(params)


@pytest.mark.parametrize("params", [{"temperature": "hot"}, {"top_p": "0.9"}, {"stop": 5}])
def test_wrong_types_are_reported_as_value_errors(params: dict[str, Any]) -> None:
    (key,) = params
    with pytest.raises(ValueError, match=key):
        SamplingParams.from_dict(params)


def test_req_sequence_and_finish() -> None:
    req = Req("r", [1, 2, 3], SamplingParams())
    req.output_ids += [7, 8]
    assert req.seq == [1, 2, 3, 7, 8] and req.seq_len == 5
    assert [req.token_at(p) for p in range(5)] == [1, 2, 3, 7, 8]
    req.finish("stop", 8)
    assert req.finished and req.status is Status.FINISHED
    assert (req.finish_reason, req.matched_stop) == ("stop", 8)
    assert req.finish_time is not None


def test_prompt_logprobs_are_owed_until_every_prompt_position_has_one() -> None:
    req = Req("r", [1, 2, 3], SamplingParams(), return_logprob=True)
    assert req.wants_prompt_logprobs
    req.prompt_logprobs += [-1.0, -2.0]
    assert not req.wants_prompt_logprobs
    assert not Req("q", [1, 2, 3], SamplingParams()).wants_prompt_logprobs
