"""The zig-zag layout of context parallelism: a chunk of T tokens is cut into 2N blocks and
CP rank r takes blocks r and 2N - 1 - r, so every rank gets one early and one late block and
the causal attention work (a token attends to every token before it) is nearly even.

Blocks are as equal as the page size allows: every block starts on a multiple of `align` (a
rank's KV then fills whole pages), the start of block b being b / 2N of the chunk rounded to
the nearest multiple, so a block is within one `align` of its equal share. Pure index arithmetic;
`split` and `unsplit` move rows of tensors."""

from __future__ import annotations

import torch


def zigzag_blocks(num_tokens: int, cp_size: int, align: int = 1) -> list[tuple[int, int]]:
    """The 2N (start, end) blocks of a chunk, in order; empty blocks where the chunk has
    fewer aligned units than blocks."""
    if cp_size < 1 or align < 1 or num_tokens < 0:
        raise ValueError(
            f"zig-zag blocks of {num_tokens} tokens over --cp-size {cp_size} with alignment "
            f"{align}: all must be positive (tokens >= 0)"
        )
    blocks = 2 * cp_size
    # block b starts at b / 2N of the chunk, rounded to the nearest page boundary
    starts = [
        min(num_tokens, (2 * num_tokens * b + blocks * align) // (2 * blocks * align) * align)
        for b in range(blocks)
    ]
    return list(zip(starts, [*starts[1:], num_tokens], strict=True))


def rank_blocks(num_tokens: int, cp_size: int, rank: int, align: int = 1) -> list[tuple[int, int]]:
    """CP rank `rank`'s two blocks, early one first."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"CP rank {rank} is outside --cp-size {cp_size} (0..{cp_size - 1})")
    blocks = zigzag_blocks(num_tokens, cp_size, align)
    return [blocks[rank], blocks[2 * cp_size - 1 - rank]]


def rank_positions(num_tokens: int, cp_size: int, rank: int, align: int = 1) -> torch.Tensor:
    """[tokens of the rank] long: the chunk positions CP rank `rank` computes, ascending."""
    parts = [torch.arange(s, e) for s, e in rank_blocks(num_tokens, cp_size, rank, align)]
    return torch.cat(parts)


def split(x: torch.Tensor, cp_size: int, rank: int, align: int = 1) -> torch.Tensor:
    """The rows of `x` ([tokens, ...], chunk order) that CP rank `rank` computes."""
    return x[rank_positions(x.shape[0], cp_size, rank, align).to(x.device)]


def unsplit(parts: list[torch.Tensor], num_tokens: int, align: int = 1) -> torch.Tensor:
    """The inverse of `split`: every rank's rows (rank order) back in chunk order."""
    cp_size = len(parts)
    if sum(p.shape[0] for p in parts) != num_tokens:
        raise ValueError(
            f"the ranks' parts hold {sum(p.shape[0] for p in parts)} rows, not {num_tokens}"
        )
    out = parts[0].new_empty((num_tokens, *parts[0].shape[1:]))
    for rank, part in enumerate(parts):
        out[rank_positions(num_tokens, cp_size, rank, align).to(part.device)] = part
    return out


def causal_work(num_tokens: int, cp_size: int, rank: int, align: int = 1) -> int:
    """Query-key pairs rank `rank` computes in causal attention over the chunk (a token at
    position p attends to p + 1 keys)."""
    return sum(
        e * (e + 1) // 2 - s * (s + 1) // 2
        for s, e in rank_blocks(num_tokens, cp_size, rank, align)
    )
