"""Which KV cache a model gets: per-head K/V (MHA/GQA), or for multi-head latent attention one
latent row per token and layer (plus DeepSeek-V3.2's indexer keys). The pool's size in bytes
per token, the pool itself and its size in pages (what the memory budget leaves) are decided
here, for the model runner and the profilers alike."""

from __future__ import annotations

import torch

from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.registry import run_backend
from pipeserve.config import EngineConfig
from pipeserve.device import memory_budget, resolve_device, resolve_dtype
from pipeserve.distributed.partition import resolve_partition
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.models.arch import ArchConfig, param_count, routed_expert_params
from pipeserve.runner.cuda_graph import GRAPH_SLOT_BYTES, graph_reserve_bytes


def kv_heads_per_rank(arch: ArchConfig, tp_size: int) -> int:
    """KV heads per TP rank (one replica each when there are fewer heads than ranks)."""
    return max(arch.num_kv_heads // tp_size, 1)


def latent_widths(arch: ArchConfig) -> tuple[int, int]:
    """(latent width, indexer key width) per token and layer of an MLA model. Every TP rank
    caches the whole latent: it is shared by all heads, so it is replicated, not split."""
    assert arch.mla is not None
    index = arch.indexer.head_dim if arch.indexer is not None else 0
    return arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim, index


def kv_bytes_per_token(arch: ArchConfig, num_layers: int, tp_size: int, dtype: torch.dtype) -> int:
    """Bytes one token's cache takes on one rank over `num_layers` layers."""
    if arch.mla is not None:
        width, index = latent_widths(arch)
        return KVPool.latent_bytes_per_token(num_layers, width, dtype, index)
    heads = kv_heads_per_rank(arch, tp_size)
    return KVPool.bytes_per_token(num_layers, heads, arch.head_dim, dtype)


def stage_kv_bytes_per_token(config: EngineConfig, arch: ArchConfig, partition: list[int]) -> int:
    """Bytes one token's cache takes on a rank of the stage with most layers (`partition`:
    layers per stage), in the run's dtype and TP share."""
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
    return kv_bytes_per_token(arch, max(partition), config.parallel.tp_size, dtype)


def build_kv_pool(
    arch: ArchConfig,
    num_slots: int,
    layers: range,
    tp_size: int,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int,
) -> KVPool:
    if arch.mla is not None:
        width, index = latent_widths(arch)
        return KVPool.latent_layout(num_slots, layers, width, dtype, device, page_size, index)
    heads = kv_heads_per_rank(arch, tp_size)
    return KVPool(num_slots, layers, heads, arch.head_dim, dtype, device, page_size)


def kv_pool_pages(
    config: EngineConfig,
    arch: ArchConfig,
    local_workers: int,
    partition: list[int] | None = None,
    backend: AttentionBackend | None = None,
) -> int:
    """KV pool size in pages: from --max-total-tokens, or this worker's memory budget
    (`device.memory_budget`: its own GPU, or its share of RAM) left after its weights and
    what `backend`'s CUDA graphs may hold (the run's, chosen here where None), sized for the
    stage with most layers. Workers agree on the smallest (worker.py)."""
    page = config.cache.page_size
    if config.cache.max_total_tokens is not None:
        return config.cache.max_total_tokens // page + 1
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
    p = config.parallel
    budget = memory_budget(device, config.cache.mem_fraction_static, local_workers)
    if partition is None:  # an explicit list in the config, else the default rule
        spec = p.layer_partition if p.layer_partition not in (None, "auto") else None
        partition = resolve_partition(spec, arch.num_layers, p.pp_size)
    stage_layers_max = max(partition)
    elsewhere = 1.0 if p.afd_enabled else 1 - 1 / p.expert_ranks  # experts on other ranks
    params = param_count(arch) - routed_expert_params(arch) * elsewhere
    weights = params * dtype.itemsize * stage_layers_max / arch.num_layers / p.tp_size
    per_token = stage_kv_bytes_per_token(config, arch, partition)
    backend = backend or run_backend(config, arch)
    graphs = graph_reserve_bytes(config, arch, device, dtype, backend)
    per_token += GRAPH_SLOT_BYTES if graphs else 0
    tokens = int((budget - weights - graphs) // per_token)
    if tokens < 4 * page:
        raise ValueError(
            f"no memory left for the KV cache ({budget / 2**30:.1f} GiB budget, "
            f"{weights / 2**30:.1f} GiB of weights); raise --mem-fraction-static or set "
            "--max-total-tokens"
        )
    return tokens // page + 1
