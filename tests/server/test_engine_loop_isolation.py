"""One bad request never takes the engine loop down: the loop of the engine process, on the
tiny model in this process (its sockets replaced by a list of what it sends), gets normal
requests mixed with requests carrying hostile values in every field of an AddRequest, one
whose output stream raises and one whose result processing in the scheduler raises. A
hostile value is refused where the request enters (its sampling parameters validated, the
message encoded for the engine) or, if it is well-typed but beyond the model's limits, by
the engine, for that request alone. Each bad request gets its own error; the normal ones
give the offline engine's tokens and text; every KV page is free afterwards."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.distributed.messages import TO_ENGINE, AddRequest, Deltas, FromEngine
from pipeserve.engine.engine import Engine
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.engine_process import EngineLoop

pytestmark = pytest.mark.timeout(180)

FLAGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096, "threads_per_worker": 1}
VOCAB = 512
NEW = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPT = [5, 17, 33, 2, 90]

# rid, input_ids, sampling params, return_logprob, top_logprobs, words the error must hold
HOSTILE: list[tuple[Any, Any, Any, Any, Any, str]] = [
    ("surrogate-stop", PROMPT, {"stop": ["ok", "\ud800"]}, False, 0, "surrogate"),
    ("10k-stops", PROMPT, {"stop": [f"s{i}" for i in range(10_000)]}, False, 0, "at most 16"),
    ("long-stop", PROMPT, {"stop": ["x" * 257]}, False, 0, "at most 256 characters"),
    ("empty-stop", PROMPT, {"stop": [""]}, False, 0, "non-empty strings"),
    ("stop-number", PROMPT, {"stop": 5}, False, 0, "stop"),
    ("stop-dict", PROMPT, {"stop": {"a": 1}}, False, 0, "stop"),
    ("stop-items", PROMPT, {"stop": ["a", 3]}, False, 0, "stop"),
    ("100k-stop-ids", PROMPT, {"stop_token_ids": list(range(100_000))}, False, 0, "at most 256"),
    ("huge-stop-id", PROMPT, {"stop_token_ids": [10**30]}, False, 0, "stop_token_ids"),
    ("stop-id-str", PROMPT, {"stop_token_ids": ["7"]}, False, 0, "stop_token_ids"),
    ("temperature-str", PROMPT, {"temperature": "hot"}, False, 0, "temperature"),
    ("temperature-nan", PROMPT, {"temperature": math.nan}, False, 0, "temperature"),
    ("temperature-neg", PROMPT, {"temperature": -1.0}, False, 0, "temperature"),
    ("temperature-10^400", PROMPT, {"temperature": 10**400}, False, 0, "temperature"),
    ("top-p-nan", PROMPT, {"top_p": math.nan}, False, 0, "top_p"),
    ("min-p-nan", PROMPT, {"min_p": math.nan}, False, 0, "min_p"),
    ("top-k-neg", PROMPT, {"top_k": -7}, False, 0, "top_k"),
    ("top-k-10^400", PROMPT, {"top_k": 10**400}, False, 0, "top_k"),
    ("max-new-neg", PROMPT, {"max_new_tokens": -5}, False, 0, "max_new_tokens"),
    ("max-new-float", PROMPT, {"max_new_tokens": 2.5}, False, 0, "max_new_tokens"),
    ("max-new-huge", PROMPT, {"max_new_tokens": 10**30}, False, 0, "max_new_tokens"),
    ("max-new-big", PROMPT, {"max_new_tokens": 2**62}, False, 0, "context length"),
    ("seed-neg", PROMPT, {"seed": -1}, False, 0, "seed"),
    ("seed-str", PROMPT, {"seed": "7"}, False, 0, "seed"),
    ("ignore-eos-str", PROMPT, {"ignore_eos": "yes"}, False, 0, "ignore_eos"),
    ("unknown-key", PROMPT, {"bogus": 1}, False, 0, "bogus"),
    ("params-list", PROMPT, [["temperature", 0.0]], False, 0, "must be a dict"),
    ("params-str", PROMPT, "temperature=0", False, 0, "must be a dict"),
    ("ids-str", "hello", GREEDY, False, 0, "input_ids"),
    ("ids-mixed", [1, "2"], GREEDY, False, 0, "input_ids"),
    ("ids-float", [1.5], GREEDY, False, 0, "input_ids"),
    ("ids-none", None, GREEDY, False, 0, "input_ids"),
    ("ids-neg", [-1, 3], GREEDY, False, 0, "vocabulary"),
    ("ids-huge", [10**30], GREEDY, False, 0, "input_ids"),
    ("ids-empty", [], GREEDY, False, 0, "empty"),
    ("logprob-str", PROMPT, GREEDY, "yes", 0, "return_logprob"),
    ("top-str", PROMPT, GREEDY, False, "5", "top_logprobs"),
    ("top-huge", PROMPT, GREEDY, True, 10**9, "top_logprobs"),
    ("top-neg", PROMPT, GREEDY, True, -1, "top_logprobs"),
    (12345, PROMPT, GREEDY, False, 0, "rid"),
]
# well-typed, so they reach the engine, which refuses them against its limits
REACH_ENGINE = {"max-new-big", "ids-neg", "ids-empty", "top-huge", "top-neg"}


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (8 + 3 * i,), generator=gen).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model), **FLAGS) as e:
        yield e


class Loop:
    """An EngineLoop driven like its run(): messages handled, then steps until idle."""

    def __init__(self, engine: Engine) -> None:
        self.loop = EngineLoop(engine, None, None, watchdog_timeout=60.0)  # type: ignore[arg-type]
        self.sent: list[FromEngine] = []
        self.loop._send = self.sent.append  # type: ignore[method-assign]
        self.steps = 0
        self.refused: dict[Any, str] = {}  # where it entered: rid -> the error

    def add(self, rid: Any, ids: Any, params: Any, logprob: Any = False, top: Any = 0) -> None:
        """As the HTTP process sends it: its sampling parameters validated, then encoded (a
        ValueError of either refuses it there); decoded and handled by the engine loop."""
        try:
            sampling = SamplingParams.from_dict(params)
            data = TO_ENGINE.encode(AddRequest(rid, ids, sampling, logprob, top))
        except ValueError as exc:  # WireError is one
            self.refused[rid] = str(exc)
            return
        self.loop._handle(TO_ENGINE.decode(data))

    def run(self) -> dict[Any, list[StreamDelta]]:
        sched = self.loop.backend.scheduler
        for _ in range(1000):
            if not sched.has_work():
                break
            self.loop._emit(self.loop.backend.step())
            self.steps += 1
        assert not sched.has_work()
        out: dict[Any, list[StreamDelta]] = defaultdict(list)
        for msg in self.sent:
            assert isinstance(msg, Deltas), msg
            for d in msg.deltas:
                out[d.rid].append(d)
        return out


def normal_requests(engine: Engine) -> list[tuple[list[int], dict[str, Any]]]:
    """Plain greedy ones, one at the limits (16 stop strings of 256 characters, 256 stop
    token ids that never come), one that stops at a string picked from its own text."""
    ps = prompts(4)
    first = engine.generate(input_ids=ps[3], sampling_params=GREEDY)
    text = first["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop, text
    limits = {"stop": ["\u2603" * 256] * 16, "stop_token_ids": [10**6 + i for i in range(256)]}
    return [
        (ps[0], GREEDY),
        (ps[1], GREEDY),
        (ps[2], {**GREEDY, **limits}),
        (ps[3], {**GREEDY, "stop": ["zzzzzz", stop]}),
    ]


def assert_all_pages_free(engine: Engine) -> None:
    kv = engine.backend.scheduler.kv
    if kv.tree is not None:
        assert kv.tree.protected_pages == 0
        kv.tree.evict(kv.allocator.capacity)
    assert kv.allocator.num_free == kv.allocator.capacity


def test_bad_requests_fail_alone(
    engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    normal = normal_requests(engine)
    refs = [engine.generate(input_ids=ids, sampling_params=sp) for ids, sp in normal]
    assert refs[3]["meta_info"]["finish_reason"] == "stop"  # the stop string path is covered
    loop = Loop(engine)
    for i, (ids, sp) in enumerate(normal[:2]):
        loop.add(f"ok-{i}", ids, sp)
    for rid, ids, params, logprob, top, _ in HOSTILE:
        loop.add(rid, ids, params, logprob, top)
    add_failing_requests(loop, monkeypatch)
    for i, (ids, sp) in enumerate(normal[2:], start=2):
        loop.add(f"ok-{i}", ids, sp)
    with caplog.at_level(logging.ERROR):
        out = loop.run()

    for i, ref in enumerate(refs):
        assert_completed(out[f"ok-{i}"], ref)
    for rid, *_, words in HOSTILE:
        if rid in REACH_ENGINE:
            assert_rejected(out[rid], "invalid", words)
        else:
            assert words.lower() in loop.refused[rid].lower(), (rid, loop.refused[rid])
    assert set(loop.refused) == {h[0] for h in HOSTILE} - REACH_ENGINE
    for rid in FAILING:
        assert_rejected(out[rid], "engine", "RuntimeError('injected')")
        assert rid in caplog.text
    assert set(out) == {f"ok-{i}" for i in range(4)} | REACH_ENGINE | set(FAILING)
    assert caplog.text.count("Traceback") >= len(FAILING)
    assert loop.steps < LONG // 2  # the failed requests were aborted, not left running
    assert not loop.loop.streams
    assert_all_pages_free(engine)


LONG = 400  # max_new_tokens of the requests that fail inside the engine
FAILING = ["bad-admit", "bad-stream", "bad-result"]


def add_failing_requests(loop: Loop, monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid requests that fail inside the engine: while admitted (after submission), in
    their output stream, while the scheduler processes their token."""
    long = {**GREEDY, "max_new_tokens": LONG}

    loop.loop.streams = FailsToTrack(loop.loop.streams, "bad-admit")
    loop.add("bad-admit", PROMPT, long)
    loop.add("bad-stream", PROMPT, long)
    loop.loop.streams["bad-stream"].delta = _raise  # type: ignore[method-assign]
    loop.add("bad-result", PROMPT, {**long, "stop": ["qqqq"]})
    loop.loop.streams["bad-result"].add = _raise  # type: ignore[method-assign]


class FailsToTrack(dict):
    """The loop's requests, failing to take one (a failure after its submission)."""

    def __init__(self, streams: dict[str, Any], rid: str) -> None:
        super().__init__(streams)
        self.rid = rid

    def __setitem__(self, key: str, value: Any) -> None:
        if key == self.rid:
            _raise()
        super().__setitem__(key, value)


def _raise(*_: Any) -> Any:
    raise RuntimeError("injected")


def assert_completed(deltas: list[StreamDelta], ref: dict[str, Any]) -> None:
    assert [d.error for d in deltas] == [None] * len(deltas)
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum((d.token_ids for d in deltas), []) == ref["output_ids"]
    assert "".join(d.text for d in deltas) == ref["text"]
    assert deltas[-1].finish_reason == ref["meta_info"]["finish_reason"]
    assert deltas[-1].matched_stop == ref["meta_info"]["matched_stop"]


def assert_rejected(deltas: list[StreamDelta], kind: str, words: str) -> None:
    assert deltas, "no answer"
    final = deltas[-1]
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert (final.finish_reason, final.error_kind) == ("error", kind), final
    assert final.error is not None and words.lower() in final.error.lower(), final.error
