"""A worker process: one pipeline stage x one TP rank (or, under expert parallelism, one
attention rank, which runs its own requests' micro-batches). Stateless apart from its KV pool (and
the last stage's sampler): everything a forward needs arrives with the batch.

Loop per micro-batch:
    take the next message (a receiver thread fetches it while the current forward runs)
    prepare tensors, launch the forward on the compute stream
    commit point: wait for the previous micro-batch's send (its payload was kept alive)
    send activations to the next stage (non-blocking) or, on the last stage, the result
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeserve import envs
from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.registry import run_backend
from pipeserve.config import EngineConfig, is_refusal
from pipeserve.device import (
    ComputeStream,
    bind_device,
    bind_thread,
    comm_group_options,
    dist_backend,
    resolve_dtype,
    set_threads,
)
from pipeserve.disaggregation.afd.ffn_worker import FfnRunner
from pipeserve.distributed import p2p
from pipeserve.distributed.channels import Endpoints, WorkerChannels
from pipeserve.distributed.messages import (
    Failed,
    Profile,
    ProfileTimes,
    Ready,
    Refused,
    ReportTimeline,
    Shutdown,
    StageCommand,
)
from pipeserve.distributed.parallel_state import (
    ParallelState,
    get_stage_links,
    init_afd_groups,
    init_parallel_groups,
    set_stage_partition,
)
from pipeserve.distributed.partition import resolve_partition
from pipeserve.engine.future_map import FutureMap
from pipeserve.lifetime import REFUSED_EXIT, WORKER_NAME, exit_with_parent, name_process
from pipeserve.models.arch import ArchConfig
from pipeserve.models.resolve import resolve_model_path
from pipeserve.runner.kv_layout import kv_pool_pages
from pipeserve.runner.layer_costs import measure_layer_costs
from pipeserve.runner.model_runner import ModelRunner
from pipeserve.scheduler.batch import BatchResult, ScheduledBatch
from pipeserve.timeline import now

INIT_TIMEOUT_S = 600
LAST_WORDS_MS = 2000  # what a failing worker sent last may take this long to leave
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    flags: dict[str, Any]
    model_path: str
    endpoints: Endpoints
    init_method: str
    threads: int
    local_workers: int
    local_index: int  # this worker's place among its node's workers (its GPU's index)
    future_ring: int  # > 0: the scheduler feeds future-token placeholders (overlap, PP = 1)
    env: dict[str, str] = field(default_factory=dict)  # the launching process's environment


def worker_main(args: WorkerArgs) -> None:
    exit_with_parent()
    name_process(f"{WORKER_NAME}{args.rank}")
    if args.env:  # a fork server's environment is the one it started with, not the launcher's
        os.environ.clear()
        os.environ.update(args.env)
    channels, started = None, False
    try:
        set_threads(args.threads)
        config = EngineConfig.from_flags(**args.flags)
        p = config.parallel
        batch_url = args.endpoints.batch[args.rank] if args.rank < p.stage_width else None
        channels = WorkerChannels(
            args.rank, args.endpoints, batch_url, p.heartbeat_interval, p.heartbeat_timeout
        )
        device = bind_device(config.model.device, args.local_index)
        _init_groups(args, config, device)
        config, model_path = _agree_on_dtype(config, args.model_path, device)
        config = _agree_on_host_tier(config, device)
        arch = ArchConfig.load(model_path)
        partition = _agree_on_partition(config, arch, device)
        state = set_stage_partition(partition)
        backend = run_backend(config, arch)  # chosen once: it sizes the pool and runs
        num_pages = _agree_on_pages(config, arch, args.local_workers, partition, device, backend)
        runner: ModelRunner | FfnRunner
        if state.is_ffn_worker:
            runner = FfnRunner(config, arch, model_path)
        else:
            runner = ModelRunner(config, arch, model_path, num_pages, backend)
        receiver = getattr(runner, "kv_receiver", None)
        gc.collect()  # start-up's garbage; then the model and the runner, which live as long
        gc.freeze()  # as this process, are never walked by the collector again
        channels.send_status(
            Ready(
                num_pages,
                partition,
                state.pp_rank,
                state.tp_rank,
                state.ep_rank,
                runner.expert_bytes(),
                _all_reduce_kind(state),
                # prefill/decode disaggregation, decode side: where this rank takes KV
                receiver.endpoint if receiver else "",
                receiver.control_endpoint if receiver else "",
                # the control link's secret, random per receiver: only this message carries it
                receiver.control_secret.hex() if receiver else "",
            )
        )
        started = True
        StageWorker(runner, state, channels, args).run()
    except BaseException as exc:
        if channels is None:
            raise
        if report_failure(channels, exc, started, args.rank):
            raise SystemExit(REFUSED_EXIT) from None
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def report_failure(channels: Any, exc: BaseException, started: bool, rank: int) -> bool:
    """Tell the scheduler why this worker stops, and close the channels once that has left
    (or LAST_WORDS_MS passed). True when it is a start-up check refusing the settings
    (`is_refusal`): sent as its message alone, the traceback logged at debug level only (the
    scheduler prints the message; PIPESERVE_TRACEBACK=1 logs it as an error); any other
    failure, or one after start-up, is sent with its traceback."""
    text = "".join(traceback.format_exception(exc))
    refused = not started and is_refusal(exc)
    if refused:
        level = logging.ERROR if envs.show_tracebacks() else logging.DEBUG
        log.log(level, "rank %d refused its settings:\n%s", rank, text)
        channels.send_status(Refused(str(exc)))
    else:
        channels.send_status(Failed(text))
    channels.close(linger_ms=LAST_WORDS_MS)
    return refused


def _init_groups(args: WorkerArgs, config: EngineConfig, device: torch.device) -> None:
    p, backend = config.parallel, dist_backend(device)
    per_node = p.world_size // p.nnodes
    if p.afd_enabled and "nccl" in backend:
        raise ValueError(
            "attention-FFN disaggregation runs on CPU workers (gloo) only: its receiver "
            "thread posts receives ahead of the compute thread's sends, which NCCL would "
            "serialise on one stream; use --device cpu"
        )
    if p.afd_enabled:
        init_afd_groups(
            args.rank,
            p.afd_attention_size,
            p.afd_ffn_size,
            p.afd_ffn_nodes,
            p.afd_dispatch_mode,
            backend,
            args.init_method,
            INIT_TIMEOUT_S,
            ranks_per_node=per_node,
        )
        return
    init_parallel_groups(
        args.rank,
        p.tp_size,
        p.pp_size,
        backend,
        args.init_method,
        INIT_TIMEOUT_S,
        ranks_per_node=per_node,
        ep_size=p.ep_size,
        comm_options=comm_group_options(backend, p.moe_comm_max_sms),
        cp_size=p.cp_size,
        sharded_cp=p.enable_sharded_cp,
    )


def _all_reduce_kind(state: ParallelState) -> str:
    if state.tp_size == 1:
        return "none"
    return "shared memory" if state.tp_shm is not None else "torch.distributed"


def _agree_on_dtype(
    config: EngineConfig, model_path: str, device: torch.device
) -> tuple[EngineConfig, str]:
    """Every rank computes in rank 0's dtype: node 0's launching process chose it (`--dtype
    best` for its device), and a node whose CPU would choose otherwise takes it too, with
    its checkpoint resolved for it (a GGUF file is converted for the agreed dtype)."""
    agreed = broadcast_text(config.model.dtype, device)
    if agreed == config.model.dtype:
        return config, model_path
    log.warning(
        "rank %d: computing in rank 0's %s (this node chose %s)",
        dist.get_rank(),
        agreed,
        config.model.dtype,
    )
    config = EngineConfig.from_flags(**{**config.flags(), "dtype": agreed})
    return config, str(resolve_model_path(config.model.model_path, agreed))


def _agree_on_host_tier(config: EngineConfig, device: torch.device) -> EngineConfig:
    """Every rank caps HiCache's host tier as node 0's launching process decided (from its
    free memory: `with_host_memory`), so all derive the same page counts."""
    if not config.cache.enable_hierarchical_cache:
        return config
    agreed = broadcast_text(repr(config.cache.hicache_size), device)
    size = None if agreed == "None" else float(agreed)
    return EngineConfig.from_flags(**{**config.flags(), "hicache_size": size})


def _agree_on_partition(config: EngineConfig, arch: ArchConfig, device: torch.device) -> list[int]:
    """Rank 0 resolves the layer partition (measuring layer costs for 'auto') for all; a
    partition it rejects fails every rank with its message."""
    p = config.parallel
    partition: list[int] = []
    error = ""
    if dist.get_rank() == 0:

        def measure() -> tuple[list[float], float, float]:
            dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
            chunk = min(config.scheduler.chunk_size or 2048, 2048)
            costs = measure_layer_costs(arch, dtype, device, chunk)
            return costs.per_layer, costs.embed, costs.head

        try:
            partition = resolve_partition(p.layer_partition, arch.num_layers, p.pp_size, measure)
        except ValueError as exc:
            error = str(exc)
    error = broadcast_text(error, device)
    if error:
        raise ValueError(error)
    return broadcast_ints(partition, p.pp_size, device)


def _agree_on_pages(
    config: EngineConfig,
    arch: ArchConfig,
    local_workers: int,
    partition: list[int],
    device: torch.device,
    backend: AttentionBackend | None = None,
) -> int:
    """Every stage must hold the same number of KV pages: the fewest any worker has room
    for (GPUs of one job may have different amounts free); `backend`: the run's (see
    `kv_pool_pages`)."""
    own = kv_pool_pages(config, arch, local_workers, partition, backend)
    pages = torch.tensor([own], device=device)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN)
    return int(pages.item())


def broadcast_ints(values: list[int], count: int, device: torch.device) -> list[int]:
    """Rank 0's `count` ints on every rank (`values` is read on rank 0 only)."""
    root = dist.get_rank() == 0
    if root and len(values) != count:
        raise ValueError(f"rank 0 has {len(values)} values to broadcast, not {count}")
    t = torch.tensor(values if root else [0] * count, dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


def broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's `text` on every rank (`text` is read on rank 0 only)."""
    data = text.encode() if dist.get_rank() == 0 else b""
    size = broadcast_ints([len(data)], 1, device)[0]
    return bytes(broadcast_ints(list(data), size, device)).decode() if size else ""


class StageWorker:
    def __init__(
        self,
        runner: ModelRunner | FfnRunner,
        state: ParallelState,
        channels: WorkerChannels,
        args: WorkerArgs,
    ) -> None:
        self.runner, self.state, self.channels = runner, state, channels
        self.links = get_stage_links()
        self.shard = p2p.Shard(state.tp_rank, state.tp_size, self.links.gather_group)
        self.device = runner.device
        # three threads, three streams: this one (sends, control messages, profiles), the
        # receiver's (a posted receive blocks it) and the compute stream's (forwards)
        bind_thread(self.device, own_stream=True)
        self.stream = ComputeStream(self.device, args.threads)
        self.future = FutureMap(args.future_ring, self.device) if args.future_ring else None
        self.inbox: queue.Queue[p2p.StageMessage | BaseException] = queue.Queue()
        # the last stage reports results: one TP (or CP) rank for all, or every attention rank
        # its own (an FFN worker of attention-FFN disaggregation has none)
        self.reports = (
            state.is_last_stage and state.tp_rank == state.cp_rank == 0 and not state.is_ffn_worker
        )
        threading.Thread(target=self._receive, daemon=True).start()

    def run(self) -> None:
        pending: p2p.PendingSend | None = None
        recorder = self.runner.recorder
        while True:
            waited = now()
            msg = self.inbox.get()
            if isinstance(msg, BaseException):
                raise msg
            recorder.add("recv_wait", waited, now())
            batch = msg.command
            if not isinstance(batch, ScheduledBatch):
                if pending is not None:
                    pending.wait()
                    pending = None
                self._pass_on(batch)
                if isinstance(batch, Shutdown):
                    break
                continue
            fb = self.runner.prepare(batch)
            done = self.stream.submit(
                self.runner.execute, batch, fb, msg.hidden, msg.residual, future=self.future
            )
            if pending is not None:
                waited = now()
                pending.wait()  # commit point of the previous micro-batch
                recorder.add("send_wait", waited, now())
                pending = None
            out = done.result()
            # the forward's end (this batch's event, not the device): its time travels with
            # the batch, and the send's stream may then read the activations
            out.wait()
            if self.links.next_rank is not None:
                nxt = p2p.StageMessage(batch, out.hidden, out.residual)
                sent = now()
                pending = p2p.send(
                    nxt, self.links.next_rank, self.links.next_group, self.device, self.shard
                )
                recorder.add("send", sent, now(), batch, nbytes=pending.bytes)
            elif self.reports:
                result = out.result or BatchResult(batch.batch_id, [], [], [])
                self.channels.send_status(result)
        self.stream.close()
        if isinstance(self.runner, ModelRunner):
            self.runner.close()

    def _receive(self) -> None:
        """Fetch the next message while the current forward runs."""
        try:
            bind_thread(self.device, own_stream=True)
            while True:
                msg = self._next_message()
                self.inbox.put(msg)
                if isinstance(msg.command, Shutdown):
                    return
        except BaseException as exc:  # surfaces in the main loop
            self.inbox.put(exc)

    def _next_message(self) -> p2p.StageMessage:
        if self.links.prev_rank is None:
            return p2p.StageMessage(self.channels.recv_batch())
        return p2p.recv(self.links.prev_rank, self.links.prev_group, self.device, self.shard)

    def _pass_on(self, command: StageCommand) -> None:
        """A control message: act on it here, then send it down the pipeline. A profile
        request is timed here (this stage's layers, zero hidden states on later stages) and
        reported before it moves on, so no two stages time at once."""
        match command:
            case ReportTimeline():
                self.channels.send_timeline(self.runner.recorder.take())
            case Profile(points, runs):
                times = self.runner.profile_prefill(points, runs)
                if self.state.stage_rank == 0:
                    self.channels.send_status(ProfileTimes(self.state.pp_rank, times))
        if self.links.next_rank is not None:
            msg = p2p.StageMessage(command)
            p2p.send(msg, self.links.next_rank, self.links.next_group, self.device).wait()
