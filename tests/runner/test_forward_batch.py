"""ForwardBatch.prepare's host work per step on the Triton path: what the host builds and
copies for the page tables is O(runs + requests), the same at 1K and 32K context; the
tables are expanded after the copy, where the copies are, with no host read of a tensor
(through the fake CUDA runtime of tests/fake_cuda.py); and a decode step's rows, built
without the general per-slice loop, are the loop's."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import pytest
import torch
from fake_cuda import FakeApi
from host_sync import no_host_sync
from torch.overrides import TorchFunctionMode

from pipeserve.backends.base import AttentionPlan
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.backends.split import LongPromptSplit
from pipeserve.backends.torch_backend import StepPlan, TorchBackend
from pipeserve.backends.triton_backend import TritonBackend
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.runner.forward_batch import ForwardBatch, HostLists, map_tensors
from pipeserve.scheduler.batch import ReqSlice, Run, ScheduledBatch, runs_prefix
from pipeserve.scheduler.request import SamplingParams
from pipeserve.streams import DeviceStreams

CPU, META = torch.device("cpu"), torch.device("meta")
TRITON = TritonBackend()
POOL = KVPool(16, range(1), 1, 8, torch.float32, CPU, 16)  # prepare reads its kind only
LATENT_POOL = KVPool.latent_layout(16, range(1), 8, torch.float32, CPU, 16)  # MLA's
GREEDY = SamplingParams(temperature=0)
CHUNK = 40  # a prompt chunk's tokens
SPACING = 1 << 20  # slots between two requests' KV


def ragged_runs(request: int, length: int) -> list[Run]:
    """`length` positions in four runs: a long one, a page of 16, one slot, `request` + 1."""
    base = 1 + request * SPACING
    tail = request + 1
    return [
        (base, length - 17 - tail),
        (base + SPACING // 2, 16),
        (base - 1 + SPACING, 1),
        (base + SPACING // 4, tail),
    ]


def decode_batch(context: int, requests: int = 6) -> ScheduledBatch:
    steps = [
        ReqSlice(f"r{i}", [5 + i], context - 1, ragged_runs(i, context), i % 3 != 1, GREEDY)
        for i in range(requests)
    ]
    return ScheduledBatch(0, steps)


def mixed_batch(context: int) -> ScheduledBatch:
    """Decode steps and a prompt chunk of CHUNK tokens over a prefix of context - CHUNK."""
    batch = decode_batch(context)
    ids = list(range(1, CHUNK + 1))
    runs = ragged_runs(7, context)
    chunk = ReqSlice("p", ids, context - CHUNK, runs, True, GREEDY, chunk_index=1)
    batch.slices.insert(2, chunk)
    return batch


class HostWork(TorchFunctionMode):
    """The torch calls made inside, and the elements of the host tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.host_elements = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append(getattr(func, "__name__", repr(func)))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.host_elements += t.numel()
        return out


