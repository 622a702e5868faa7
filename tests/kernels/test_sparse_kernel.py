"""DeepSeek-V3.2's sparse attention in latent space (`mla.sparse_latent_attention`): the
compiled CPU kernel (rows read in place) and the torch path (rows gathered per block of
queries) against float64 softmax attention under the selection's mask, and the work they do:
each query reads its chosen rows and no others, min(visible, topk) of them with an indexer's
choice."""

from __future__ import annotations

import pytest
import torch
from selection_oracle import masked_attention, selection_mask
from torch_threads import torch_threads

from pipeserve.backends import torch_ops
from pipeserve.device import native_sparse_kernel
from pipeserve.layers.indexer import top_positions
from pipeserve.layers.mla import sparse_latent_attention

KERNEL = native_sparse_kernel()  # what the native backend's `kernels.sparse_latent` holds
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no native kernels here")
# odd sizes: heads not a multiple of the kernel's tile of 4, widths with tails past its 8 lanes
N, H, W, RANK, ROWS, TOPK = 37, 7, 45, 37, 300, 64


def problem(dtype: torch.dtype, seed: int = 0):
    """q, the rows, and a choice of TOPK rows per query in shuffled order, some rows padded
    with -1 (one query choosing nothing)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, W, generator=gen).to(dtype)
    rows = torch.randn(ROWS, W, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(ROWS, generator=gen)[:TOPK] for _ in range(N)])
    slots[3, 10:] = -1
    slots[5, :] = -1  # nothing chosen: zeros
    slots[7, ::2] = -1  # holes anywhere
    return q, rows, slots


def oracle(q, rows, slots, scale):
    keep = selection_mask(slots, rows.shape[0])
    k = rows[:, None].expand(-1, q.shape[1], -1)
    return masked_attention(q, k, k[..., :RANK], keep, scale)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attends_to_the_chosen_rows_only(
    native: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, rows, slots = problem(dtype)
    if not native:  # several gathered blocks of queries
        monkeypatch.setattr(torch_ops, "GATHER_BLOCK_BYTES", 9 * TOPK * W * q.element_size())
        slots[5, 0] = 0  # torch's softmax of nothing is not zeros; the kernel's is
    read = torch.zeros(1, dtype=torch.long)
    out = sparse_latent_attention(q, rows, slots, RANK, 0.17, KERNEL if native else None, read)
    expected = oracle(q, rows, slots, 0.17)
    assert out.dtype == dtype and out.shape == (N, H, RANK)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    else:  # float32 arithmetic, one rounding of the output to bfloat16
        torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2**-8)
    if native:
        assert (out[5] == 0).all()
    assert read.item() == int((slots >= 0).sum())


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "width", "rank", "threads"),
    [
        (8, 288, 256, 2),  # benchmarks/v32_sparse.py's latent (256 + rope 32)
        (16, 576, 512, 1),  # DeepSeek-V3.2's own (512 + rope 64)
        (5, 77, 70, 2),  # chunks of 32 with tails; heads past the tile of 4
    ],
)
def test_bfloat16_at_model_widths(heads: int, width: int, rank: int, threads: int) -> None:
    """bfloat16 rows at DeepSeek's widths: on CPUs with AVX512-BF16 the kernel's vdpbf16ps
    form (scores by chunks of 32 values; values two rows at a time with their weights rounded
    to bfloat16, the channels permuted within a chunk and put back in order), elsewhere
    bfloat16 widened. Against float64 attention on the same values, within the output's
    bfloat16 rounding and the weights' own; choices whose tiles of 8 rows end odd."""
    gen = torch.Generator().manual_seed(3)
    n, length, topk = 19, 500, 75
    q = torch.randn(n, heads, width, generator=gen).bfloat16()
    rows = torch.randn(length, width, generator=gen).bfloat16()
    slots = torch.stack([torch.randperm(length, generator=gen)[:topk] for _ in range(n)])
    slots[2, ::4] = -1
    with torch_threads(threads):
        out = KERNEL(q, rows, slots, rank, width**-0.5, torch.zeros(1, dtype=torch.long))
    k = rows[:, None].expand(-1, heads, -1)
    keep = selection_mask(slots, length)
    expected = masked_attention(q, k, k[..., :rank], keep, width**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2**-8)


