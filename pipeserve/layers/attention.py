"""Attention over the paged KV cache: the layer writes its new keys and values into the pool
and hands the attention to the batch's backend (pipeserve/backends), which reads the pool
through the plan it made for the batch."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.backends.base import AttentionBackend, AttentionPlan, Segment
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.mem_cache.kv_pool import KVPool


def plan_attention(
    segments: list[Segment],
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend | None = None,
    prompts: frozenset[int] = frozenset(),
    expanded: bool = True,
) -> AttentionPlan:
    """A batch's attention plan on `backend` (the torch backend for `device` where None), or
    on the backend it hands these segments to; built on `device`. `expanded`=False: as it
    crosses to a device (`AttentionPlan.expanded()` there)."""
    chosen = (backend or TorchBackend(device)).for_batch(segments)
    plan = AttentionPlan(chosen, chosen.plan(segments, device, dtype, prompts))
    return plan.expanded() if expanded else plan


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KVPool,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d]."""
        k_cache, v_cache = pool.buffers(self.layer_id)
        k_cache[:, out_slots] = k.transpose(0, 1)
        v_cache[:, out_slots] = v.transpose(0, 1)
        return self.attend(q, pool, plan, (k, v))

    def attend(
        self,
        q: torch.Tensor,
        pool: KVPool,
        plan: AttentionPlan,
        fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention over a pool that holds the batch's new keys and values already: q
        [tokens, heads, d] -> [tokens, heads * d]. `fresh`: those keys and values [tokens,
        kv_heads, d], where the caller has them (the torch backend's prompt chunks read them)."""
        k_cache, v_cache = pool.buffers(self.layer_id)
        out = torch.empty_like(q)
        plan.backend.attend(self, q, k_cache, v_cache, plan.meta, fresh, out)
        return out.flatten(1)  # [tokens, heads * head_dim], also for no tokens
