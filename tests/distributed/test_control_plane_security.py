"""The control plane takes orders only from the engine's own processes.

- a status message or a batch that does not decode (garbage, a pickle whose unpickling would
  create a file) is dropped: no file appears and the pipeline serves the next request;
- on one node the channels are ipc:// sockets in a 0700 directory and nothing listens on a
  network address (the torch.distributed store is a file, gloo binds to loopback);
- with an auth key, a client with another key or without CURVE can neither deliver a status
  message nor take a batch, while the right key can;
- the layer partition and the page count reach every rank as tensors, not pickles.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import stat
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
from floods import Flood
from ports import free_port

from pipeserve.disaggregation.pd import link
from pipeserve.distributed import gate
from pipeserve.distributed.channels import (
    CurveKeys,
    SchedulerChannels,
    private_directory,
    secure_client,
)
from pipeserve.distributed.gate import Tunnel, gate_secret
from pipeserve.distributed.messages import STAGE, STATUS, Heartbeat, ReportTimeline, Status
from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine

pytestmark = pytest.mark.timeout(180)

FLAGS: dict[str, Any] = {"pp_size": 2, "dtype": "float32", "max_total_tokens": 2048,
                         "threads_per_worker": 1}
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
POLL_MS = 1500


class CreatesFile:
    """Unpickling this creates `path` (what a hostile pickle could do with any command)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def greedy(engine: Engine) -> list[int]:
    out = engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)
    assert isinstance(out, list)
    return list(out[0]["output_ids"])


@pytest.fixture(scope="module")
def engine(model_dir) -> Any:
    with Engine(str(model_dir("tiny-qwen3")), **FLAGS) as e:
        yield e


def scheduler_channels(engine: Engine) -> SchedulerChannels:
    assert isinstance(engine.backend, WorkerBackend)
    return engine.backend.workers.channels


def test_undecodable_messages_are_dropped_without_effect(engine: Engine, tmp_path: Path,
                                                         caplog) -> None:
    before = greedy(engine)
    channels = scheduler_channels(engine)
    marker = tmp_path / "unpickled"
    hostile = [b"\x00garbage\xff", pickle.dumps(CreatesFile(marker)),
               pickle.dumps(("error", 0, "a forged worker failure"))]
    ctx = zmq.Context()
    try:
        intruder = ctx.socket(zmq.PUSH)
        intruder.connect(channels.endpoints.status)
        for data in hostile:
            intruder.send(data)
        for data in hostile:  # stands in for a hostile sender at the scheduler's end
            channels._batch[0].send(data)
        time.sleep(1.0)
        assert greedy(engine) == before
    finally:
        ctx.destroy(linger=0)
    assert not marker.exists()
    assert "dropped" in caplog.text


