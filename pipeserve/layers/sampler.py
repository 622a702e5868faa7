"""Token sampling: greedy, temperature, top-k, top-p, min-p; a private generator per seeded
request, so its tokens do not depend on what else is in the batch; and the logprobs asked for
(the sampled tokens', the most likely ones', the prompt's). Nothing here reads a device value
on the host (the forward's stream runs on)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeserve.device import small_tensor
from pipeserve.scheduler.request import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.shared = torch.Generator(device=device).manual_seed(seed)
        self.per_request: dict[str, torch.Generator] = {}

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.per_request.pop(rid, None)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], rids: list[str]
    ) -> torch.Tensor:
        """logits [rows, vocab] float32 -> token ids [rows]."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens

        def index(x: list[int]) -> torch.Tensor:
            return small_tensor(x, torch.long, logits.device)

        probs = self._filtered_probs(logits[index(rows)], [params[i] for i in rows])
        shared = [j for j, i in enumerate(rows) if params[i].seed is None]
        if shared:
            picked = torch.multinomial(probs[index(shared)], 1, generator=self.shared).squeeze(1)
            tokens[index([rows[j] for j in shared])] = picked
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is not None:
                gen = self._generator(rids[i], seed)
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return tokens

    def _generator(self, rid: str, seed: int) -> torch.Generator:
        if rid not in self.per_request:
            self.per_request[rid] = torch.Generator(device=self.device).manual_seed(seed)
        return self.per_request[rid]

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then the top-k / top-p / min-p cuts, over tokens sorted by probability;
        the most likely token always survives. Only what the batch asks for is sorted: no
        cut, no sort (the distribution as it is); top-k alone, or with the others, over the
        k best (`topk`) when every row has one; else the whole vocabulary (a sort of 49,152
        logits costs ~3 ms a row on a CPU core)."""

        def column(values: list[float]) -> torch.Tensor:
            return small_tensor(values, torch.float32, logits.device)[:, None]

        vocab = logits.shape[-1]
        probs = torch.softmax(logits / column([p.temperature for p in params]), dim=-1)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(top_k) == vocab and all(p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
            return probs
        kept = max(top_k)
        if kept < vocab:
            sorted_p, order = probs.topk(kept, dim=-1)
        else:
            sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(kept, device=logits.device)[None, :]
        drop = rank >= column([float(k) for k in top_k])
        # top-p 1 cuts nothing (a cumulative sum may round past 1 in the tail)
        top_p = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p
        drop |= sorted_p < sorted_p[:, :1] * column([p.min_p for p in params])
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


LOGPROB_ROWS_PER_PASS = 1024  # prompt logprobs: LM head rows per pass (bounds memory)


def output_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, wanted: bool, top_k: int
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Log-probabilities (of the raw model distribution, before temperature and cuts) of the
    sampled tokens `ids` [rows], where `wanted`, and the `top_k` most likely with their ids
    (none for 0): (chosen [rows], (values, ids) [rows, top_k])."""
    if not wanted:
        return None, None
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    if top_k <= 0:
        return chosen, None
    values, top_ids = logp.topk(top_k, dim=-1)
    return chosen, (values, top_ids)


def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """Prompt logprobs: for each of `rows` of `hidden`, the float32 log-probability of its
    target token (the next one in the prompt), the LM head (`logits_of`) applied
    LOGPROB_ROWS_PER_PASS rows at a time."""
    out = [torch.empty(0, dtype=torch.float32, device=hidden.device)]
    for i in range(0, rows.shape[0], LOGPROB_ROWS_PER_PASS):
        logits = logits_of(hidden[rows[i : i + LOGPROB_ROWS_PER_PASS]])
        part = targets[i : i + LOGPROB_ROWS_PER_PASS]
        out.append(torch.log_softmax(logits, dim=-1).gather(1, part[:, None])[:, 0])
    return torch.cat(out).float()
