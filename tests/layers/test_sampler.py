"""The sampler's cuts (layers/sampler.py `_filtered_probs`) against the whole-vocabulary sort
they replace where they can: the same distribution to the bit for every mix of temperature,
top-k, top-p and min-p in a batch; the sort runs only where a row asks for top-p or min-p
without top-k, `topk` over the k best where every row has a top-k, neither without cuts; and
seeded draws follow."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeserve.layers.sampler import Sampler
from pipeserve.scheduler.request import SamplingParams

VOCAB = 5000


def sorted_cuts(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The cuts over the whole vocabulary sorted by probability (the code before, but for
    top-p 1)."""
    vocab = logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[:, None]

    probs = torch.softmax(logits / column([p.temperature for p in params]), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    drop = rank >= column([p.top_k if p.top_k > 0 else vocab for p in params])
    # top-p 1 cuts nothing (the code before dropped tail tokens where the cumulative sum
    # rounded past 1)
    top_p = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p
    drop |= sorted_p < sorted_p[:, :1] * column([p.min_p for p in params])
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


def params(**cut: Any) -> SamplingParams:
    return SamplingParams(temperature=cut.pop("temperature", 0.8), **cut)


BATCHES = {
    "no cuts": [params(), params(temperature=1.3)],
    "top-k": [params(top_k=40), params(top_k=7, temperature=1.1)],
    "top-k with top-p and min-p": [params(top_k=50, top_p=0.9), params(top_k=20, min_p=0.05)],
    "top-k past the vocabulary": [params(top_k=VOCAB + 10), params(top_k=3)],
    "top-p": [params(top_p=0.95), params()],
    "min-p": [params(min_p=0.1)],
    "some rows top-k, some top-p": [params(top_k=10), params(top_p=0.8)],
    "some rows top-k, the others no cut": [params(top_k=10), params()],
}


class Calls:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        for name in ("sort", "topk"):
            method = getattr(torch.Tensor, name)

            def counted(t: torch.Tensor, *a: Any, _m: Any = method, _n: str = name, **k: Any):
                self.names.append(_n)
                return _m(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_cuts_are_the_whole_sort_s(monkeypatch: pytest.MonkeyPatch, batch: str) -> None:
    rows = BATCHES[batch]
    logits = 3 * torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(7))
    want = sorted_cuts(logits, rows)
    calls = Calls(monkeypatch)
    got = Sampler(0, torch.device("cpu"))._filtered_probs(logits, rows)
    assert torch.equal(got, want)
    sorts = {
        "no cuts": [],
        "top-k": ["topk"],
        "top-k with top-p and min-p": ["topk"],
        "top-k past the vocabulary": ["sort"],  # a row without a real top-k: the whole sort
        "top-p": ["sort"],
        "min-p": ["sort"],
        "some rows top-k, some top-p": ["sort"],
        "some rows top-k, the others no cut": ["sort"],
    }
    assert calls.names == sorts[batch]


def test_top_p_1_keeps_the_tail() -> None:
    """A cumulative sum of probabilities may round past 1 before the last tokens: top-p 1
    still keeps every token with a probability, on the sorted path too."""
    logits = 3 * torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    rows = [params(top_p=1.0), params(top_p=0.5)]  # the second row makes the batch sort
    probs = torch.softmax(logits[0] / 0.8, dim=-1)
    assert probs.sort(descending=True)[0].cumsum(0)[-2] > 1.0  # where the tail rounded past 1
    got = Sampler(0, torch.device("cpu"))._filtered_probs(logits, rows)
    assert torch.equal(got[0], probs)


def test_seeded_draws_follow_the_distribution() -> None:
    """A seeded row draws the same tokens from the cut distribution as from the sorted one."""
    rows = [SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=11)]
    logits = 2 * torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(0, torch.device("cpu"))
    drawn = [sampler.sample(logits.clone(), rows, ["r"]).item() for _ in range(20)]
    gen = torch.Generator().manual_seed(11)
    probs = sorted_cuts(logits, rows)[0]
    assert drawn == [torch.multinomial(probs, 1, generator=gen).item() for _ in range(20)]
    assert len(set(drawn)) > 1 and all(probs[t] > 0 for t in drawn)
