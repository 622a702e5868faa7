"""DeepSeek-V3.2's sparse attention on up-projected keys (kernels/sparse_expanded.cpp, what
`MLAttention.sparse_expanded` runs): each query's heads over its chosen positions only, keys
[k_nope | the shared k_rope] read from strided views of one up-projection, against float64
softmax attention under the selection's mask; the positions read are counted; the layer's
choice between this form and the latent one."""

from __future__ import annotations

import threading

import pytest
import torch
from selection_oracle import masked_attention, selection_mask
from torch_threads import torch_threads

from pipeserve.backends.base import TORCH_KERNELS
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.device import native_sparse_expanded_kernel
from pipeserve.layers.mla import MLAttention
from pipeserve.models.arch import IndexerConfig, MLAConfig

pytestmark = pytest.mark.skipif(
    native_sparse_expanded_kernel() is None, reason="no native kernels here"
)
# odd sizes: widths with tails past the kernel's 8 lanes, runs that are not whole tiles, a
# request long enough for several blocks of 64 positions and spans of positions
N, H, DK, DR, DV, L, TOPK = 45, 3, 13, 5, 11, 700, 90
NATIVE = NativeBackend().kernels  # the native backend's compiled kernels


def problem(dtype: torch.dtype, seed: int = 0):
    """q; k, v as views of one [L, H, DK + DV] up-projection; rope as a view of wider rows;
    each query's choice of TOPK positions in shuffled order, with holes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, DK + DR, generator=gen).to(dtype)
    up = torch.randn(L, H, DK + DV, generator=gen).to(dtype)
    rows = torch.randn(L, 7 + DR, generator=gen).to(dtype)
    positions = torch.stack([torch.randperm(L, generator=gen)[:TOPK] for _ in range(N)])
    positions[3, 10:] = -1
    positions[5, :] = -1  # nothing chosen: zeros
    positions[7, ::2] = -1  # holes anywhere
    positions[8] = torch.arange(L - TOPK, L)  # one run across the last blocks, in order
    return q, up[..., :DK], up[..., DK:], rows[:, 7:], positions


def oracle(q, k, v, rope, positions, scale):
    keys = torch.cat([k, rope[:, None].expand(-1, H, -1)], dim=-1)
    return masked_attention(q, keys, v, selection_mask(positions, L), scale)


def attend(q, k, v, rope, positions, scale, read=None):
    kernel = native_sparse_expanded_kernel()
    read = torch.zeros(1, dtype=torch.long) if read is None else read
    return kernel(q, k, v, rope, positions, scale, read)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attends_to_the_chosen_positions_only(dtype: torch.dtype) -> None:
    q, k, v, rope, positions = problem(dtype)
    read = torch.zeros(1, dtype=torch.long)
    out = attend(q, k, v, rope, positions, 0.3, read)
    expected = oracle(q, k, v, rope, positions, 0.3)
    assert out.dtype == dtype and out.shape == (N, H, DV)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    else:  # float32 arithmetic, one rounding of the output to bfloat16
        torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2**-8)
    assert (out[5] == 0).all()
    assert read.item() == int((positions >= 0).sum())


@pytest.mark.parametrize(
    ("heads", "dk", "dr", "dv", "threads"),
    [
        (8, 64, 32, 64, 2),  # benchmarks/v32_sparse.py's widths
        (12, 64, 32, 64, 1),  # a group of eight heads and one of four
        (16, 128, 64, 128, 2),  # the released widths, two groups of eight heads
        (4, 128, 64, 128, 1),  # the released model's
        (3, 40, 0, 72, 2),  # no rope part; chunks of 32 with tails
        (2, 300, 16, 24, 1),  # wider than the vdpbf16ps form's six key chunks
    ],
)
def test_bfloat16_at_model_widths(heads: int, dk: int, dr: int, dv: int, threads: int) -> None:
    """bfloat16 storage at DeepSeek's widths. On CPUs with AVX512-BF16 this is the kernel's
    vdpbf16ps form (the query's chunks held over a run, the values two positions at a time
    with their weights rounded to bfloat16, the channels permuted within each chunk and put
    back in order at the end); elsewhere, and past its widths, bfloat16 widened to float32.
    Against float64 attention on the same bfloat16 values, within the output's bfloat16
    rounding and the weights' own; runs of odd lengths (holes, a run cut by a block edge)."""
    gen = torch.Generator().manual_seed(7)
    n, length, topk = 37, 600, 200
    q = torch.randn(n, heads, dk + dr, generator=gen).bfloat16()
    up = torch.randn(length, heads, dk + dv, generator=gen).bfloat16()
    rope = torch.randn(length, dr, generator=gen).bfloat16()
    positions = torch.stack([torch.randperm(length, generator=gen)[:topk] for _ in range(n)])
    positions[4, ::3] = -1
    positions[5, 1:] = -1  # one position: runs of one
    positions[6] = torch.arange(length - topk, length)  # one run across a block's edge
    k, v = up[..., :dk], up[..., dk:]
    scale = (dk + dr) ** -0.5
    with torch_threads(threads):
        out = attend(q, k, v, rope if dr else torch.empty(0), positions, scale)
    keys = torch.cat([k, rope[:, None].expand(-1, heads, -1)], dim=-1)
    expected = masked_attention(q, keys, v, selection_mask(positions, length), scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2**-8)


