"""What a model runner wires around its model and KV pool, feature by feature: context
parallelism's share of every batch, shard linear's weight broadcasts, HiCache's host and disk
tiers, and prefill/decode disaggregation's KV sender or receiver. Each is built once, from the
config and the runner's parts, and handed to the runner."""

from __future__ import annotations

import torch

from pipeserve.backends.base import AttentionBackend
from pipeserve.config import EngineConfig
from pipeserve.context_parallel.attention import CpContext
from pipeserve.context_parallel.layer_shards import LayerShards
from pipeserve.context_parallel.layout import PageStriping
from pipeserve.disaggregation.pd import auth
from pipeserve.disaggregation.pd.kv_remap import SideLayout
from pipeserve.disaggregation.pd.transfer import KVReceiver, KVSender
from pipeserve.distributed.parallel_state import ParallelState, stage_layers
from pipeserve.mem_cache.host_tier import tier_pages
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.mem_cache.tier_store import TierStore
from pipeserve.models.arch import ArchConfig
from pipeserve.models.llama import LlamaForCausalLM
from pipeserve.runner.kv_layout import stage_kv_bytes_per_token


def context_parallel(
    config: EngineConfig,
    arch: ArchConfig,
    state: ParallelState,
    dtype: torch.dtype,
    backend: AttentionBackend,
) -> CpContext:
    """This rank's context-parallel share of every batch (see pipeserve/context_parallel)."""
    if config.model.enable_deterministic_inference:
        raise ValueError(
            "--enable-deterministic-inference with --cp-size: context parallelism merges "
            "partial attention results, which the batch-invariant kernels do not cover"
        )
    p = config.parallel
    if arch.mla is not None:
        given = [
            flag
            for flag, on in (
                ("--cp-kv-exchange ring", p.cp_kv_exchange == "ring"),
                ("--cp-prefix-mode merge", p.cp_prefix_mode == "merge"),
            )
            if on
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)}: for GQA models only; an MLA model (DeepSeek) moves "
                "its latent rows itself under --cp-size (drop the flag)"
            )
    return CpContext(
        state.cp_size,
        state.cp_rank,
        state.cp_group,
        PageStriping(state.cp_size, state.cp_rank, config.cache.page_size),
        p.cp_prefix_mode,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        dtype.itemsize,
        prefill=backend.kernels.prefill(dtype),
        overlap=not p.disable_cp_kv_overlap,
        latent=arch.mla is not None,
        ring=p.cp_kv_exchange == "ring",
        ranks=state.cp_ranks,
    )


def shard_linear(
    config: EngineConfig, arch: ArchConfig, state: ParallelState, model: LlamaForCausalLM
) -> LayerShards:
    """Shard linear over the CP group (see pipeserve/context_parallel/layer_shards)."""
    p = config.parallel
    names = [n.strip() for n in p.shard_linear_layers.split(",") if n.strip()]
    layers = [model.model.layers[i] for i in stage_layers(arch.num_layers)]
    return LayerShards(
        model,
        layers,
        names,
        p.shard_linear_warm_layers,
        state.cp_rank,
        state.cp_weights_group,
        list(state.cp_ranks),
    )


def tier_store(
    config: EngineConfig,
    arch: ArchConfig,
    state: ParallelState,
    pool: KVPool,
    num_pages: int,
    name: str,
) -> TierStore:
    """HiCache's host (and disk) copies of this worker's part of the KV pool."""
    c = config.cache
    partition = list(state.partition) or [arch.num_layers]
    per_token = stage_kv_bytes_per_token(config, arch, partition)
    host, disk = tier_pages(c, num_pages, per_token)
    return TierStore(pool, c.page_size, host, disk, c.hicache_storage_dir, name)


def kv_transfer(
    config: EngineConfig,
    arch: ArchConfig,
    state: ParallelState,
    pool: KVPool,
    cp: CpContext | None,
) -> tuple[KVSender | None, KVReceiver | None]:
    """Prefill/decode disaggregation: a prefill worker's sender (of each layer's new KV, from
    the model's layer hook), or a decode worker's receiver (of KV into its pool)."""
    d = config.disaggregation
    if d.disaggregation_mode == "null":
        return None, None
    partition = list(state.partition) or [arch.num_layers]
    layout = SideLayout.of(partition, state.tp_size, arch.num_kv_heads, arch.mla is not None)
    me = (state.pp_rank, state.tp_rank)
    key = auth.pd_key(d.pd_auth_key)
    if d.disaggregation_mode == "prefill":
        layers = stage_layers(arch.num_layers)
        timeout = d.disaggregation_transfer_timeout
        striping = cp.striping if cp is not None else None
        return KVSender(pool, layout, me, layers, timeout, striping, key), None
    # the engine process is on node 0: other nodes' control listeners need tcp
    remote = config.parallel.node_rank != 0
    return None, KVReceiver(pool, layout, me, d.disaggregation_host, key, remote)
