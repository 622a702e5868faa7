"""Per-stage timelines: when each stage ran which micro-batch, and when it waited.

Workers record events as they go; `pipeserve bench --trace` writes them as a Chrome/Perfetto
trace and `--timeline` draws the Gantt chart users read to find bubbles.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeserve.scheduler.batch import ScheduledBatch

# Every process keeps its latest events in a ring for `--timeline` and the profiles; a
# server that never asks for them must not grow: 20K events (~1 KB each with a batch's
# request ids) bound it to ~20 MB per process, and cover 10K micro-batches of a benchmark.
MAX_EVENTS = 20_000


@dataclass
class Event:
    kind: str  # "forward", "recv_wait", "send" (posted), "send_wait"
    stage: int
    tp_rank: int
    start: float  # seconds, wall clock (comparable across local processes)
    end: float
    batch_id: int = -1
    rids: list[str] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # chunk index per request (-1: decode)
    tokens: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)
    nbytes: int = 0  # "send": bytes this rank put on the link to the next stage


class Recorder:
    def __init__(self, stage: int = 0, tp_rank: int = 0) -> None:
        self.stage, self.tp_rank = stage, tp_rank
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)

    def add(
        self,
        kind: str,
        start: float,
        end: float,
        batch: ScheduledBatch | None = None,
        nbytes: int = 0,
    ) -> None:
        ev = Event(kind, self.stage, self.tp_rank, start, end, nbytes=nbytes)
        if batch is not None:
            ev.batch_id = batch.batch_id
            ev.rids = [s.rid for s in batch.slices]
            ev.chunks = [s.chunk_index for s in batch.slices]
            ev.tokens = [s.num_tokens for s in batch.slices]
            ev.prefix = [s.prefix_len for s in batch.slices]
        self.events.append(ev)

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Record the enclosed block (e.g. the scheduler's CPU work) as one event."""
        start = now()
        try:
            yield
        finally:
            self.add(kind, start, now())

    def take(self) -> list[Event]:
        out = list(self.events)
        self.events.clear()
        return out


def now() -> float:
    return time.time()


def forward_events(events: list[Event], tp_rank: int = 0) -> list[Event]:
    return [e for e in events if e.kind == "forward" and e.tp_rank == tp_rank]


def bubble_ratios(events: list[Event]) -> list[float]:
    """Per stage: idle share of the time between its first and last busy moment."""
    fwd = forward_events(events)
    out = []
    for stage in sorted({e.stage for e in fwd}):
        spans = sorted((e.start, e.end) for e in fwd if e.stage == stage)
        busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_end:
                busy += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        busy += cur_end - cur_start
        total = spans[-1][1] - spans[0][0]
        out.append(0.0 if total <= 0 else max(0.0, 1.0 - busy / total))
    return out


def stage_overlap(events: list[Event]) -> float:
    """How much adjacent pipeline stages computed at the same time: for each pair of
    neighbours, the time both ran a forward over the busy time of the less busy one; the
    smallest over all pairs (1.0 for one stage). A pipeline that runs one stage at a time
    scores 0; K equal chunks on P stages score (K - 1) / K."""
    fwd = forward_events(events)
    stages = sorted({e.stage for e in fwd})
    busy = {s: _union([(e.start, e.end) for e in fwd if e.stage == s]) for s in stages}
    shares = []
    for a, b in zip(stages, stages[1:], strict=False):
        both = _intersect(busy[a], busy[b])
        least = min(_length(busy[a]), _length(busy[b]))
        shares.append(both / least if least > 0 else 0.0)
    return min(shares, default=1.0)


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def boundary_bytes(events: list[Event]) -> list[dict[str, float]]:
    """Per stage boundary (stage s -> s + 1): bytes sent by all of stage s's TP ranks, in
    total and per micro-batch."""
    sends = [e for e in events if e.kind == "send"]
    out = []
    for stage in sorted({e.stage for e in sends}):
        mine = [e for e in sends if e.stage == stage]
        total = sum(e.nbytes for e in mine)
        batches = len({e.batch_id for e in mine})
        out.append({"bytes": total, "per_micro_batch": total / batches if batches else 0.0})
    return out


