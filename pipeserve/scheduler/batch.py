"""What the scheduler hands to an executor, and what comes back: plain data, no tensors.

A `ScheduledBatch` is self-contained: with it (and the KV pool contents) a model runner of
any pipeline stage or TP rank can run the forward, and a simulated executor can cost it.
It is also the message that travels with the activations between pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.disaggregation.pd.kv_remap import KVDestination
from pipeserve.mem_cache.hicache import CacheOp
from pipeserve.scheduler.request import SamplingParams

Run = tuple[int, int]  # (first KV slot, number of slots)


def runs_prefix(runs: list[Run], num: int) -> list[Run]:
    """The runs covering the first `num` positions."""
    out: list[Run] = []
    for start, length in runs:
        if num <= 0:
            break
        out.append((start, min(length, num)))
        num -= length
    return out


@dataclass
class ReqSlice:
    """One request's share of a forward."""

    rid: str
    input_ids: list[int]  # tokens fed now; negative ids are future-token placeholders
    prefix_len: int  # tokens of this request already in the KV cache
    kv_runs: list[Run]  # where the KV of positions [0, prefix_len + len(input_ids)) lives
    sample: bool  # produce the next token (decode step or last prompt chunk)
    sampling: SamplingParams | None = None  # set when `sample`
    return_logprob: bool = False  # logprob of the sampled token
    top_logprobs: int = 0  # and of the k most likely tokens
    logprob_targets: list[int] = field(default_factory=list)  # prompt logprobs: next token of
    # each of the first len(logprob_targets) positions of this slice
    chunk_index: int = -1  # prefill chunk number (-1: decode step)
    future_slot: int = 0  # overlap loop: ring slot the sampled token is written to (0: none)
    # prefill/decode disaggregation, prefill side: the KV this chunk makes (the first chunk:
    # from position 0, cached prefix included) goes there, layer by layer
    kv_dest: KVDestination | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return self.chunk_index < 0


@dataclass(frozen=True)
class TwoBatchSplit:
    """Two-batch overlap of one forward: micro-batch A is `slices[:index]` plus the first
    `tokens` tokens of `slices[index]` (0: the split falls between requests), B the rest.
    `decode`: the decode strategy (else prefill's); every rank of a step runs the same."""

    index: int
    tokens: int
    decode: bool


@dataclass
class ScheduledBatch:
    batch_id: int
    slices: list[ReqSlice]
    released: list[str] = field(default_factory=list)  # requests gone since the last batch
    stage_times: list[float] = field(default_factory=list)  # forward seconds, appended per stage
    two_batch: TwoBatchSplit | None = None  # run as two interleaved micro-batches
    combine_blocks: int = 1  # single-batch overlap: the experts' combine in this many blocks
    # attention-FFN disaggregation: slices per micro-batch, in order (some may be 0; every
    # rank runs as many); empty: one batch
    micro_batches: list[int] = field(default_factory=list)
    # HiCache: copies between cache tiers every worker makes before this batch's forward
    cache_ops: list[CacheOp] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)

    @property
    def is_decode(self) -> bool:
        return all(s.is_decode for s in self.slices)

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.slices if s.sample)

    @property
    def single_prompt_chunk(self) -> ReqSlice | None:
        """The one slice when the batch is exactly one prompt chunk (its cost is the chunk's)."""
        if len(self.slices) == 1 and not self.slices[0].is_decode:
            return self.slices[0]
        return None


@dataclass
class BatchResult:
    batch_id: int
    next_token_ids: list[int]  # one per sampling slice, in slice order
    output_logprobs: list[float]  # one per sampling slice (nan where not requested)
    prompt_logprobs: list[list[float]]  # one list per slice (empty where not requested)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per sampling
    # slice: (token, logprob) of the k most likely tokens (empty where not requested)
    stage_times: list[float] = field(default_factory=list)  # forward seconds of each stage
