"""Token sampling: greedy, temperature, top-k, top-p, min-p; a private generator per seeded
request, so its tokens do not depend on what else is in the batch; and the logprobs asked for
(the sampled tokens', the most likely ones', the prompt's). Nothing here reads a device value
on the host (the forward's stream runs on) where work queues on streams (CUDA); on a CPU the
top-p and min-p cuts read their candidates (`cut_candidates`), which costs no wait there."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeserve.device import queues_on_streams, small_tensor
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
            picked = draw(probs[index(shared)], self.shared)
            tokens[index([rows[j] for j in shared])] = picked
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is not None:
                gen = self._generator(rids[i], seed)
                tokens[i] = draw(probs[j : j + 1], gen)[0]
        return tokens

    def _generator(self, rid: str, seed: int) -> torch.Generator:
        if rid not in self.per_request:
            self.per_request[rid] = torch.Generator(device=self.device).manual_seed(seed)
        return self.per_request[rid]

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then the top-k / top-p / min-p cuts, over tokens sorted by probability;
        the most likely token always survives. Only what the batch asks for is sorted: no
        cut, no sort (the distribution as it is); top-k alone, or with the others, over the
        k best (`topk`) when every row has one; else as many as `cut_candidates` finds the
        cuts need (a sort of 49,152 logits costs ~3.5 ms a row on a CPU core)."""

        def column(values: list[float]) -> torch.Tensor:
            return small_tensor(values, torch.float32, logits.device)[:, None]

        vocab = logits.shape[-1]
        probs = torch.softmax(logits / column([p.temperature for p in params]), dim=-1)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(top_k) == vocab and all(p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
            return probs
        # top-p 1 cuts nothing (a cumulative sum may round past 1 in the tail)
        top_p = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
        min_p = column([p.min_p for p in params])
        k_col = column([float(k) for k in top_k])
        kept = max(top_k)
        if kept < vocab:
            sorted_p, order = probs.topk(kept, dim=-1)
        else:
            # a row without any cut keeps its whole distribution: the whole sort
            uncut = any(
                k == vocab and p.top_p >= 1.0 and p.min_p <= 0.0
                for k, p in zip(top_k, params, strict=True)
            )
            sorted_p, order = cut_candidates(probs, k_col, top_p, min_p, uncut)
            kept = sorted_p.shape[-1]
        rank = torch.arange(kept, device=logits.device)[None, :]
        drop = rank >= k_col
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p
        drop |= sorted_p < sorted_p[:, :1] * min_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


# Top-p or min-p without a top-k on a CPU: this many most likely tokens are taken first (topk:
# 0.3 ms a row of 49,152 on a Zen 4 core, against 3.5 ms for the whole sort), the whole
# vocabulary sorted only where some row's cut lies past them.
CUT_CANDIDATES = 1024


def cut_candidates(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uncut: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens sorted by probability as far as some row's cut needs them (a row
    without a top-k asks for top-p or min-p): the CUT_CANDIDATES most likely (`topk`, and
    the next) where every row's cut falls among them, i.e. its top-k is within them, or
    they hold more than its top-p, or the next is below its min-p threshold (then every
    token past them is dropped, as the whole sort would drop it); else the whole
    vocabulary sorted, as it is at once where some row has no cut (`uncut`). Deciding
    reads the candidates on the host, so only where that costs no wait (a CPU): a device
    sorts its vocabulary in microseconds anyway."""
    if not uncut and probs.shape[-1] > CUT_CANDIDATES and not queues_on_streams(probs.device):
        # one more than the candidates: the first past them must be dropped, by the very sums
        # and comparisons the cuts then make (the sort's scan sums the same prefix alike)
        sorted_p, order = probs.topk(CUT_CANDIDATES + 1, dim=-1)
        first_out = sorted_p[:, -1:]
        before = sorted_p.cumsum(dim=-1)[:, -1:] - first_out
        dropped = (top_k <= CUT_CANDIDATES) | (before > top_p)
        if bool((dropped | (first_out < sorted_p[:, :1] * min_p)).all()):
            return sorted_p, order
    return probs.sort(dim=-1, descending=True)


DRAW_BLOCK = 1024  # tokens per block of draw's float32 sums


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (nonnegative, each row's sum positive) with
    those probabilities: the row's cumulative distribution inverted at one uniform number
    (`generator`'s) times its total, where torch.multinomial draws one random number per
    token (~1 ms a row of 49,152 on a CPU core). The sums run in float32 within blocks of
    DRAW_BLOCK tokens and in float64 across them (a whole float64 cumsum costs 8x float32's
    on a CPU), so a token's interval is off by float32 rounding of its block's mass at most;
    a token of probability 0 spans none and is never drawn."""
    rows, vocab = probs.shape
    pad = -vocab % DRAW_BLOCK
    blocks = (probs if pad == 0 else F.pad(probs, (0, pad))).reshape(rows, -1, DRAW_BLOCK)
    inner = blocks.cumsum(dim=-1)  # float32 sums within each block
    mass = inner[..., -1].double()
    outer = mass.cumsum(dim=-1)  # float64 sums of the blocks
    total = outer[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    target = u * total
    # the block: the first whose sum passes the target (u < 1 keeps u * total below the
    # total in float64, so there is one, and it has mass; bounded all the same, as is the
    # token, so that a row of NaN gives some token, as its argmax would, not one past the row)
    b = torch.searchsorted(outer, target, right=True).clamp_(max=outer.shape[1] - 1)
    # rounding may put the mass before the block a hair above the block's start: not below 0
    within = (target - (outer.gather(1, b) - mass.gather(1, b))).clamp_min(0.0).float()
    row = inner.gather(1, b[..., None].expand(-1, -1, DRAW_BLOCK)).squeeze(1)
    # the target's rounding to float32 may carry it to the block's sum: then the block's last
    # token with mass
    last = torch.searchsorted(row, row[:, -1:].contiguous())
    i = torch.minimum(torch.searchsorted(row, within, right=True), last)
    return (b * DRAW_BLOCK + i).squeeze(1).clamp_(max=vocab - 1)  # a NaN row: in the row


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
