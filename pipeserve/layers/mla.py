"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

What a token caches, per layer: one row of `kv_lora_rank + qk_rope_head_dim` values, the normed
KV latent then the roped key part shared by all heads (in half-split order, see rotary.py). No
per-head K or V is ever stored; kv_b_proj turns a latent into every head's k_nope and v.

Two ways to attend to the cache, equal up to rounding:
- expanded (prompt chunks): kv_b_proj up-projects each cached latent of the request to per-head
  [k_nope | v]; keys are [k_nope | k_rope]; causal attention of the chunk over prefix + chunk.
- absorbed (decode steps; valid for chunks too): kv_b_proj's key rows W_UK are folded into the
  query, q_nope·k_nope = (q_nope W_UK)·latent, and its value rows W_UV into the output,
  probs·v = (probs·latent) W_UV^T. Attention is then one shared key head whose key is the whole
  cache row and whose value is its latent part, so it reads only the cache. The dot products
  are the same numbers as expanded, so the softmax scale is that of qk_head_dim (with YaRN's
  mscale, `mla_softmax_scale`), not of the latent width.

Tensor parallelism: q_b_proj (or q_proj) and kv_b_proj are column-parallel over heads, o_proj
row-parallel; the latent projection and its norm are replicated, so every rank caches the same
rows (a TP group could share one cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pipeserve.distributed.parallel_state import get_tp_size
from pipeserve.layers.layernorm import RMSNorm
from pipeserve.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from pipeserve.layers.rotary import ScalingLike, apply_rotary, apply_rotary_part, mla_softmax_scale
from pipeserve.models.arch import MLAConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [tokens, 1, qk_rope_head_dim]
Mode = Literal["auto", "expanded", "absorbed"]  # auto: absorbed for one-token segments
NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm ignore the config's rms_norm_eps


@dataclass(frozen=True)
class LatentSegment:
    """One request's tokens in a batch and where all its positions live in the latent cache."""

    q_start: int  # row of its first token in the batch
    q_len: int  # its new tokens (a prompt chunk, or 1 for a decode step)
    slots: torch.Tensor  # [prefix_len + q_len] long: the cache slot of each position, in order

    @property
    def prefix_len(self) -> int:
        return self.slots.shape[0] - self.q_len

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_start + self.q_len)

    @property
    def new_slots(self) -> torch.Tensor:
        return self.slots[self.prefix_len :]


def latent_width(mla: MLAConfig) -> int:
    """Values one token caches per layer."""
    return mla.kv_lora_rank + mla.qk_rope_head_dim


class MLAttention(nn.Module):
    """Parameters under DeepSeek-V3's checkpoint names (q_a_proj, q_a_layernorm, q_b_proj or
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mla: MLAConfig,
        rope_scaling: ScalingLike,
        dtype: torch.dtype,
        bias: bool = False,  # the config's attention_bias (q_a, kv_a and o projections)
    ) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = divide(num_heads, get_tp_size(), "number of attention heads")  # local
        self.scale = mla_softmax_scale(mla.qk_head_dim, rope_scaling)
        self._init_query(hidden_size, num_heads, bias, dtype)
        self._init_latent(hidden_size, num_heads, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * mla.v_head_dim, hidden_size, bias, dtype)

    def _init_query(self, hidden: int, heads: int, bias: bool, dtype: torch.dtype) -> None:
        rank, out = self.mla.q_lora_rank, heads * self.mla.qk_head_dim
        self.q_proj = None if rank else ColumnParallelLinear(hidden, out, False, dtype)
        self.q_a_proj = ReplicatedLinear(hidden, rank, bias, dtype) if rank else None
        self.q_a_layernorm = RMSNorm(rank, NORM_EPS, dtype) if rank else None
        self.q_b_proj = ColumnParallelLinear(rank, out, False, dtype) if rank else None

    def _init_latent(self, hidden: int, heads: int, bias: bool, dtype: torch.dtype) -> None:
        m = self.mla
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent_width(m), bias, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, NORM_EPS, dtype)
        per_head = m.qk_nope_head_dim + m.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, heads * per_head, False, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: torch.Tensor,
        segments: list[LatentSegment],
        mode: Mode = "auto",
    ) -> torch.Tensor:
        """x [tokens, hidden]; cache [slots, latent_width] of this layer, written at each
        segment's new slots, then read at all its slots -> [tokens, hidden], all-reduced."""
        q = self.query(x, rope)
        new = self.latent(x, rope)
        for seg in segments:
            cache[seg.new_slots] = new[seg.rows]
        out = x.new_empty(x.shape[0], self.num_heads, self.mla.v_head_dim)
        for seg in segments:
            kv = cache[seg.slots]  # [prefix_len + q_len, latent_width]
            absorb = mode == "absorbed" or (mode == "auto" and seg.q_len == 1)
            attend = self.absorbed if absorb else self.expanded
            out[seg.rows] = attend(q[seg.rows], kv, seg.prefix_len)
        return self.o_proj(out.view(x.shape[0], -1))

    def query(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[tokens, heads, qk_head_dim]: per head [q_nope | roped q_rope]."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim)
        m = self.mla
        return apply_rotary_part(q, *rope, start=m.qk_nope_head_dim, interleaved=m.rope_interleave)

    def latent(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """What the tokens cache: [tokens, latent_width], [normed latent | roped k_rope]."""
        m = self.mla
        c, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_rope = apply_rotary(k_rope[:, None], *rope, interleaved=m.rope_interleave)[:, 0]
        return torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)

    def expanded(self, q: torch.Tensor, kv: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """q [n, heads, qk_head_dim]; kv [L, latent_width] cached rows of positions [0, L),
        the queries at the last n of them -> [n, heads, v_head_dim]."""
        m, h = self.mla, self.num_heads
        c, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        up = self.kv_b_proj(c).view(kv.shape[0], h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = up.split([m.qk_nope_head_dim, m.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, h, -1)], dim=-1)  # [L, heads, qk]
        return causal_attention(q, k, v, prefix_len, self.scale)

    def absorbed(self, q: torch.Tensor, kv: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """As `expanded`, attending in latent space: only the cache rows are read."""
        m = self.mla
        w_uk, w_uv = self.absorbed_weights()
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, heads, rank]
        q_cat = torch.cat([q_latent, q_rope], dim=-1)  # [n, heads, latent_width]
        c = kv[:, None, : m.kv_lora_rank]  # values: the latents, one head shared by all
        o = causal_attention(q_cat, kv[:, None], c, prefix_len, self.scale)  # [n, heads, rank]
        return torch.matmul(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK [heads, qk_nope_head_dim, rank] and
        W_UV [heads, v_head_dim, rank] (rows are head-major [k_nope | v] per head)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        return w_uk, w_uv


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """q [n, h, d]; k [L, hk, d], v [L, hk, dv] with hk = h or 1 (shared by all heads); key j
    is position j, query i position prefix_len + i -> [n, h, dv]. Softmax in float32."""
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale  # [h, n, L]
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    scores = scores.masked_fill(future.triu(prefix_len + 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
