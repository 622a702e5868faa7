"""The sampler's cuts (layers/sampler.py `_filtered_probs`) against the whole-vocabulary sort
they replace where they can: the same distribution to the bit for every mix of temperature,
top-k, top-p and min-p in a batch; the sort runs only where a row has no cut or its top-p or
min-p cut lies past the CUT_CANDIDATES most likely, `topk` over the k best where every row
has a top-k or over the candidates, neither without cuts; and the draws: seeded ones as an
independent inversion picks them, and every draw with its token's probability."""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import pytest
import torch

from pipeserve.layers.sampler import DRAW_BLOCK, Sampler, draw
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
    "top-p on every row": [params(top_p=0.95), params(top_p=0.6, temperature=1.2)],
    "top-p past the candidates": [params(top_p=0.95, temperature=50.0)],  # a flat distribution
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
        "top-k past the vocabulary": ["sort"],  # a row without any cut: the whole sort
        "top-p": ["sort"],
        # the CUT_CANDIDATES most likely hold each row's nucleus: no sort
        "top-p on every row": ["topk"],
        "top-p past the candidates": ["topk", "sort"],  # they hold less than top-p
        "min-p": ["topk"],
        "some rows top-k, some top-p": ["topk"],
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
    """A seeded row draws each token as the inverse of the cut distribution's cumulative sum
    at one uniform number of its generator: what an independent inversion (Python's bisect
    over float64 sums) picks from the sorted cuts at the same numbers."""
    rows = [SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=11)]
    logits = 2 * torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(0, torch.device("cpu"))
    drawn = [sampler.sample(logits.clone(), rows, ["r"]).item() for _ in range(20)]
    gen = torch.Generator().manual_seed(11)
    probs = sorted_cuts(logits, rows)[0]
    cdf = list(itertools.accumulate(probs.double().tolist()))
    uniforms = [torch.rand(1, 1, generator=gen, dtype=torch.float64).item() for _ in range(20)]
    assert drawn == [bisect.bisect_right(cdf, u * cdf[-1]) for u in uniforms]
    assert len(set(drawn)) > 1 and all(probs[t] > 0 for t in drawn)


def test_draws_have_the_row_s_probabilities() -> None:
    """20,000 draws (rows of one distribution, the shared generator) fall on each token within
    five standard deviations of its probability, never on a token of probability 0, the last
    ones included."""
    p = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1, 0.0])
    n = 20_000
    tokens = draw(p.repeat(n, 1), torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * sigma).all(), counts
    assert counts[2] == 0 and counts[5] == 0
    assert draw(torch.tensor([[0.0, 0.0, 1.0]]), torch.Generator()).item() == 2
    # past one block of sums (DRAW_BLOCK): mass only in the middle block, or only on the last
    # token, or on both sides of a block's edge
    wide = torch.zeros(3, 2 * DRAW_BLOCK + 500)
    wide[0, DRAW_BLOCK + 7] = 1.0
    wide[1, -1] = 3.0
    wide[2, DRAW_BLOCK - 1] = wide[2, DRAW_BLOCK] = 0.5
    picks = draw(wide.repeat(200, 1), torch.Generator().manual_seed(2)).view(200, 3)
    assert (picks[:, 0] == DRAW_BLOCK + 7).all() and (picks[:, 1] == wide.shape[1] - 1).all()
    edge = picks[:, 2]
    assert ((edge == DRAW_BLOCK - 1) | (edge == DRAW_BLOCK)).all() and 60 < (
        edge == DRAW_BLOCK
    ).sum() < 140


def test_a_uniform_number_next_to_1_draws_the_last_token_with_mass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The largest uniform number below 1 puts the target at its block's sum once rounded to
    float32: the draw is still the last token with a probability, not a later one of
    probability 0, in a block ending in zeros and before a block that holds nothing."""
    largest = 1.0 - 2.0**-53
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], largest, **_dtype(k)))
    probs = torch.zeros(2, 3 * DRAW_BLOCK)
    probs[0, :5] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])  # then zeros to the block's end
    probs[1, DRAW_BLOCK + 3] = probs[1, 10] = 0.5  # the last block holds nothing
    assert draw(probs, torch.Generator()).tolist() == [4, DRAW_BLOCK + 3]


def _dtype(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in ("dtype", "device")}


def test_a_row_of_nan_still_gives_a_token_of_the_vocabulary() -> None:
    """Broken logits (NaN) draw some token of the row, as greedy's argmax picks one, never an
    index past the vocabulary."""
    probs = torch.full((2, 3 * DRAW_BLOCK - 5), float("nan"))
    picked = draw(probs, torch.Generator().manual_seed(0))
    assert ((picked >= 0) & (picked < probs.shape[1])).all()
