"""Starting worker processes: all of them on a single node, or this node's share of the
global ranks when --nnodes > 1 (node 0 also runs the scheduler; other nodes only workers)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import dataclass

from pipeserve import envs
from pipeserve.config import EngineConfig
from pipeserve.device import cpu_cores
from pipeserve.distributed.channels import Endpoints
from pipeserve.distributed.netif import set_gloo_socket_ifname


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet: the torch.distributed store and the scheduler's ZMQ ports."""

    host: str
    store_port: int
    zmq_base_port: int | None  # None: pick free ports (single node only)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.store_port}"


def rendezvous(config: EngineConfig) -> Rendezvous:
    p = config.parallel
    if p.dist_init_addr:
        host, _, port = p.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr {p.dist_init_addr!r} must be host:port")
        return Rendezvous(host, int(port), int(port) + 1)
    return Rendezvous("127.0.0.1", free_port(), None)


def endpoints_for(rdzv: Rendezvous, tp_size: int) -> Endpoints:
    """The scheduler's fixed ports on node 0 (multi-node: every node computes the same)."""
    assert rdzv.zmq_base_port is not None
    base = rdzv.zmq_base_port
    return Endpoints(
        rdzv.host, tuple(range(base, base + tp_size)), base + tp_size, base + tp_size + 1
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_ranks(config: EngineConfig) -> range:
    p = config.parallel
    per_node = p.world_size // p.nnodes
    return range(p.node_rank * per_node, (p.node_rank + 1) * per_node)


def threads_per_worker(config: EngineConfig) -> int:
    p = config.parallel
    cores = envs.num_threads() or cpu_cores()
    return p.threads_per_worker or max(1, cores // (p.world_size // p.nnodes))


def start_workers(
    config: EngineConfig, model_path: str, endpoints: Endpoints, rdzv: Rendezvous, future_ring: int
) -> list[mp.process.BaseProcess]:
    from pipeserve.distributed.worker import WorkerArgs, worker_main

    set_gloo_socket_ifname(rdzv.host)  # before the spawn: workers inherit the environment
    ctx = mp.get_context("spawn")
    ranks = local_ranks(config)
    procs: list[mp.process.BaseProcess] = []
    for rank in ranks:
        args = WorkerArgs(
            rank,
            config.flags(),
            model_path,
            endpoints,
            rdzv.init_method,
            threads_per_worker(config),
            len(ranks),
            future_ring,
        )
        proc = ctx.Process(
            target=worker_main, args=(args,), name=f"pipeserve-worker-{rank}", daemon=True
        )
        proc.start()
        procs.append(proc)
    return procs


def run_worker_node(config: EngineConfig, model_path: str) -> int:
    """A node other than 0: start this node's workers and wait for them (they exit when
    node 0 shuts the pipeline down, or on their own once node 0 is gone)."""
    rdzv = rendezvous(config)
    endpoints = endpoints_for(rdzv, config.parallel.tp_size)
    from pipeserve.engine.future_map import worker_ring_size
    from pipeserve.models.arch import ArchConfig

    context = ArchConfig.load(model_path).context_length(config.model.context_length)
    ring = worker_ring_size(config, context)
    procs = start_workers(config, model_path, endpoints, rdzv, ring)
    print(
        f"node {config.parallel.node_rank}: workers {list(local_ranks(config))} started", flush=True
    )
    for proc in procs:
        proc.join()
    return max((abs(p.exitcode or 0) for p in procs), default=0)
