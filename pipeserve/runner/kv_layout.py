"""Which KV cache a model gets: per-head K/V (MHA/GQA), or for multi-head latent attention one
latent row per token and layer (plus DeepSeek-V3.2's indexer keys). The pool's size in bytes
per token and the pool itself are decided here, for the model runner and the profilers alike."""

from __future__ import annotations

import torch

from pipeserve.config import EngineConfig
from pipeserve.device import resolve_dtype
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.models.arch import ArchConfig


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
