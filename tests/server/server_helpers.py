"""Shared by the HTTP server tests: real `pipeserve serve` processes on free ports, their
process trees (read from /proc), Prometheus metrics and small polling utilities.

Every server is started in its own session so that, whatever a test does, the finalizer can
reach all of its processes (engine, workers, resource tracker) by the ids it recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ports import free_port

from pipeserve.lifetime import WORKER_NAME

PIPESERVE = Path(sys.executable).parent / "pipeserve"
READY_TIMEOUT_S = 180.0  # two slow cores, other jobs: start-up of a PP server can be slow
POOL_TOKENS = 32768  # a small KV pool: the default takes half of the machine's RAM
Pid = tuple[int, int]  # (pid, start time in clock ticks): a pid that cannot be mistaken


# -- process trees (/proc) ----------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a live, non-zombie process; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # exited; only waiting to be reaped
        return None
    return int(fields[1]), int(fields[19])


def process_tree(root: int) -> list[Pid]:
    """`root` and all its live descendants, each with its start time."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        st = _stat(pid)
        if st is not None:
            found.append((pid, st[1]))
            todo += children.get(pid, [])
    return found


def worker_pids(root: int) -> list[int]:
    """The engine workers among `root`'s descendants (named by the worker at start-up; they
    are the children of the engine process's fork server)."""
    found = []
    for pid, _ in process_tree(root):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith(WORKER_NAME):
            found.append(pid)
    return sorted(found)


def engine_and_workers(server: Server, workers: int = 2) -> tuple[int, list[int]]:
    """The engine process (the server's spawned child) and its workers."""
    engines = []
    for child in os.listdir("/proc"):
        if not child.isdigit():
            continue
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == server.proc.pid and b"spawn_main" in cmd:
            engines.append(int(child))
    assert len(engines) == 1, engines
    found = worker_pids(engines[0])
    assert len(found) == workers, found
    return engines[0], found


def alive(p: Pid) -> bool:
    st = _stat(p[0])
    return st is not None and st[1] == p[1]


def kill_pids(pids: list[Pid]) -> None:
    for p in pids:
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p[0], signal.SIGKILL)


def wait_gone(pids: list[Pid], timeout_s: float) -> list[Pid]:
    """The pids still alive after waiting up to `timeout_s` for all to exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    """Poll until `predicate()` is truthy; return its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# -- servers ------------------------------------------------------------------------------


class Server:
    """One `pipeserve serve` process (a worker-only node with --node-rank > 0), its log file
    and every process of its tree seen so far."""

    def __init__(
        self,
        model: Path,
        args: list[str],
        log: Path,
        port: int | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        defaults = ["--dtype", "float32", "--max-total-tokens", str(POOL_TOKENS)]
        self.cmd = [
            str(PIPESERVE),
            "serve",
            "--model",
            str(model),
            *defaults,
            "--port",
            str(self.port),
            *args,
        ]
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.seen: list[Pid] = []  # every process of the tree observed so far

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.cmd} exited with {self.proc.returncode} before printing "
                    f"{text!r}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{self.cmd} did not print {text!r} in {timeout_s:.0f}s:\n"
                    f"{self.output()[-4000:]}"
                )
            time.sleep(0.05)
        self.tree()

    def tree(self) -> list[Pid]:
        """The live tree now; remembered so that the finalizer can reach reparented orphans."""
        now = process_tree(self.proc.pid)
        self.seen += [p for p in now if p not in self.seen]
        return now

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for whatever of the tree (or its session) is left."""
        self.tree()
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_pids(self.seen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log_file.close()
        wait_gone(self.seen, 10)

    # -- HTTP helpers --

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=30, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        if body is not None:
            kw["json"] = body
        return httpx.post(self.base_url + path, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics").text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@contextlib.contextmanager
def running_server(model: Path, args: list[str], log: Path, **kw: Any) -> Iterator[Server]:
    server = Server(model, args, log, **kw)
    try:
        server.wait_for_line("ready")
        yield server
    finally:
        server.stop()


def drained(server: Server) -> dict[str, float] | None:
    """The metrics once no request holds KV or waits, else None."""
    m = server.metrics()
    ok = (
        m.get("pipeserve_kv_pages_used") == 0
        and m.get("pipeserve_kv_pages_free") == m.get("pipeserve_kv_pages_total")
        and m.get("pipeserve_requests_running") == 0
        and m.get("pipeserve_requests_waiting") == 0
    )
    return m if ok else None


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-style error body (fails the test if the body is not one)."""
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"HTTP {response.status_code} body is not JSON: {response.text[:300]!r}")
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    message = body["error"].get("message")
    assert isinstance(message, str) and message, body
    return message


class Router:
    """One `pipeserve router` process in front of `prefill` and `decode` servers (the PD key
    comes from the environment), with `extra` flags."""

    def __init__(
        self, prefill: list[str], decode: list[str], log: Path, extra: list[str] | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [str(PIPESERVE), "router", "--port", str(self.port), "--health-interval", "0.3"]
        cmd += ["--prefill", *prefill, "--decode", *decode, *(extra or [])]
        self.log = log
        self._file = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT)
        ready = wait_for(lambda: "router ready" in self.output() or self.proc.poll(), 60)
        assert ready and self.proc.poll() is None, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=10).json()

    def complete(self, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(self.base_url + "/v1/completions", json=body, timeout=timeout)

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc.kill()
        self._file.close()
