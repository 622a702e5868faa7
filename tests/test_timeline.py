"""The per-process event ring: a server that records every micro-batch and never asks for
its timeline must not grow without bound (a 10-minute soak grew each worker ~6 MB/min with
a 200K-event ring)."""

from __future__ import annotations

from pipeserve import timeline
from pipeserve.timeline import Recorder


def test_the_recorder_keeps_only_the_latest_events() -> None:
    rec = Recorder()
    for i in range(timeline.MAX_EVENTS + 500):
        rec.add("forward", float(i), float(i) + 0.5)
    events = rec.take()
    assert len(events) == timeline.MAX_EVENTS
    assert events[0].start == 500.0 and events[-1].start == timeline.MAX_EVENTS + 499
    assert timeline.MAX_EVENTS * 1500 <= 32 * 2**20  # ~1.4 KB per event of a 32-request batch
