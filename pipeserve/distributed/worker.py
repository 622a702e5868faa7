"""A worker process: one pipeline stage x one TP rank. Stateless apart from its KV pool (and
the last stage's sampler): everything a forward needs arrives with the batch.

Loop per micro-batch:
    take the next message (a receiver thread fetches it while the current forward runs)
    prepare tensors, launch the forward on the compute stream
    commit point: wait for the previous micro-batch's send (its payload was kept alive)
    send activations to the next stage (non-blocking) or, on the last stage, the result
"""

from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeserve.config import EngineConfig
from pipeserve.device import ComputeStream, dist_backend, resolve_device, set_threads
from pipeserve.distributed import p2p
from pipeserve.distributed.channels import Endpoints, WorkerChannels
from pipeserve.distributed.parallel_state import (
    ParallelState,
    get_stage_links,
    init_parallel_groups,
)
from pipeserve.distributed.partition import resolve_partition
from pipeserve.engine.future_map import FutureMap
from pipeserve.models.arch import ArchConfig
from pipeserve.runner.model_runner import ModelRunner, kv_pool_pages
from pipeserve.scheduler.batch import BatchResult

INIT_TIMEOUT_S = 600


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    flags: dict[str, Any]
    model_path: str
    endpoints: Endpoints
    init_method: str
    threads: int
    local_workers: int
    future_ring: int  # > 0: the scheduler feeds future-token placeholders (overlap, PP = 1)


def worker_main(args: WorkerArgs) -> None:
    channels = None
    try:
        set_threads(args.threads)
        config = EngineConfig.from_flags(**args.flags)
        p = config.parallel
        batch_port = args.endpoints.batch_ports[args.rank] if args.rank < p.tp_size else None
        channels = WorkerChannels(args.rank, args.endpoints, batch_port)
        arch = ArchConfig.load(args.model_path)
        partition = resolve_partition(p.layer_partition, arch.num_layers, p.pp_size)
        device = resolve_device(config.model.device)
        state = init_parallel_groups(args.rank, p.tp_size, p.pp_size, partition,
                                     dist_backend(device), args.init_method, INIT_TIMEOUT_S)
        num_pages = _agree_on_pages(config, arch, args.local_workers)
        runner = ModelRunner(config, arch, args.model_path, num_pages)
        channels.send_status("ready", {"num_pages": num_pages, "partition": partition,
                                       "stage": state.pp_rank, "tp_rank": state.tp_rank})
        StageWorker(runner, state, channels, args).run()
    except BaseException:
        if channels is not None:
            channels.send_status("error", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _agree_on_pages(config: EngineConfig, arch: ArchConfig, local_workers: int) -> int:
    """Every stage must hold the same number of KV pages: rank 0 decides."""
    pages = [kv_pool_pages(config, arch, local_workers)]
    dist.broadcast_object_list(pages, src=0)
    return int(pages[0])


class StageWorker:
    def __init__(self, runner: ModelRunner, state: ParallelState, channels: WorkerChannels,
                 args: WorkerArgs) -> None:
        self.runner, self.state, self.channels = runner, state, channels
        self.links = get_stage_links()
        self.device = runner.device
        self.stream = ComputeStream(self.device, args.threads)
        self.future = FutureMap(args.future_ring, self.device) if args.future_ring else None
        self.inbox: queue.Queue[p2p.StageMessage | BaseException] = queue.Queue()
        self.reports = state.is_last_stage and state.tp_rank == 0
        threading.Thread(target=self._receive, daemon=True).start()

    def run(self) -> None:
        pending: p2p.PendingSend | None = None
        while True:
            msg = self.inbox.get()
            if isinstance(msg, BaseException):
                raise msg
            if msg.kind is p2p.MsgType.SHUTDOWN:
                if pending is not None:
                    pending.wait()
                self._forward_shutdown()
                break
            batch = msg.batch
            assert batch is not None
            fb = self.runner.prepare(batch)
            done = self.stream.submit(self.runner.execute, batch, fb, msg.hidden, msg.residual,
                                      future=self.future)
            if pending is not None:
                pending.wait()  # commit point of the previous micro-batch
                pending = None
            out = done.result()
            if self.links.next_rank is not None:
                nxt = p2p.StageMessage(p2p.MsgType.PROXY, batch, out.hidden, out.residual)
                pending = p2p.send(nxt, self.links.next_rank, self.links.next_group, self.device)
            elif self.reports:
                result = out.result or BatchResult(batch.batch_id, [], [], [])
                self.channels.send_status("result", result)
        self.stream.close()

    def _receive(self) -> None:
        """Fetch the next message while the current forward runs."""
        try:
            while True:
                msg = self._next_message()
                self.inbox.put(msg)
                if msg.kind is p2p.MsgType.SHUTDOWN:
                    return
        except BaseException as exc:  # surfaces in the main loop
            self.inbox.put(exc)

    def _next_message(self) -> p2p.StageMessage:
        if self.links.prev_rank is None:
            obj = self.channels.recv_batch()
            if obj == "shutdown":
                return p2p.StageMessage(p2p.MsgType.SHUTDOWN)
            return p2p.StageMessage(p2p.MsgType.PROXY, obj)
        return p2p.recv(self.links.prev_rank, self.links.prev_group, self.device)

    def _forward_shutdown(self) -> None:
        if self.links.next_rank is not None:
            msg = p2p.StageMessage(p2p.MsgType.SHUTDOWN)
            p2p.send(msg, self.links.next_rank, self.links.next_group, self.device).wait()
