"""The scheduler's view of its worker processes: start them, hear them, notice when one
dies or stalls, and stop them all."""

from __future__ import annotations

import time
import typing
from collections import deque
from collections.abc import Sequence

from pipeserve.config import EngineConfig, SettingsError
from pipeserve.distributed.channels import SchedulerChannels
from pipeserve.distributed.launcher import (
    endpoints_for,
    local_ranks,
    rendezvous,
    start_workers,
)
from pipeserve.distributed.messages import (
    Failed,
    Heartbeat,
    Profile,
    ProfileTimes,
    Ready,
    Refused,
    ReportTimeline,
    Shutdown,
    StageCommand,
    Status,
    StatusBody,
    TimelinePiece,
)
from pipeserve.lifetime import REFUSED_EXIT
from pipeserve.scheduler.batch import BatchResult, Run, ScheduledBatch
from pipeserve.scheduler.data_parallel import BatchGroup
from pipeserve.timeline import Event

POLL_MS = 100
REFUSAL_WAIT_MS = 1000  # for the message of a worker that exited refusing its settings
START_TIMEOUT_S = 600.0
PROFILE_TIMEOUT_S = 900.0  # every stage times chunks at long prefixes, one after the other
TIMELINE_TIMEOUT_S = 120.0  # the request waits behind the micro-batches in flight


