"""Decode steps' CUDA graphs (pipeserve/runner/cuda_graph.py), what a CPU can check: the
buckets and the choice of one, which steps are replayed and which runners capture at all,
the padding of a step to its bucket (a padded row reads and writes only page 0, which the
allocator never hands out, and is never sampled), the KV budget's reserve, and an engine
on a CPU (where nothing is captured) serving as before. The replay itself over the
persistent buffers runs in tests/kernels/triton_interpreted.py (the Triton path) and,
captured, in its `-m cuda` tests."""

from __future__ import annotations

import random
import types

import pytest
import torch

from pipeserve.backends.flashinfer_backend import FlashInferBackend
from pipeserve.backends.registry import select_backend
from pipeserve.backends.split import LongPromptSplit
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.backends.triton_backend import TritonBackend
from pipeserve.config import EngineConfig
from pipeserve.mem_cache.allocator import PageAllocator
from pipeserve.mem_cache.kv_pool import PAD_SLOT, KVPool
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config
from pipeserve.runner.cuda_graph import (
    bucket_for,
    graph_blocker,
    graph_buckets,
    graph_reserve_bytes,
    graphable,
)
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch

TRITON = TritonBackend()


def test_buckets_cover_every_size_with_little_padding() -> None:
    buckets = graph_buckets(128)
    assert buckets == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128)
    assert graph_buckets(100)[-2:] == (96, 100)  # the largest is always its own bucket
    assert graph_buckets(3) == (1, 2, 3) and graph_buckets(0) == ()
    for n in range(1, 129):
        b = bucket_for(n, buckets)
        assert b is not None and n <= b < n + (8 if n <= 64 else 32)
        assert b == min(x for x in buckets if x >= n)
    assert bucket_for(129, buckets) is None


def decode_slice(rid: str, length: int, runs: list, **kw) -> ReqSlice:
    return ReqSlice(rid, [5], length - 1, runs, True, **kw)


def test_only_plain_decode_steps_are_replayed() -> None:
    runs = [(16, 8)]
    step = [decode_slice("a", 8, runs), decode_slice("b", 3, [(32, 3)])]
    assert graphable(ScheduledBatch(0, step), 8)
    assert not graphable(ScheduledBatch(0, step), 1)  # more requests than the largest bucket
    assert not graphable(ScheduledBatch(0, []), 8)
    chunk = ReqSlice("c", [1, 2, 3], 0, [(48, 3)], True, chunk_index=0)
    assert not graphable(ScheduledBatch(0, [*step, chunk]), 8)  # a prompt chunk
    unsampled = ReqSlice("d", [1], 0, [(48, 1)], False, chunk_index=0)
    assert not graphable(ScheduledBatch(0, [unsampled]), 8)
    logprobs = ReqSlice("e", [1], 0, [(48, 1)], True, logprob_targets=[4], chunk_index=0)
    assert not graphable(ScheduledBatch(0, [logprobs]), 8)  # prompt logprobs need all rows
    copies = ScheduledBatch(0, step)
    copies.cache_ops = [object()]  # type: ignore[list-item]
    assert not graphable(copies, 8)


def test_which_engines_capture() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dense = ArchConfig.from_dict(load_config("bench")[0])
    v32 = ArchConfig.from_dict(load_config("tiny-deepseek-v32")[0])
    triton = {"attention_backend": "triton"}
    assert graph_blocker(EngineConfig.from_flags(**triton), dense, cuda, TRITON) is None
    auto = select_backend("auto", cuda, torch.bfloat16, 128)  # where triton imports
    assert isinstance(auto, LongPromptSplit) and auto.primary.capturable
    assert graph_blocker(EngineConfig.from_flags(), dense, cuda, auto) is None
    assert graph_blocker(EngineConfig.from_flags(**triton), v32, cuda, TRITON) is not None
    fake_flashinfer = FlashInferBackend(types.ModuleType("flashinfer"))
    blocked = [
        ({"attention_backend": "torch"}, cuda, TorchBackend("cuda"), "cannot be captured"),
        ({"attention_backend": "flashinfer"}, cuda, fake_flashinfer, "cannot be captured"),
        (triton, cpu, TRITON, "need a CUDA device"),
        ({**triton, "pp_size": 2}, cuda, TRITON, "pipeline 2"),
        ({**triton, "tp_size": 2}, cuda, TRITON, "tensor 2"),
        (
            {
                **triton,
                "disaggregation_mode": "decode",
                "disaggregation_auth_key": "7" + "0123456789abcdef" * 2,
            },
            cuda,
            TRITON,
            "disaggregation",
        ),
        ({**triton, "cuda_graph_max_bs": 0}, cuda, TRITON, "--disable-cuda-graph"),
        ({**triton, "disable_cuda_graph": True}, cuda, TRITON, "--disable-cuda-graph"),
    ]
    for flags, device, backend, reason in blocked:
        got = graph_blocker(EngineConfig.from_flags(**flags), dense, device, backend)
        assert got is not None and reason in got, (flags, got)


