"""Per-stage timelines: when each stage ran which micro-batch, and when it waited.

Workers record events as they go; `pipeserve bench --trace` writes them as a Chrome/Perfetto
trace and `--timeline` draws the Gantt chart users read to find bubbles. Communication spans
inside a forward (MoE dispatch and combine halves per layer, TP all-reduces) go to a log of
their own, which the model runner's recorder drains; the bench turns them into bytes per
forward and exposed (waited) seconds per kind.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, deque
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
# Communication spans come several per layer per forward, so they have a ring of their own and
# never push forward events out of a recorder's: 100K spans (~200 bytes each) bound it to
# ~20 MB per process, ~400 forwards of a 61-layer MoE model under EP.
MAX_COMM_SPANS = 100_000


@dataclass
class Event:
    # "forward", "recv_wait", "send" (posted), "send_wait"; communication spans (record_comm):
    # "dispatch_launch", "dispatch_wait", "combine_launch", "combine_wait", "tp_all_reduce";
    # context parallelism: "cp_kv_launch", "cp_kv_wait", "cp_kv_exchange" (launch to the end
    # of its wait), "cp_merge" (query gather, partials all-to-all), "cp_rows_fetch" (V3.2's
    # chosen prefix rows asked of their holders), "cp_hidden_gather";
    # shard linear: "shard_linear_launch", "shard_linear_wait"; "weights" (after each
    # forward: nbytes = the most weight bytes the rank held so far, nbytes_recv = shard
    # linear's expected peak)
    kind: str
    stage: int
    tp_rank: int
    start: float  # seconds, wall clock (comparable across local processes)
    end: float
    batch_id: int = -1
    rids: list[str] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # chunk index per request (-1: decode)
    tokens: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)
    # bytes this rank sent: "send" to the next stage; "tp_all_reduce" the ring algorithm's
    # share (see communication.tp_all_reduce); "dispatch_launch"/"combine_launch" to other ranks
    nbytes: int = 0
    nbytes_recv: int = 0  # "dispatch_launch"/"combine_launch": bytes from other ranks
    layer: int = -1  # communication spans of a MoE layer: its layer id
    micro_batch: int = -1  # spans inside an overlapped forward: which micro-batch (0 = A)


# (kind, start, end, layer, nbytes, nbytes_recv, micro-batch) per span, in the order they ended
CommSpan = tuple[str, float, float, int, int, int, int]
_comm_log: deque[CommSpan] = deque(maxlen=MAX_COMM_SPANS)
_micro_batch = -1  # the micro-batch an overlapped forward is running now (-1: none)


def set_micro_batch(mb: int) -> None:
    """Tag the spans logged from now on with micro-batch `mb` (-1: none)."""
    global _micro_batch
    _micro_batch = mb


def record_comm(
    kind: str, start: float, layer: int = -1, nbytes: int = 0, nbytes_recv: int = 0
) -> None:
    """Log a communication span of this process from `start` (a `now()`) until now. Called
    per layer per forward, so it builds one tuple and appends it (thread-safe, no lock)."""
    _comm_log.append((kind, start, now(), layer, nbytes, nbytes_recv, _micro_batch))


def record_op(name: str, start: float) -> None:
    """Log an operation of an overlapped forward (kind "op:<name>") from `start` until now."""
    record_comm(f"op:{name}", start)


def drain_comm() -> list[CommSpan]:
    """Take every logged span out of this process's log, oldest first."""
    return [_comm_log.popleft() for _ in range(len(_comm_log))]


class Recorder:
    """A process's events. With `comm` (the model runner's recorder), `take` also drains the
    process's communication log, stamped with this recorder's stage and rank."""

    def __init__(self, stage: int = 0, tp_rank: int = 0, comm: bool = False) -> None:
        self.stage, self.tp_rank, self.comm = stage, tp_rank, comm
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)

    def add(
        self,
        kind: str,
        start: float,
        end: float,
        batch: ScheduledBatch | None = None,
        nbytes: int = 0,
        nbytes_recv: int = 0,
    ) -> None:
        ev = Event(kind, self.stage, self.tp_rank, start, end, nbytes=nbytes)
        ev.nbytes_recv = nbytes_recv
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
        if self.comm:
            out += [self._comm_event(span) for span in drain_comm()]
        return out

    def _comm_event(self, span: CommSpan) -> Event:
        kind, start, end, layer, sent, recv, mb = span
        ev = Event(kind, self.stage, self.tp_rank, start, end, nbytes=sent, layer=layer)
        ev.nbytes_recv, ev.micro_batch = recv, mb
        return ev


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


