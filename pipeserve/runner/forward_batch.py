"""A scheduled batch turned into tensors (the model runner's one `prepare` step)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, TypeVar

import torch

from pipeserve.backends.base import AttentionBackend, AttentionPlan, Segment
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.context_parallel.attention import CpContext, CpPlan
from pipeserve.layers.attention import plan_attention
from pipeserve.layers.attention_parts import SlotRuns
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.mem_cache.kv_pool import PAD_SLOT, KVPool
from pipeserve.scheduler.batch import ReqSlice, Run, ScheduledBatch, runs_prefix

Mover = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # host tensors -> the device's


@dataclass
class LatentSlots:
    """MLA's per-request segments. Built on the host for a device (`table`), their slots are
    one slot-run table, copied in O(runs + requests) however long the contexts are; every
    position's slot is made in one expansion on the device after the copy (`expanded`), each
    segment's slots a slice of it. Built where they run (the CPU), each segment makes its
    slots from its runs only if read."""

    segments: list[LatentSegment] = field(default_factory=list)  # once expanded, if a table
    table: SlotRuns | None = None
    heads: list[tuple[int, int, tuple[Run, ...]]] = field(default_factory=list)  # (row, n, runs)

    @classmethod
    def build(cls, segments: list[Segment], device: torch.device, table: bool) -> LatentSlots:
        """The segments of requests whose positions [0, prefix_len + q_len) lie in their
        runs; `table`: as a slot-run table to move (an empty batch has none)."""
        used = [runs_prefix(runs, prefix + n) for _, n, prefix, runs in segments]
        heads = [(row, n, tuple(r)) for (row, n, _, _), r in zip(segments, used, strict=True)]
        if table and segments:
            return cls(table=SlotRuns.build(used, device), heads=heads)
        return cls([LatentSegment(row, n, runs=r, device=device) for row, n, r in heads])

    def expanded(self) -> LatentSlots:
        if self.table is None or self.segments:
            return self
        slots, first, out = self.table.slots(), 0, []
        for row, n, runs in self.heads:
            length = sum(count for _, count in runs)
            out.append(LatentSegment(row, n, slots[first : first + length], runs=runs))
            first += length
        return replace(self, segments=out)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]; negative = future-token placeholder
    positions: torch.Tensor  # [tokens]
    out_slots: torch.Tensor  # [tokens] KV slot each new token is written to
    attn: AttentionPlan  # the batch's attention backend and its plan (how it reads the cache)
    kv_pool: KVPool
    sample_rows: torch.Tensor  # [samples] row of each sampling slice's last token
    logprob_rows: torch.Tensor  # [n] rows whose prompt logprob is wanted
    logprob_targets: torch.Tensor  # [n] the token whose logprob each of those rows gives
    future_slots: torch.Tensor  # [samples] overlap loop: ring slot of each sampled token
    # latent (MLA) pools: each request's rows and the slots of all its positions
    latent: LatentSlots = field(default_factory=LatentSlots)
    # context parallelism: this rank's share of the batch (its rows are only some of the
    # batch's; sample and logprob rows index the batch's rows, gathered after the last layer)
    cp: CpPlan | None = None
    # on a device: the event that marks the end of the inputs' copy, and what was copied
    ready: Any = None
    uploaded: list[torch.Tensor] = field(default_factory=list)
    graphed: bool = False  # a decode step padded to a CUDA graph's bucket (cuda_graph.py)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def latent_segments(self) -> list[LatentSegment]:
        return self.latent.segments

    @classmethod
    def prepare(
        cls,
        batch: ScheduledBatch,
        pool: KVPool,
        device: torch.device,
        backend: AttentionBackend | None = None,
        cp: CpContext | None = None,
        move: Mover | None = None,
    ) -> ForwardBatch:
        """The batch's tensors on `device`. With `move` (the model runner's on a device: the
        tensors packed into a pinned buffer, one non-blocking copy on the copy stream) every
        tensor is built on the host (`build`) and then moved, all at once, and a backend's
        page tables are expanded on the device after the copy; without, built on `device`
        directly. (A CUDA graph's step is built on the host alone: `build(pad_to=...)`,
        copied by `DecodeGraphs.load`.)"""
        fb = cls.build(batch, pool, device, backend, cp, move is not None)
        return (fb if move is None else fb.moved(move)).expanded()

    @classmethod
    def build(
        cls,
        batch: ScheduledBatch,
        pool: KVPool,
        device: torch.device,
        backend: AttentionBackend | None = None,
        cp: CpContext | None = None,
        on_host: bool = False,
        pad_to: int | None = None,
    ) -> ForwardBatch:
        """The batch's tensors built on the host (`on_host`: with host-side index
        arithmetic, to be moved) or on `device`, a backend's page tables as their slot runs
        (`expanded` makes them). (A context-parallel plan is built on `device` in both
        cases.) `backend`: the run's (the torch backend where None), which hands the batch to
        the backend that plans it. `pad_to`: a decode step padded with rows that read and
        write PAD_SLOT alone (token 0 at position 0, never sampled) to that many rows."""
        lists = HostLists.of(batch, cp is None, pad_to)
        host = torch.device("cpu") if on_host else device

        def tensor(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=host)

        ids, positions, segments = lists.ids, lists.positions, lists.segments
        chosen = (backend or TorchBackend(device)).for_batch(segments)
        cp_plan = None
        if cp is not None:  # this rank's rows; its attention reads the cache through the plan
            cp_plan, ids, positions = CpPlan.build(batch, cp, device)
        latent = LatentSlots()
        if pool.latents:  # MLA reads the cache through latent segments (and a batched plan)
            attn = AttentionPlan(chosen, chosen.latent_plan(segments, host))
            if pad_to is None:  # a graph's step reads the graph's buffers, not segments
                latent = LatentSlots.build(segments, host, table=on_host)
        else:
            prompts = frozenset(i for i, s in enumerate(batch.slices) if not s.is_decode)
            attn = plan_attention(segments, host, pool.dtype, chosen, prompts, expanded=False)
        return cls(
            tensor(ids),
            tensor(positions),
            tensor(lists.slots),
            attn,
            pool,
            tensor(lists.sample_rows),
            tensor(lists.lp_rows),
            tensor(lists.lp_targets),
            tensor(lists.future_slots),
            latent,
            cp_plan,
            graphed=pad_to is not None,
        )

    def expanded(self) -> ForwardBatch:
        """Batched page tables and the latent segments' slots made where the tensors are."""
        return replace(self, attn=self.attn.expanded(), latent=self.latent.expanded())

    def moved(self, move: Mover) -> ForwardBatch:
        """This batch with its tensors (not the pool's, not a CP plan's) moved by one call
        of `move` (all of them in one list, `tensors()`)."""
        parts = tuple(getattr(self, n) for n in _MOVED)
        on_device = iter(move(self.tensors()))
        moved = map_tensors(parts, lambda _: next(on_device))
        return replace(self, **dict(zip(_MOVED, moved, strict=True)))

    def tensors(self) -> list[torch.Tensor]:
        """What `moved` moves, in this order: the rows' ids, positions and write slots, the
        attention plan's, then the rest. A CUDA graph reads tensors at the head of that list
        where a step's copy put them (runner/cuda_graph.py)."""
        out: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> torch.Tensor:
            out.append(t)
            return t

        map_tensors(tuple(getattr(self, n) for n in _MOVED), collect)
        return out


