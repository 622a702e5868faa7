"""`pipeserve tune` and `pipeserve bench` with several layouts, end to end on a tiny model
(in-process through `pipeserve.cli.main`; the PP2 and CP2 layouts run real worker
processes): the files they promise exist and hold what they say. No assertion is about
speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeserve.cli import main
from pipeserve.models.arch import ArchConfig
from pipeserve.timeline import COMM_BYTES

pytestmark = pytest.mark.timeout(150)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INPUT_LEN = 512


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("tiny-qwen3")


def test_tune_writes_trials_best_flags_and_plot(model, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path / "cache"))
    out_json, out_png = tmp_path / "tune.json", tmp_path / "tune.png"
    main(["tune", "--model", str(model), "--pp-size", "2", "--input-len", str(INPUT_LEN),
          "--budget-s", "20", "--json", str(out_json), "--png", str(out_png)])
    report = json.loads(out_json.read_text())
    assert (report["pp_size"], report["tp_size"], report["input_len"]) == (2, 1, INPUT_LEN)
    assert report["model"] == str(model)
    trials = report["trials"]
    fixed = [t for t in trials if t["mode"] == "fixed"]
    dynamic = [t for t in trials if t["mode"] == "dynamic"]
    assert fixed and dynamic
    # Fixed sizes from 256 up to the input length; each trial prefilled the whole input.
    assert sorted(t["chunk_size"] for t in fixed) == [256, 512]
    for t in trials:
        assert sum(t["chunk_sizes"]) == INPUT_LEN and t["ttft_s"] > 0
    for t in fixed:
        assert t["smooth_factor"] is None
        assert t["chunk_sizes"] == [t["chunk_size"]] * (INPUT_LEN // t["chunk_size"])
    for t in dynamic:  # initial sizes 2x..4x the best fixed size, capped by the input
        assert t["chunk_size"] % 64 == 0 and t["chunk_size"] <= INPUT_LEN
        assert 0.0 <= t["smooth_factor"] <= 1.0 and t["chunk_sizes"][0] <= t["chunk_size"]
    assert len({t["smooth_factor"] for t in dynamic}) == len(dynamic)  # one trial per factor
    best = min(trials, key=lambda t: t["ttft_s"])
    assert report["best"] == best
    assert report["best_fixed"] == min(fixed, key=lambda t: t["ttft_s"])
    flags = f"--chunked-prefill-size {best['chunk_size']}"
    if best["mode"] == "dynamic":
        flags += (" --enable-dynamic-chunking --dynamic-chunking-smooth-factor "
                  f"{best['smooth_factor']}")
    assert report["recommended_flags"] == flags
    assert report["gain_over_best_fixed"] == pytest.approx(
        1 - best["ttft_s"] / report["best_fixed"]["ttft_s"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert f"recommended: {flags}" in capsys.readouterr().out
    # Every dynamic trial with the same initial size shared one cached profile.
    profiles = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(profiles) == len({t["chunk_size"] for t in dynamic})


def test_bench_compares_layouts_and_writes_trace_and_timeline(model, tmp_path, capsys) -> None:
    out_json, trace, timeline = tmp_path / "b.json", tmp_path / "trace.json", tmp_path / "t.png"
    main(["bench", "--model", str(model), "--pp-size", "1,2", "--input-len", "256",
          "--output-len", "4", "--num-prompts", "2", "--dtype", "float32",
          "--chunked-prefill-size", "64", "--json", str(out_json), "--trace", str(trace),
          "--timeline", str(timeline)])
    report = json.loads(out_json.read_text())
    layouts = report["layouts"]
    assert [(r["pp_size"], r["tp_size"]) for r in layouts] == [(1, 1), (2, 1)]
    for row in layouts:
        for key in ("ttft_mean_s", "input_throughput_tok_s", "speedup", "efficiency"):
            assert isinstance(row[key], float) and row[key] > 0, key
        assert len(row["bubble_ratio"]) == row["pp_size"]  # one number per stage
        assert all(0.0 <= b <= 1.0 for b in row["bubble_ratio"])
        assert row["chunk_sizes"] == [[64] * 4] * 2
    base, pp2 = layouts
    assert base["speedup"] == 1.0 and base["efficiency"] == 1.0
    assert pp2["speedup"] == pytest.approx(base["prefill_s"] / pp2["prefill_s"])
    assert pp2["efficiency"] == pytest.approx(pp2["speedup"] / 2)
    assert pp2["loop"] == "pipeline"
    # Bytes a rank sends per forward: PP1 moves nothing; PP2's first stage sends one
    # boundary's activations per micro-batch. Nothing here runs TP or EP.
    assert [r["ep_size"] for r in layouts] == [1, 1]
    assert base["comm_bytes_per_forward"] == dict.fromkeys(COMM_BYTES, 0.0)
    pp2_bytes = pp2["comm_bytes_per_forward"]
    assert pp2_bytes["pp_boundary"] == pytest.approx(pp2["boundary_bytes"][0]["per_micro_batch"])
    assert pp2_bytes["tp_all_reduce"] == pp2_bytes["ep_dispatch"] == 0.0
    assert base["exposed_comm_s"] == dict.fromkeys(COMM_BYTES, 0.0)
    assert pp2["exposed_comm_s"]["pp_boundary"] > 0.0  # the second stage waits for the first
    assert pp2["exposed_comm_share_of_forward"]["pp_boundary"] > 0.0
    assert report["same_tokens_across_layouts"] is True
    assert "same tokens across layouts: True" in capsys.readouterr().out

    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    # Layout i's stages are numbered from 100 * i: PP1 -> stage 0, PP2 -> stages 100, 101;
    # each layout's scheduler (its CPU-side work) is the row just before its stages.
    assert names == {0: "stage 0", 100: "stage 100", 101: "stage 101",
                     -1: "scheduler", 99: "scheduler"}
    forwards = [e for e in spans if e["cat"] == "forward"]
    assert {e["pid"] for e in forwards} == {0, 100, 101}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # Every stage of PP2 ran every prompt chunk of the timed prompts (4 chunks x 2 prompts).
    for stage in (100, 101):
        chunks = {(r, c) for e in forwards if e["pid"] == stage
                  for r, c in zip(e["args"]["rids"], e["args"]["chunks"], strict=True)
                  if r.startswith("bench-") and c >= 0}
        assert chunks == {(f"bench-{i}", c) for i in range(2) for c in range(4)}
    assert timeline.read_bytes()[:8] == PNG_MAGIC


def test_tune_named_trials_in_interleaved_rounds(model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path / "cache"))
    out_json = tmp_path / "tune.json"
    main(["tune", "--model", str(model), "--pp-size", "2", "--input-len", str(INPUT_LEN),
          "--fixed-sizes", "128:256:128", "--dynamic", "256:1.0,256:0.0", "--rounds", "2",
          "--budget-s", "120", "--json", str(out_json), "--png", str(tmp_path / "t.png")])
    report = json.loads(out_json.read_text())
    trials = report["trials"]
    assert [(t["mode"], t["chunk_size"], t["smooth_factor"]) for t in trials] == [
        ("fixed", 128, None), ("fixed", 256, None), ("dynamic", 256, 1.0), ("dynamic", 256, 0.0)]
    for t in trials:
        assert len(t["samples"]) == 2 and t["ttft_s"] == pytest.approx(sum(t["samples"]) / 2)
    fixed = {t["chunk_size"]: t["ttft_s"] for t in trials if t["mode"] == "fixed"}
    best = min(fixed.values())
    for ratio, t in zip(report["dynamic_vs_fixed"], trials[2:], strict=True):
        assert ratio["to_best_fixed"] == pytest.approx(t["ttft_s"] / best)
        assert ratio["to_same_fixed"] == pytest.approx(t["ttft_s"] / fixed[256])
    assert trials[3]["chunk_sizes"] == [256] * (INPUT_LEN // 256)  # s = 0: fixed chunks


def test_bench_compares_a_context_parallel_layout(model, tmp_path) -> None:
    """`--layouts 1x1,cp2`: the CP2 row counts its two ranks and gives the same tokens; it
    reports the K/V exchange of every layer, half the KV bytes per device, and with shard
    linear of the q/k/v projection fewer weight bytes per device."""
    out_json = tmp_path / "cp.json"
    main(["bench", "--model", str(model), "--layouts", "1x1,cp2", "--input-len", "125",
          "--output-len", "3", "--num-prompts", "1", "--dtype", "float32",
          "--chunked-prefill-size", "64", "--json", str(out_json),
          "--shard-linear-layers", "qkv_proj", "--shard-linear-warm-layers", "0"])
    report = json.loads(out_json.read_text())
    base, cp2 = report["layouts"]
    assert [(r["layout"], r["pp_size"], r["cp_size"], r["devices"]) for r in (base, cp2)] == [
        ("PP1 TP1", 1, 1, 1), ("PP1 TP1 CP2", 1, 2, 2)]
    assert report["cp_size"] == 1  # the top level repeats the first layout's row
    assert cp2["speedup"] == pytest.approx(base["prefill_s"] / cp2["prefill_s"])
    assert cp2["efficiency"] == pytest.approx(cp2["speedup"] / 2)
    assert cp2["chunk_sizes"] == [[64, 61]]
    assert report["same_tokens_across_layouts"] is True
    assert base["cp"] is None
    layers = ArchConfig.load(model).num_layers
    assert sorted(cp2["cp"]["kv_exchange_per_layer"]) == [str(i) for i in range(layers)]
    assert cp2["comm_bytes_per_forward"]["cp_kv"] > 0
    assert cp2["kv_bytes_per_device"] * 2 == base["kv_bytes_per_device"]  # 128 tokens
    assert 0 < cp2["weight_bytes_per_device"] < base["weight_bytes_per_device"]
    assert cp2["weight_bytes_per_device"] == cp2["cp"]["shard_linear_expected_weight_bytes"]