def makespan_idle_share(events: list[Event]) -> float:
    """Idle share of the whole run over all stages: 1 - (busy seconds summed over the stages)
    / (stages x (last forward end - first forward start)). For M equal micro-batches on P
    equal stages with free transfers this is the textbook (P - 1) / (P - 1 + M); unlike
    `bubble_ratios` it counts a stage's wait before its first and after its last forward."""
    fwd = forward_events(events)
    if not fwd:
        return 0.0
    stages = {e.stage for e in fwd}
    span = max(e.end for e in fwd) - min(e.start for e in fwd)
    busy = sum(_length(_union([(e.start, e.end) for e in fwd if e.stage == s])) for s in stages)
    return 0.0 if span <= 0 else max(0.0, 1.0 - busy / (len(stages) * span))


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


# Per communication kind the bench reports: the event whose `nbytes` (bytes the rank sent)
# counts its traffic, and the spans in which a rank waited for it. The launch of a dispatch
# blocks on its counts exchange, so it counts as waited; a combine launch does not wait. A
# stage's recv_wait also holds its bubbles (the previous stage has not finished the
# micro-batch), so pp_boundary's seconds are an upper bound; the first stage's recv_wait
# (waiting for the scheduler) is left out. Spans are host wall-clock: with gloo they are the
# waiting itself; on a GPU a wait only orders streams (and the dispatch launch's count read
# waits for the kernels before it), so there they place the waiting only roughly.
COMM_BYTES = {
    "tp_all_reduce": "tp_all_reduce",
    "pp_boundary": "send",
    "ep_dispatch": "dispatch_launch",
    "ep_combine": "combine_launch",
    "cp_kv": "cp_kv_launch",
    "cp_merge": "cp_merge",
    "cp_fetch": "cp_rows_fetch",
    "cp_hidden": "cp_hidden_gather",
    "shard_linear": "shard_linear_launch",
}
COMM_WAITS = {
    "tp_all_reduce": ("tp_all_reduce",),
    "pp_boundary": ("recv_wait", "send_wait"),
    "ep_dispatch": ("dispatch_launch", "dispatch_wait"),
    "ep_combine": ("combine_wait",),
    "cp_kv": ("cp_kv_wait",),
    "cp_merge": ("cp_merge",),
    "cp_fetch": ("cp_rows_fetch",),
    "cp_hidden": ("cp_hidden_gather",),
    "shard_linear": ("shard_linear_wait",),
}

Rank = tuple[int, int]  # (stage, rank within the stage)


def _forwards(events: list[Event]) -> Counter[Rank]:
    """Forwards per rank; the ranks are the ones that ran a forward."""
    return Counter((e.stage, e.tp_rank) for e in events if e.kind == "forward")


def comm_bytes_per_forward(events: list[Event]) -> dict[str, float]:
    """Per kind (COMM_BYTES): the bytes a rank sent per forward it ran, the largest over
    ranks (the rank whose links carry the most)."""
    forwards = _forwards(events)
    out = {}
    for kind, source in COMM_BYTES.items():
        sent: Counter[Rank] = Counter()
        for e in events:
            if e.kind == source:
                sent[e.stage, e.tp_rank] += e.nbytes
        out[kind] = max((sent[r] / n for r, n in forwards.items()), default=0.0)
    return out


def exposed_comm_s(events: list[Event]) -> dict[str, float]:
    """Per kind (COMM_WAITS): seconds a rank spent waiting for that communication over the
    whole run, the mean over ranks."""
    ranks = _forwards(events)
    waited = [e for e in events if (e.stage, e.tp_rank) in ranks and _waits_for_peer(e)]
    return {
        kind: sum(e.end - e.start for e in waited if e.kind in kinds) / max(1, len(ranks))
        for kind, kinds in COMM_WAITS.items()
    }


def _waits_for_peer(e: Event) -> bool:
    """The first stage's recv_wait waits for the scheduler, not for another rank."""
    return not (e.kind == "recv_wait" and e.stage == 0)


def forward_s_per_rank(events: list[Event]) -> float:
    """Seconds a rank spent in forwards over the run, the mean over ranks."""
    forwards = _forwards(events)
    total = sum(e.end - e.start for e in events if e.kind == "forward")
    return total / len(forwards) if forwards else 0.0