def test_a_page_table_past_the_persistent_one_stays_eager() -> None:
    """Requests sharing a cached prefix list its slots each: past the table's size (twice
    the pool's slots) a step is not padded into the graph buffers."""
    from pipeserve.runner.cuda_graph import DecodeGraphs

    pool = KVPool(256, range(1), 1, 8, torch.float32, torch.device("cpu"), 4)
    graphs = DecodeGraphs(lambda fb: fb.input_ids, pool, TRITON, (1, 2, 4, 8), pool.k[0].device)
    shared = [(4, 200)]  # 200 slots every request reads
    fits = ScheduledBatch(0, [decode_slice(f"r{i}", 200, shared) for i in range(2)])
    past = ScheduledBatch(0, [decode_slice(f"r{i}", 200, shared) for i in range(3)])
    assert graphs.holds(fits, 2) and not graphs.holds(past, 4)


def test_a_step_of_more_slot_runs_than_the_input_buffer_holds_does_not_fit() -> None:
    """The graphs' input buffer keeps room for a quarter of a slot run per pool slot: a step
    whose requests' KV lies in more runs than that (a fragmented pool) does not fit it
    (`ModelRunner.prepare` then prepares it as an ordinary step). What the buffers hold per
    slot is what the KV budget counts (GRAPH_SLOT_BYTES), beside a fixed part for the
    largest bucket."""
    from pipeserve.runner.cuda_graph import GRAPH_SLOT_BYTES, DecodeGraphs

    slots, cpu = 512, torch.device("cpu")
    pool = KVPool(slots, range(1), 1, 8, torch.float32, cpu, 1)
    graphs = DecodeGraphs(lambda fb: fb.input_ids, pool, TRITON, (1, 2, 4, 8), cpu)
    held = graphs.inputs.nbytes + graphs.attention.kv_indices.nbytes
    assert held <= GRAPH_SLOT_BYTES * slots + 128 * 8
    room = slots // 4 + 2 * 8  # runs (and the largest padding step's few bytes beside)

    def step(runs: int) -> ForwardBatch:
        scattered = [(2 * i + 1, 1) for i in range(runs)]  # one slot each, none adjacent
        batch = ScheduledBatch(0, [decode_slice("a", runs, scattered)])
        assert graphs.holds(batch, 1)  # its keys fit the page table
        return ForwardBatch.build(batch, pool, cpu, TRITON, None, True, 1)

    assert graphs.fits(step(room)) and not graphs.fits(step(room + 64))


