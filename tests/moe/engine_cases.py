"""A fixed set of requests for the expert-parallel engine tests: prompts of several lengths
and greedy sampling of several lengths, run through an engine and compared with a reference
run (tokens identical, logprobs within a tolerance)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeserve.engine.engine import Engine


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
