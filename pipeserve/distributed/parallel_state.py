"""Parallel state: created once per process, read through getters.

Layers never ask torch.distributed who they are; they ask this module. A single process is
the default state (every size 1, every layer on the one stage).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeserve import envs

if TYPE_CHECKING:
    from pipeserve.moe.dispatcher.placement import ExpertPlacement

log = logging.getLogger(__name__)
SHM_SLOT_BYTES = 16 << 20  # a tensor larger than this is all-reduced in slices


@dataclass(frozen=True)
class AfdState:
    """Attention-FFN disaggregation: ranks 0..attention_size-1 are attention (A) workers, the
    next ffn_size ranks FFN (F) workers, in ffn_nodes nodes of equal size."""

    attention_size: int
    ffn_size: int
    ffn_nodes: int
    dispatch_mode: str
    rank: int  # this rank's index among the workers of its role
    is_attention: bool
    group: Any = None  # every A and F rank: the point-to-point rows between them

    def global_rank(self, ffn: int) -> int:
        """The global rank of F worker `ffn`."""
        return self.attention_size + ffn


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: range | None = None  # this stage's layers; None = all of them
    tp_group: Any = None  # torch.distributed group of this stage's TP ranks
    tp_ranks: tuple[int, ...] = (0,)  # global ranks of that group
    tp_shm: Any = None  # shared-memory all-reduce of that group (CPU, all on one machine)
    # Expert parallelism: the routed experts are spread over the ep_size ranks of ep_group
    # (None: the default group), each running its own tokens through attention. Under EP the
    # experts are not split by TP, so ep_size > 1 requires tp_size == 1 (TP inside an
    # attention rank is later work).
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    # the same ranks as ep_group, for the dispatch counts exchange only (it must not queue
    # behind another micro-batch's transfers); None: ep_group
    ep_counts_group: Any = None
    afd: AfdState | None = None  # attention-FFN disaggregation; None: off
    # Context parallelism: a prompt chunk's tokens are split over the cp_size ranks of
    # cp_group, which exchange KV per layer (pipeserve/context_parallel); needs tp = ep = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    cp_ranks: tuple[int, ...] = (0,)  # global ranks of cp_group
    cp_weights_group: Any = None  # the same ranks: shard linear's weight broadcasts
    # sharded CP: the CP ranks are also the expert-parallel ranks (ep_* describe them): each
    # rank's tokens are dispatched to the experts over the CP ranks (sequence-parallel MoE)
    sharded_cp: bool = False
    partition: tuple[int, ...] = ()  # every stage's layer count; empty: one stage

    def __post_init__(self) -> None:
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError(
                f"--ep-size {self.ep_size} with --tp-size {self.tp_size}: under expert "
                "parallelism the experts are not split by tensor parallelism yet; use "
                "--tp-size 1 with --ep-size > 1"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            last = self.ep_size - 1
            raise ValueError(
                f"ep_rank {self.ep_rank} is outside --ep-size {self.ep_size} (0..{last})"
            )

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage: its TP ranks, under EP its attention ranks, under CP its
        context-parallel ranks, under AFD its attention and then its FFN workers."""
        if self.afd is not None:
            return self.afd.attention_size + self.afd.ffn_size
        if self.sharded_cp:  # the expert-parallel ranks are the CP ranks
            return self.tp_size * self.cp_size
        return self.tp_size * self.ep_size * self.cp_size

    @property
    def stage_rank(self) -> int:
        """This rank's place within its stage (its TP rank, under EP its ep rank, under CP its
        cp rank)."""
        if self.afd is not None:
            return self.afd.rank + (0 if self.afd.is_attention else self.afd.attention_size)
        if self.cp_size > 1:
            return self.cp_rank
        return self.tp_rank if self.tp_size > 1 else self.ep_rank

    @property
    def is_ffn_worker(self) -> bool:
        """An FFN worker of attention-FFN disaggregation (experts only, no requests)."""
        return self.afd is not None and not self.afd.is_attention

    @property
    def global_rank(self) -> int:
        """Global rank layout: `pp_rank * stage_width + stage_rank`."""
        return self.pp_rank * self.stage_width + self.stage_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = ParallelState()


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def get_parallel_state() -> ParallelState:
    return _state


