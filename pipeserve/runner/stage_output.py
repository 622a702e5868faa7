"""What a stage's forward hands on, and how a launched forward is finished: on a device the
forward runs on while the host goes on, and its results (tokens, logprobs, its time) are
read from the host copies once the host waits for the batch's event (pipeserve/streams.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.scheduler.batch import BatchResult, ScheduledBatch
from pipeserve.streams import HostCopy, StageTimer
from pipeserve.timeline import Recorder


class StageOutput:
    """What a stage's forward hands on: hidden states [tokens, hidden] (and the residual) for
    the next stage, and on the last stage the sampled tokens. On a device the forward may
    still be running when this is returned: `wait()` (or reading `result`) waits for this
    batch's events only, then records its time. Holds the batch's inputs until then, so no
    buffer the forward reads is reused early."""

    def __init__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        result: BatchResult | None = None,
        pending: PendingResult | None = None,
    ) -> None:
        self.hidden, self.residual = hidden, residual
        self._result, self._pending = result, pending

    @property
    def result(self) -> BatchResult | None:
        self.wait()
        return self._result

    def wait(self) -> None:
        if self._pending is not None:
            self._result = self._pending.finish()
            self._pending = None


@dataclass
class SampledTensors:
    """A last stage's results on the device, before they are copied to the host."""

    ids: torch.Tensor  # [samples] sampled tokens
    chosen: torch.Tensor | None  # [samples] float32 logprobs of them (None: none asked for)
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([samples, k] values, ids)
    prompt: torch.Tensor  # [rows] float32 prompt logprobs

    def flat(self) -> list[torch.Tensor]:
        top = list(self.top) if self.top is not None else []
        chosen = [self.chosen] if self.chosen is not None else []
        return [self.ids, *chosen, *top, self.prompt]


@dataclass
class PendingResult:
    """A launched forward's bookkeeping, finished once the host has its values."""

    batch: ScheduledBatch
    timer: StageTimer
    recorder: Recorder
    weights: tuple[int, int]
    keep: list[ForwardBatch]  # inputs the forward reads: alive until it is done
    sampled: SampledTensors | None = None
    host: HostCopy | None = None

    def finish(self) -> BatchResult | None:
        seconds = self.timer.seconds()  # on a device: after the forward's end event
        batch = self.batch
        batch.stage_times.append(seconds)
        start, end = self.timer.start_wall, self.timer.start_wall + seconds
        self.recorder.add("forward", start, end, batch)
        self.recorder.add("weights", end, end, nbytes=self.weights[0], nbytes_recv=self.weights[1])
        self.keep = []
        if self.sampled is None or self.host is None:
            return None
        result = batch_result(batch, self.sampled, self.host.get())
        result.stage_times = batch.stage_times
        return result


def batch_result(
    batch: ScheduledBatch, sampled: SampledTensors, host: list[torch.Tensor]
) -> BatchResult:
    """The host copies of `sampled` (in `flat()` order) as the scheduler's lists."""
    samples = [s for s in batch.slices if s.sample]
    it = iter(host)
    tokens: list[int] = next(it).tolist()
    chosen = next(it).tolist() if sampled.chosen is not None else [math.nan] * len(samples)
    lps = [lp if s.return_logprob else math.nan for lp, s in zip(chosen, samples, strict=True)]
    tops: list[list[tuple[int, float]]] = [[] for _ in samples]
    if sampled.top is not None:
        values, indices = next(it).tolist(), next(it).tolist()
        for i, s in enumerate(samples):
            n = s.top_logprobs
            tops[i] = list(zip(indices[i][:n], values[i][:n], strict=True))
    prompt: list[float] = next(it).tolist()
    per_slice, start = [], 0
    for s in batch.slices:
        per_slice.append(prompt[start : start + len(s.logprob_targets)])
        start += len(s.logprob_targets)
    return BatchResult(batch.batch_id, tokens, lps, per_slice, top_logprobs=tops)
