"""The simulator runs the engine's own scheduling: on the same inputs and the same fit, its
chunk sequence and every micro-batch's composition equal a real PP2 engine's (workers on the
tiny model, the stages' profile replaced in the test process by a synthetic one where the fit
is made). Also: the `pipeserve simulate` interface outside checks rely on, two-batch overlap
split by the real rules, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeserve.cli import main
from pipeserve.config import EngineConfig
from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.sim import collectives
from pipeserve.sim.cost_model import Precision
from pipeserve.sim.executor import SimClock
from pipeserve.sim.hardware import load_hardware
from pipeserve.sim.run import SimSpec, simulate
from pipeserve.sim.simulator import SimBackend, SimRequest, serve
from pipeserve.timeline import Event

PREFIX = {"c": 0.002, "g": 1e-6, "b": 1e-5, "a": 5e-9}  # synthetic t(L, x), seconds
FLAGS: dict[str, Any] = {
    "pp_size": 2,
    "dtype": "float32",
    "chunked_prefill_size": 256,
    "enable_dynamic_chunking": True,
    "dynamic_chunking_smooth_factor": 1.0,
    "dynamic_chunking_profile_max_len": 2048,
    "max_total_tokens": 8192,
    "max_running_requests": 4,
}
LENGTHS = [1500, 700, 1900, 90]
NEW_TOKENS = [3, 5, 2, 4]


def synthetic(points: list[tuple[int, int]], runs: Any = None) -> list[list[float]]:
    """Two stages, the second 1.2x the first."""
    t = [
        PREFIX["c"] + PREFIX["g"] * L + PREFIX["b"] * x + PREFIX["a"] * (2 * L * x + x * x)
        for L, x in points
    ]
    return [t, [1.2 * s for s in t]]


def composition(events: list[Event]) -> list[tuple]:
    """Every micro-batch of the first stage: its slices' request, chunk, tokens and prefix."""
    fwd = sorted(
        (e for e in events if e.kind == "forward" and e.stage == 0 and e.tp_rank == 0),
        key=lambda e: e.batch_id,
    )
    return [tuple(zip(e.rids, e.chunks, e.tokens, e.prefix, strict=True)) for e in fwd]