@contextmanager
def standalone() -> Iterator[None]:
    """Build a model as if it were the only process (e.g. to time a probe of its layers)."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield
    finally:
        _state = saved


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_size() -> int:
    return _state.pp_size


def get_ep_rank() -> int:
    return _state.ep_rank


def get_ep_size() -> int:
    return _state.ep_size


def get_ep_group() -> Any:
    """The expert-parallel process group; None: the default group."""
    return _state.ep_group


def get_ep_counts_group() -> Any:
    """The group of the dispatch counts exchange; None: the expert-parallel group."""
    return _state.ep_counts_group


def get_expert_placement(num_experts: int) -> ExpertPlacement:
    """Which ep rank (under AFD: which FFN worker) holds each routed expert: a contiguous
    block per rank."""
    from pipeserve.moe.dispatcher.placement import ExpertPlacement

    size = _state.afd.ffn_size if _state.afd is not None else _state.ep_size
    return ExpertPlacement.contiguous(num_experts, size)


def get_held_experts(num_experts: int) -> tuple[int, ...]:
    """Global ids of the routed experts this rank holds: its ep rank's block, under AFD an
    FFN worker's block and none on an attention worker."""
    afd = _state.afd
    if afd is not None and afd.is_attention:
        return ()
    rank = afd.rank if afd is not None else _state.ep_rank
    return get_expert_placement(num_experts).experts_on(rank)


def get_cp() -> tuple[int, int, Any]:
    """Context parallelism: (cp rank, cp size, cp group)."""
    return _state.cp_rank, _state.cp_size, _state.cp_group


def get_afd() -> AfdState | None:
    """Attention-FFN disaggregation's roles and group; None: off."""
    return _state.afd


def is_first_stage() -> bool:
    return _state.is_first_stage


def is_last_stage() -> bool:
    return _state.is_last_stage


def stage_layers(num_layers: int) -> range:
    return _state.layers if _state.layers is not None else range(num_layers)


@dataclass(frozen=True)
class StageLinks:
    """Point-to-point groups of this rank: to the rank of the same place (TP or EP rank) in
    the previous and next stage (a group per link, so sending and receiving never share one),
    and, under TP, a group of this stage's ranks in which received activation shares are put
    together (apart from the forward's TP group, which another thread uses meanwhile)."""

    prev_group: Any = None
    next_group: Any = None
    prev_rank: int | None = None
    next_rank: int | None = None
    gather_group: Any = None


_links = StageLinks()


def get_stage_links() -> StageLinks:
    return _links


def set_stage_partition(partition: list[int]) -> ParallelState:
    """Fix this stage's layer range once the partition is agreed on."""
    from dataclasses import replace

    from pipeserve.distributed.partition import stage_ranges

    layers = stage_ranges(partition)[_state.pp_rank]
    state = replace(_state, layers=layers, partition=tuple(partition))
    set_parallel_state(state)
    return state


def init_parallel_groups(
    rank: int,
    tp_size: int,
    pp_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    ranks_per_node: int | None = None,
    ep_size: int = 1,
    comm_options: Any = None,
    cp_size: int = 1,
    sharded_cp: bool = False,
) -> ParallelState:
    """Join the process group and create every TP, EP (with its counts group), CP and
    stage-link group (all ranks create all groups, in the same order). A stage has
    `tp_size * ep_size * cp_size` ranks (at most one of them above 1); rank layout:
    pp_rank * width + rank within the stage, and a stage link joins the ranks of the same
    place in adjacent stages. A TP group whose ranks share a machine (of `ranks_per_node`
    consecutive ranks) all-reduces through shared memory on CPUs. With every rank on this
    machine, gloo listens on loopback only. `comm_options`: process-group options of the
    expert-parallel data groups (device.comm_group_options). `sharded_cp`: the CP ranks are
    also the expert-parallel ranks (their own data and counts groups)."""
    import torch.distributed as dist

    global _links
    width = tp_size * ep_size * cp_size
    world = width * pp_size
    _join(rank, world, backend, init_method, timeout_s, ranks_per_node)
    pp_rank, local = divmod(rank, width)
    tp_rank = local if tp_size > 1 else 0
    ep_rank = local if ep_size > 1 else 0
    cp_rank = local if cp_size > 1 else 0
    tp_group, tp_ranks, gather_group = None, tuple[int, ...]((rank,)), None
    ep_group, counts_group, cp_group, cp_weights = None, None, None, None
    cp_ranks: tuple[int, ...] = (rank,)
    for stage in range(pp_size):
        ranks = [stage * width + t for t in range(width)]
        options = comm_options if ep_size > 1 else None
        group = dist.new_group(ranks, pg_options=options) if width > 1 else None
        gather = dist.new_group(ranks) if tp_size > 1 and stage > 0 else None
        counts = dist.new_group(ranks) if ep_size > 1 else None
        weights = dist.new_group(ranks) if cp_size > 1 else None
        if sharded_cp:  # created by every rank for every stage, in the same order
            experts = dist.new_group(ranks, pg_options=comm_options)
            expert_counts = dist.new_group(ranks)
        if stage == pp_rank and tp_size > 1:
            tp_group, tp_ranks, gather_group = group, tuple(ranks), gather
        if stage == pp_rank and ep_size > 1:
            ep_group, counts_group = group, counts
        if stage == pp_rank and cp_size > 1:
            cp_group, cp_weights, cp_ranks = group, weights, tuple(ranks)
        if stage == pp_rank and sharded_cp:
            ep_group, counts_group = experts, expert_counts
    links: dict[tuple[int, int], Any] = {}
    for stage in range(pp_size - 1):
        for t in range(width):
            pair = (stage * width + t, (stage + 1) * width + t)
            links[pair] = dist.new_group(list(pair))
    prev_rank = rank - width if pp_rank > 0 else None
    next_rank = rank + width if pp_rank < pp_size - 1 else None
    _links = StageLinks(
        prev_group=links.get((prev_rank, rank)) if prev_rank is not None else None,
        next_group=links.get((rank, next_rank)) if next_rank is not None else None,
        prev_rank=prev_rank,
        next_rank=next_rank,
        gather_group=gather_group,
    )
    shm = None
    if backend == "gloo" and tp_size > 1 and _one_machine(tp_ranks, ranks_per_node or world):
        shm = _shared_memory_all_reduce(tp_group, tp_ranks, tp_rank, timeout_s)
    state = ParallelState(
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        None,
        tp_group,
        tp_ranks,
        shm,
        ep_rank=cp_rank if sharded_cp else ep_rank,
        ep_size=cp_size if sharded_cp else ep_size,
        ep_group=ep_group,
        ep_counts_group=counts_group,
        cp_rank=cp_rank,
        cp_size=cp_size,
        cp_group=cp_group,
        cp_ranks=cp_ranks,
        cp_weights_group=cp_weights,
        sharded_cp=sharded_cp,
    )
    set_parallel_state(state)
    return state


