"""The zig-zag layout: 2N blocks that partition the chunk (aligned to pages, sizes within one
page), rank r holding blocks r and 2N-1-r, split and its inverse, and the even causal work
that is the point of it (a contiguous split gives the last rank ~2N-1 times the first's)."""

from __future__ import annotations

import pytest
import torch

from pipeserve.context_parallel.zigzag import (
    causal_work,
    rank_blocks,
    rank_positions,
    split,
    unsplit,
    zigzag_blocks,
)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 100, 1001])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 16])
def test_blocks_partition_the_chunk_on_page_boundaries(num_tokens: int, cp: int,
                                                       align: int) -> None:
    blocks = zigzag_blocks(num_tokens, cp, align)
    assert len(blocks) == 2 * cp
    assert blocks[0][0] == 0 and blocks[-1][1] == num_tokens
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    assert all(s % align == 0 for s, _ in blocks)  # every block starts on a page
    share = num_tokens / (2 * cp)  # each block within one page of its equal share
    assert all(abs((e - s) - share) <= align for s, e in blocks)


def test_rank_r_holds_blocks_r_and_2n_minus_1_minus_r() -> None:
    assert zigzag_blocks(16, 2) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert rank_blocks(16, 2, 0) == [(0, 4), (12, 16)]
    assert rank_blocks(16, 2, 1) == [(4, 8), (8, 12)]
    assert zigzag_blocks(10, 2) == [(0, 3), (3, 5), (5, 8), (8, 10)]  # 2.5 rounds up
    assert rank_positions(10, 2, 0).tolist() == [0, 1, 2, 8, 9]
    assert rank_positions(10, 2, 1).tolist() == [3, 4, 5, 6, 7]
    # 3 pages over 2 ranks: rank 0 (blocks 0 and 3) two, rank 1 (blocks 1 and 2) one
    assert zigzag_blocks(40, 2, align=16) == [(0, 16), (16, 16), (16, 32), (32, 40)]
    with pytest.raises(ValueError, match="CP rank 2 is outside --cp-size 2"):
        rank_blocks(16, 2, 2)


@pytest.mark.parametrize(("num_tokens", "cp", "align"), [(10, 2, 1), (1001, 3, 1), (300, 4, 16),
                                                         (5, 4, 1)])
def test_split_and_unsplit_are_inverse(num_tokens: int, cp: int, align: int) -> None:
    x = torch.randn(num_tokens, 3)
    parts = [split(x, cp, r, align) for r in range(cp)]
    assert sum(p.shape[0] for p in parts) == num_tokens
    assert torch.equal(unsplit(parts, num_tokens, align), x)
    covered = torch.cat([rank_positions(num_tokens, cp, r, align) for r in range(cp)])
    assert sorted(covered.tolist()) == list(range(num_tokens))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_even_across_ranks(cp: int) -> None:
    n = 32768
    work = [causal_work(n, cp, r) for r in range(cp)]
    assert sum(work) == n * (n + 1) // 2
    assert max(work) / min(work) < 1.001
    # the contiguous split it replaces: the last rank does ~2N-1 times the first's work
    shard = n // cp
    contiguous = [(r + 1) * shard * ((r + 1) * shard + 1) // 2 - r * shard * (r * shard + 1) // 2
                  for r in range(cp)]
    assert max(contiguous) / min(contiguous) > 2 * cp - 1.5


def test_page_aligned_blocks_stay_nearly_even() -> None:
    work = [causal_work(32768 + 5, 4, r, align=64) for r in range(4)]
    assert max(work) / min(work) < 1.01