def test_keys_without_a_shared_rope_part() -> None:
    """Whole per-head keys (the context-parallel path's expanded keys) and no rope: the same
    numbers as the keys split in two."""
    q, k, v, rope, positions = problem(torch.float32, seed=1)
    whole = torch.cat([k, rope[:, None].expand(-1, H, -1)], dim=-1).contiguous()
    split = attend(q, k, v, rope, positions, 0.2)
    joined = attend(q, whole, v, torch.empty(0), positions, 0.2)
    torch.testing.assert_close(joined, split, atol=2e-6, rtol=0)


def as_the_indexer_writes(positions: torch.Tensor) -> torch.Tensor:
    """Each row increasing, then its -1s (the kernel reads such rows in place, not copied)."""
    tail = torch.where(positions < 0, L, positions).sort(dim=-1).values
    tail[tail == L] = -1
    return tail


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_and_order_of_a_choice_change_nothing(threads: int, dtype: torch.dtype) -> None:
    """Shuffled rows, rows with their -1s first, rows as the indexer writes them, and the
    last beside shuffled ones in one call (pointers into a scratch copy that grows as rows
    are copied, beside rows read in place; once on a fresh thread, whose scratch starts
    empty): the same outputs and the same count of pairs read."""
    q, k, v, rope, positions = problem(dtype, seed=2)
    ordered = positions.sort(dim=-1).values  # -1s first, then increasing
    tail = as_the_indexer_writes(positions)
    mixed = torch.where(torch.arange(N)[:, None] % 2 == 0, tail, positions)
    orders = (ordered, tail, mixed)
    reads = [torch.zeros(1, dtype=torch.long) for _ in range(len(orders) + 1)]
    fresh: list[torch.Tensor] = []
    with torch_threads(threads):
        shuffled = attend(q, k, v, rope, positions, 0.2, reads[0])
        outs = [attend(q, k, v, rope, o, 0.2, r) for o, r in zip(orders, reads[1:], strict=True)]
        worker = threading.Thread(target=lambda: fresh.append(attend(q, k, v, rope, mixed, 0.2)))
        worker.start()
        worker.join(timeout=60)
    tolerance = 2e-6 if dtype == torch.float32 else 0.0  # the same sums in the same order
    for out in [*outs, *fresh]:
        torch.testing.assert_close(shuffled, out, atol=tolerance, rtol=0)
    assert len(fresh) == 1
    assert [r.item() for r in reads] == [int((positions >= 0).sum())] * len(reads)
    if dtype == torch.float32:
        torch.testing.assert_close(
            shuffled.double(), oracle(q, k, v, rope, positions, 0.2), atol=2e-6, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_queries_in_several_tiles_tasks_and_rounds(dtype: torch.dtype) -> None:
    """1100 queries on 2 threads: several tiles of queries per task (128 at most), tasks in
    two rounds per thread (512 queries at most), each query still reading its own choice."""
    gen = torch.Generator().manual_seed(9)
    n, keys, topk = 1100, 160, 24
    q = torch.randn(n, H, DK + DR, generator=gen).to(dtype)
    up = torch.randn(keys, H, DK + DV, generator=gen).to(dtype)
    rope = torch.randn(keys, DR, generator=gen).to(dtype)
    positions = torch.stack([torch.randperm(keys, generator=gen)[:topk] for _ in range(n)])
    positions[::7, ::3] = -1
    k, v = up[..., :DK], up[..., DK:]
    read = torch.zeros(1, dtype=torch.long)
    with torch_threads(2):
        out = attend(q, k, v, rope, positions, 0.2, read)
    keys_h = torch.cat([k, rope[:, None].expand(-1, H, -1)], dim=-1)
    want = masked_attention(q, keys_h, v, selection_mask(positions, keys), 0.2)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)
    else:
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2**-8)
    assert read.item() == int((positions >= 0).sum())


def test_a_position_chosen_many_times_is_read_each_time() -> None:
    """A choice that repeats one position more often than a block holds positions (what no
    indexer gives, but a caller may): one run longer than a block, every copy weighed alike,
    so the answer is that position's value."""
    q, k, v, rope, positions = problem(torch.float32, seed=4)
    positions[2] = 5
    read = torch.zeros(1, dtype=torch.long)
    out = attend(q, k, v, rope, positions, 0.2, read)
    torch.testing.assert_close(out[2], v[5], atol=1e-6, rtol=1e-5)
    assert read.item() == int((positions >= 0).sum())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [L, -2])
