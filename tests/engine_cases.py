"""A fixed set of requests for the MoE engine tests (expert parallelism, batch overlap,
attention-FFN disaggregation): prompts of several lengths and greedy sampling of several
lengths, run through an engine and compared with a reference run (tokens identical, logprobs
within a tolerance); and a worker killed in the middle of a long prefill."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine
from pipeserve.engine.workers import WorkerError
from pipeserve.scheduler.request import Req, SamplingParams

KILL_DEADLINE_S = 30


def kill_during_prefill(engine: Engine, victim: int, vocab: int) -> None:
    """Kill worker rank `victim` while the engine prefills a 2000-token prompt: the
    scheduler raises WorkerError naming a rank within KILL_DEADLINE_S, and no worker is
    left."""
    backend = engine.backend
    assert isinstance(backend, WorkerBackend)
    procs = list(backend.workers.procs)
    sp = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
    req = Req("victim", torch.randint(0, vocab, (2000,)).tolist(), sp)
    req.arrival_time = time.perf_counter()
    backend.submit(req)
    for _ in range(3):
        backend.step()
    assert req.num_chunks > 0 and not req.finished
    pid = procs[victim].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank \d+ "):
        while time.monotonic() - start < KILL_DEADLINE_S:
            backend.step()
    assert time.monotonic() - start < KILL_DEADLINE_S
    assert not any(p.is_alive() for p in procs)
    assert backend.workers.closed


@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    seed: int
    vocab: int = 512

    def prompts(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randint(0, self.vocab, (n,), generator=gen).tolist()
                for n in self.prompt_lens]

    @property
    def sampling(self) -> list[dict[str, Any]]:
        return [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
                for n in self.new_tokens]

    def run(self, engine: Engine) -> list[dict[str, Any]]:
        out = engine.generate(input_ids=self.prompts(), sampling_params=self.sampling,
                              return_logprob=True)
        assert isinstance(out, list)
        return out

    def references(self, models: dict[str, Path], flags: dict[str, Any]
                   ) -> dict[str, list[dict[str, Any]]]:
        """Each model's outputs from one in-process engine (the oracle of the layouts)."""
        out = {}
        for name, path in models.items():
            with Engine(str(path), **flags) as engine:
                out[name] = self.run(engine)
        return out

    def assert_matches(self, got: list[dict[str, Any]], want: list[dict[str, Any]],
                       atol: float) -> None:
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [len(o["output_ids"]) for o in got] == list(self.new_tokens)
        for key in ("prompt_logprobs", "output_logprobs"):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(torch.tensor(g[key]), torch.tensor(w[key]),
                                           atol=atol, rtol=0)
