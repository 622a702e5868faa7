"""WorkerSet's message handling without processes: results that arrive while the scheduler
collects a profile or a timeline stay queued for `wait_results`, in order; with several
reporting ranks (data-parallel attention) each rank's results are paired by micro-batch;
each attention rank gets its own batch and profile slots; and every wait has a deadline."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest

from pipeserve.config import SettingsError
from pipeserve.distributed.messages import (
    Failed,
    Heartbeat,
    Profile,
    ProfileTimes,
    Refused,
    Status,
    StatusBody,
    TimelinePiece,
)
from pipeserve.engine import workers as workers_mod
from pipeserve.engine.workers import WorkerError, WorkerSet, report_ranks
from pipeserve.lifetime import REFUSED_EXIT
from pipeserve.scheduler.batch import BatchResult, ScheduledBatch
from pipeserve.scheduler.data_parallel import BatchGroup
from pipeserve.timeline import Event

pytestmark = pytest.mark.timeout(30)  # a lost result would make wait_results wait forever


def status(kind: str, rank: int, payload: Any) -> Status:
    """A status message, written in the tests as (kind, rank, payload)."""
    body: StatusBody
    match kind:
        case "result":
            body = payload
        case "profile":
            body = ProfileTimes(*payload)
        case "timeline":
            body = TimelinePiece(*payload)
        case "heartbeat":
            body = Heartbeat()
        case "error":
            body = Failed(payload)
        case "refused":
            body = Refused(payload)
    return Status(rank, body)


class FakeChannels:
    def __init__(self, inbox: list[tuple[str, int, Any]]) -> None:
        self.inbox = deque(status(*m) for m in inbox)
        self.sent: list[Any] = []  # what went to every first-stage rank alike
        self.sent_each: list[list[Any]] = []  # per-rank messages, one list per send

    def send_batch(self, obj: Any, block: bool = True) -> bool:
        self.sent.append(obj)
        return True

    def send_each(self, objs: list[Any], block: bool = True) -> bool:
        self.sent_each.append(list(objs))
        return True

    def poll(self, timeout_ms: int) -> Status | None:
        return self.inbox.popleft() if self.inbox else None


def worker_set(
    inbox: list[tuple[str, int, Any]], pp: int = 2, tp: int = 1, ep: int = 1
) -> WorkerSet:
    ws = WorkerSet.__new__(WorkerSet)  # no processes: only the message handling under test
    ws.world_size, ws.width, ws.pp_size = pp * tp * ep, tp * ep, pp
    ws.reporters = report_ranks(pp, tp, ep)
    ws.ffn_ranks = 0
    ws._results = {r: deque() for r in ws.reporters}
    ws.step_timeout_s, ws.heartbeat_timeout_s = 300.0, 1e9
    ws.channels = FakeChannels(inbox)  # type: ignore[assignment]
    ws.local, ws.last_seen, ws._pending, ws.info, ws.closed = {}, {}, deque(), {}, False
    return ws


def sent(ws: WorkerSet) -> FakeChannels:
    assert isinstance(ws.channels, FakeChannels)
    return ws.channels


def result(batch_id: int, token: int | None = None) -> BatchResult:
    return BatchResult(batch_id, [batch_id if token is None else token], [0.0], [[]])


def ids(results: list[BatchResult]) -> list[tuple[int, int]]:
    return [(r.batch_id, r.next_token_ids[0]) for r in results]


def test_report_ranks_are_the_last_stage_s_first_rank_or_its_attention_ranks() -> None:
    assert report_ranks(1, 1, 1) == [0]
    assert report_ranks(2, 1, 1) == [1]
    assert report_ranks(2, 2, 1) == [2]  # TP: rank 0 of the last stage reports for all
    assert report_ranks(1, 1, 2) == [0, 1]
    assert report_ranks(3, 1, 2) == [4, 5]
    assert report_ranks(2, 1, 1, cp_size=2) == [2]  # CP: rank 0 of the last stage reports


def test_results_arriving_during_a_profile_are_kept_in_order() -> None:
    ws = worker_set(
        [
            ("result", 1, result(7)),
            ("profile", 0, (0, [0.1, 0.2])),
            ("heartbeat", 0, None),
            ("result", 1, result(8)),
            ("profile", 1, (1, [0.3, 0.4])),
        ]
    )
    points = [(0, 64), (64, 64)]
    assert ws.profile_stages(points, [[(1, 128)]]) == [[0.1, 0.2], [0.3, 0.4]]
    assert sent(ws).sent == [Profile(points, [(1, 128)])]  # one rank: a plain send
    assert [ids(ws.wait_results()) for _ in range(2)] == [[(7, 7)], [(8, 8)]]


def test_results_arriving_during_a_timeline_are_kept() -> None:
    ws = worker_set(
        [
            ("timeline", 0, ([], True)),
            ("result", 1, result(3)),
            ("timeline", 1, ([], True)),
        ]
    )
    assert ws.collect_timeline() == []
    assert ids(ws.wait_results()) == [(3, 3)]


def test_a_timeline_in_pieces_is_put_together() -> None:
    """A rank's timeline comes in pieces (each status message stays under its cap); the
    collection waits for every rank's last piece."""
    a, b, c = (Event("forward", 0, 0, float(t), float(t) + 1) for t in range(3))
    ws = worker_set(
        [
            ("timeline", 0, ([a], False)),
            ("timeline", 1, ([c], True)),
            ("timeline", 0, ([b], True)),
        ]
    )
    assert ws.collect_timeline() == [a, c, b]


