"""A two-"node" launch on localhost: `pipeserve generate --nnodes 2` run as two commands
(node 1 only runs its workers, node 0 schedules and prints) prints what one
`pipeserve generate --pp-size 2` command prints, and node 1 exits on its own; the same for
`pipeserve bench` (node 0 reports and saves the JSON)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

from pipeserve.cli import main

pytestmark = pytest.mark.timeout(180)

PIPESERVE = str(Path(sys.executable).with_name("pipeserve"))
PROMPTS = ["The capital of France is", "Long prompts are split into chunks because"]


def generate_args(model: Path) -> list[str]:
    args = ["generate", "--model", str(model), "--pp-size", "2", "--max-new-tokens", "8",
            "--temperature", "0",
            "--dtype", "float32", "--threads-per-worker", "1", "--chunked-prefill-size", "4"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args


def completions(printed: str) -> list[tuple[str, str, str]]:
    """(prompt, text, token counts) per prompt from `pipeserve generate` output."""
    pattern = r">>> (.*)\n(.*)\n\[(\d+ prompt \+ \d+ generated tokens),"
    return re.findall(pattern, printed)


def run_nodes(
    commands: list[list[str]], env: dict[str, str] | None = None
) -> list[tuple[int, str, str]]:
    """Start node 1's command, then node 0's; wait for both (node 1 exits after node 0);
    kill what is left on a timeout. -> (return code, stdout, stderr) per command."""
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for cmd in commands]
    try:
        outs = [nodes[0].communicate(timeout=120), nodes[1].communicate(timeout=60)]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(nodes, outs, strict=True)]


@pytest.mark.parametrize("key", [None, "3c9e71a0f5b24d86e27a4b0c91d5f368"], ids=["no-key", "gated"])
def test_two_node_launch_matches_one_command(model_dir, capsys, key: str | None) -> None:
    """Also with a key: then every worker reaches the scheduler through its tunnel and the
    gate (distributed/gate.py), node 0's own workers too."""
    model = model_dir("tiny-qwen3")
    main(generate_args(model))
    expected = completions(capsys.readouterr().out)
    assert [c[0] for c in expected] == PROMPTS
    assert all(c[2].endswith("+ 8 generated tokens") for c in expected)

    port = free_port(4)  # store, then batch, status and control ports (TP 1)
    multi = [*generate_args(model), "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    env = {**os.environ, **({"PIPESERVE_DIST_AUTH_KEY": key} if key else {})}
    if key is None:
        env.pop("PIPESERVE_DIST_AUTH_KEY", None)
    (rc1, out1, err1), (rc0, out0, err0) = run_nodes(
        [[PIPESERVE, *multi, "--node-rank", str(rank)] for rank in (1, 0)], env)
    assert rc0 == 0, err0
    assert ("unauthenticated" in err0) == (key is None)
    assert rc1 == 0, err1  # node 1 exited on its own, cleanly
    assert "node 1: workers [1] started" in out1
    assert ">>>" not in out1  # only node 0 schedules and prints
    assert completions(out0) == expected


def test_bench_on_two_nodes_reports_only_on_node_0(model_dir, tmp_path: Path) -> None:
    model = model_dir("tiny-qwen3")
    port = free_port(4)
    bench = [PIPESERVE, "bench", "--model", str(model), "--pp-size", "2", "--input-len", "64",
             "--output-len", "2", "--dtype", "float32", "--threads-per-worker", "1",
             "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    report = tmp_path / "report.json"
    (rc1, out1, err1), (rc0, out0, err0) = run_nodes(
        [[*bench, "--node-rank", "1", "--json", str(tmp_path / "n1.json")],
         [*bench, "--node-rank", "0", "--json", str(report)]])
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    assert "node 1: workers [1] started" in out1
    assert "PP2 TP1" not in out1  # only node 0 reports
    assert not (tmp_path / "n1.json").exists()
    assert json.loads(report.read_text())["layouts"][0]["pp_size"] == 2
    assert "PP2 TP1" in out0


def test_refused_settings_end_both_nodes_without_a_traceback(model_dir) -> None:
    """A TP size that does not divide the heads, on two nodes: every worker refuses it at
    start-up; node 0 prints the check's message in one line and exits with 2, node 1 exits
    on its own, saying node 0 has the reason when its workers refused (they may instead be
    ended as orphans first), and neither prints a traceback."""
    model = model_dir("tiny-qwen3")
    port = free_port(6)  # store, then 3 batch (the first stage's TP ranks), status, control
    multi = [*generate_args(model), "--tp-size", "3", "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{port}"]
    (rc1, _, err1), (rc0, _, err0) = run_nodes(
        [[PIPESERVE, *multi, "--node-rank", str(rank)] for rank in (1, 0)])
    assert rc0 == 2, err0
    errors = [line for line in err0.splitlines() if line.startswith("pipeserve: error:")]
    assert len(errors) == 1 and "not divisible by --tp-size 3" in errors[0], err0
    assert rc1 != 0
    assert rc1 != 2 or "node 1: the settings were refused; node 0 says why" in err1, err1
    assert "Traceback" not in err0 + err1, err0 + err1


def test_bench_refuses_several_layouts_across_nodes() -> None:
    with pytest.raises(SystemExit, match="runs one layout per command"):
        main(["bench", "--pp-size", "2,4", "--nnodes", "2", "--node-rank", "1",
              "--dist-init-addr", "127.0.0.1:29500"])
