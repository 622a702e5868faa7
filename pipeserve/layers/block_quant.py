"""Weights kept in GGUF's blocks of 32 values along a row (Q4_1, Q8_0) in float32 runs.

A GGUF checkpoint is loaded dequantised (models/gguf: each value computed from its block as
GGUF's reference does it, in float32). Where a float32 weight's values are exactly such a
dequantisation, `requantize` finds its blocks again (each block's scale, minimum and small
integers, checked by rebuilding every value bitwise) and the run may keep those bytes
instead: a quarter of the float32 weight's for Q4_1, a bit more for Q8_0, the same products
(the skinny kernel rebuilds each value in registers: kernels/skinny_linear.cpp). A weight
kept so is a 2-D tensor of its rows' block bytes, [N, K / 32 * bytes per block], whose dtype
names the format (`FORMATS`); `values` gives its float32 values back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per block
PROBE_ROWS = 4  # rows tried first: most weights fail there, at no cost


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernel's number for it
    block_bytes: int
    storage: torch.dtype  # the dtype of a weight kept in it
    levels: tuple[int, int]  # the integers' range


# Q4_1: fp16 d, fp16 m, 16 bytes with q_j in byte j's low nibble and q_(j+16) in its high one;
# v = d * q + m (two roundings). Q8_0: fp16 d, 32 int8 q; v = d * q.
Q4_1 = BlockFormat("Q4_1", 1, 20, torch.uint8, (0, 15))
Q8_0 = BlockFormat("Q8_0", 2, 34, torch.int8, (-127, 127))
BLOCK_FORMATS = (Q4_1, Q8_0)  # the smallest first
FORMATS = {f.storage: f for f in BLOCK_FORMATS}


def block_format(weight: torch.Tensor) -> BlockFormat | None:
    """The format a kept weight is in; None: a plain matrix of values."""
    return FORMATS.get(weight.dtype) if weight.dim() == 2 else None


def values(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A kept weight's (or some of its rows') float32 values [N, K]."""
    n = blocks.shape[0]
    b = blocks.view(torch.uint8).reshape(n, -1, fmt.block_bytes)
    d = _halves(b, 0)
    if fmt is Q4_1:
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return torch.add(torch.mul(d, q), _halves(b, 2)).reshape(n, -1)
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return torch.mul(d, q).reshape(n, -1)


def requantize(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] float32 in the first format whose blocks give back every value
    bitwise (Q4_1, then Q8_0), or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    for fmt in BLOCK_FORMATS:
        if _encode(weight[:PROBE_ROWS], fmt) is not None:
            found = _encode(weight, fmt)
            if found is not None:
                return found
    return None


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 [n, blocks, 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def _encode(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor | None:
    n, k = weight.shape
    v = weight.reshape(n, k // BLOCK, BLOCK)
    if not torch.isfinite(v).all():
        return None
    lo, hi = fmt.levels
    if fmt is Q4_1:
        m = v.amin(-1, keepdim=True)  # the block's minimum has q = 0
        m16 = m.to(torch.float16)
        if not torch.equal(m16.float(), m):
            return None
        estimate = (v.amax(-1, keepdim=True) - m) / hi
    else:
        m16 = None
        estimate = v.abs().amax(-1, keepdim=True) / hi
    d16, q = _scale_and_levels(v, estimate, m16, fmt)
    if d16 is None or q is None:
        return None
    head = [d16.view(torch.uint8)]
    if m16 is not None:
        head.append(m16.view(torch.uint8))
        body = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
    else:
        body = q.to(torch.int8).view(torch.uint8)
    blocks = torch.cat([*head, body], dim=-1).reshape(n, -1)
    return blocks.view(fmt.storage)


def _scale_and_levels(
    v: torch.Tensor, estimate: torch.Tensor, m16: torch.Tensor | None, fmt: BlockFormat
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each block's fp16 scale (the estimate rounded to fp16, or one step either side of it)
    and integers that give back its values bitwise; (None, None) where some block has none."""
    lo, hi = fmt.levels
    m = m16.float() if m16 is not None else None
    nearest = estimate.to(torch.float16)
    bits = nearest.view(torch.int16)
    candidates = [
        nearest,
        (bits + 1).view(torch.float16),
        (bits - 1).clamp(min=0).view(torch.float16),
    ]
    chosen_d = nearest.clone()
    chosen_q = torch.zeros(v.shape, dtype=torch.int16)
    done = torch.zeros(estimate.shape, dtype=torch.bool)
    for d16 in candidates:
        d = d16.float()
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = ((v if m is None else v - m) / safe).round().clamp(lo, hi)
        q = torch.where(d == 0, torch.zeros_like(q), q)
        rebuilt = torch.mul(d, q)
        if m is not None:
            rebuilt = torch.add(rebuilt, m)
        ok = (rebuilt == v).all(-1, keepdim=True) & ~done
        chosen_d = torch.where(ok, d16, chosen_d)
        chosen_q = torch.where(ok, q.to(torch.int16), chosen_q)
        done |= ok
        if bool(done.all()):
            return chosen_d, chosen_q
    return None, None