def exposed_comm_share(events: list[Event]) -> dict[str, float]:
    """Per kind: `exposed_comm_s` over `forward_s_per_rank` (dispatch, combine and all-reduce
    waits happen inside forwards, a pipeline stage's waits between them)."""
    forward_s = forward_s_per_rank(events)
    return {k: s / forward_s if forward_s else 0.0 for k, s in exposed_comm_s(events).items()}


def cp_kv_per_layer(events: list[Event]) -> dict[int, dict[str, float]]:
    """Context parallelism's per-layer K/V exchange, per forward of a rank (the mean over
    ranks and forwards): seconds from its launch to the end of its wait (`span_s`), seconds
    waited (`exposed_s`: what the query projection did not hide) and the hidden share."""
    forwards = sum(_forwards(events).values())
    out: dict[int, dict[str, float]] = {}
    for layer in sorted({e.layer for e in events if e.kind == "cp_kv_exchange"}):
        span = sum(
            e.end - e.start for e in events if e.kind == "cp_kv_exchange" and e.layer == layer
        )
        waited = sum(e.end - e.start for e in events if e.kind == "cp_kv_wait" and e.layer == layer)
        out[layer] = {
            "span_s": span / max(1, forwards),
            "exposed_s": waited / max(1, forwards),
            "hidden_share": 1 - waited / span if span else 0.0,
        }
    return out


def weight_bytes_per_device(events: list[Event]) -> tuple[int, int]:
    """(the most weight bytes any rank held, the most shard linear's plan expects of any rank)
    from the ranks' "weights" events; (0, 0) without any."""
    held = [e for e in events if e.kind == "weights"]
    if not held:
        return 0, 0
    return max(e.nbytes for e in held), max(e.nbytes_recv for e in held)


def split_forward_share(events: list[Event]) -> float:
    """Of the forwards of each rank, the share that ran as two micro-batches (an operation of
    micro-batch B inside), the mean over ranks."""
    shares = []
    for rank in _forwards(events):
        forwards = [e for e in events if e.kind == "forward" and (e.stage, e.tp_rank) == rank]
        b_ops = [e.start for e in events if e.micro_batch == 1 and (e.stage, e.tp_rank) == rank]
        split = sum(any(f.start <= t <= f.end for t in b_ops) for f in forwards)
        shares.append(split / len(forwards) if forwards else 0.0)
    return statistics.fmean(shares) if shares else 0.0


def afd_bytes_per_step(events: list[Event], attention_size: int) -> float:
    """Attention-FFN disaggregation: bytes the attention workers (ranks below
    `attention_size`) sent to and got back from the FFN workers, per step. Every such byte
    crosses between nodes (the two kinds never share one)."""
    mine = [e for e in events if e.tp_rank < attention_size]
    sent = sum(e.nbytes for e in mine if e.kind == "dispatch_launch")
    back = sum(e.nbytes_recv for e in mine if e.kind == "combine_wait")
    return _per_step(sent + back, events)


def _per_step(total: float, events: list[Event]) -> float:
    """`total` per forward of the first stage's first rank (one per step)."""
    steps = _forwards(events)[0, 0]
    return total / steps if steps else 0.0


def afd_in_node_bytes_per_step(events: list[Event]) -> float:
    """Attention-FFN disaggregation, two-stage dispatch: bytes the FFN workers sent each
    other inside their nodes (forwarded rows and the partial sums back), per step."""
    return _per_step(sum(e.nbytes for e in events if e.kind == "afd_in_node"), events)


def micro_batch_seconds(events: list[Event], count: int) -> list[float]:
    """Per micro-batch, the seconds its operations took per forward of rank 0 (the first
    stage's first rank), the mean over forwards."""
    spent = [0.0] * count
    for e in events:
        first = (e.stage, e.tp_rank) == (0, 0)
        if first and e.kind.startswith("op:") and 0 <= e.micro_batch < count:
            spent[e.micro_batch] += e.end - e.start
    return [_per_step(s, events) for s in spent]


def afd_idle_shares(events: list[Event], attention_size: int) -> dict[int, float]:
    """Per worker (global rank), the share of its forward time spent waiting for the other
    kind: an attention worker for its partial sums, an FFN worker for its rows."""
    shares = {}
    for rank in sorted({e.tp_rank for e in events if e.kind == "forward"}):
        waits = "combine_wait" if rank < attention_size else "dispatch_wait"
        mine = [e for e in events if e.tp_rank == rank]
        busy = sum(e.end - e.start for e in mine if e.kind == "forward")
        waited = sum(e.end - e.start for e in mine if e.kind == waits)
        shares[rank] = waited / busy if busy else 0.0
    return shares


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
            "name": _name(e),
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