def test_single_node_channels_are_ipc_sockets_in_a_private_directory(engine: Engine) -> None:
    endpoints = scheduler_channels(engine).endpoints
    assert endpoints.directory is not None
    info = os.stat(endpoints.directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    for url in (*endpoints.batch, endpoints.status, endpoints.control):
        assert url.startswith(f"ipc://{endpoints.directory}/")
        assert os.path.exists(url.removeprefix("ipc://"))


def test_closed_channels_remove_their_directory() -> None:
    channels = SchedulerChannels("127.0.0.1", 2)
    directory = channels.endpoints.directory
    assert directory is not None and os.path.isdir(directory)
    channels.close()
    assert not os.path.exists(directory)


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_listeners() -> list[tuple[str, str]]:
    """(local address in /proc's hex, inode) of every listening TCP socket."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                out.append((f[1].rsplit(":", 1)[0], f[9]))
    return out


def is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return hex_addr.endswith("7F")
    return hex_addr in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_a_single_node_pipeline_listens_on_no_network_address(engine: Engine) -> None:
    assert isinstance(engine.backend, WorkerBackend)
    pids = [os.getpid(), *(p.pid for p in engine.backend.workers.procs if p.pid)]
    ours = set().union(*(socket_inodes(pid) for pid in pids))
    listening = [addr for addr, inode in tcp_listeners() if inode in ours]
    assert listening, "expected gloo's loopback listeners"
    assert all(is_loopback(a) for a in listening), listening


# --- CURVE ----------------------------------------------------------------------------------


RIGHT, WRONG = "5e1c" * 8, "a7d3" * 8  # two keys of 128 bits


class Clients:
    """ZMQ clients of the scheduler's sockets, each as a worker would make it: with a key,
    through a tunnel to the gate under that key (gate.py); without, straight at the port."""

    def __init__(self, channels: SchedulerChannels) -> None:
        self.endpoints = channels.endpoints
        self.ctx = zmq.Context()
        self.tunnels: list[Tunnel] = []

    def __call__(self, kind: int, url: str, key: str | None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            secure_client(sock, CurveKeys.derive(key))
            tunnel = Tunnel(gate_secret(key), [url], private_directory())
            self.tunnels.append(tunnel)
            url = tunnel.local[url]
        sock.connect(url)
        return sock

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        for tunnel in self.tunnels:
            tunnel.close()


def test_with_an_auth_key_only_the_right_key_gets_through() -> None:
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key=RIGHT)
    client = Clients(channels)
    try:
        heartbeat = STATUS.encode(Status(0, Heartbeat()))
        senders = [client(zmq.PUSH, channels.endpoints.status, key) for key in (WRONG, None)]
        for sender in senders:
            sender.send(heartbeat, zmq.NOBLOCK)
        assert channels.poll(POLL_MS) is None
        outsiders = [client(zmq.PULL, channels.endpoints.batch[0], key) for key in (WRONG, None)]
        spies = [client(zmq.SUB, channels.endpoints.control, key) for key in (WRONG, None)]
        for spy in spies:
            spy.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(POLL_MS / 1000)
        assert not channels.send_batch(ReportTimeline(), block=False)  # no authenticated taker

        sender = client(zmq.PUSH, channels.endpoints.status, RIGHT)
        sender.send(heartbeat)
        assert channels.poll(10_000) == Status(0, Heartbeat())
        assert channels.poll(POLL_MS) is None  # and nothing of the others' came after it
        worker = client(zmq.PULL, channels.endpoints.batch[0], RIGHT)
        deadline = time.monotonic() + 10
        while not channels.send_batch(ReportTimeline(), block=False):
            assert time.monotonic() < deadline, "the right key never connected"
            time.sleep(0.05)
        assert worker.poll(10_000)
        assert STAGE.decode(worker.recv()) == ReportTimeline()
        for sock in [*outsiders, *spies]:
            assert not sock.poll(POLL_MS)
    finally:
        client.close()
        channels.close()


# --- agreeing on the partition and the pages ------------------------------------------------


def agree(rank: int, store: str, results: Any) -> None:
    try:
        _agree(rank, store, results)
    except BaseException as exc:  # reported, so the test fails with it instead of waiting
        results.put((rank, None, None, f"{type(exc).__name__}: {exc}"))
        raise


def _agree(rank: int, store: str, results: Any) -> None:
    import torch.distributed as dist

    from pipeserve.config import EngineConfig
    from pipeserve.distributed import worker
    from pipeserve.distributed.parallel_state import init_parallel_groups

    def no_pickles(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an object collective (pickle) was used")

    dist.broadcast_object_list = no_pickles
    dist.broadcast_object = no_pickles
    worker.kv_pool_pages = lambda *args: 1000 + rank  # the fewest any rank has room for
    init_parallel_groups(rank, 1, 2, "gloo", f"file://{store}", 60)
    cpu, arch = torch.device("cpu"), SimpleNamespace(num_layers=4)
    good = EngineConfig.from_flags(pp_size=2, pp_layer_partition="3,1")
    partition = worker._agree_on_partition(good, arch, cpu)  # type: ignore[arg-type]
    pages = worker._agree_on_pages(good, arch, 2, partition, cpu)  # type: ignore[arg-type]
    bad = EngineConfig.from_flags(pp_size=2, pp_layer_partition="2,1")
    try:
        worker._agree_on_partition(bad, arch, cpu)  # type: ignore[arg-type]
        error = ""
    except ValueError as exc:
        error = str(exc)
    results.put((rank, partition, pages, error))
    dist.destroy_process_group()


def test_partition_and_pages_are_broadcast_as_tensors(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=agree, args=(r, str(tmp_path / "store"), results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [g[1:3] for g in got] == [([3, 1], 1000)] * 2
    assert got[0][3] == got[1][3] and "2,1" in got[0][3]


def test_curve_still_guards_the_sockets_behind_the_gate() -> None:
    """A client that passes the gate (its secret) but lacks the CURVE client key, or has
    another, still delivers nothing and takes nothing: the gate adds to CURVE, not instead."""
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key=RIGHT)
    ctx = zmq.Context()
    tunnels = []
    try:
        heartbeat = STATUS.encode(Status(0, Heartbeat()))
        for curve in (WRONG, None):
            tunnel = Tunnel(gate_secret(RIGHT), [channels.endpoints.status], private_directory())
            tunnels.append(tunnel)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                secure_client(sock, CurveKeys.derive(curve))
            sock.connect(tunnel.local[channels.endpoints.status])
            sock.send(heartbeat, zmq.NOBLOCK)  # queued for a peer that never completes
        assert channels.poll(POLL_MS) is None  # (the right key gets through: the test above)
    finally:
        ctx.destroy(linger=0)
        for tunnel in tunnels:
            tunnel.close()
        channels.close()


def test_a_stranger_s_silent_connections_are_closed_after_the_handshake_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's public ports are the gate's link listeners: a connection that never
    completes the link handshake is closed after link.HANDSHAKE_S, having been sent nothing
    (ZeroMQ, which would greet it, is on loopback only)."""
    monkeypatch.setattr(link, "HANDSHAKE_S", 0.5)
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key=RIGHT)
    strangers: list[socket.socket] = []
    try:
        for port in range(base, base + 3):  # the batch, status and control ports
            for _ in range(10):
                strangers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        deadline = time.monotonic() + 3  # HANDSHAKE_S 0.5 and a sweep's turn
        for s in strangers:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            assert s.recv(4096) == b""  # closed without a word, in time
    finally:
        for s in strangers:
            s.close()
        channels.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_flood_leaves_a_late_worker_served() -> None:
    """Strangers open connections to the scheduler's status port as fast as one thread can,
    from one address and from a hundred: the scheduler holds a bounded number of them (the
    gate's per-address and pending caps; ZeroMQ never sees them), and a worker that connects
    in the middle of the flood delivers its first message at once."""
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key=RIGHT)
    client = Clients(channels)
    before = open_fds()
    status = ("127.0.0.1", base + 1)
    try:
        for sources in (["127.0.0.2"], [f"127.0.3.{i}" for i in range(100)]):
            flood = Flood(status, sources, keep=400)
            deadline = time.monotonic() + 10
            while flood.opened < 300:
                assert time.monotonic() < deadline, flood.opened
                time.sleep(0.01)
            held = open_fds() - before - len(flood.held)  # the flood's own sockets excluded
            start = time.monotonic()
            sender = client(zmq.PUSH, channels.endpoints.status, RIGHT)
            sender.send(STATUS.encode(Status(0, Heartbeat())))
            got = channels.poll(10_000)
            waited = time.monotonic() - start
            flood.end()
            assert got == Status(0, Heartbeat())
            assert waited < 1.0, waited  # here 0.03-0.04 s; the flood against ZeroMQ: ~3 s
            cap = gate.PER_ADDRESS if len(sources) == 1 else gate.PENDING
            assert held <= cap + 8, held  # not one descriptor per connection
            sender.close()
    finally:
        client.close()
        channels.close()
