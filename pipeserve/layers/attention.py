"""Attention over the paged KV cache.

Per request, the keys are: the cached prefix, read from the pool, and (for a prompt chunk)
the chunk itself, causally, straight from the fresh k/v. Long runs of consecutive slots
are read in place as views; the short, scattered rest is gathered into one tensor. Each
part yields (output, log-sum-exp) and the parts are merged exactly, so no request's KV is
ever copied whole. Query heads of one KV head (GQA) are folded into the query length for
the non-causal parts, so keys are never repeated either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeserve.device import attention_with_lse
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.scheduler.batch import Run

VIEW_MIN_TOKENS = 256  # shorter runs are cheaper to gather than to attend to separately


@dataclass
class SegmentPlan:
    """How one request's attention reads the cache; built once per batch, used by all layers."""

    q_start: int
    q_len: int
    views: list[Run]  # long slot runs read in place
    gather: torch.Tensor | None  # slot ids of the remaining cached positions
    fresh_causal: bool  # a prompt chunk: also attend causally within the chunk's own k/v


def plan_segment(q_start: int, q_len: int, prefix_len: int, runs: list[Run],
                 device: torch.device) -> SegmentPlan:
    """A single-token step reads all its keys (itself included, already written) from the
    pool; a longer chunk reads the prefix from the pool and itself from the fresh k/v."""
    cached = prefix_len + 1 if q_len == 1 else prefix_len
    views: list[Run] = []
    scattered: list[int] = []
    left = cached
    for start, length in runs:
        n = min(length, left)
        if n >= VIEW_MIN_TOKENS:
            views.append((start, n))
        else:
            scattered.extend(range(start, start + n))
        left -= n
        if left == 0:
            break
    gather = torch.tensor(scattered, dtype=torch.long, device=device) if scattered else None
    return SegmentPlan(q_start, q_len, views, gather, fresh_causal=q_len > 1)


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool,
        out_slots: torch.Tensor, plans: list[SegmentPlan],
    ) -> torch.Tensor:
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d]."""
        k_cache, v_cache = pool.buffers(self.layer_id)
        k_cache[:, out_slots] = k.transpose(0, 1)
        v_cache[:, out_slots] = v.transpose(0, 1)
        out = torch.empty_like(q)
        for p in plans:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._segment(q[rows], k[rows], v[rows], k_cache, v_cache, p)
        return out.view(q.shape[0], -1)

    def _segment(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, p: SegmentPlan,
    ) -> torch.Tensor:
        n, h, hk, d = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_heads = q.transpose(0, 1).contiguous()  # [h, n, d]
        q_fold = q_heads.view(1, hk, self.group * n, d)  # GQA: a KV head's queries in a row
        parts = []
        for start, length in p.views:
            kv = (k_cache[None, :, start : start + length], v_cache[None, :, start : start + length])
            parts.append(attention_with_lse(q_fold, *kv, False, self.scale))
        if p.gather is not None:
            kv = (k_cache[None, :, p.gather], v_cache[None, :, p.gather])
            parts.append(attention_with_lse(q_fold, *kv, False, self.scale))
        if p.fresh_causal:
            kr = k.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]  # [1, h, n, d]
            vr = v.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]
            o, lse = attention_with_lse(q_heads[None], kr, vr, True, self.scale)
            parts.append((o.reshape(1, hk, self.group * n, d), lse.reshape(1, hk, self.group * n)))
        o = merge_partials(parts)  # [1, hk, group * n, d]
        return o.reshape(h, n, d).transpose(0, 1)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention over disjoint key sets: weights exp(lse_i - lse_total)."""
    if len(parts) == 1:
        return parts[0][0]
    lse_all = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lse_all, dim=0)
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    for (o, _), lse in zip(parts, lse_all, strict=True):
        out += o.float() * torch.exp(lse - total)[..., None]
    return out.to(parts[0][0].dtype)
