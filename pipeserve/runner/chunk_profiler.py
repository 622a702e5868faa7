"""Timing prompt chunks on a stage's layers, for dynamic chunking's cost model and for the
chunk size a PP/TP layout picks at start-up (engine/chunking.py asks through the backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeserve.context_parallel.layout import runs_of
from pipeserve.scheduler.batch import ReqSlice, Run, ScheduledBatch, runs_prefix

if TYPE_CHECKING:
    from pipeserve.runner.model_runner import ModelRunner


def profile_prefill(
    runner: ModelRunner, points: list[tuple[int, int]], runs: list[Run]
) -> list[float]:
    """Seconds of one prompt chunk per (prefix_len, chunk_len) point on the runner's layers
    (a later stage gets zero hidden states). The KV lives in `runs`, slots the scheduler lent
    for the purpose; the prefix is never computed: attention over zeroed slots costs what it
    costs over real keys, so a point costs one chunk's forward."""
    _zero_slots(runner, runs_prefix(runs, max(p + n for p, n in points)))  # those read
    times = [_time_chunk(runner, prefix, n, runs) for prefix, n in points]
    runner.recorder.take()  # the profile's forwards are not the timeline's
    return times


def _time_chunk(runner: ModelRunner, prefix: int, n: int, runs: list[Run]) -> float:
    ids = [i % runner.arch.vocab_size for i in range(n)]
    runs = runs_prefix(runs, prefix + n)
    s = ReqSlice("profile", ids, prefix, runs, sample=False, chunk_index=1 if prefix else 0)
    batch = ScheduledBatch(-1, [s])
    fb = runner.prepare(batch)
    hidden = None
    if not runner.state.is_first_stage:  # this rank's rows: under CP its share of the chunk
        rows = fb.positions.shape[0]
        size = (rows, runner.arch.hidden_size)
        hidden = torch.zeros(size, dtype=runner.dtype, device=runner.device)
    residual = None if hidden is None else torch.zeros_like(hidden)
    runner.execute(batch, fb, hidden, residual).wait()
    return batch.stage_times[-1]


def _zero_slots(runner: ModelRunner, runs: list[Run]) -> None:
    """Lent slots may hold anything (never written memory: NaNs, denormals, which some CPUs
    compute slowly); zeros keep the profile's timings honest."""
    if runner.cp is not None:  # the slots of this rank's pages
        num = sum(n for _, n in runs)
        runs = runs_of(runner.cp.striping.owned(runs, 0, num, torch.device("cpu"))[1])
    for start, n in runs:
        runner.kv_pool.zero_slots(start, n)
