"""benchmarks/netlab.sh: two network namespaces joined by a rate-limited veth pair, one
`pipeserve bench --nnodes 2` node in each. Needs root (skipped otherwise): the run reports,
its traffic crosses the veth, and the namespaces and processes are gone afterwards, also
after a Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "netlab.sh"
PIPESERVE = str(Path(sys.executable).with_name("pipeserve"))


@pytest.fixture(scope="module")
def netlab_env() -> dict[str, str]:
    """The environment to run the script in; skips where network namespaces are not ours."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs ip and tc (iproute2)")
    probe = f"psnetlab-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        pytest.skip("cannot create network namespaces here")
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return {**os.environ, "PIPESERVE": PIPESERVE}


def bench_args(model: Path, output_len: int, num_prompts: int) -> list[str]:
    return ["--model", str(model), "--input-len", "64", "--output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--dtype", "float32"]


def namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if f"psnetlab-{pid}-" in line]


def test_two_nodes_over_the_rate_limited_link(model_dir, netlab_env, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [str(SCRIPT), "--rate", "100mbit", "--", "--pp-size", "2", "--json", str(report),
         *bench_args(model_dir("tiny-qwen3"), 2, 1)],
        env=netlab_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(report.read_text())["layouts"][0]["pp_size"] == 2
    assert "PP2 TP1" in out
    assert "[node 1] node 1: workers [1] started" in err
    sent = re.search(r"link bytes: node 0 -> 1 (\d+), node 1 -> 0 (\d+)", err)
    assert sent is not None, err
    assert int(sent[1]) > 64 * 64 * 4  # at least the activations of 64 tokens x 64 floats
    assert namespaces_of(proc.pid) == []


@pytest.mark.timeout(300)
def test_ctrl_c_tears_everything_down(model_dir, netlab_env) -> None:
    proc = subprocess.Popen(
        # work enough to outlast the wait for both nodes on a loaded machine (8 prompts of a
        # tiny model could end first, and the script then exits 0, not 130)
        [str(SCRIPT), "--", "--pp-size", "2", *bench_args(model_dir("tiny-qwen3"), 4000, 64)],
        env=netlab_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
        # a run started in the background of a shell without job control inherits SIGINT
        # ignored, and bash cannot trap a signal ignored at its start: Ctrl-C as in a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pids = wait_for_both_nodes(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        assert proc.wait(timeout=120) == 130  # a loaded machine tears down slowly
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert namespaces_of(proc.pid) == []
    deadline = time.monotonic() + 10  # killed processes may take a moment to be reaped
    while [pid for pid in pids if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if running(pid)]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_for_both_nodes(pid: int) -> list[int]:
    """The processes inside the script's two namespaces, once both nodes have started their
    workers (two processes at least in each: so node 0 is past building the kernels, which
    a kill would interrupt, leaving the build's lock file behind)."""
    deadline = time.monotonic() + 120  # a loaded machine starts them slowly
    while time.monotonic() < deadline:
        names = sorted(namespaces_of(pid))
        found = [subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                text=True).stdout.split() for n in names]
        if len(names) == 2 and min(map(len, found)) >= 2:
            return [int(p) for f in found for p in f]
        time.sleep(0.2)
    raise AssertionError("the two nodes did not start within 120 s")
