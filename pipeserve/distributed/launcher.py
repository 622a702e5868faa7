"""Starting worker processes: all of them on a single node, or this node's share of the
global ranks when --nnodes > 1 (node 0 also runs the scheduler; other nodes only workers).

Where the ranks meet: on a single node, torch.distributed's rendezvous is a file store in
the scheduler's private 0700 directory (beside its ipc sockets) and gloo binds to loopback,
so nothing listens on a network. Across nodes it is torch's TCP store on --dist-init-addr,
and gloo connects the nodes over TCP: neither authenticates anyone (--dist-auth-key only
secures the scheduler's ZMQ channels), so the cluster network must be private.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field

from pipeserve import envs
from pipeserve.config import EngineConfig
from pipeserve.device import cpu_cores
from pipeserve.distributed.channels import Endpoints
from pipeserve.distributed.netif import set_gloo_socket_ifname
from pipeserve.lifetime import REFUSED_EXIT

log = logging.getLogger(__name__)
STORE_FILE = "store"


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet across nodes: torch.distributed's TCP store on node 0 and the
    scheduler's ZMQ ports after it (both None on a single node: a file store and ipc
    sockets in the scheduler's private directory)."""

    host: str
    store_port: int | None
    zmq_base_port: int | None
    auth_key: str | None = field(default=None, repr=False)  # CURVE on the ZMQ channels


def rendezvous(config: EngineConfig) -> Rendezvous:
    p = config.parallel
    if p.nnodes == 1:
        return Rendezvous("127.0.0.1", None, None)
    assert p.dist_init_addr is not None  # validated with the config
    host, _, port = p.dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr {p.dist_init_addr!r} must be host:port")
    if not p.auth_key:
        log.warning(
            "the control plane between nodes is unauthenticated: anyone who reaches %s's "
            "ports %s.. can submit or take micro-batches. Give every node the same "
            "--dist-auth-key (or PIPESERVE_DIST_AUTH_KEY), and keep the cluster network "
            "private (torch.distributed's store and gloo have no authentication)",
            host,
            port,
        )
    return Rendezvous(host, int(port), int(port) + 1, p.auth_key)


def endpoints_for(rdzv: Rendezvous, width: int) -> Endpoints:
    """The scheduler's fixed ports on node 0 (multi-node: every node computes the same)."""
    assert rdzv.zmq_base_port is not None
    return Endpoints.tcp(rdzv.host, rdzv.zmq_base_port, width, rdzv.auth_key)


def init_method(rdzv: Rendezvous, endpoints: Endpoints) -> str:
    """torch.distributed's rendezvous: a file in the scheduler's private directory on a
    single node (no listening socket), node 0's TCP store across nodes."""
    if endpoints.directory is not None:
        return f"file://{os.path.join(endpoints.directory, STORE_FILE)}"
    return f"tcp://{rdzv.host}:{rdzv.store_port}"


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

    set_gloo_socket_ifname(rdzv.host)  # before the start: workers take this environment
    ctx = worker_context()
    ranks = local_ranks(config)
    procs: list[mp.process.BaseProcess] = []
    for rank in ranks:
        args = WorkerArgs(
            rank,
            config.flags(),
            model_path,
            endpoints,
            init_method(rdzv, endpoints),
            threads_per_worker(config),
            len(ranks),
            rank - ranks.start,
            future_ring,
            dict(os.environ),
        )
        proc = ctx.Process(
            target=worker_main, args=(args,), name=f"pipeserve-worker-{rank}", daemon=True
        )
        proc.start()
        procs.append(proc)
    return procs


def worker_context() -> mp.context.ForkServerContext:
    """How workers start: forked from a server process that imported the worker's modules
    once (multiprocessing's 'forkserver', preloaded), not as fresh interpreters ('spawn'):
    importing torch and pipeserve took ~3 s of each worker's start here. The fork server
    never touches a GPU, so forked workers may. It keeps the environment it started with:
    workers take the launching process's current one from WorkerArgs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["pipeserve.distributed.worker"])
    return ctx


def run_worker_node(config: EngineConfig, model_path: str) -> int:
    """A node other than 0: start this node's workers and wait for them (they exit when
    node 0 shuts the pipeline down, or on their own once node 0 is gone)."""
    rdzv = rendezvous(config)
    endpoints = endpoints_for(rdzv, config.parallel.stage_width)
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
    if any(p.exitcode == REFUSED_EXIT for p in procs):  # the check's message went to node 0
        print(
            f"node {config.parallel.node_rank}: the settings were refused; node 0 says why",
            file=sys.stderr,
            flush=True,
        )
    return max((abs(p.exitcode or 0) for p in procs), default=0)