def init_afd_groups(
    rank: int,
    attention_size: int,
    ffn_size: int,
    ffn_nodes: int,
    dispatch_mode: str,
    backend: str,
    init_method: str,
    timeout_s: float,
    ranks_per_node: int | None = None,
) -> ParallelState:
    """Join the process group as an attention worker (ranks 0..attention_size-1) or an FFN
    worker (the next ffn_size ranks) of attention-FFN disaggregation, with the group of all
    of them that carries the rows between the two kinds."""
    import torch.distributed as dist

    world = attention_size + ffn_size
    _join(rank, world, backend, init_method, timeout_s, ranks_per_node)
    group = dist.new_group(list(range(world)))
    is_attention = rank < attention_size
    role_rank = rank if is_attention else rank - attention_size
    afd = AfdState(
        attention_size, ffn_size, ffn_nodes, dispatch_mode, role_rank, is_attention, group
    )
    state = ParallelState(afd=afd)
    set_parallel_state(state)
    return state


def _join(
    rank: int,
    world: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    ranks_per_node: int | None,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    if _one_machine(tuple(range(world)), ranks_per_node or world):
        _gloo_on_loopback()
    # NCCL: communicators made now, for this worker's GPU, not lazily by whichever thread
    # first uses a group while other NCCL kernels run
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device,
    )


def _one_machine(ranks: tuple[int, ...], ranks_per_node: int) -> bool:
    return len({r // ranks_per_node for r in ranks}) == 1


def _gloo_on_loopback() -> None:
    """Point GLOO_SOCKET_IFNAME at the loopback interface unless it is set (in this process,
    the one whose gloo binds)."""
    from pipeserve.distributed.netif import interface_with_address

    if envs.gloo_socket_ifname() is None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_with_address("127.0.0.1") or "lo"


def _shared_memory_all_reduce(
    group: Any, ranks: tuple[int, ...], tp_rank: int, timeout_s: float
) -> Any:
    """The group's shared-memory all-reduce, or None (native kernels unavailable, no
    /dev/shm): then gloo all-reduces over loopback TCP. The group's first rank creates the
    segment and removes its name once all have it mapped, so nothing outlives the ranks.
    Every rank reaches every collective here, whatever fails."""
    import torch
    import torch.distributed as dist

    owner = torch.tensor([os.getpid() if tp_rank == 0 else 0], dtype=torch.long)
    dist.broadcast(owner, src=ranks[0], group=group)  # the segment is named by its creator
    name = f"/pipeserve-tp-{int(owner)}-{ranks[0]}"
    shm = _open_segment(name, tp_rank, len(ranks), timeout_s) if tp_rank == 0 else None
    dist.barrier(group=group)  # created before the others open it
    if tp_rank > 0:
        shm = _open_segment(name, tp_rank, len(ranks), timeout_s)
    ready = torch.tensor([int(shm is not None)], dtype=torch.long)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
    if tp_rank == 0 and shm is not None:
        shm.unlink()
    if not int(ready):
        log.warning("shared-memory all-reduce unavailable on some rank; TP all-reduces over gloo")
        return None
    return shm


def _open_segment(name: str, rank: int, world: int, timeout_s: float) -> Any:
    from pipeserve.kernels import native

    kernels = native()
    if kernels is None:
        return None
    try:
        return kernels.ShmAllReduce(name, rank, world, SHM_SLOT_BYTES, rank == 0, timeout_s)
    except RuntimeError as exc:
        log.warning("shared-memory all-reduce: %s", exc)
        return None
