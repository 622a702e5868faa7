"""Test-side oracle of DeepSeek-V3.2's sparse attention: an indexer's choice as a dense mask,
and plain softmax attention under that mask (what the package's sparse kernels must equal
without ever building either)."""

from __future__ import annotations

import torch


def selection_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """positions [n, topk] of one request (-1: none) -> [n, length] bool, True where selected."""
    mask = torch.zeros(positions.shape[0], length + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(positions < 0, length, positions), True)  # -1: a spare column
    return mask[:, :length]


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, h, d], k [L, h, d], v [L, h, dv], keep [n, L] -> [n, h, dv] in float64; a row
    that keeps nothing gives zeros."""
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    scores = scores.masked_fill(~keep[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", probs, v.double())