def test_each_bucket_is_captured_over_its_own_padding_step(monkeypatch) -> None:
    """The buckets share one input buffer, where a step leaves its own values: capture()
    loads each bucket's padding step before that bucket's warm-up runs and its capture, so
    every captured forward reads padding alone (ids and positions 0, write slots PAD_SLOT,
    one key each: kv_indptr 0..b over PAD_SLOT). torch.cuda's graph calls are stand-ins
    here: what is checked is what the forwards read."""
    import contextlib

    from pipeserve.runner.cuda_graph import DecodeGraphs

    class Stand:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def replay(self) -> None:
            pass

    for name, value in {
        "graph_pool_handle": lambda: object(),
        "Stream": Stand,
        "current_stream": lambda device=None: Stand(),
        "stream": lambda s: contextlib.nullcontext(),
        "CUDAGraph": Stand,
        "graph": lambda *args, **kwargs: contextlib.nullcontext(),
        "empty_cache": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    seen: list[tuple[int, list, list, list, list, list]] = []

    def forward(fb: ForwardBatch) -> torch.Tensor:
        steps = fb.attn.meta.decode
        b = fb.num_tokens
        indptr = steps.kv_indptr.tolist()
        keys = steps.kv_indices[: indptr[-1]].tolist()
        ids, positions, slots = fb.input_ids.tolist(), fb.positions.tolist(), fb.out_slots.tolist()
        seen.append((b, ids, positions, slots, indptr, keys))
        return fb.input_ids

    cpu = torch.device("cpu")
    pool = KVPool(256, range(1), 1, 8, torch.float32, cpu, 4)
    graphs = DecodeGraphs(forward, pool, TRITON, (1, 2, 4, 8), cpu)
    step = ScheduledBatch(
        0, [decode_slice(f"r{i}", 9 + i, [(16 + 16 * i, 9 + i)]) for i in range(5)]
    )
    graphs.load(ForwardBatch.build(step, pool, cpu, TRITON, None, True, 8))  # a real step's
    assert graphs.batches[8].out_slots.tolist()[:5] != [PAD_SLOT] * 5
    graphs.capture()
    assert sorted({b for b, *_ in seen}) == [1, 2, 4, 8] and len(seen) == 4 * 3  # 2 warm-ups
    for b, ids, positions, slots, indptr, keys in seen:
        assert ids == positions == [0] * b and slots == [PAD_SLOT] * b, b
        assert indptr == list(range(b + 1)) and keys == [PAD_SLOT] * b, b


def test_the_buffers_steps_run_on_the_backend_a_decode_step_gets() -> None:
    """Auto on CUDA is a split (long prompt chunks elsewhere): the graphs' steps run on the
    backend it hands decode steps to, whose norms and fused rotary they use."""
    from pipeserve.runner.cuda_graph import DecodeGraphs

    pool = KVPool(256, range(1), 1, 8, torch.float32, torch.device("cpu"), 4)
    auto = LongPromptSplit(TRITON, TorchBackend("cpu"), 16)
    graphs = DecodeGraphs(lambda fb: fb.input_ids, pool, auto, (1, 2, 4), pool.k[0].device)
    assert all(fb.attn.backend is TRITON for fb in graphs.batches.values())
    step = ScheduledBatch(0, [decode_slice("a", 40, [(4, 40)])])
    assert ForwardBatch.prepare(step, pool, torch.device("cpu"), auto).attn.backend is TRITON


def test_a_padded_row_never_touches_a_page_a_request_owns() -> None:
    """Requests on pages the allocator handed out, decoded as one step padded to its bucket:
    the padded rows write PAD_SLOT (page 0) and read it alone; the real rows and their page
    table are those of the unpadded step; only real rows are sampled."""
    page = 4
    allocator = PageAllocator(64)
    rng = random.Random(3)
    slices, owned = [], set()
    for i in range(5):
        length = rng.randint(1, 30)
        pages = allocator.alloc(-(-length // page))
        assert pages is not None and 0 not in pages
        runs = [(p * page, page) for p in pages]
        owned |= {p * page + s for p in pages for s in range(page)}
        slices.append(decode_slice(f"r{i}", length, runs))
    batch = ScheduledBatch(0, slices)
    pool = KVPool(64 * page, range(1), 1, 8, torch.float32, torch.device("cpu"), page)
    cpu = torch.device("cpu")
    plain = ForwardBatch.prepare(batch, pool, cpu, TRITON)
    padded = ForwardBatch.build(batch, pool, cpu, TRITON, pad_to=8).expanded()
    assert padded.graphed and not plain.graphed and padded.num_tokens == 8
    assert PAD_SLOT // page == 0 and PAD_SLOT not in owned
    assert torch.equal(padded.out_slots[:5], plain.out_slots)
    assert padded.out_slots[5:].tolist() == [PAD_SLOT] * 3
    assert set(padded.out_slots[:5].tolist()) <= owned
    assert padded.input_ids[5:].tolist() == [0] * 3 and padded.positions[5:].tolist() == [0] * 3
    assert torch.equal(padded.sample_rows, plain.sample_rows)  # padded rows are never sampled
    a, b = plain.attn.meta.decode, padded.attn.meta.decode
    assert a is not None and b is not None
    assert a.kv_indptr is not None and b.kv_indptr is not None
    assert a.kv_indices is not None and b.kv_indices is not None
    real = int(a.kv_indptr[-1])
    assert torch.equal(b.kv_indptr[:6], a.kv_indptr)
    assert torch.equal(b.kv_indices[:real], a.kv_indices)
    assert b.kv_indptr[6:].tolist() == [real + 1, real + 2, real + 3]  # one key each
    assert b.kv_indices[real:].tolist() == [PAD_SLOT] * 3
    assert set(a.kv_indices.tolist()) <= owned


def test_the_kv_budget_keeps_room_for_the_graphs() -> None:
    arch = ArchConfig.from_dict(load_config("bench")[0])
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    triton = {"attention_backend": "triton"}
    on = EngineConfig.from_flags(**triton, cuda_graph_max_bs=64)
    reserve = graph_reserve_bytes(on, arch, cuda, bf16, TRITON)
    bigger = graph_reserve_bytes(EngineConfig.from_flags(**triton), arch, cuda, bf16, TRITON)
    assert 64 << 20 < reserve < bigger  # the default 128 takes more than 64
    auto = select_backend("auto", cuda, bf16, arch.head_dim)
    assert graph_reserve_bytes(EngineConfig.from_flags(), arch, cuda, bf16, auto) == bigger
    for off, backend in (
        ({**triton, "disable_cuda_graph": True}, TRITON),
        ({**triton, "cuda_graph_max_bs": 0}, TRITON),
        ({**triton, "tp_size": 2}, TRITON),  # no graph is captured: nothing kept back
        ({"attention_backend": "torch"}, TorchBackend("cuda")),
    ):
        flags = EngineConfig.from_flags(**off)
        assert graph_reserve_bytes(flags, arch, cuda, bf16, backend) == 0
    assert graph_reserve_bytes(on, arch, torch.device("cpu"), bf16, TRITON) == 0


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_on_a_cpu_nothing_is_captured_and_both_loops_serve(model_path, loop: str) -> None:
    """Graphs are asked for by default; a CPU runner captures none, pads nothing, and the
    engine's outputs are those of graphs turned off."""
    from pipeserve import Engine

    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    params = {"max_new_tokens": 4, "temperature": 0}
    outs = []
    for extra in ({}, {"disable_cuda_graph": True}):
        loop_flag = "disable_overlap_schedule" if loop == "plain" else "enable_overlap_schedule"
        with Engine(str(model_path), dtype="float32", **{loop_flag: True}, **extra) as engine:
            assert engine.backend.runner.graphs is None
            outs.append(engine.generate(input_ids=prompts, sampling_params=params))
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]
