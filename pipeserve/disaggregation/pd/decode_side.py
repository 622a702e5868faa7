"""The decode server's side of a disaggregated request, in its engine process, as one
state machine: reserve the prompt's pages, open a room for them on every decode rank, call
the prefill server with where to send the KV (prefill_client.py), and hand the request to
the scheduler once both its KV (every rank's done notice) and its first token (the prefill
server's answer) are in.

    waiting (no pages yet) -> pending: room open, call in flight -> first token in
        -> KV in (both, in either order) -> the scheduler decodes it

Every way out frees what the request holds: an abort (the client gone), a failed call, or a
transfer that overruns the timeout cancels the call and closes the room on every rank (so
no late message can write into the pages) before the pages are released.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.disaggregation.pd.prefill_client import PrefillCall, PrefillCalls, PrefillFailed
from pipeserve.disaggregation.pd.transfer import (
    ReceiverControl,
    RoomRefused,
    RoomStats,
    new_room,
)
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler

Top = list[tuple[int, float]]


@dataclass
class _Pending:
    req: Req
    room: str
    opened_at: float
    first: tuple[int, float, Top] | None = None  # the prefill side's first token
    first_at: float = 0.0  # when it came
    kv: RoomStats | None = None  # set once every rank has all of the KV


@dataclass
class TransferTotals:
    done: int = 0
    failed: int = 0
    nbytes: int = 0
    wire_s: float = 0.0
    exposed_s: float = 0.0

    def stats(self, active: int, waiting: int) -> dict[str, Any]:
        return {
            "pd_transfers_done": self.done,
            "pd_transfers_failed": self.failed,
            "pd_transfers_active": active,
            "pd_transfers_waiting": waiting,
            "pd_transfer_bytes": self.nbytes,
            "pd_transfer_wire_s": self.wire_s,
            "pd_transfer_exposed_s": self.exposed_s,
        }


class DecodeTransfers:
    def __init__(
        self,
        scheduler: Scheduler,
        control: ReceiverControl,
        layout: SideLayout,
        prefill_timeout_s: float,
        transfer_timeout_s: float,
        calls: PrefillCalls | None = None,
    ) -> None:
        """The KV must be in `transfer_timeout_s` after the first token came (its last layer
        was computed by then); the whole, within the prefill timeout plus that (a cap: the
        call fails the request first when the prefill server dies or takes too long).
        `calls`: where the prefill calls run (None: whoever drives this calls `prefilled`)."""
        self.scheduler, self.control, self.layout = scheduler, control, layout
        self.prefill_timeout_s, self.transfer_timeout_s = prefill_timeout_s, transfer_timeout_s
        self.calls = calls
        self.waiting: deque[tuple[Req, PrefillCall | None]] = deque()  # no pages yet
        self.pending: dict[str, _Pending] = {}
        self.refused: list[RequestUpdate] = []  # requests whose room a rank refused
        self.totals = TransferTotals()

    def __contains__(self, rid: str) -> bool:
        return rid in self.pending or any(r.rid == rid for r, _ in self.waiting)

    @property
    def active(self) -> bool:
        return bool(self.pending or self.waiting)

    def add(self, req: Req, call: PrefillCall | None = None) -> None:
        """Queue a request for pages, its prefill `call` made once it has them; ValueError
        if it can never be served."""
        if req.rid in self or req.rid in self.scheduler.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.scheduler.check_request(len(req.input_ids), req.sampling.max_new_tokens)
        self.waiting.append((req, call))

    def reserve(self) -> list[tuple[str, dict[str, Any]]]:
        """Pages and a room for queued requests, in order, while memory lasts, and their
        prefill calls started: (rid, the destination the prefill side sends to) for each."""
        out = []
        while self.waiting:
            req, call = self.waiting[0]
            runs = self.scheduler.reserve_transfer(req)
            if runs is None:
                break
            self.waiting.popleft()
            room = new_room()
            try:
                self.control.open(room, runs, len(req.input_ids))
            except RoomRefused as exc:  # this request fails alone
                self.scheduler.drop_transfer(req)
                self.totals.failed += 1
                update = RequestUpdate(req.rid, finish_reason="error")
                update.error = str(exc)
                self.refused.append(update)
                continue
            except BaseException:
                self.scheduler.drop_transfer(req)
                raise
            self.pending[req.rid] = _Pending(req, room, time.monotonic())
            dest = KVDestination(room, self.control.endpoints, self.layout).to_json()
            if self.calls is not None and call is not None:
                self.calls.start(req.rid, call, dest)
            out.append((req.rid, dest))
        return out

    def prefilled(self, rid: str, token: int, logprob: float, top: Top) -> None:
        p = self.pending.get(rid)
        if p is not None:
            p.first, p.first_at = (token, logprob, top), time.monotonic()

    def step(self) -> list[RequestUpdate]:
        """Requests whose KV and first token are both in start decoding (their first token
        is their first update); transfers past the timeout fail."""
        updates, self.refused = self.refused, []
        for rid, answer in self.calls.done() if self.calls is not None else []:
            if isinstance(answer, PrefillFailed):
                if rid in self.pending:  # the call failed, not the transfer: not counted
                    update = self._fail(rid, "error", counted=False)
                    update.error = str(answer)
                    update.error_kind = "invalid" if answer.invalid else "engine"
                    updates.append(update)
            else:
                self.prefilled(rid, *answer)
        for room, stats in self.control.poll():
            p = next((p for p in self.pending.values() if p.room == room), None)
            if p is not None:
                p.kv = stats
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if p.kv is not None and p.first is not None:
                del self.pending[rid]
                self._count(p.kv)
                updates.append(self.scheduler.start_decoding(p.req, *p.first))
            elif (late := self._late(p, now)) is not None:
                update = self._fail(rid, "error")
                update.error = late
                updates.append(update)
        return updates

    def _late(self, p: _Pending, now: float) -> str | None:
        """Why a transfer has taken too long, if it has."""
        t = self.transfer_timeout_s
        if p.first is not None and now - p.first_at > t:
            return (
                f"the prompt's KV did not arrive within --disaggregation-transfer-timeout {t:g}s "
                "after the prefill server answered"
            )
        if now - p.opened_at > self.prefill_timeout_s + t:
            return (
                "the prompt was not prefilled within --disaggregation-prefill-timeout "
                f"{self.prefill_timeout_s:g}s"
            )
        return None

    def abort(self, rid: str) -> RequestUpdate | None:
        """End a request still waiting for pages or KV (None if it is not here)."""
        queued = next((w for w in self.waiting if w[0].rid == rid), None)
        if queued is not None:
            self.waiting.remove(queued)
            return RequestUpdate(rid, finish_reason="abort")
        return self._fail(rid, "abort") if rid in self.pending else None

    def _fail(self, rid: str, reason: str, counted: bool = True) -> RequestUpdate:
        p = self.pending.pop(rid)
        if self.calls is not None:
            self.calls.cancel(rid)  # the prefill server aborts the prompt
        try:
            self.control.close(p.room)  # no rank writes into the pages after this
        finally:
            self.scheduler.drop_transfer(p.req)
        self.totals.failed += counted and reason == "error"
        return RequestUpdate(rid, finish_reason=reason)

    def _count(self, s: RoomStats) -> None:
        t = self.totals
        t.done += 1
        t.nbytes += s.nbytes
        t.wire_s += s.wire_s
        t.exposed_s += s.exposed_s

    def stats(self) -> dict[str, Any]:
        stats = self.totals.stats(len(self.pending), len(self.waiting))
        return stats | {"pd_kv_messages_dropped": self.control.dropped}

    def shutdown(self) -> None:
        if self.calls is not None:
            self.calls.shutdown()
        self.control.shutdown()
