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
import stat
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
from ports import free_port

from pipeserve.distributed import wire
from pipeserve.distributed.channels import CurveKeys, SchedulerChannels, secure_client
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


def client(ctx: zmq.Context, kind: int, url: str, key: str | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        secure_client(sock, CurveKeys.derive(key))
    sock.connect(url)
    return sock


def test_with_an_auth_key_only_the_right_key_gets_through() -> None:
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key="right key")
    ctx = zmq.Context()
    try:
        heartbeat = wire.encode_status("heartbeat", 0)
        senders = [client(ctx, zmq.PUSH, channels.endpoints.status, key)
                   for key in ("wrong key", None)]
        for sender in senders:
            sender.send(heartbeat, zmq.NOBLOCK)
        assert channels.poll(POLL_MS) is None
        outsiders = [client(ctx, zmq.PULL, channels.endpoints.batch[0], key)
                     for key in ("wrong key", None)]
        spies = [client(ctx, zmq.SUB, channels.endpoints.control, key)
                 for key in ("wrong key", None)]
        for spy in spies:
            spy.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(POLL_MS / 1000)
        assert not channels.send_batch("timeline", block=False)  # no authenticated taker

        sender = client(ctx, zmq.PUSH, channels.endpoints.status, "right key")
        sender.send(heartbeat)
        assert channels.poll(10_000) == ("heartbeat", 0, None)
        assert channels.poll(POLL_MS) is None  # and nothing of the others' came after it
        worker = client(ctx, zmq.PULL, channels.endpoints.batch[0], "right key")
        deadline = time.monotonic() + 10
        while not channels.send_batch("timeline", block=False):
            assert time.monotonic() < deadline, "the right key never connected"
            time.sleep(0.05)
        assert worker.poll(10_000)
        assert wire.decode_stage(worker.recv()) == (wire.MsgType.TIMELINE, None)
        for sock in [*outsiders, *spies]:
            assert not sock.poll(POLL_MS)
    finally:
        ctx.destroy(linger=0)
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


def test_a_stranger_s_silent_connections_are_closed_after_the_handshake_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZMQ takes every TCP connection to the scheduler's sockets and cannot cap them: a
    connection that never completes the (CURVE) handshake is closed after HANDSHAKE_MS, so
    a stranger cannot keep connections (file descriptors) open by the thousand."""
    import socket

    from pipeserve.distributed import channels as channels_mod

    monkeypatch.setattr(channels_mod, "HANDSHAKE_MS", 500)
    base = free_port(3)
    channels = SchedulerChannels("127.0.0.1", 1, base, auth_key="right key")
    strangers: list[socket.socket] = []
    try:
        for port in range(base, base + 3):  # the batch, status and control sockets
            for _ in range(10):
                strangers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        deadline = time.monotonic() + 10
        for s in strangers:  # each reads ZMQ's greeting, then the end of the connection
            s.settimeout(max(0.01, deadline - time.monotonic()))
            while s.recv(4096):
                pass
    finally:
        for s in strangers:
            s.close()
        channels.close()
