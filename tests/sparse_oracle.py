"""References for DeepSeek-V3.2's sparse attention tests: a selection as a dense mask, and
masked softmax attention computed in float64 math (the oracle the sparse paths are held to;
not the engine's code)."""

from __future__ import annotations

import torch


def selection_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """positions [n, topk] of one request (-1: none) -> [n, length] bool, True where selected."""
    mask = torch.zeros(positions.shape[0], length + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(positions < 0, length, positions).cpu(), True)
    return mask[:, :length].to(positions.device)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, h, d], k [L, hk, d], v [L, hk, dv] (hk = h or 1), keep [n, L] bool -> [n, h, dv]
    in q's dtype, computed in float64."""
    h = q.shape[1]
    kk = k.double().expand(-1, h, -1) if k.shape[1] == 1 else k.double()
    vv = v.double().expand(-1, h, -1) if v.shape[1] == 1 else v.double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    scores = scores.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vv).to(q.dtype)
