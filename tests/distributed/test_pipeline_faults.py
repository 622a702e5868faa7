"""Faults under pipeline parallelism (2 stages, real worker processes):

- a request aborted while its prompt chunks are in the pipeline: the others get the tokens
  they get without it, every KV page comes back, and the stages keep no stale state (the
  engine then serves the same prompt, now partly from the prefix cache, correctly);
- a worker killed with SIGKILL (first or last stage): the scheduler raises WorkerError
  within a bounded time and no worker process is left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine
from pipeserve.engine.pipeline_loop import PipelineLoop
from pipeserve.engine.workers import WorkerError
from pipeserve.scheduler.request import Req, SamplingParams, Status
from pipeserve.scheduler.scheduler import RequestUpdate

pytestmark = pytest.mark.timeout(120)

VOCAB = 512
CHUNK = 32
FLAGS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": CHUNK,
                         "max_total_tokens": 4096}
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
DEADLINE_S = 30.0


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LONG, SHORT, OTHER = random_ids(600, 1), random_ids(40, 2), random_ids(150, 3)


def worker_backend(engine: Engine) -> WorkerBackend:
    assert isinstance(engine.backend, WorkerBackend)
    return engine.backend


def greedy(engine: Engine, ids: list[list[int]]) -> list[list[int]]:
    out = engine.generate(input_ids=ids, sampling_params=vars(GREEDY))
    assert isinstance(out, list)
    return [o["output_ids"] for o in out]


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("tiny-qwen3")


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt run alone, in one process."""
    with Engine(str(model), **FLAGS) as engine:
        return {name: greedy(engine, [ids])[0]
                for name, ids in (("long", LONG), ("short", SHORT), ("other", OTHER))}


@pytest.fixture(autouse=True)
def _no_leftover_workers() -> Iterator[None]:
    before = set(mp.active_children())
    yield
    leftover = [p for p in set(mp.active_children()) - before]
    for p in leftover:
        p.kill()
    assert not leftover, f"worker processes left running: {leftover}"


def kill(proc: mp.process.BaseProcess) -> None:
    assert proc.pid is not None and proc.is_alive()
    os.kill(proc.pid, signal.SIGKILL)


class Collector:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def add(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            self.tokens.setdefault(u.rid, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                self.finished[u.rid] = u.finish_reason


@pytest.mark.parametrize("radix", [True, False], ids=["radix-cache", "no-radix-cache"])
def test_abort_in_the_middle_of_a_chunked_prefill(model, reference, radix: bool) -> None:
    with Engine(str(model), **FLAGS, pp_size=2, disable_radix_cache=not radix) as engine:
        backend, seen = worker_backend(engine), Collector()
        assert isinstance(backend.loop, PipelineLoop)
        long, short = Req("long", LONG, GREEDY), Req("short", SHORT, GREEDY)
        backend.submit(long)
        backend.submit(short)
        while long.num_chunks < 5:
            seen.add(backend.step())
        total_chunks = -(-len(LONG) // CHUNK)
        assert long.status is Status.PREFILL and long.num_chunks < total_chunks
        assert long.inflight > 0  # some of its chunks are still in the pipeline
        assert short.status is Status.WAITING  # FCFS: admitted after the chunked prompt
        backend.abort("long")
        while "short" not in seen.finished or backend.loop.inflight:
            seen.add(backend.step())
        assert seen.finished == {"long": "abort", "short": "length"}
        assert seen.tokens.get("long", []) == []
        assert seen.tokens["short"] == reference["short"]
        assert long.num_chunks < total_chunks  # no chunk was scheduled after the abort
        stats = backend.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]
        # The stages hold nothing stale: the aborted prompt (its first chunks now cached
        # when the radix cache is on) and a new one give the tokens they give alone.
        out = engine.generate(input_ids=[LONG, OTHER], sampling_params=vars(GREEDY))
        assert isinstance(out, list)
        assert [o["output_ids"] for o in out] == [reference["long"], reference["other"]]
        if radix:
            assert out[0]["meta_info"]["cached_tokens"] > 0
        stats = backend.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]


@pytest.mark.parametrize("stage", [0, 1], ids=["first-stage", "last-stage"])
def test_killed_worker_raises_and_leaves_no_process(model, stage: int) -> None:
    with Engine(str(model), **FLAGS, pp_size=2) as engine:
        backend = worker_backend(engine)
        procs = list(backend.workers.procs)  # global rank = stage (TP 1)
        req = Req("victim", random_ids(2000, 4), SamplingParams(max_new_tokens=500,
                                                                temperature=0.0,
                                                                ignore_eos=True))
        backend.submit(req)
        for _ in range(3):
            backend.step()
        assert req.num_chunks > 0 and not req.finished
        kill(procs[stage])
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank [01] "):
            while time.monotonic() - start < DEADLINE_S:
                backend.step()
        # The backend shut the pipeline down before raising: every worker is gone.
        assert not any(p.is_alive() for p in procs)
        assert procs[stage].exitcode == -signal.SIGKILL
        assert backend.workers.closed


def test_killed_last_stage_fails_a_running_generate_call(model) -> None:
    """Through the public API: generate() raises instead of waiting forever."""
    with Engine(str(model), **FLAGS, pp_size=2) as engine:
        procs = list(worker_backend(engine).workers.procs)
        killed: list[float] = []

        def kill_when_running() -> None:
            while engine.backend.scheduler.num_running == 0:
                time.sleep(0.005)
            kill(procs[-1])
            killed.append(time.monotonic())

        killer = threading.Thread(target=kill_when_running, daemon=True)
        killer.start()
        with pytest.raises(WorkerError, match=r"worker rank [01] "):
            engine.generate(input_ids=random_ids(2000, 5),
                            sampling_params={"max_new_tokens": 2000, "temperature": 0.0,
                                             "ignore_eos": True})
        killer.join(timeout=5)
        assert killed and time.monotonic() - killed[0] < DEADLINE_S
        assert not any(p.is_alive() for p in procs)
