"""The `pipeserve` command: make-model, generate and bench, called in-process through
`pipeserve.cli.main`, plus one real run of the installed entry point."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file

from pipeserve.cli import CHAT_PROMPTS, RAW_PROMPTS, main
from pipeserve.engine.engine import Engine

pytestmark = pytest.mark.timeout(300)

TIMING_KEYS = ("ttft_mean_s", "ttft_p50_s", "input_throughput_tok_s", "output_throughput_tok_s")


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny-qwen3"
    main(["make-model", "--preset", "tiny-qwen3", "--out", str(out)])
    return out


def test_make_model_writes_a_loadable_checkpoint(cli_model: Path, model_dir, capsys) -> None:
    names = {p.name for p in cli_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert json.loads((cli_model / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]
    # Same preset, same default seed: the same weights as the library call.
    ours, lib = load_file(cli_model / "model.safetensors"), load_file(
        model_dir("tiny-qwen3") / "model.safetensors")
    assert ours.keys() == lib.keys() and all(torch.equal(ours[k], lib[k]) for k in ours)
    with Engine(str(cli_model), max_total_tokens=256) as engine:
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert isinstance(out, dict) and len(out["output_ids"]) == 2


def test_make_model_list_and_missing_arguments(capsys) -> None:
    main(["make-model", "--list"])
    listed = json.loads(capsys.readouterr().out)
    assert listed["tiny-qwen3-moe"] == "Qwen3MoeForCausalLM"
    with pytest.raises(SystemExit, match="make-model needs --preset NAME and --out DIR"):
        main(["make-model", "--preset", "tiny-qwen3"])


@pytest.mark.parametrize("raw", [False, True])
def test_generate_prints_greedy_text(cli_model: Path, capsys, raw: bool) -> None:
    """The default prompts go through the model's chat template as user messages (the
    preset has one); --raw sends completions' prompts as they are."""
    main(["generate", "--model", str(cli_model), "--max-new-tokens", "4", "--temperature", "0",
          *(["--raw"] if raw else [])])
    printed = capsys.readouterr().out
    assert f"model: {cli_model} (Qwen3ForCausalLM)" in printed
    prompts = RAW_PROMPTS if raw else CHAT_PROMPTS
    with Engine(str(cli_model)) as engine:
        tok = engine.tokenizer
        assert tok is not None
        texts = prompts if raw else [
            tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
        expected = engine.generate(texts, sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    assert isinstance(expected, list)
    for prompt, out in zip(prompts, expected, strict=True):
        assert f">>> {prompt}\n{out['text']}\n" in printed
    assert printed.count(" generated tokens, TTFT ") == len(prompts)


def test_generate_with_own_prompt_and_engine_flags(cli_model: Path, capsys) -> None:
    main(["generate", "--model", str(cli_model), "--max-new-tokens", "3", "--prompt", "hi there",
          "--chunked-prefill-size", "16", "--page-size", "16", "--disable-radix-cache",
          "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert ">>> hi there\n" in printed and ">>> The capital" not in printed


def read_report(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    for key in (*TIMING_KEYS, "prefill_flops_share_of_peak"):
        value = report[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    return report


def test_bench_writes_json(cli_model: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "bench.json"
    main(["bench", "--model", str(cli_model), "--input-len", "64", "--output-len", "4",
          "--num-prompts", "2", "--json", str(path)])
    report = read_report(path)
    assert (report["input_len"], report["output_len"], report["num_prompts"]) == (64, 4, 2)
    assert "baseline" not in report
    assert f"saved {path}" in capsys.readouterr().out


def test_bench_with_hf_baseline(cli_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "bench-hf.json"
    main(["bench", "--model", str(cli_model), "--input-len", "64", "--output-len", "4",
          "--num-prompts", "2", "--json", str(path), "--baseline", "hf", "--dtype", "float32"])
    report = read_report(path)
    base = report["baseline"]
    for key in TIMING_KEYS:
        assert math.isfinite(base[key]) and base[key] > 0, (key, base[key])
    ratio = report["ratio_to_baseline"]
    assert ratio["prefill_time"] > 0 and ratio["ttft_mean"] > 0
    assert report["same_greedy_tokens_as_baseline"] is True  # float32: no near-ties


def test_entry_point_subprocess(cli_model: Path) -> None:
    exe = Path(sys.executable).parent / "pipeserve"
    if not exe.is_file():
        pytest.skip(f"no installed entry point at {exe}")
    done = subprocess.run(
        [str(exe), "generate", "--model", str(cli_model), "--max-new-tokens", "4",
         "--prompt", "Hello"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert ">>> Hello\n" in done.stdout and "generated tokens" in done.stdout


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("generate", ["--tp-size", "3"], "attention heads (4) is not divisible by --tp-size 3"),
        ("generate", ["--page-size", "3"], "--page-size 3 must be a power of two"),
        ("serve", ["--tp-size", "3"], "is not divisible by --tp-size 3"),
    ],
)
def test_settings_that_do_not_fit_end_in_one_line(
    cli_model: Path, command: str, flags: list[str], message: str
) -> None:
    """Settings refused at start-up (here by the workers of a TP layout that does not divide
    the model's heads, or by the flag checks) end the command with exit code 2 and the
    check's message on one line: no traceback from the workers, the engine process or the
    server."""
    exe = Path(sys.executable).parent / "pipeserve"
    if not exe.is_file():
        pytest.skip(f"no installed entry point at {exe}")
    done = subprocess.run(
        [str(exe), command, "--model", str(cli_model), "--prompt", "Hello", *flags]
        if command == "generate"
        else [str(exe), command, "--model", str(cli_model), "--port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("pipeserve: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_the_engine_raises_a_settings_error(cli_model: Path) -> None:
    from pipeserve.config import SettingsError

    with pytest.raises(SettingsError, match="not divisible by --tp-size 3"):
        Engine(str(cli_model), tp_size=3, dtype="float32")


def bench_layouts(monkeypatch, argv: list[str]) -> list[tuple[str, dict[str, Any], int]]:
    """The layouts (name, engine flags, repeat) a bench command line would run."""
    from pipeserve.bench import offline

    seen: list[tuple[str, dict[str, Any], int]] = []

    def fake(flags, layouts, *args, **kwargs) -> None:
        seen.extend((lay.name, lay.flags(flags), args[-1]) for lay in layouts)

    monkeypatch.setattr(offline, "run_bench", fake)
    main(["bench", *argv])
    return seen


def test_bench_layout_options(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--layouts", "1x1,2x1,1x2", "--repeat", "3"])
    assert [(n, f["pp_size"], f["tp_size"], r) for n, f, r in got] == [
        ("PP1 TP1", 1, 1, 3), ("PP2 TP1", 2, 1, 3), ("PP1 TP2", 1, 2, 3)]
    got = bench_layouts(monkeypatch, ["--threads-per-worker", "1,2", "--compare-worker-process"])
    assert [(n, f["threads_per_worker"], f.get("spawn_workers", False)) for n, f, _ in got] == [
        ("PP1 TP1 1thr", 1, False), ("PP1 TP1 worker 1thr", 1, True),
        ("PP1 TP1 2thr", 2, False), ("PP1 TP1 worker 2thr", 2, True)]
    got = bench_layouts(monkeypatch, ["--pp-size", "1,2", "--compare-loops"])
    assert [n for n, _, _ in got] == ["PP1 TP1 plain", "PP1 TP1 overlap", "PP2 TP1"]
    assert got[0][1]["disable_overlap_schedule"] and got[1][1]["enable_overlap_schedule"]
    with pytest.raises(SystemExit):
        main(["bench", "--layouts", "2y1"])


def test_bench_ep_sizes_multiply_the_layouts(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--pp-size", "1,2", "--ep-size", "1,2"])
    assert [(n, f["pp_size"], f["tp_size"], f["ep_size"]) for n, f, _ in got] == [
        ("PP1 TP1", 1, 1, 1), ("PP1 TP1 EP2", 1, 1, 2), ("PP2 TP1", 2, 1, 1),
        ("PP2 TP1 EP2", 2, 1, 2)]
    got = bench_layouts(monkeypatch, ["--layouts", "1x1,2x1", "--ep-size", "2"])
    assert [n for n, _, _ in got] == ["PP1 TP1 EP2", "PP2 TP1 EP2"]
    got = bench_layouts(monkeypatch, ["--layouts", "1x1,1x2,1x1x2,2x1x2"])  # EP in triples
    assert [(f["pp_size"], f["tp_size"], f["ep_size"]) for _, f, _ in got] == [
        (1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)]
    with pytest.raises(SystemExit):
        main(["bench", "--layouts", "1x1x2x2"])
    with pytest.raises(SystemExit):
        main(["bench", "--layouts", "1x1x1x1x1"])


def test_bench_afd_layouts_beside_ep(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--layouts", "1x1x2,a1f1,a2f2", "--compare-worker-process"])
    assert [(n, f.get("afd_attention_size"), f.get("afd_ffn_size"), f["ep_size"])
            for n, f, _ in got] == [
        ("PP1 TP1 EP2", None, None, 2), ("AFD 1A+1F", 1, 1, 1), ("AFD 2A+2F", 2, 2, 1)]
    with pytest.raises(SystemExit):
        main(["bench", "--layouts", "a1f0"])
    got = bench_layouts(monkeypatch, ["--afd-attention-size", "2", "--afd-ffn-size", "1"])
    assert [(n, f["afd_attention_size"], f["afd_ffn_size"]) for n, f, _ in got] == [
        ("AFD 2A+1F", 2, 1)]  # the flags' AFD layout, named as such
    with pytest.raises(SystemExit):
        main(["bench", "--ep-size", "1,two"])


def test_bench_compare_overlap_runs_each_ep_layout_four_ways(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--layouts", "1x2,1x1x2", "--compare-overlap"])
    assert [(n, f.get("enable_two_batch_overlap"), f.get("enable_single_batch_overlap"))
            for n, f, _ in got] == [
        ("PP1 TP2", None, None),  # no experts moved: one run, the flags as given
        ("PP1 TP1 EP2 none", False, False), ("PP1 TP1 EP2 tbo", True, False),
        ("PP1 TP1 EP2 sbo", False, True), ("PP1 TP1 EP2 tbo+sbo", True, True)]


def test_bench_cp_sizes_multiply_the_valid_layouts(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--cp-size", "1,2"])
    assert [(n, f["pp_size"], f["tp_size"], f["ep_size"], f["cp_size"]) for n, f, _ in got] == [
        ("PP1 TP1", 1, 1, 1, 1), ("PP1 TP1 CP2", 1, 1, 1, 2)]
    # CP above 1 only with TP 1 and EP 1 (what the engine builds): the rest is skipped
    got = bench_layouts(monkeypatch, ["--pp-size", "1,2", "--tp-size", "1,2", "--cp-size", "1,2"])
    assert [n for n, _, _ in got] == [
        "PP1 TP1", "PP1 TP1 CP2", "PP1 TP2", "PP2 TP1", "PP2 TP1 CP2", "PP2 TP2"]
    got = bench_layouts(monkeypatch, ["--ep-size", "1,2", "--cp-size", "1,2"])
    assert [(n, f["ep_size"], f["cp_size"]) for n, f, _ in got] == [
        ("PP1 TP1", 1, 1), ("PP1 TP1 CP2", 1, 2), ("PP1 TP1 EP2", 2, 1)]
    got = bench_layouts(monkeypatch, ["--afd-attention-size", "1", "--afd-ffn-size", "1",
                                      "--cp-size", "1,2"])
    assert [(n, f["cp_size"]) for n, f, _ in got] == [("AFD 1A+1F", 1)]
    # one-device layouts only get a worker-process twin: CP2 has two devices
    got = bench_layouts(monkeypatch, ["--cp-size", "1,2", "--compare-worker-process"])
    assert [n for n, _, _ in got] == ["PP1 TP1", "PP1 TP1 worker", "PP1 TP1 CP2"]
    with pytest.raises(SystemExit, match="no layout to run: PP1 TP2 EP1 CP2 do not combine"):
        main(["bench", "--tp-size", "2", "--cp-size", "2"])
    with pytest.raises(SystemExit):
        main(["bench", "--cp-size", "1,two"])


def test_bench_cp_layouts(monkeypatch) -> None:
    got = bench_layouts(monkeypatch, ["--layouts", "cp2,pp2cp2"])
    assert [(n, f["pp_size"], f["tp_size"], f["ep_size"], f["cp_size"]) for n, f, _ in got] == [
        ("PP1 TP1 CP2", 1, 1, 1, 2), ("PP2 TP1 CP2", 2, 1, 1, 2)]
    # named sizes: pp2tp1 is the pair 2x1; a pair or a left-out cp runs with every --cp-size,
    # a triple too (its EP2 with CP2 skipped); a named cp is as written
    got = bench_layouts(monkeypatch, ["--layouts", "1x1,pp2tp1,1x1x2,pp2cp2,tp2ep1",
                                      "--cp-size", "1,2"])
    assert [n for n, _, _ in got] == [
        "PP1 TP1", "PP1 TP1 CP2", "PP2 TP1", "PP2 TP1 CP2", "PP1 TP1 EP2", "PP2 TP1 CP2",
        "PP1 TP2"]
    got = bench_layouts(monkeypatch, ["--layouts", "cp2,pp2", "--ep-size", "1,2"])
    assert [(n, f["ep_size"], f["cp_size"]) for n, f, _ in got] == [
        ("PP1 TP1 CP2", 1, 2), ("PP2 TP1", 1, 1), ("PP2 TP1 EP2", 2, 1)]
    got = bench_layouts(monkeypatch, ["--layouts", "pp1tp1ep2,cp1"])
    assert [(n, f["cp_size"]) for n, f, _ in got] == [("PP1 TP1 EP2", 1), ("PP1 TP1", 1)]
    for bad in ("tp2cp2", "ep2cp2", "cp0", "cpp2", "cp2pp2", "pp", "1x1,,cp2"):
        with pytest.raises(SystemExit):
            main(["bench", "--layouts", bad])


def test_bench_worker_node_gets_the_cp_layout(monkeypatch) -> None:
    """`--nnodes 2 --node-rank 1` (what benchmarks/netlab.sh --layouts runs on node 1):
    the worker node starts the one layout's workers, CP size included."""
    from pipeserve.distributed import launcher
    from pipeserve.models import resolve

    started = []
    monkeypatch.setattr(launcher, "run_worker_node", lambda config, path: started.append(config))
    monkeypatch.setattr(resolve, "resolve_model_path", lambda path, dtype=None: Path("model"))
    node = ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29500"]
    with pytest.raises(SystemExit):
        main(["bench", *node, "--layouts", "pp2cp2"])
    p = started[0].parallel
    assert (p.pp_size, p.tp_size, p.ep_size, p.cp_size, p.world_size) == (2, 1, 1, 2, 4)
    with pytest.raises(SystemExit):
        main(["bench", *node, "--pp-size", "2", "--cp-size", "2"])
    assert started[1].parallel.cp_size == 2
    with pytest.raises(SystemExit, match="runs one layout per command"):
        main(["bench", *node, "--cp-size", "1,2"])
    assert len(started) == 2


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "router"])
def test_help_says_each_default_once_and_names_no_old_link(command: str, capsys) -> None:
    """Every flag's help prints its default once (a help that says it in words adds none),
    and no help names the KV link's old transports (ZeroMQ, CURVE)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    flags = text.split(" --")
    assert [f for f in flags if f.count("(default:") > 1] == []
    assert "ZeroMQ over TCP" not in text and "KV link (CURVE)" not in text