def test_collecting_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "POLL_MS", 1)
    monkeypatch.setattr(workers_mod, "TIMELINE_TIMEOUT_S", 0.05)
    ws = worker_set([("timeline", 0, ([], True)), ("result", 1, result(5))])
    start = time.monotonic()
    with pytest.raises(WorkerError, match="the timeline took longer"):
        ws.collect_timeline()  # rank 1 never reports
    assert time.monotonic() - start < 5
    assert ids(ws.wait_results()) == [(5, 5)]  # kept even though the collection failed


def test_a_step_past_the_watchdog_timeout_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = worker_set([])
    ws.step_timeout_s = 0.05
    with pytest.raises(WorkerError, match="watchdog"):
        ws.wait_results()


# -- several attention ranks ------------------------------------------------------------


def test_results_of_two_attention_ranks_are_paired_by_micro_batch() -> None:
    # rank 0 is a micro-batch ahead of rank 1; the last stage (pp 2, ep 2) is ranks 2 and 3
    ws = worker_set(
        [
            ("result", 2, result(1, token=10)),
            ("result", 2, result(2, token=20)),
            ("heartbeat", 3, None),
            ("result", 3, result(1, token=11)),
            ("result", 3, result(2, token=21)),
        ],
        pp=2,
        ep=2,
    )
    assert ids(ws.wait_results()) == [(1, 10), (1, 11)]
    assert ids(ws.wait_results()) == [(2, 20), (2, 21)]


def test_results_in_rank_order_whichever_rank_answers_first() -> None:
    ws = worker_set(
        [("result", 1, result(4, token=41)), ("result", 0, result(4, token=40))], pp=1, ep=2
    )
    assert ids(ws.wait_results()) == [(4, 40), (4, 41)]


def test_a_profile_over_two_attention_ranks_sends_each_its_own_slots() -> None:
    ws = worker_set([("profile", 0, (0, [0.1])), ("profile", 2, (1, [0.2]))], pp=2, ep=2)
    points = [(0, 64)]
    runs = [[(0, 128)], [(512, 128)]]
    assert ws.profile_stages(points, runs) == [[0.1], [0.2]]
    assert sent(ws).sent == []
    assert sent(ws).sent_each == [[Profile(points, runs[0]), Profile(points, runs[1])]]


def test_a_group_sends_each_attention_rank_its_batch() -> None:
    one, two = ScheduledBatch(3, []), ScheduledBatch(3, [], released=["r"])
    ws = worker_set([], pp=1, ep=2)
    ws.send_batch(BatchGroup(3, [one, two]))
    assert sent(ws).sent_each == [[one, two]] and sent(ws).sent == []
    ws = worker_set([], pp=1, tp=2)
    ws.send_batch(BatchGroup(3, [one]))
    assert sent(ws).sent == [one] and sent(ws).sent_each == []  # TP ranks share one batch