_MOVED = (
    "input_ids",
    "positions",
    "out_slots",
    "attn",
    "sample_rows",
    "logprob_rows",
    "logprob_targets",
    "future_slots",
    "latent",
)


@dataclass
class HostLists:
    """A batch's rows as the host lists its tensors are made of."""

    ids: list[int]
    positions: list[int]
    slots: list[int]  # KV slot each row is written to
    segments: list[Segment]  # one per slice (padding rows: one each)
    sample_rows: list[int]  # row of each sampling slice's last token
    future_slots: list[int]
    lp_rows: list[int]
    lp_targets: list[int]

    @classmethod
    def of(cls, batch: ScheduledBatch, with_kv: bool, pad_to: int | None) -> HostLists:
        """`with_kv`: the slots and segments too (not under CP: its plan says where this
        rank's rows write and read)."""
        slices = batch.slices
        if all(len(s.input_ids) == 1 and not s.logprob_targets for s in slices):
            lists = cls._of_steps(slices, with_kv)
        else:
            lists = cls._of_rows(slices, with_kv)
        lists.pad(pad_to or 0)
        return lists

    @classmethod
    def _of_steps(cls, slices: list[ReqSlice], with_kv: bool) -> HostLists:
        """Slices of one row each (decode steps): each list in one comprehension. A row is
        written to the last slot of its runs (each run holds one slot at least)."""
        last = [s.kv_runs[-1] for s in slices] if with_kv else []
        return cls(
            [s.input_ids[0] for s in slices],
            [s.prefix_len for s in slices],
            [start + n - 1 for start, n in last],
            [(row, 1, s.prefix_len, s.kv_runs) for row, s in enumerate(slices)] if with_kv else [],
            [row for row, s in enumerate(slices) if s.sample],
            [s.future_slot for s in slices if s.sample],
            [],
            [],
        )

    @classmethod
    def _of_rows(cls, slices: list[ReqSlice], with_kv: bool) -> HostLists:
        """Any slices (prompt chunks among them): one pass over them."""
        out = cls([], [], [], [], [], [], [], [])
        for s in slices:
            row, n = len(out.ids), len(s.input_ids)
            out.ids.extend(s.input_ids)
            out.positions.extend(range(s.prefix_len, s.prefix_len + n))
            if with_kv:
                out.slots.extend(_tail_slots(s.kv_runs, n))
                out.segments.append((row, n, s.prefix_len, s.kv_runs))
            if s.sample:
                out.sample_rows.append(row + n - 1)
                out.future_slots.append(s.future_slot)
            out.lp_rows.extend(range(row, row + len(s.logprob_targets)))
            out.lp_targets.extend(s.logprob_targets)
        return out

    def pad(self, rows: int) -> None:
        """Padding rows up to `rows`: token 0 at position 0, reading and writing PAD_SLOT."""
        pad = range(len(self.ids), rows)
        self.ids += [0] * len(pad)
        self.positions += [0] * len(pad)
        self.slots += [PAD_SLOT] * len(pad)
        self.segments += [(row, 1, 0, [(PAD_SLOT, 1)]) for row in pad]


