"""Per-operation profile of a worker's forwards (PIPESERVE_TORCH_PROFILER_DIR).

With the variable set, every model runner keeps one torch profiler running from its start
and, when it closes, writes two files to the directory, named by its
pipeline stage and rank within the stage: `op-profile-s{stage}r{rank}.txt`, the operators
and labelled regions by total CPU time (and device time where there is one), and
`op-profile-s{stage}r{rank}.json`, a Chrome/Perfetto trace. The labelled regions
(`pipeserve.*`, see `region`) split a layer into attention, its kernel, the MLP or MoE and
the context-parallel exchange, so two layouts' forwards can be set side by side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import profile, record_function

from pipeserve import envs
from pipeserve.device import profiler_activities

_active = False  # whether a profiler is recording in this process


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """A labelled span `pipeserve.<name>` on the profile; nothing without a profiler."""
    if not _active:
        yield
        return
    with record_function(f"pipeserve.{name}"):
        yield


class OpProfile:
    """One profiler over a runner's life, started where the runner is built and stopped by
    `write` on the same thread (the profiler's own requirement); its ops on every thread are
    recorded, and `step()` labels one forward."""

    def __init__(self, directory: Path, name: str, device: torch.device) -> None:
        self.path = directory / f"op-profile-{name}"
        activities = profiler_activities(device)
        self.device_time = len(activities) > 1  # device kernels are recorded
        # the forwards run on a compute thread, not the one that starts the profiler
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        self.prof = profile(activities=activities, experimental_config=every_thread)
        self.prof.start()
        self.forwards = 0

    @staticmethod
    def from_env(name: str, device: torch.device) -> OpProfile | None:
        directory = envs.torch_profiler_dir()
        if directory is None:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        return OpProfile(directory, name, device)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        global _active
        _active = True
        try:
            with record_function("pipeserve.forward"):
                yield
        finally:
            _active = False
            self.forwards += 1

    def write(self) -> Path:
        """Stop and write the table and the trace."""
        self.prof.stop()
        key = "self_cuda_time_total" if self.device_time else "self_cpu_time_total"
        averages = self.prof.key_averages()
        table = averages.table(sort_by=key, row_limit=60, max_name_column_width=60)
        regions = averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
        text = f"{self.forwards} forwards\n\n# by self time\n{table}\n# by total time\n{regions}"
        out = self.path.with_suffix(".txt")
        out.write_text(text)
        self.prof.export_chrome_trace(str(self.path.with_suffix(".json")))
        return out