def test_afd_ffn_workers_get_the_step_without_work() -> None:
    """Attention-FFN disaggregation, 2 attention + 2 FFN workers: the attention workers get
    their batches, each FFN worker an empty batch of the same step and a profile request
    without KV slots; only the attention workers report results."""
    assert report_ranks(1, 1, 1, afd_attention=2) == [0, 1]
    ws = worker_set([], pp=1, ep=2)
    ws.ffn_ranks = 2
    one = ScheduledBatch(7, [], released=["r"], micro_batches=[0, 0, 0])
    two = ScheduledBatch(7, [], micro_batches=[0, 0, 0])
    ws.send_batch(BatchGroup(7, [one, two]))
    (batches,) = sent(ws).sent_each
    assert batches[:2] == [one, two]
    assert [(b.batch_id, b.slices, b.released, b.micro_batches) for b in batches[2:]] == [
        (7, [], [], [0, 0, 0])] * 2  # as many micro-batches as the attention workers run
    ws.ffn_ranks, ws.pp_size = 2, 1
    ws.channels = FakeChannels([("profile", 0, (0, [0.1]))])  # type: ignore[assignment]
    points, runs = [(0, 16)], [[(0, 128)], [(512, 128)]]
    assert ws.profile_stages(points, runs) == [[0.1]]
    assert sent(ws).sent_each == [[Profile(points, runs[0]), Profile(points, runs[1]),
                                   Profile(points, []), Profile(points, [])]]


# --- settings refused at start-up ------------------------------------------------------------

REFUSAL = "number of attention heads (4) is not divisible by --tp-size 3"
GLOO_ERROR = "Traceback (most recent call last):\n  ...\nRuntimeError: Connection closed by peer"


class LateChannels(FakeChannels):
    """Each message arrives only after `delay` empty polls."""

    def __init__(self, inbox: list[tuple[str, int, Any]], delay: int) -> None:
        super().__init__(inbox)
        self.delay = delay

    def poll(self, timeout_ms: int) -> Status | None:
        if self.delay:
            self.delay -= 1
            return None
        return super().poll(timeout_ms)


class Exited:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode


def test_a_refusal_while_starting_is_a_settings_error() -> None:
    ws = worker_set([("heartbeat", 0, None), ("refused", 1, REFUSAL)])
    with pytest.raises(SettingsError) as info:
        ws.wait_ready()
    assert str(info.value) == REFUSAL


def test_while_starting_another_rank_s_error_gives_way_to_the_refusal() -> None:
    """A rank whose peer refused and left may fail first (a collective's peer is gone): the
    refusal that follows says what to change."""
    ws = worker_set([("error", 0, GLOO_ERROR), ("heartbeat", 0, None), ("refused", 1, REFUSAL)])
    with pytest.raises(SettingsError, match="not divisible"):
        ws.wait_ready()


def test_an_error_while_starting_without_a_refusal_stays_a_worker_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers_mod, "REFUSAL_WAIT_MS", 50)
    ws = worker_set([("error", 0, GLOO_ERROR)])
    with pytest.raises(WorkerError, match="worker rank 0 failed: RuntimeError: Connection"):
        ws.wait_ready()


def test_a_refusal_after_the_start_is_a_worker_error() -> None:
    ws = worker_set([("refused", 1, REFUSAL)])
    ws.info = {0: {}, 1: {}}  # every rank was ready
    with pytest.raises(WorkerError, match="worker rank 1 failed: number of attention heads"):
        ws._drain(0)


def test_a_worker_that_exited_refusing_is_waited_for_its_message() -> None:
    """Its exit code (2) can be seen before its message has arrived: the message decides."""
    ws = worker_set([])
    ws.channels = LateChannels([("refused", 1, REFUSAL)], delay=5)  # type: ignore[assignment]
    ws.local = {1: Exited(REFUSED_EXIT)}  # type: ignore[dict-item]
    with pytest.raises(SettingsError, match="not divisible"):
        ws.wait_ready()