def _name(e: Event) -> str:
    if e.kind == "forward":
        return _label(e)
    name = e.kind if e.layer < 0 else f"{e.kind} L{e.layer}"
    if e.micro_batch < 0:
        return name
    return f"{name} [{'ABCDEFGH'[e.micro_batch] if e.micro_batch < 8 else e.micro_batch}]"


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


WAIT_KINDS = ("dispatch_launch", "dispatch_wait", "combine_wait", "tp_all_reduce")
COMM_OPS = ("op:dispatch_a", "op:dispatch_b", "op:combine_a", "op:combine_b")


def _ffn_waits(events: list[Event], fwd: Event) -> list[Event]:
    """The dispatch waits, inside `fwd`'s window, of the first rank that waits for rows but
    runs no operations of its own (an FFN worker of attention-FFN disaggregation)."""
    with_ops = {e.tp_rank for e in events if e.kind.startswith("op:")}
    waiting = sorted(
        {e.tp_rank for e in events if e.kind == "dispatch_wait" and e.tp_rank not in with_ops}
    )
    if not waiting:
        return []
    return [
        e
        for e in events
        if e.kind == "dispatch_wait" and e.tp_rank == waiting[0] and fwd.start <= e.start <= fwd.end
    ]


def overlapped_forward(events: list[Event]) -> Event | None:
    """The longest forward of the first stage's rank 0 in which two micro-batches ran."""
    ops = [e for e in events if e.kind.startswith("op:") and e.micro_batch >= 1]
    found = [
        f
        for f in forward_events(events)
        if f.stage == 0 and any(f.start <= o.start <= f.end and o.stage == 0 for o in ops)
    ]
    return max(found, key=lambda f: f.end - f.start, default=None)


def draw_overlap(panels: list[tuple[str, list[Event]]], path: str | Path) -> bool:
    """Inside one overlapped forward per run (the longest): a row per micro-batch with its
    operations (compute) and one with its waits for communication (dispatch launch and wait,
    combine wait), so hidden transfers show as one micro-batch computing while the other
    waits. False if no run has an overlapped forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(t, ev, f) for t, ev in panels if (f := overlapped_forward(ev)) is not None]
    if not shown:
        return False
    fig, axes = plt.subplots(len(shown), 1, figsize=(14, 2.6 * len(shown)), squeeze=False)
    for ax, (title, events, fwd) in zip(axes[:, 0], shown, strict=True):
        _draw_overlap_panel(ax, title, events, fwd)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _draw_overlap_panel(ax: Any, title: str, events: list[Event], fwd: Event) -> None:
    """A row of compute and one of waits per micro-batch (A, B, C, ...); under attention-FFN
    disaggregation also a row of the first FFN worker's waits for rows (it computes between
    them)."""
    inside = [
        e
        for e in events
        if e.stage == fwd.stage and e.tp_rank == fwd.tp_rank and fwd.start <= e.start <= fwd.end
    ]
    count = 1 + max((e.micro_batch for e in inside), default=0)
    letters = [chr(ord("A") + m) for m in range(count)]
    rows = [f"{x} {what}" for x in letters for what in ("compute", "waits")]
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for e in inside:
        if e.micro_batch < 0 or not (e.kind.startswith("op:") or e.kind in WAIT_KINDS):
            continue
        if e.kind in COMM_OPS:  # mostly waiting: shown by their dispatch/combine spans
            continue
        compute = e.kind.startswith("op:")
        y = 2 * e.micro_batch + (0 if compute else 1)
        color = colors[e.micro_batch % len(colors)] if compute else "tab:red"
        ax.barh(y, e.end - e.start, left=e.start - fwd.start, height=0.8, color=color)
    ffn = _ffn_waits(events, fwd)
    if ffn:
        rows.append("FFN waits")
        for e in ffn:
            ax.barh(
                len(rows) - 1,
                e.end - e.start,
                left=e.start - fwd.start,
                height=0.8,
                color="tab:gray",
            )
    waits = sum(e.end - e.start for e in inside if e.kind in WAIT_KINDS and e.micro_batch >= 0)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the forward")
    ax.set_title(
        f"{title} — one forward ({fwd.end - fwd.start:.3f} s, batch {fwd.batch_id}), "
        f"{waits:.3f} s waited on communication"
    )
