"""Weights kept in GGUF's blocks of 32 values along a row (Q4_1, Q8_0) in float32 runs; a
Q4_0 weight's blocks (d (q - 8)) as the Q4_1 blocks of the same values (d, m = -8 d).

A GGUF checkpoint is loaded dequantised (models/gguf: each value computed from its block as
GGUF's reference does it, in float32). Where a float32 weight's values are exactly such a
dequantisation, the compiled `requantize_blocks` (kernels/skinny_linear.cpp) finds its
blocks again (each block's scale, minimum and small integers, checked by rebuilding every
value bitwise) and the native backend keeps those bytes instead: a quarter of the float32
weight's for Q4_1, a bit more for Q8_0. Its skinny kernel multiplies them by integer dot
products with x rounded per block in two 8-bit parts (about 16 bits); torch's GEMM, for more
rows, gets the exact values rebuilt.

A weight kept so is a 2-D tensor of [N, K / 32 * bytes per block] bytes whose dtype names the
format (`FORMATS`), its rows in groups of GROUP (`group`: the layout the kernel streams, see
kernels/skinny_linear.cpp; the rows past the last whole group in GGUF's own layout).
`values` gives its float32 values back and `row_values` some rows' (torch ops: a tied
embedding's lookups)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

BLOCK = 32  # values per block
GROUP = 8  # rows whose blocks lie together (kernels/skinny_linear.cpp kGroup)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernel's number for it
    block_bytes: int
    storage: torch.dtype  # the dtype of a weight kept in it


# Q4_1: fp16 d, fp16 m, 16 bytes with q_j in byte j's low nibble and q_(j+16) in its high one;
# v = d * q + m (two roundings). Q8_0: fp16 d, 32 int8 q; v = d * q.
Q4_1 = BlockFormat("Q4_1", 1, 20, torch.uint8)
Q8_0 = BlockFormat("Q8_0", 2, 34, torch.int8)
BLOCK_FORMATS = (Q4_1, Q8_0)  # the smallest first
FORMATS = {f.storage: f for f in BLOCK_FORMATS}


def block_format(weight: torch.Tensor) -> BlockFormat | None:
    """The format a kept weight is in; None: a plain matrix of values."""
    return FORMATS.get(weight.dtype) if weight.dim() == 2 else None


def describe_blocks(weights: Iterable[torch.Tensor]) -> str | None:
    """What a run keeps in blocks, in a line (None: nothing): tensors, bytes, and the bytes
    their float32 values would take."""
    kept = [(w, f) for w in weights if (f := block_format(w)) is not None]
    if not kept:
        return None
    held = sum(w.nbytes for w, _ in kept)
    wide = sum(4 * w.shape[0] * (w.shape[1] // f.block_bytes * BLOCK) for w, f in kept)
    names = sorted({f.name for _, f in kept})
    return (
        f"GGUF weights kept in their blocks ({', '.join(names)}): {len(kept)} tensors, "
        f"{held / 2**20:.1f} MiB (as float32: {wide / 2**20:.1f} MiB)"
    )


def group(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A weight's GGUF blocks [N, K / 32 * block bytes] (row after row) in the kept layout:
    each group of GROUP rows as tiles, one per block along K, holding the rows' scales (and
    Q4_1's minimums), then their integers four values at a time, row after row."""
    n, ld = blocks.shape
    whole = n - n % GROUP
    b = blocks[:whole].reshape(whole // GROUP, GROUP, ld // fmt.block_bytes, fmt.block_bytes)
    b = b.transpose(1, 2)  # [groups, blocks, row, bytes]
    head = 4 if fmt is Q4_1 else 2
    scales = [b[..., h : h + 2].flatten(-2) for h in range(0, head, 2)]
    quads = b[..., head:].unflatten(-1, (-1, 4)).transpose(2, 3).flatten(-3)
    tiles = torch.cat([*scales, quads], dim=-1).reshape(whole, ld)
    return torch.cat([tiles, blocks[whole:]]).contiguous()


def ungroup(kept: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """`group`'s inverse: the rows' GGUF blocks, row after row."""
    n, ld = kept.shape
    whole = n - n % GROUP
    t = kept[:whole].reshape(whole // GROUP, ld // fmt.block_bytes, GROUP * fmt.block_bytes)
    head = 4 if fmt is Q4_1 else 2
    scales = [
        t[..., GROUP * h : GROUP * (h + 2)].unflatten(-1, (GROUP, 2)) for h in range(0, head, 2)
    ]
    quads = t[..., GROUP * head :].unflatten(-1, (-1, GROUP, 4)).transpose(2, 3).flatten(-2)
    b = torch.cat([*scales, quads], dim=-1).transpose(1, 2).reshape(whole, ld)
    return torch.cat([b, kept[whole:]]).contiguous()


def values(kept: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A kept weight's float32 values [N, K]."""
    return gguf_values(ungroup(kept, fmt), fmt)


def row_values(kept: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a kept weight, as float32 values [*ids.shape, K]: each row's
    group ungrouped (a tied embedding's lookups)."""
    n, ld = kept.shape
    whole = n - n % GROUP
    flat = ids.reshape(-1)
    if whole == 0:  # no groups: every row in GGUF's layout
        return gguf_values(kept[flat], fmt).view(*ids.shape, -1)
    grouped = flat < whole
    picked = kept[:whole].reshape(-1, GROUP * ld)[torch.where(grouped, flat // GROUP, 0)]
    rows = ungroup(picked.reshape(-1, ld), fmt).view(-1, GROUP, ld)
    rows = rows[torch.arange(flat.numel()), flat % GROUP]
    tail = kept[torch.where(grouped, n - 1, flat)]  # rows past the groups, as they lie
    gguf = torch.where(grouped.unsqueeze(-1), rows, tail)
    return gguf_values(gguf, fmt).view(*ids.shape, -1)


def gguf_values(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The float32 values [N, K] of blocks in GGUF's layout, row after row."""
    n = blocks.shape[0]
    b = blocks.view(torch.uint8).reshape(n, -1, fmt.block_bytes)
    d = _halves(b, 0)
    if fmt is Q4_1:
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return torch.add(torch.mul(d, q), _halves(b, 2)).reshape(n, -1)
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return torch.mul(d, q).reshape(n, -1)


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 [n, blocks, 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()