class WorkerError(RuntimeError):
    """A worker failed, died or stopped answering; the engine cannot go on."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details  # e.g. the worker's traceback (for logs, not for clients)


def report_ranks(
    pp_size: int, tp_size: int, ep_size: int, afd_attention: int = 0, cp_size: int = 1
) -> list[int]:
    """Global ranks that report results: the last stage's first TP (or CP) rank, under expert
    parallelism each of its attention ranks, under attention-FFN disaggregation each
    attention worker (ranks 0..afd_attention-1)."""
    if afd_attention:
        return list(range(afd_attention))
    last = (pp_size - 1) * tp_size * ep_size * cp_size
    return [last + e for e in range(ep_size)]


class WorkerSet:
    def __init__(self, config: EngineConfig, model_path: str, future_ring: int) -> None:
        p = config.parallel
        self.world_size, self.width, self.pp_size = p.world_size, p.stage_width, p.pp_size
        self.reporters = report_ranks(
            p.pp_size, p.tp_size, p.ep_size, p.afd_attention_size, p.cp_size
        )
        self.ffn_ranks = p.afd_ffn_size  # AFD: FFN workers after the attention workers
        self.step_timeout_s = config.server.watchdog_timeout
        self.heartbeat_timeout_s = p.heartbeat_timeout
        rdzv = rendezvous(config)
        self.channels = SchedulerChannels(
            "0.0.0.0" if p.nnodes > 1 else rdzv.host,
            p.stage_width,
            rdzv.zmq_base_port,
            auth_key=rdzv.auth_key,
        )
        endpoints = self.channels.endpoints
        if rdzv.zmq_base_port is not None:
            endpoints = endpoints_for(rdzv, p.stage_width)
        self.procs = start_workers(config, model_path, endpoints, rdzv, future_ring)
        self.local = dict(zip(local_ranks(config), self.procs, strict=True))
        self.last_seen: dict[int, float] = {}
        self._pending: deque[Status] = deque()
        self._results: dict[int, deque[BatchResult]] = {r: deque() for r in self.reporters}
        self.info: dict[int, Ready] = {}
        self.closed = False

    def wait_ready(self) -> dict[int, Ready]:
        """Block until every rank (on every node) has loaded its shard."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.info) < self.world_size:
            msg = self._poll()
            if msg is not None and isinstance(msg.body, Ready):
                self.info[msg.rank] = msg.body
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self.info))
                raise WorkerError(f"workers {missing} did not start within {START_TIMEOUT_S:.0f}s")
        return self.info

    def send_batch(self, group: BatchGroup) -> None:
        """The same batch to every first-stage TP rank, or each attention rank its own."""
        self._check_alive(time.monotonic())
        if not self._send_per_rank(group.batches):
            self._check_alive(time.monotonic())
            raise WorkerError("the first pipeline stage is not taking batches")

    def _send_per_rank(self, objs: Sequence[StageCommand]) -> bool:
        """`objs`: one per attention rank. An FFN worker of attention-FFN disaggregation gets
        the same with no work: an empty batch of the step (it serves the MoE layers of the
        attention workers' forward), a profile request without KV slots."""
        if self.ffn_ranks:
            objs = [*objs, *[_without_work(objs[0])] * self.ffn_ranks]
        if len(objs) == 1:
            return self.channels.send_batch(objs[0])
        return self.channels.send_each(list(objs))

    def wait_results(self) -> list[BatchResult]:
        """The next micro-batch's result from every reporting rank (the last stage's first
        TP rank, or each attention rank), in rank order. Each rank's results arrive in launch
        order; one rank may be a micro-batch ahead of another."""
        while not all(self._results.values()):
            msg = self._collect(BatchResult, 1, self.step_timeout_s, "a step (--watchdog-timeout)")
            self._results[msg[0].rank].append(typing.cast(BatchResult, msg[0].body))
        return [self._results[r].popleft() for r in self.reporters]

    def profile_stages(
        self, points: list[tuple[int, int]], runs: list[list[Run]]
    ) -> list[list[float]]:
        """Every stage times the profile chunks on its own layers, one stage after the other
        (the request travels down the pipeline); the seconds per stage, in stage order.
        `runs`: per attention rank, the KV slots its pool lent for the profile."""
        self._send_per_rank([Profile(points, r) for r in runs])
        stages = self.pp_size
        msgs = self._collect(ProfileTimes, stages, PROFILE_TIMEOUT_S, "the chunk-time profile")
        times = [typing.cast(ProfileTimes, m.body) for m in msgs]
        by_stage = {t.stage: t.seconds for t in times}
        return [by_stage[s] for s in sorted(by_stage)]

    def collect_timeline(self) -> list[Event]:
        """Every rank's recorded events (sent down the pipeline in order, so all micro-batches
        launched before are included)."""
        self.channels.send_batch(ReportTimeline())
        events: list[Event] = []
        finished: set[int] = set()  # ranks whose last piece came
        deadline = time.monotonic() + TIMELINE_TIMEOUT_S
        while len(finished) < self.world_size:
            left = max(0.0, deadline - time.monotonic())
            for msg in self._collect(TimelinePiece, 1, left, "the timeline"):
                piece = typing.cast(TimelinePiece, msg.body)
                events += piece.events
                if piece.last:
                    finished.add(msg.rank)
        return events

    def _collect(
        self, kind: type[StatusBody], count: int, timeout_s: float, what: str
    ) -> list[Status]:
        """The next `count` messages of `kind`; messages of other kinds that arrive meanwhile
        (results of micro-batches in flight) stay queued, in order, for their own readers."""
        deadline = time.monotonic() + timeout_s
        found: list[Status] = []
        others: list[Status] = []
        try:
            while len(found) < count:
                msg = self._poll()
                if msg is not None:
                    (found if isinstance(msg.body, kind) else others).append(msg)
                elif time.monotonic() > deadline:
                    raise WorkerError(f"{what} took longer than {timeout_s:g}s")
        finally:
            self._pending.extendleft(reversed(others))
        return found

    def check_health(self) -> None:
        """Raise WorkerError if a worker died or went silent (also while idle)."""
        self._drain(0)
        self._check_alive(time.monotonic())

    def _poll(self) -> Status | None:
        """The next message that is not a heartbeat (waiting up to POLL_MS for one); all
        heartbeats queued before it are counted first, so a long idle spell is no silence."""
        if not self._pending:
            self._drain(POLL_MS)
        self._check_alive(time.monotonic())
        return self._pending.popleft() if self._pending else None

    @property
    def starting(self) -> bool:
        return len(self.info) < self.world_size

    def _drain(self, timeout_ms: int) -> None:
        msg = self.channels.poll(timeout_ms)
        while msg is not None:
            self.last_seen[msg.rank] = time.monotonic()
            match msg.body:
                case Refused(message) if self.starting:
                    raise SettingsError(message)
                case Failed(text) | Refused(text):
                    if self.starting:  # another rank's refusal may be what failed this one
                        self._await_refusal()
                    last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
                    raise WorkerError(f"worker rank {msg.rank} failed: {last}", details=text)
                case Heartbeat():
                    pass
                case _:
                    self._pending.append(msg)
            msg = self.channels.poll(0)

    def _await_refusal(self) -> None:
        """While starting: raise SettingsError if a rank's refusal arrives within
        REFUSAL_WAIT_MS (other messages are dropped: the start has failed either way)."""
        deadline = time.monotonic() + REFUSAL_WAIT_MS / 1000
        while (left := deadline - time.monotonic()) > 0:
            msg = self.channels.poll(int(left * 1000) + 1)
            if msg is not None and isinstance(msg.body, Refused):
                raise SettingsError(msg.body.message)

    def _check_alive(self, now: float) -> None:
        for rank, proc in self.local.items():
            if proc.exitcode == REFUSED_EXIT and self.starting:
                self._await_refusal()  # its message may still be on the way
            if proc.exitcode is not None:
                raise WorkerError(f"worker rank {rank} exited with code {proc.exitcode}")
        for rank, seen in self.last_seen.items():
            if now - seen > self.heartbeat_timeout_s:
                raise WorkerError(f"worker rank {rank} sent no heartbeat for {now - seen:.0f}s")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def shutdown(self) -> None:
        """Ask the pipeline to stop; kill whatever has not exited shortly after."""
        if self.closed:
            return
        self.closed = True
        first_stage_alive = all(p.is_alive() for r, p in self.local.items() if r < self.width)
        if first_stage_alive:  # a dead first stage would make this wait out the send timeout
            self.channels.send_batch(Shutdown(), block=False)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.channels.close()


def _without_work(command: StageCommand) -> StageCommand:
    match command:
        case ScheduledBatch():  # as many micro-batches as the attention workers
            return ScheduledBatch(
                command.batch_id, [], micro_batches=[0] * len(command.micro_batches)
            )
        case Profile(points, _runs):
            return Profile(points, [])
    return command
