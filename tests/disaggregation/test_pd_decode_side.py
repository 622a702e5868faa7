"""A decode server's reserved requests (no model, a fake receiver control): pages are
reserved in order while memory lasts; a request decodes only once both its KV and its first
token are in (either order), from the first token on; an abort or a transfer past the
timeout closes the room on the ranks before its pages are freed; nothing leaks. The engine's
prefill call starts once the pages and room are there; a failed call fails its request
alone (a 400 when the prefill server refused it); an abort cancels the call."""

from __future__ import annotations

import pytest

from pipeserve.config import SchedulerConfig
from pipeserve.disaggregation.pd.decode_side import DecodeTransfers
from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.disaggregation.pd.prefill_client import First, PrefillCall, PrefillFailed
from pipeserve.disaggregation.pd.transfer import RoomRefused, RoomStats
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.scheduler.scheduler import Scheduler

PAGE, PAGES = 4, 33  # 32 usable pages: 128 tokens
LAYOUT = SideLayout(((0, 2),), 1, 2)


class FakeControl:
    endpoints = ("tcp://127.0.0.1:1",)
    dropped = 0

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.open_rooms: dict[str, list] = {}
        self.done: list[tuple[str, RoomStats]] = []
        self.log: list[tuple[str, int]] = []  # (what, free pages at that moment)

    refuse: set[int] = set()  # sizes of the requests whose room a rank refuses

    def open(self, room: str, runs: list, num_tokens: int) -> None:
        if num_tokens in self.refuse:
            raise RoomRefused("a decode rank refused to open the request's room")
        self.open_rooms[room] = runs

    def close(self, room: str) -> None:
        self.log.append(("close", self.kv.allocator.num_free))
        del self.open_rooms[room]

    def poll(self) -> list[tuple[str, RoomStats]]:
        out, self.done = self.done, []
        return out

    def finish(self, rid: str, transfers: DecodeTransfers) -> None:
        self.done.append((transfers.pending[rid].room, RoomStats(100, 0.5, 0.01)))

    def shutdown(self) -> None:
        pass


def setup(
    prefill_s: float = 3600.0, transfer_s: float = 60.0
) -> tuple[Scheduler, FakeControl, DecodeTransfers]:
    kv = KVManager(PAGES, PAGE, disable_radix_cache=False)
    sched = Scheduler(SchedulerConfig(), kv, 4096, (0,))
    control = FakeControl(kv)
    transfers = DecodeTransfers(sched, control, LAYOUT, prefill_s, transfer_s)  # type: ignore[arg-type]
    return sched, control, transfers


def req(rid: str, n: int, max_new: int = 4) -> Req:
    return Req(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new, temperature=0))


def test_reserve_in_order_while_memory_lasts_and_tell_where() -> None:
    sched, control, t = setup()
    for rid, n in (("a", 40), ("b", 60), ("c", 40)):
        t.add(req(rid, n))
    reserved = t.reserve()
    assert [rid for rid, _ in reserved] == ["a", "b"]  # c waits: 100 of 128 tokens taken
    dest = KVDestination.from_json(reserved[0][1])
    assert dest.layout == LAYOUT and dest.room in control.open_rooms
    assert sum(n for _, n in control.open_rooms[dest.room]) == 40  # one slot per position
    assert t.stats()["pd_transfers_waiting"] == 1 and t.stats()["pd_transfers_active"] == 2
    with pytest.raises(ValueError, match="already in use"):
        t.add(req("a", 4))


@pytest.mark.parametrize("kv_first", [True, False])
def test_decodes_once_kv_and_first_token_are_both_in(kv_first: bool) -> None:
    sched, control, t = setup()
    t.add(req("a", 40))
    t.reserve()
    if kv_first:
        control.finish("a", t)
    else:
        t.prefilled("a", 7, -0.5, [])
    assert t.step() == [] and "a" not in sched.reqs
    if kv_first:
        t.prefilled("a", 7, -0.5, [])
    else:
        control.finish("a", t)
    (update,) = t.step()
    assert update.new_token_ids == [7] and update.ttft is not None
    batch = sched.schedule()
    assert batch is not None and batch.slices[0].input_ids == [7]  # the first token, fed
    assert batch.slices[0].prefix_len == 40  # after the prompt's transferred KV
    assert t.stats()["pd_transfers_done"] == 1 and t.stats()["pd_transfer_bytes"] == 100


def test_abort_closes_the_room_before_the_pages_go() -> None:
    sched, control, t = setup()
    free = sched.kv.allocator.num_free
    t.add(req("a", 40))
    t.reserve()
    held = free - sched.kv.allocator.num_free
    assert held == 10
    t.abort("a")
    assert control.log == [("close", free - held)]  # closed while the pages were still held
    assert sched.kv.allocator.num_free == free and not control.open_rooms and not t.active