CPU_KINDS = ("schedule", "prepare", "process")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def hidden_cpu_time(events: list[Event]) -> tuple[float, float]:
    """(scheduler CPU seconds, of which spent while the first stage was computing): how much
    of the CPU-side step time the overlap hid."""
    cpu = _union([(e.start, e.end) for e in events if e.kind in CPU_KINDS])
    busy = _union([(e.start, e.end) for e in forward_events(events) if e.stage == 0])
    total = sum(e - s for s, e in cpu)
    hidden, j = 0.0, 0
    for s, e in cpu:
        while j < len(busy) and busy[j][1] <= s:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < e:
            hidden += min(e, busy[k][1]) - max(s, busy[k][0])
            k += 1
    return total, hidden


def write_trace(events: list[Event], path: str | Path) -> None:
    """Chrome trace format (open in chrome://tracing or ui.perfetto.dev)."""
    t0 = min((e.start for e in events), default=0.0)
    trace = [
        {
            "name": e.kind if e.kind != "forward" else _label(e),
            "cat": e.kind,
            "ph": "X",
            "pid": e.stage,
            "tid": e.tp_rank,
            "ts": (e.start - t0) * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "args": {k: v for k, v in asdict(e).items() if k not in ("start", "end")},
        }
        for e in events
    ]
    meta = [
        {"name": "process_name", "ph": "M", "pid": s, "args": {"name": name}}
        for s, name in sorted({(e.stage, _row_name(e)) for e in events})
    ]
    Path(path).write_text(json.dumps({"traceEvents": meta + trace}))


def _row_name(e: Event) -> str:
    return "scheduler" if e.kind in CPU_KINDS else f"stage {e.stage}"


def _label(e: Event) -> str:
    parts = [
        f"{r[:6]}#{c}" if c >= 0 else f"{r[:6]}:dec" for r, c in zip(e.rids, e.chunks, strict=True)
    ]
    return " ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")


def draw_timeline(panels: list[tuple[str, list[Event]]], path: str | Path) -> None:
    """Gantt chart: one panel per run, a row per stage, a colour per request, the chunk index
    in each box; white space is idle time (bubbles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [max(1, len({e.stage for e in ev})) for _, ev in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(14, sum(0.8 + 0.6 * r for r in rows)),
        squeeze=False,
        gridspec_kw={"height_ratios": rows},
    )
    for ax, (title, events) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, title, forward_events(events))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_panel(ax: Any, title: str, fwd: list[Event]) -> None:
    import matplotlib.pyplot as plt

    if not fwd:
        ax.set_title(f"{title} (no events)")
        return
    t0 = min(e.start for e in fwd)
    stages = sorted({e.stage for e in fwd})
    rids = sorted({e.rids[0] for e in fwd if e.rids})
    colors = plt.get_cmap("tab20")
    for e in fwd:
        color = colors(rids.index(e.rids[0]) % 20) if e.rids else "grey"
        y = stages.index(e.stage)
        ax.barh(
            y,
            e.end - e.start,
            left=e.start - t0,
            height=0.8,
            color=color,
            edgecolor="black",
            linewidth=0.4,
        )
        chunk = e.chunks[0] if e.chunks else -1
        label = str(chunk) if chunk >= 0 else "d"
        ax.text(
            e.start - t0 + (e.end - e.start) / 2,
            y,
            label,
            ha="center",
            va="center",
            fontsize=7,
            clip_on=True,
        )
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ratios = bubble_ratios(fwd)
    ax.set_title(f"{title} — bubble ratio per stage: " + ", ".join(f"{r:.2f}" for r in ratios))
    ax.set_xlabel("seconds")
