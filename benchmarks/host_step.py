"""Host work per decode step, without a model: a scheduler holding N requests at a context
of C tokens decodes, and each step's host phases are timed (median over the steps, ms of
this thread's CPU time by default: the machine may be shared; torch on one thread):

- schedule: `Scheduler.schedule()`;
- prepare_torch: `ForwardBatch.prepare` for the torch kernels (built on the CPU);
- prepare_triton: `ForwardBatch.prepare` for the batched Triton kernels as on a device: built
  on the host, each tensor copied (what pinning it costs) and moved to PyTorch's meta device
  (shapes, no data), and whatever runs on the device after the copy dispatched there;
- expand_on_device: of prepare_triton, the page tables' expansion on the device after the
  copy (`SlotRuns.expand`, where the code has it). Its ops' meta dispatch costs 5-120 us each
  here, several times a CUDA launch, so prepare_triton less this is the host's own share;
- result: the sampled tokens' host copies turned into the scheduler's lists (`batch_result`);
- process: `Scheduler.process_result` (tokens appended, stop checks, updates).

The garbage collector is off while the steps are timed. Prints and saves JSON. To compare
with an older commit, copy this file into a worktree of it and run it there.

    python benchmarks/host_step.py --requests 8 64 256 --context 1024 --json out/host_step.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipeserve.backends.triton_backend import TritonBackend
from pipeserve.config import SchedulerConfig
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.runner.stage_output import SampledTensors, batch_result
from pipeserve.scheduler.batch import BatchResult, ScheduledBatch
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.scheduler.scheduler import Scheduler

CPU = torch.device("cpu")
META = torch.device("meta")
TRITON = TritonBackend()
EOS = 0
VOCAB = 32000
PHASES = ("schedule", "prepare_torch", "prepare_triton", "expand_on_device", "result", "process")
Clock = Callable[[], float]


class Bench:
    """A scheduler with `requests` requests prefilled to `context` tokens, decoding. The KV
    pool is a token one: prepare reads its kind, never its buffers."""

    def __init__(
        self, requests: int, context: int, steps: int, page_size: int, latent: bool = False
    ) -> None:
        pages = requests * -(-(context + steps + page_size) // page_size) + 64
        self.kv = KVManager(pages, page_size, disable_radix_cache=True)
        config = SchedulerConfig(max_running_requests=requests)
        self.sched = Scheduler(config, self.kv, context + steps + 16, (EOS,))
        if latent:  # MLA: the batch carries each request's latent segment
            self.pool = KVPool.latent_layout(page_size, range(1), 8, torch.float32, CPU, page_size)
        else:
            self.pool = KVPool(page_size, range(1), 1, 8, torch.float32, CPU, page_size)
        self.gen = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_new_tokens=steps + 8, ignore_eos=True)
        for i in range(requests):
            prompt = [(i + j) % (VOCAB - 1) + 1 for j in range(context)]
            self.sched.add_request(Req(f"r{i}", prompt, params))
        while not self._decoding(requests):
            batch = self.sched.schedule()
            assert batch is not None, "the requests do not fit"
            self.sched.process_result(batch, self._result(batch))

    def _decoding(self, requests: int) -> bool:
        running = self.sched.decode.running
        return len(running) == requests and all(r.output_ids for r in running)

    def _sampled(self, batch: ScheduledBatch) -> SampledTensors:
        ids = torch.randint(1, VOCAB, (batch.num_samples,), generator=self.gen)
        return SampledTensors(ids, None, None, torch.empty(0))

    def _result(self, batch: ScheduledBatch) -> BatchResult:
        sampled = self._sampled(batch)
        return batch_result(batch, sampled, sampled.flat())

    def step(self, times: dict[str, list[float]], clock: Clock) -> ScheduledBatch:
        """One decode step, each phase's time appended to `times`."""
        batch = timed(times["schedule"], clock, self.sched.schedule)
        assert batch is not None and batch.is_decode
        timed(times["prepare_torch"], clock, ForwardBatch.prepare, batch, self.pool, CPU)
        args = (batch, self.pool, META, TRITON, None, to_device)
        with expansions(clock) as expand:
            timed(times["prepare_triton"], clock, ForwardBatch.prepare, *args)
        times["expand_on_device"].append(sum(expand))
        sampled = self._sampled(batch)
        result = timed(times["result"], clock, batch_result, batch, sampled, sampled.flat())
        timed(times["process"], clock, self.sched.process_result, batch, result)
        return batch


def to_device(host: Any) -> Any:
    """The runner's move, host side: a copy (into pinned memory, there), then the device; of
    one tensor (commits before the one-copy staging) or of a step's list of them."""
    if isinstance(host, list):
        return [h.clone().to(META) for h in host]
    return host.clone().to(META)


@contextmanager
def expansions(clock: Clock) -> Iterator[list[float]]:
    """The time of each outermost `SlotRuns.expand` or `SlotRuns.slots` call inside (none
    where the code has none)."""
    spent: list[float] = []
    try:
        from pipeserve.layers.attention_parts import SlotRuns
    except ImportError:
        yield spent
        return
    originals = {
        name: getattr(SlotRuns, name) for name in ("expand", "slots") if hasattr(SlotRuns, name)
    }
    depth = [0]

    def timing(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(self: Any) -> Any:
            depth[0] += 1
            try:
                return timed(spent, clock, fn, self) if depth[0] == 1 else fn(self)
            finally:
                depth[0] -= 1

        return timed_call

    for name, fn in originals.items():
        setattr(SlotRuns, name, timing(fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(SlotRuns, name, fn)


def timed(into: list[float], clock: Clock, fn: Callable[..., Any], *args: Any) -> Any:
    start = clock()
    out = fn(*args)
    into.append(clock() - start)
    return out


def measure(
    requests: int, context: int, steps: int, page_size: int, clock: Clock, latent: bool = False
) -> dict:
    bench = Bench(requests, context, steps + 2, page_size, latent)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(2):  # warm-up
        bench.step({p: [] for p in PHASES}, clock)
    gc.collect()
    gc.disable()  # no phase pays for another's garbage
    try:
        for _ in range(steps):
            batch = bench.step(times, clock)
    finally:
        gc.enable()
    runs = statistics.mean(len(s.kv_runs) for s in batch.slices)
    out: dict[str, Any] = {"requests": requests, "context": context, "runs_per_request": runs}
    out |= {f"{p}_ms": statistics.median(t) * 1e3 for p, t in times.items()}
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{name} ({' '.join(f for f in ('avx2', 'avx512f') if f in flags)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[1024])
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--wall", action="store_true", help="wall time instead of CPU time")
    ap.add_argument("--latent", action="store_true", help="an MLA (latent) KV pool")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.thread_time
    report: dict[str, Any] = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "clock": "wall" if args.wall else "thread cpu",
        "pool": "latent" if args.latent else "per-head",
        "cases": [],
    }
    print(
        f"{report['cpu']}, torch {torch.__version__}; {report['pool']} pool; {report['clock']}"
        " ms per decode step"
    )
    print("requests context runs " + " ".join(f"{p:>16s}" for p in PHASES))
    for context in args.context:
        for n in args.requests:
            case = measure(n, context, args.steps, args.page_size, clock, args.latent)
            report["cases"].append(case)
            cols = " ".join(f"{case[f'{p}_ms']:16.3f}" for p in PHASES)
            print(f"{n:8d} {context:7d} {case['runs_per_request']:4.1f} {cols}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