T = TypeVar("T")


def map_tensors(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """`obj` with every tensor in it (through dataclass fields, lists and tuples) replaced by
    fn(tensor); other values kept."""
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj)  # type: ignore[return-value]
    if isinstance(obj, list | tuple):
        mapped = [map_tensors(x, fn) for x in obj]
        if all(a is b for a, b in zip(mapped, obj, strict=True)):
            return obj  # nothing in it changed (a traversal that only looks)
        return mapped if isinstance(obj, list) else tuple(mapped)  # type: ignore[return-value]
    if is_dataclass(obj) and not isinstance(obj, type):
        names = _init_fields(type(obj))
        values = [getattr(obj, n) for n in names]
        mapped = [map_tensors(v, fn) for v in values]
        if all(a is b for a, b in zip(mapped, values, strict=True)):
            return obj
        return replace(obj, **dict(zip(names, mapped, strict=True)))
    return obj


_LEAVES = (int, float, bool, str, type(None))


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.init)


def _tail_slots(runs: list[Run], n: int) -> Sequence[int]:
    """Slots of the last n positions covered by `runs`."""
    if runs and runs[-1][1] >= n:  # all in the last run (a decode step's one always is)
        end = runs[-1][0] + runs[-1][1]
        return range(end - n, end)
    out: list[int] = []
    for start, length in reversed(runs):
        take = min(length, n - len(out))
        out[:0] = range(start + length - take, start + length)
        if len(out) == n:
            break
    return out