@pytest.mark.timeout(180)
def test_same_chunks_and_batches_as_a_real_pp2_engine(model_dir, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(
        WorkerBackend, "profile_stages", lambda self, points, runs: synthetic(points)
    )
    path = model_dir("tiny-qwen3")
    reqs = [
        Req(
            f"sim-{i}",
            [i] + [7] * (n - 1),
            SamplingParams(max_new_tokens=m, temperature=0, ignore_eos=True),
        )
        for i, (n, m) in enumerate(zip(LENGTHS, NEW_TOKENS, strict=True))
    ]
    with Engine(str(path), **FLAGS) as engine:
        engine.backend.timeline()
        real = engine.run(reqs)
        real_events = engine.backend.timeline()
        info = engine.backend.chunking
    assert info["mode"] == "dynamic"
    real_sizes = [r["meta_info"]["chunk_sizes"] for r in real]
    assert len(set(real_sizes[0][:-1])) > 1  # the fit shrinks chunks: sizes vary

    arch = ArchConfig.load(path)
    config = EngineConfig.from_flags(**{k: v for k, v in FLAGS.items() if k != "dtype"})
    clock = SimClock()
    backend = SimBackend(
        config,
        arch,
        load_hardware("cpu"),
        Precision("float32", "float32"),
        clock,
        arch.max_position_embeddings,
        stage_profile=info["profile_stage_seconds"],
    )
    assert backend.chunking["coefficients"] == info["coefficients"]
    sim = serve(
        backend, [SimRequest(r.rid, len(r.input_ids), r.sampling.max_new_tokens) for r in reqs]
    )
    assert [o.chunk_sizes for o in sim] == real_sizes
    assert composition(backend.timeline()) == composition(real_events)
    assert backend.loop.depth == 3  # P + the async depth, as the real loop


def test_the_cost_models_own_profile_shrinks_chunks_under_pp() -> None:
    r = simulate(
        {
            "pp_size": 4,
            "tp_size": 8,
            "chunked_prefill_size": 12288,
            "enable_dynamic_chunking": True,
            "dynamic_chunking_smooth_factor": 0.65,
            "dynamic_chunking_profile_max_len": 131072,
        },
        SimSpec("deepseek-v3.1", "h20", input_len=131072),
    )
    sizes = r["chunk_sizes"][0]
    assert r["chunking"]["mode"] == "dynamic" and sizes[0] == 12288
    assert sizes[-2] < sizes[1]  # later chunks smaller
    assert sum(sizes) == 131072


def test_simulate_cli_writes_the_fields_outside_checks_read(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim.json"
    trace, png = tmp_path / "trace.json", tmp_path / "gantt.png"
    main(
        [
            "simulate",
            "--model",
            "deepseek-v3.1",
            "--hardware",
            "h20",
            "--tp-size",
            "8",
            "--pp-size",
            "2",
            "--nnodes",
            "2",
            "--chunked-prefill-size",
            "4096",
            "--input-len",
            "32768",
            "--num-prompts",
            "2",
            "--dtype",
            "fp8",
            "--json",
            str(out),
            "--trace",
            str(trace),
            "--timeline",
            str(png),
        ]
    )
    r = json.loads(out.read_text())
    assert r["ttft_mean_s"] > 0 and r["input_throughput_tok_s"] > 0
    assert len(r["bubble_ratio"]) == 2 and all(0 <= b < 1 for b in r["bubble_ratio"])
    assert r["layout"]["nnodes"] == 2 and r["precision"]["weights"] == "fp8"
    assert r["chunk_sizes"] == [[4096] * 8] * 2
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert any("sim-0#0" in n for n in names)  # the same trace format as real runs
    assert png.stat().st_size > 0
    assert "TTFT mean" in capsys.readouterr().out


def test_pp_across_nodes_sends_over_the_slow_link() -> None:
    spec = SimSpec("deepseek-v3.1", "h20", input_len=16384)
    flags = {"tp_size": 8, "pp_size": 2, "chunked_prefill_size": 4096}
    between = simulate(flags, spec)  # 8 GPUs per node: the boundary crosses nodes
    inside = simulate(flags, SimSpec(**{**spec.__dict__, "devices_per_node": 16}))
    h20 = load_hardware("h20")
    total = 4096 * 7168 * 2 * 2  # hidden states and residual of a chunk, bf16
    gather = collectives.ring_all_gather_s(total, 8, h20.intra_node)
    for report, link in ((between, h20.inter_node), (inside, h20.intra_node)):
        send = next(e for e in report["events"] if e.kind == "send")
        assert send.nbytes == total // 8  # each TP rank its eighth
        assert send.end - send.start == pytest.approx(collectives.p2p_s(total / 8, link))
        first = next(e for e in report["events"] if e.kind == "forward" and e.stage == 1)
        assert first.start == pytest.approx(send.end + gather)  # then re-gathered there


def test_two_batch_overlap_splits_by_the_engines_rules_and_hides_dispatch() -> None:
    spec = SimSpec("qwen3-235b-a22b", "h20", input_len=16384, num_prompts=8)  # one a rank
    base = {"ep_size": 8, "chunked_prefill_size": 4096, "max_running_requests": 16}
    plain = simulate(base, spec)
    tbo = simulate(base | {"enable_two_batch_overlap": True}, spec)
    assert plain["two_batch_forwards"] == 0
    assert tbo["two_batch_forwards"] == tbo["forwards"]  # every rank has a 4096-token chunk
    assert tbo["seconds_by_class"]["ep_comm"] < plain["seconds_by_class"]["ep_comm"]
    # the engine's rules: no split below --two-batch-overlap-min-tokens ...
    small = simulate(
        base | {"enable_two_batch_overlap": True, "two_batch_overlap_min_tokens": 8192}, spec
    )
    assert small["two_batch_forwards"] == 0
    # ... nor when a rank has nothing to split (4 prompts on 8 ranks: all or none)
    idle = simulate(
        base | {"enable_two_batch_overlap": True}, SimSpec(**{**spec.__dict__, "num_prompts": 4})
    )
    assert idle["two_batch_forwards"] == 0


def test_an_idle_first_ep_rank_still_leaves_a_trace() -> None:
    r = simulate(
        {"ep_size": 4, "chunked_prefill_size": 4096},
        SimSpec("qwen3-235b-a22b", "h20", dtype="fp8", input_len=8192),
    )
    fwd = [e for e in r["events"] if e.kind == "forward"]
    assert fwd and all(e.rids == ["sim-0"] for e in fwd)


def test_context_parallel_pool_is_every_ranks_pages() -> None:
    from pipeserve.context_parallel.layout import global_pages

    flags = {"cp_size": 2, "pp_size": 4, "chunked_prefill_size": 4096}  # 24 layers at most
    arch = ArchConfig.from_dict(load_config("qwen3-235b-a22b")[0])
    config = EngineConfig.from_flags(**flags, mem_fraction_static=0.92)
    backend = SimBackend(config, arch, load_hardware("h20"), Precision("fp8"), SimClock(), 65536)
    per_rank = backend.memory.kv_tokens + 1
    assert backend.memory.kv_bytes_per_token == 24 * 2 * 4 * 128 * 2  # all KV heads: TP 1
    assert backend.scheduler.ranks[0].kv.allocator.capacity == global_pages(per_rank, 2) - 1


def test_nnodes_places_gpu_ranks_on_several_nodes() -> None:
    flags = {"tp_size": 4, "pp_size": 2, "nnodes": 2, "chunked_prefill_size": 4096}
    r = simulate(flags, SimSpec("qwen3-235b-a22b", "h20", input_len=16384))
    assert r["layout"]["nnodes"] == 2 and r["layout"]["devices_per_node"] == 4
    one = simulate({**flags, "nnodes": 1}, SimSpec("qwen3-235b-a22b", "h20", input_len=16384))
    assert one["layout"]["nnodes"] == 1
    send = next(e for e in r["events"] if e.kind == "send")
    send_one = next(e for e in one["events"] if e.kind == "send")
    assert send.end - send.start > send_one.end - send_one.start  # RDMA, not NVLink


def test_refusals_and_notes() -> None:
    spec = SimSpec("bench", "cpu", input_len=512)
    with pytest.raises(ValueError, match="attention-FFN"):
        simulate({"afd_attention_size": 1, "afd_ffn_size": 1}, SimSpec("bench-moe", "cpu"))
    with pytest.raises(ValueError, match="unknown hardware"):
        simulate({}, SimSpec("bench", "tpu"))
    with pytest.raises(ValueError, match="no memory left"):
        simulate({}, SimSpec("deepseek-v3.1", "h20", input_len=4096))  # one H20
    with pytest.raises(ValueError, match="--num-prompts must be at least 1"):
        SimSpec("bench", "cpu", num_prompts=0)
    with pytest.raises(SystemExit, match="fp8 is for --simulate"):
        main(["tune", "--dtype", "fp8"])
    r = simulate({"context_length": 256}, spec)
    assert r["notes"] and "raised" in r["notes"][0]
    assert load_config("qwen3-235b-a22b")[1] == "preset qwen3-235b-a22b"


def test_an_fp8_checkpoint_is_counted_as_the_engine_holds_it() -> None:
    """DeepSeek-V3.1's FP8 release: by default the engine dequantises it at load, so the
    simulator counts bfloat16 weights; with --fp8-weights keep it counts fp8, as --dtype fp8
    does; fp8 holds about half the bytes."""
    spec = SimSpec("deepseek-v3.1", "h20", input_len=4096)
    flags = {"tp_size": 8, "pp_size": 2, "nnodes": 2}
    runs = {
        "dequantize": simulate(flags, spec),
        "keep": simulate({**flags, "fp8_weights": "keep"}, spec),
        "fp8": simulate(flags, SimSpec("deepseek-v3.1", "h20", dtype="fp8", input_len=4096)),
    }
    weights = {k: r["precision"]["weights"] for k, r in runs.items()}
    assert weights == {"dequantize": "bfloat16", "keep": "fp8", "fp8": "fp8"}
    held = {k: r["memory"]["weight_gb_per_device"] for k, r in runs.items()}
    assert held["keep"] == held["fp8"] < 0.6 * held["dequantize"]