def test_kv_late_after_the_first_token_fails_and_frees_everything() -> None:
    sched, control, t = setup(transfer_s=0.0)
    free = sched.kv.allocator.num_free
    t.add(req("a", 40))
    t.add(req("b", 100))  # waits for pages, which a's failure gives back
    t.reserve()
    assert t.step() == []  # the prompt may wait in the prefill server's queue
    t.prefilled("a", 7, -0.5, [])
    (update,) = t.step()
    assert update.finish_reason == "error" and "did not arrive" in (update.error or "")
    assert sched.kv.allocator.num_free == free and not control.open_rooms
    assert t.stats()["pd_transfers_failed"] == 1
    assert [rid for rid, _ in t.reserve()] == ["b"]


def test_a_waiting_request_aborts_without_pages() -> None:
    sched, control, t = setup()
    t.add(req("a", 120))
    t.add(req("b", 40))
    t.reserve()
    update = t.abort("b")
    assert update is not None and update.finish_reason == "abort" and "b" not in t
    assert t.abort("nobody") is None


def test_a_prompt_never_prefilled_fails_at_the_cap() -> None:
    sched, control, t = setup(prefill_s=0.0, transfer_s=0.0)
    free = sched.kv.allocator.num_free
    t.add(req("a", 40))
    t.reserve()
    (update,) = t.step()
    assert update.finish_reason == "error" and "not prefilled" in (update.error or "")
    assert sched.kv.allocator.num_free == free and not control.open_rooms


def test_a_refused_room_fails_its_request_alone() -> None:
    """A rank refusing to open a room (its checks: slots, lifetime, a duplicate room) fails
    that request with an error and frees its pages; the engine and the others go on."""
    sched, control, t = setup()
    control.refuse = {40}
    free = sched.kv.allocator.num_free
    t.add(req("a", 40))
    t.add(req("b", 20))
    assert [rid for rid, _ in t.reserve()] == ["b"]
    (update,) = t.step()
    assert update.rid == "a" and update.finish_reason == "error"
    assert update.error is not None and "refused" in update.error
    assert sched.kv.allocator.num_free == free - 20 // PAGE  # only b's pages are held
    assert t.stats()["pd_transfers_failed"] == 1 and "a" not in t


# -- the prefill call, made by the engine ---------------------------------------------------


class FakeCalls:
    """Stands in for PrefillCalls: records what is started and cancelled; the test ends
    the calls."""

    def __init__(self) -> None:
        self.started: dict[str, tuple[PrefillCall, dict]] = {}
        self.cancelled: list[str] = []
        self.ended: list[tuple[str, First | PrefillFailed]] = []

    def start(self, rid: str, call: PrefillCall, destination: dict) -> None:
        self.started[rid] = (call, destination)

    def done(self) -> list[tuple[str, First | PrefillFailed]]:
        out, self.ended = self.ended, []
        return out

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)

    def shutdown(self) -> None:
        pass


def with_calls() -> tuple[Scheduler, FakeControl, DecodeTransfers, FakeCalls]:
    sched, control, t = setup()
    calls = FakeCalls()
    t.calls = calls  # type: ignore[assignment]
    return sched, control, t, calls


def call_of(r: Req) -> PrefillCall:
    return PrefillCall("http://p:1", r.input_ids, r.sampling, False, 0)


def test_the_call_starts_once_pages_and_room_are_there_and_its_token_starts_decoding() -> None:
    sched, control, t, calls = with_calls()
    a, b = req("a", 100), req("b", 60)
    t.add(a, call_of(a))
    t.add(b, call_of(b))  # no pages for it yet: no call either
    t.reserve()
    assert list(calls.started) == ["a"]
    call, dest = calls.started["a"]
    assert call.url == "http://p:1" and KVDestination.from_json(dest).room in control.open_rooms
    calls.ended.append(("a", (7, -0.5, [])))
    control.finish("a", t)
    (update,) = t.step()
    assert update.rid == "a" and update.new_token_ids == [7] and "a" in sched.reqs


@pytest.mark.parametrize("invalid", [True, False])
def test_a_failed_call_fails_its_request_alone_and_frees_everything(invalid: bool) -> None:
    sched, control, t, calls = with_calls()
    free = sched.kv.allocator.num_free
    a, b = req("a", 40), req("b", 40)
    t.add(a, call_of(a))
    t.add(b, call_of(b))
    t.reserve()
    calls.ended.append(("a", PrefillFailed("the prefill server rejected it", invalid=invalid)))
    (update,) = t.step()
    assert (update.rid, update.finish_reason) == ("a", "error")
    assert update.error_kind == ("invalid" if invalid else "engine")
    assert calls.cancelled == ["a"] and [r for r, _ in control.log] == ["close"]
    assert t.stats()["pd_transfers_failed"] == 0  # the call failed, not a transfer
    assert "b" in t.pending and sched.kv.allocator.num_free == free - 10


def test_an_abort_cancels_the_call() -> None:
    sched, control, t, calls = with_calls()
    a = req("a", 40)
    t.add(a, call_of(a))
    t.reserve()
    t.abort("a")
    assert calls.cancelled == ["a"] and not control.open_rooms and not t.active
    calls.ended.append(("a", (7, -0.5, [])))  # a late answer finds nothing to start
    assert t.step() == [] and "a" not in sched.reqs
