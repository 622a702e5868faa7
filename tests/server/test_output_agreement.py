"""The offline engine and the server give the same output for the same request, because
one output processor makes both: a request through `Engine.generate` and the same request
through the engine process's loop (as the HTTP process sends it, over the wire) agree on
text, tokens, logprobs, finish reason and matched stop, for a corpus of stop strings on the
tiny model's random output (a byte-level tokenizer: characters split over tokens, invalid
bytes): one mid-text, overlapping ones (the earliest ending wins), one starting with a
multi-byte character, one across a token boundary, one never reached, and the stop string
kept with include_stop_str_in_output. The text also matches an oracle: the unstopped
output cut at the first stop string."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.distributed.messages import TO_ENGINE, AddRequest, Deltas
from pipeserve.engine.engine import Engine
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.engine_process import EngineLoop

pytestmark = pytest.mark.timeout(180)

FLAGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096, "threads_per_worker": 1}
NEW = 40


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model), **FLAGS) as e:
        yield e


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 512, (6 + 2 * i,), generator=gen).tolist() for i in range(n)]


def served(engine: Engine, ids: list[int], params: dict[str, Any]) -> list[StreamDelta]:
    """The request through the engine process's loop, as the HTTP process sends it."""
    loop = EngineLoop(engine, None, None, watchdog_timeout=60.0)  # type: ignore[arg-type]
    sent: list[Any] = []
    loop._send = sent.append  # type: ignore[method-assign]
    msg = AddRequest("r", ids, SamplingParams.from_dict(params), True, 2)
    loop._handle(TO_ENGINE.decode(TO_ENGINE.encode(msg)))
    while engine.backend.scheduler.has_work():
        loop._emit(engine.backend.step())
    assert all(isinstance(m, Deltas) for m in sent), sent
    return [d for m in sent for d in m.deltas]


def stop_cases(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Stop strings picked from a request's unstopped text (so that they are reached)."""
    n = len(text)
    wide = next((i for i, c in enumerate(text) if ord(c) > 127 and c != "\ufffd"), None)
    cases = [
        ("mid-text", {"stop": [text[n // 2 : n // 2 + 2]]}),
        ("overlapping", {"stop": [text[n // 3 : n // 3 + 4], text[n // 3 + 1 : n // 3 + 3]]}),
        ("across-tokens", {"stop": [text[n // 4 : n // 4 + 3]]}),
        ("never", {"stop": ["\u2603never\u2603"]}),
        ("kept", {"stop": [text[n // 2 : n // 2 + 2]], "include_stop_str_in_output": True}),
    ]
    if wide is not None:
        cases.append(("multi-byte", {"stop": [text[wide : wide + 2]]}))
    return cases


def oracle(text: str, stops: list[str], keep: bool) -> str:
    """`text` cut at the stop string that ends first (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end] if keep else text[: end - len(stop)]
    return text


def test_offline_and_served_outputs_agree(engine: Engine) -> None:
    greedy = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    checked = set()
    for ids in prompts(4):
        full = engine.generate(input_ids=ids, sampling_params=greedy)["text"]
        assert len(full) >= 8, full
        for name, extra in stop_cases(full):
            params = {**greedy, **extra}
            offline = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            deltas = served(engine, ids, params)
            meta = offline["meta_info"]
            assert "".join(d.text for d in deltas) == offline["text"], (name, extra)
            assert sum((d.token_ids for d in deltas), []) == offline["output_ids"], name
            assert sum((d.logprobs for d in deltas), []) == offline["output_logprobs"], name
            final = deltas[-1]
            assert (final.finish_reason, final.matched_stop) == (
                meta["finish_reason"],
                meta["matched_stop"],
            ), name
            keep = bool(extra.get("include_stop_str_in_output"))
            assert offline["text"] == oracle(full, extra["stop"], keep), (name, extra, full)
            if name != "never":
                assert meta["finish_reason"] == "stop" and meta["matched_stop"] in extra["stop"]
            checked.add(name)
    assert {"mid-text", "overlapping", "across-tokens", "never", "kept", "multi-byte"} <= checked