class NoDataSizedOutputs(TorchFunctionMode):
    """Inside, a torch call whose output CUDA sizes from the values of a device tensor (a
    device sync, not seen by `no_host_sync`) fails."""

    SIZED_BY_DATA = frozenset({"nonzero", "bincount", "unique", "masked_select"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        unsized = name == "repeat_interleave" and kwargs.get("output_size") is None
        assert not unsized and name not in self.SIZED_BY_DATA, f"{name} sizes from device data"
        return func(*args, **kwargs)


def to_meta(hosts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [h.to(META) for h in hosts]


def prepared_on_meta(batch: ScheduledBatch, pool: KVPool = POOL) -> tuple[HostWork, ForwardBatch]:
    with HostWork() as work:
        fb = ForwardBatch.prepare(batch, pool, META, TRITON, move=to_meta)
    return work, fb


def positions_slots(batch: ScheduledBatch) -> list[list[int]]:
    """Each slice's slots of all its positions, one position at a time."""
    per_seq = [runs_prefix(s.kv_runs, s.prefix_len + len(s.input_ids)) for s in batch.slices]
    return [[start + i for start, n in runs for i in range(n)] for runs in per_seq]


def table(per_seq: list[list[Run]]) -> tuple[list[int], list[int]]:
    """(kv_indptr, kv_indices) built one position at a time."""
    lengths = [sum(n for _, n in runs) for runs in per_seq]
    slots = [start + i for runs in per_seq for start, n in runs for i in range(n)]
    return list(accumulate(lengths, initial=0)), slots


@pytest.mark.parametrize("make", [decode_batch, mixed_batch])
def test_the_host_builds_the_same_for_1k_and_32k_context(make: Any) -> None:
    """The same torch calls, the same host elements (well under one request's context): the
    page tables cross as runs and are expanded on the device (meta here), at full size."""
    short, long = (prepared_on_meta(make(context)) for context in (1024, 32 * 1024))
    (work_1k, _), (work_32k, fb) = short, long
    assert work_1k.calls == work_32k.calls
    assert work_1k.host_elements == work_32k.host_elements < 1024
    decode, extend = fb.attn.meta.decode, fb.attn.meta.extend
    assert decode is not None and decode.kv_indices is not None
    assert decode.kv_indices.device == META
    assert decode.kv_indices.shape == (6 * 32 * 1024,)
    if make is mixed_batch:
        assert extend is not None and extend.kv_indices is not None
        assert extend.kv_indices.device == META and extend.kv_indices.shape == (32 * 1024,)


def test_mla_decode_plan_host_work_does_not_grow_with_context() -> None:
    def plan(context: int) -> tuple[HostWork, AttentionPlan]:
        batch = decode_batch(context)
        segments = [(row, 1, s.prefix_len, s.kv_runs) for row, s in enumerate(batch.slices)]
        with HostWork() as work:
            attn = AttentionPlan(TRITON, TRITON.latent_plan(segments, CPU))
            attn = map_tensors(attn, lambda t: t.to(META)).expanded()
        return work, attn

    (work_1k, _), (work_32k, attn) = plan(1024), plan(32 * 1024)
    assert work_1k.calls == work_32k.calls
    assert work_1k.host_elements == work_32k.host_elements < 1024
    assert attn.meta.decode is not None and attn.meta.decode.kv_indices is not None
    assert attn.meta.decode.kv_indices.shape == (6 * 32 * 1024,)


def test_mla_segments_host_work_does_not_grow_with_context() -> None:
    """MLA's per-request latent segments on the device path: their slots cross as one
    slot-run table and are made on the device (meta here) after the copy, at full size."""
    (work_1k, _), (work_32k, fb) = (
        prepared_on_meta(mixed_batch(context), LATENT_POOL) for context in (1024, 32 * 1024)
    )
    assert work_1k.calls == work_32k.calls
    assert work_1k.host_elements == work_32k.host_elements < 1024
    lengths = [len(slots) for slots in positions_slots(mixed_batch(32 * 1024))]
    assert [seg.slots.shape for seg in fb.latent_segments] == [(n,) for n in lengths]
    assert all(seg.slots.device == META for seg in fb.latent_segments)


@pytest.mark.parametrize("context", [64, 1024])
def test_mla_segments_slots_are_every_positions_slot(context: int) -> None:
    """Both builds of the latent segments, the device path's (one table copied without
    host reads, expanded after the copy) and the CPU's (each segment's slots made from its
    runs), give each request's slots of all its positions, at its rows."""
    batch = mixed_batch(context)
    streams = DeviceStreams(CPU, FakeApi())
    with streams.upload() as up, no_host_sync(), NoDataSizedOutputs():
        moved = ForwardBatch.prepare(batch, LATENT_POOL, CPU, TRITON, move=up.move)
    assert sum(t.numel() * t.element_size() for t in up.tensors) < 8 * 1024  # bytes
    on_cpu = ForwardBatch.prepare(batch, LATENT_POOL, CPU, TRITON)
    expected = positions_slots(batch)
    rows = list(accumulate((len(s.input_ids) for s in batch.slices), initial=0))[:-1]
    for fb in (moved, on_cpu):
        segments = fb.latent_segments
        assert [seg.slots.tolist() for seg in segments] == expected
        assert [(seg.q_start, seg.q_len) for seg in segments] == [
            (row, len(s.input_ids)) for row, s in zip(rows, batch.slices, strict=True)
        ]
        assert [seg.prefix_len for seg in segments] == [s.prefix_len for s in batch.slices]


def test_mla_decode_steps_on_the_cpu_make_no_slot_tensors() -> None:
    """On the CPU's MLA backend (the native kernels' `sparse_latent`) a decode step reads
    its runs in place: preparing the step makes nothing in the length of its context."""
    works = []
    for context in (1024, 32 * 1024):
        with HostWork() as work:
            ForwardBatch.prepare(decode_batch(context), LATENT_POOL, CPU, NativeBackend())
        works.append(work)
    assert works[0].calls == works[1].calls
    assert works[0].host_elements == works[1].host_elements < 1024


@pytest.mark.parametrize(
    ("backend", "pool"),
    [(TRITON, LATENT_POOL), (TorchBackend("cpu"), LATENT_POOL), (TorchBackend("cpu"), POOL)],
    ids=["triton-mla", "torch-mla", "torch-gqa"],
)
def test_decode_steps_page_table_is_made_after_the_copy(backend: Any, pool: KVPool) -> None:
    """Decode steps on a backend that reads them through a page table (Triton's MLA kernel,
    the torch backend's gathers, MLA's and GQA's): the host builds and copies the same at 1K
    and 32K context, and the table is made where the copies are."""
    works = []
    for context in (1024, 32 * 1024):
        with HostWork() as work:
            fb = ForwardBatch.prepare(decode_batch(context), pool, META, backend, move=to_meta)
        works.append(work)
        decode = fb.attn.meta.decode
        table = getattr(decode, "table", decode)  # the torch backend's StepPlan holds it
        assert table.kv_indices is not None and table.kv_indices.device == META
        assert table.kv_indices.shape[0] == 6 * context
    assert works[0].calls == works[1].calls
    assert works[0].host_elements == works[1].host_elements < 1024


def test_a_graphed_mla_step_carries_no_latent_segments() -> None:
    """A decode step padded to a CUDA graph's bucket replays the graph, which reads its own
    buffers: nothing of the per-request segments is built or copied for it, its page table
    is. The same step unpadded has them."""
    built = ForwardBatch.build(decode_batch(1024), LATENT_POOL, META, TRITON, None, True, 8)
    padded = built.moved(to_meta).expanded()
    assert padded.latent_segments == [] and padded.latent.table is None
    decode = padded.attn.meta.decode
    assert decode is not None and decode.kv_indices is not None
    _, eager = prepared_on_meta(decode_batch(1024), LATENT_POOL)
    assert len(eager.latent_segments) == 6


@pytest.mark.parametrize("context", [64, 1024, 32 * 1024])
def test_a_moved_plan_is_expanded_after_the_copy_without_host_reads(context: int) -> None:
    """As the runner prepares on a device (pinned copies queued on the copy stream): no
    tensor is read on the host, no output is sized by device data; what is copied is the
    same at any context (not the tables, which are made from the copies); the tables equal
    those built one position at a time."""
    batch = mixed_batch(context)
    streams = DeviceStreams(CPU, FakeApi())
    with streams.upload() as up, no_host_sync(), NoDataSizedOutputs():
        fb = ForwardBatch.prepare(batch, POOL, CPU, TRITON, move=up.move)
    decode, extend = fb.attn.meta.decode, fb.attn.meta.extend
    assert decode is not None and decode.kv_indptr is not None and decode.kv_indices is not None
    assert extend is not None and extend.kv_indptr is not None and extend.kv_indices is not None
    tables = [decode.kv_indptr, decode.kv_indices, extend.kv_indptr, extend.kv_indices]
    assert not any(t is u for t in tables for u in up.tensors)
    copied = sum(t.numel() * t.element_size() for t in up.tensors)  # bytes
    assert copied == sum(t.numel() * t.element_size() for t in _copied(mixed_batch(1024)))
    assert copied < 8 * 1024
    steps = [s for s in batch.slices if s.is_decode]
    chunk = next(s for s in batch.slices if not s.is_decode)
    assert decode.rows.tolist() == [0, 1, 2 + CHUNK, 3 + CHUNK, 4 + CHUNK, 5 + CHUNK]
    expected = table([s.kv_runs for s in steps])
    assert (decode.kv_indptr.tolist(), decode.kv_indices.tolist()) == expected
    expected = table([runs_prefix(chunk.kv_runs, chunk.prefix_len + CHUNK)])
    assert (extend.kv_indptr.tolist(), extend.kv_indices.tolist()) == expected


def _copied(batch: ScheduledBatch) -> list[torch.Tensor]:
    streams = DeviceStreams(CPU, FakeApi())
    with streams.upload() as up:
        ForwardBatch.prepare(batch, POOL, CPU, TRITON, move=up.move)
    return up.tensors


@pytest.mark.parametrize("pad_to", [None, 8])
@pytest.mark.parametrize("with_kv", [True, False])
def test_decode_steps_rows_are_the_general_loops(pad_to: int | None, with_kv: bool) -> None:
    slices = decode_batch(100).slices
    slices[3].future_slot = 7
    fast = HostLists.of(ScheduledBatch(0, slices), with_kv, pad_to)
    loop = HostLists._of_rows(slices, with_kv)
    loop.pad(pad_to or 0)
    assert fast == loop
    if with_kv:
        assert fast.slots[:6] == [start + n - 1 for start, n in (s.kv_runs[-1] for s in slices)]


def test_auto_runs_a_batch_with_a_long_prompt_chunk_on_the_library_kernels() -> None:
    """Auto on CUDA (batched, with a key limit): decode steps and prompt chunks within the
    limit stay on the batched Triton plan; a batch with a chunk over more keys (its prefix
    plus itself) is planned for the library kernels, norms and rotary included (the
    batch's backend is the library's), whatever else it holds."""
    limit = 1024
    auto = LongPromptSplit(TRITON, TorchBackend("cpu"), limit)
    prefix = limit - CHUNK  # a chunk of CHUNK tokens after it: exactly `limit` keys
    cases = {
        "decode, long context": (decode_batch(64 * limit), True),
        "chunk at the limit": (mixed_batch(limit), True),
        "chunk past the limit": (mixed_batch(limit + 1), False),
    }
    for name, (batch, batched) in cases.items():
        fb = ForwardBatch.prepare(batch, POOL, CPU, auto)
        assert (fb.attn.backend is TRITON) == batched, name
        assert fb.attn.norms is fb.attn.backend.norms
        meta = fb.attn.meta
        if batched:  # one launch for the decode steps and one for the chunks (if any)
            assert meta.decode is not None and meta.decode.kv_indices is not None
        else:  # the torch kernels' plan: the chunk reads its prefix, decode steps gather
            assert [p.prefix_len for p in meta.chunks] == [prefix + 1]
            assert isinstance(meta.decode, StepPlan)
    explicit = ForwardBatch.prepare(mixed_batch(limit + 1), POOL, CPU, TRITON)  # triton: all
    assert explicit.attn.backend is TRITON