@needs_kernel
def test_kernel_reads_strided_rows_in_place() -> None:
    """A view of wider rows (the context-parallel path's latent part of [latent | index key]
    rows) gives what a compact copy gives, and the order of a choice changes nothing."""
    q, rows, slots = problem(torch.float32, seed=3)
    wide = torch.cat([rows, torch.randn(ROWS, 11)], dim=1)
    shuffled = slots[:, torch.randperm(TOPK, generator=torch.Generator().manual_seed(1))]
    compact = sparse_latent_attention(q, rows, slots, RANK, 0.2, KERNEL)
    strided = sparse_latent_attention(q, wide[:, :W], shuffled, RANK, 0.2, KERNEL)
    torch.testing.assert_close(strided, compact, atol=2e-6, rtol=0)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_kernel), False])
def test_rows_read_per_query_are_min_of_visible_and_topk(native: bool) -> None:
    """An indexer-like choice over causal scores (a chunk of queries after a prefix, the early
    ones seeing fewer than topk positions): exactly min(visible, topk) rows read per query."""
    n, prefix, topk = 90, 40, 64
    length = prefix + n
    gen = torch.Generator().manual_seed(5)
    scores = torch.rand(n, length, generator=gen)
    visible = torch.arange(length)[None] <= prefix + torch.arange(n)[:, None]
    chosen = top_positions(scores.masked_fill(~visible, float("-inf")), topk)
    q, rows = torch.randn(n, H, W, generator=gen), torch.randn(length, W, generator=gen)
    read = torch.zeros(1, dtype=torch.long)
    out = sparse_latent_attention(q, rows, chosen, RANK, 0.2, KERNEL if native else None, read)
    want = (prefix + torch.arange(n) + 1).clamp(max=topk)
    assert torch.equal((chosen >= 0).sum(-1), want)
    assert read.item() == int(want.sum())
    torch.testing.assert_close(out.double(), oracle(q, rows, chosen, 0.2), atol=2e-6, rtol=0)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_outside_the_rows_is_refused(dtype: torch.dtype, threads: int) -> None:
    """Checked by the task that reads the rows (on whichever thread): the call fails with
    the message for the first query's slot, the last one's, and a lone query's (a decode
    step, its heads split over the threads)."""
    q, rows, slots = problem(dtype)
    with torch_threads(threads):
        for row in (0, slots.shape[0] - 1):
            wrong = slots.clone()
            wrong[row, 4] = ROWS
            with pytest.raises(RuntimeError, match="outside the cache"):
                sparse_latent_attention(q, rows, wrong, RANK, 0.2, KERNEL)
        wrong = slots[:1].clone()
        wrong[0, 4] = ROWS
        with pytest.raises(RuntimeError, match="outside the cache"):
            sparse_latent_attention(q[:1], rows, wrong, RANK, 0.2, KERNEL)


@needs_kernel
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_queries_split_their_heads_over_threads(n: int, dtype: torch.dtype) -> None:
    """Decode steps (fewer queries than threads) run in groups of heads, each group reading
    the rows: the same output, and each query's rows counted once (bfloat16: within its
    rounding, in the vdpbf16ps form where the CPU has it)."""
    q, rows, slots = problem(dtype, seed=6)
    q, slots = q[:n], slots[:n]
    read = torch.zeros(1, dtype=torch.long)
    with torch_threads(2):
        out = sparse_latent_attention(q, rows, slots, RANK, 0.2, KERNEL, read)
    tolerance = (
        {"atol": 2e-6, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2**-8}
    )
    torch.testing.assert_close(out.double(), oracle(q, rows, slots, 0.2), **tolerance)
    assert read.item() == int((slots >= 0).sum())


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_kernel), False])
def test_no_queries_give_an_empty_answer(native: bool) -> None:
    q, rows, slots = problem(torch.float32)
    read = torch.zeros(1, dtype=torch.long)
    out = sparse_latent_attention(
        q[:0], rows, slots[:0], RANK, 0.2, KERNEL if native else None, read
    )
    assert out.shape == (0, H, RANK) and read.item() == 0