def test_a_position_outside_the_keys_is_refused(bad: int, dtype: torch.dtype, threads: int) -> None:
    """Checked by the task that reads the rows (on whichever thread): the call fails with
    the message, whether the bad position is the first query's or the last one's."""
    q, k, v, rope, positions = problem(dtype)
    with torch_threads(threads):
        for row in (0, positions.shape[0] - 1):
            wrong = positions.clone()
            wrong[row, 4] = bad
            with pytest.raises(RuntimeError, match="outside the keys"):
                attend(q, k, v, rope, wrong, 0.2)
            # in a row read in place (increasing, the -1s at its end): its last position
            wrong = as_the_indexer_writes(positions)
            wrong[row, int((wrong[row] >= 0).sum()) - 1] = bad
            with pytest.raises(RuntimeError, match="outside the keys"):
                attend(q, k, v, rope, wrong, 0.2)


def test_no_queries_give_an_empty_answer() -> None:
    q, k, v, rope, positions = problem(torch.float32)
    read = torch.zeros(1, dtype=torch.long)
    out = attend(q[:0], k, v, rope, positions[:0], 0.2, read)
    assert out.shape == (0, H, DV) and read.item() == 0


def layer(rank: int, heads: int, nope: int = 64, rope: int = 32) -> MLAttention:
    mla = MLAConfig(
        q_lora_rank=64,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=nope,
        rope_interleave=False,
    )
    index = IndexerConfig(n_heads=4, head_dim=32, topk=2048)
    return MLAttention(128, heads, mla, None, torch.float32, indexer=index)


def test_long_chunks_of_narrow_latents_expand_decode_steps_stay_latent() -> None:
    """The cost rule: with the benchmark's widths (latent 256, heads of 96/64) a 2,048-query
    chunk of a 16K request expands and a decode step does not; at DeepSeek-V3's widths (latent
    512, heads of 192/128) a 512-query chunk of a 128K request stays latent (up-projecting
    every position would cost more than it saves), as does a 2,048-query chunk of 32K with heads
    of 192/128 over a 256 latent (a pair's 320 per-head multiply-adds at the expanded kernel's
    cost exceed the latent's 576); nothing expands off the compiled kernels or their dtypes."""
    narrow = layer(256, 8)
    assert narrow.sparse_expands(2048, 16384, NATIVE, torch.float32)
    assert narrow.sparse_expands(2048, 16384, NATIVE, torch.bfloat16)
    assert not narrow.sparse_expands(1, 16384, NATIVE, torch.float32)
    assert not narrow.sparse_expands(2048, 16384, TORCH_KERNELS, torch.float32)
    assert not narrow.sparse_expands(2048, 16384, NATIVE, torch.float16)
    v3 = layer(512, 8, nope=128, rope=64)
    assert not v3.sparse_expands(512, 131072, NATIVE, torch.float32)
    released = layer(256, 16, nope=128, rope=64)  # the released model's heads: a 2K chunk of 32K
    assert not released.sparse_expands(2048, 32768, NATIVE, torch.bfloat16)


def test_the_form_can_be_forced_and_a_wrong_one_is_refused(monkeypatch: pytest.MonkeyPatch):
    narrow = layer(256, 8)
    monkeypatch.setenv("PIPESERVE_SPARSE_ATTENTION_FORM", "latent")
    assert not narrow.sparse_expands(2048, 16384, NATIVE, torch.float32)
    monkeypatch.setenv("PIPESERVE_SPARSE_ATTENTION_FORM", "expanded")
    assert narrow.sparse_expands(1, 16384, NATIVE, torch.float32)
    assert not narrow.sparse_expands(1, 16384, TORCH_KERNELS, torch.float32)  # no kernel: latent
    monkeypatch.setenv("PIPESERVE_SPARSE_ATTENTION_FORM", "dense")
    with pytest.raises(ValueError, match="expected auto, latent or expanded"):
        narrow.sparse_expands(2048, 16384, NATIVE, torch.float32)


def test_the_layer_computes_the_same_in_both_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLAttention.sparse on up-projected keys equals the latent form on the same choice."""
    from pipeserve.layers.latent_segment import LatentSegment

    torch.manual_seed(0)
    lay = layer(64, 4)
    for p in lay.parameters():
        p.data.normal_(0, 0.2)
    length, n = 300, 40
    cache = torch.randn(length + 5, 64 + 32)
    slots = torch.randperm(length + 5)[:length]
    seg = LatentSegment(0, n, slots)
    q = torch.randn(n, 4, 96)
    gen = torch.Generator().manual_seed(3)
    chosen = torch.stack(
        [torch.randperm(length - n + i + 1, generator=gen)[:100] for i in range(n)]
    )
    forms = {}
    for name in ("expanded", "latent"):
        monkeypatch.setenv("PIPESERVE_SPARSE_ATTENTION_FORM", name)
        assert lay.sparse_expands(n, length, NATIVE, torch.float32) == (name == "expanded")
        read = torch.zeros(1, dtype=torch.long)
        forms[name] = lay.sparse(q, seg, cache, chosen, NATIVE, read)
        assert read.item() == n * 100
    torch.testing.assert_close(forms["expanded"], forms["latent"], atol=1e-5, rtol=1e-5)
