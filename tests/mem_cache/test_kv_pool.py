"""KVPool: the per-head K/V layout and the MLA latent layout (with and without indexer keys),
one slot numbering, page 0 zeroed, bytes per token by hand."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pipeserve.mem_cache.kv_pool import KVPool

CPU = torch.device("cpu")
BF16 = torch.bfloat16
# DeepSeek-V3: 61 layers, kv_lora_rank 512 + qk_rope_head_dim 64; V3.2 adds a 128-wide indexer key.
V3_LAYERS, V3_WIDTH, V32_INDEX = 61, 512 + 64, 128


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.empty returns NaNs, so a zero page 0 is the pool's doing, not fresh memory's."""
    full = torch.full

    def empty(*shape: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return full(size, math.nan, dtype=dtype, device=device)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "empty", empty)
    yield


def test_kv_layout_shapes_and_accessors() -> None:
    pool = KVPool(64, range(4, 7), 2, 16, torch.float32, CPU, page_size=4)
    assert len(pool.k) == len(pool.v) == 3
    assert pool.latents == [] and pool.index_key_bufs == []
    k, v = pool.buffers(5)
    assert k is pool.k[1] and v is pool.v[1]
    assert k.shape == v.shape == (2, 64, 16)  # [kv_heads, slots, head_dim]


def test_kv_bytes_per_token_gqa_by_hand() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: K and V, 2 bytes each.
    assert KVPool.bytes_per_token(32, 8, 128, BF16) == 2 * 32 * 8 * 128 * 2 == 131072
    assert KVPool.bytes_per_token(2, 4, 64, torch.float32) == 2 * 2 * 4 * 64 * 4


def test_latent_layout_shapes_deepseek_v3() -> None:
    pool = KVPool.latent_layout(32, range(30, V3_LAYERS), V3_WIDTH, BF16, CPU, page_size=4)
    assert pool.k == [] and pool.v == [] and pool.index_key_bufs == []
    assert len(pool.latents) == V3_LAYERS - 30
    assert pool.latent(30) is pool.latents[0] and pool.latent(60) is pool.latents[-1]
    assert pool.latent(42).shape == (32, V3_WIDTH) and pool.latent(42).dtype == BF16


def test_latent_layout_with_indexer_keys_deepseek_v32() -> None:
    pool = KVPool.latent_layout(
        32, range(V3_LAYERS), V3_WIDTH, BF16, CPU, page_size=4, extra_width=V32_INDEX
    )
    assert len(pool.index_key_bufs) == V3_LAYERS
    assert pool.latent(7).shape == (32, V3_WIDTH)
    assert pool.index_keys(7).shape == (32, V32_INDEX)
    assert pool.index_keys(7).data_ptr() != pool.latent(7).data_ptr()


def test_latent_bytes_per_token_deepseek() -> None:
    v3 = KVPool.latent_bytes_per_token(V3_LAYERS, V3_WIDTH, BF16)
    v32 = KVPool.latent_bytes_per_token(V3_LAYERS, V3_WIDTH, BF16, extra_width=V32_INDEX)
    assert v3 == 61 * 576 * 2 == 70272
    assert v32 == 61 * (576 + 128) * 2 == 85888


def test_latent_bytes_per_token_matches_the_buffers() -> None:
    pool = KVPool.latent_layout(10, range(3), 24, BF16, CPU, 2, extra_width=8)
    allocated = sum(b.numel() * b.element_size() for b in pool.latents + pool.index_key_bufs)
    assert allocated == 10 * KVPool.latent_bytes_per_token(3, 24, BF16, extra_width=8)


def test_mla_bytes_per_token_against_gqa() -> None:
    mla = KVPool.latent_bytes_per_token(V3_LAYERS, V3_WIDTH, BF16)
    mha = KVPool.bytes_per_token(V3_LAYERS, 128, 128, BF16)  # V3's 128 heads as plain K/V
    gqa = KVPool.bytes_per_token(V3_LAYERS, 8, 128, BF16)  # 8 KV heads of 128
    report = (
        f"per token over {V3_LAYERS} layers, bf16: MLA {mla} B; MHA 128x128 {mha} B "
        f"({mha / mla:.1f}x MLA); GQA 8x128 {gqa} B ({gqa / mla:.2f}x MLA)"
    )
    print(report)
    assert mha == 2 * 61 * 128 * 128 * 2 and gqa == 2 * 61 * 8 * 128 * 2, report
    assert mla * 56 < mha and mla * 3 < gqa < mla * 4, report


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("extra_width", [0, V32_INDEX])
def test_page_zero_zeroed_latent_layout(extra_width: int) -> None:
    pool = KVPool.latent_layout(16, range(2), 8, BF16, CPU, page_size=4, extra_width=extra_width)
    for buf in pool.latents + pool.index_key_bufs:
        assert torch.equal(buf[:4], torch.zeros_like(buf[:4]))
        assert buf[4:].isnan().all()  # the rest is left to the writers


@pytest.mark.usefixtures("nan_empty")
def test_page_zero_zeroed_kv_layout() -> None:
    pool = KVPool(16, range(2), 2, 8, torch.float32, CPU, page_size=4)
    for buf in pool.k + pool.v:
        assert torch.equal(buf[:, :4], torch.zeros_like(buf[:, :4]))
        assert buf[:, 4:].isnan().all()


def test_zero_slots_clears_one_run_in_either_layout() -> None:
    kv = KVPool(16, range(1), 2, 8, torch.float32, CPU, page_size=1)
    latent = KVPool.latent_layout(16, range(1), 8, torch.float32, CPU, 1, extra_width=4)
    for buf in kv.k + kv.v + latent.latents + latent.index_key_bufs:
        buf.fill_(1.0)
    kv.zero_slots(5, 3)
    latent.zero_slots(5, 3)
    for buf in kv.k + kv.v:
        assert buf[:, 5:8].eq(0).all() and buf[:, :5].eq(1).all() and buf[:, 8:].eq(1).all()
    for buf in latent.latents + latent.index_key_bufs:
        assert buf[5:8].eq(0).all() and buf[:5].eq(1).all() and buf[8:].eq(1).all()


def test_the_other_layouts_accessor_says_what_to_build() -> None:
    kv = KVPool(8, range(1), 1, 4, torch.float32, CPU, 1)
    latent = KVPool.latent_layout(8, range(1), 4, torch.float32, CPU, 1)
    with pytest.raises(ValueError, match="no latent cache"):
        kv.latent(0)
    with pytest.raises(ValueError, match="no per-head K/V"):
        latent.buffers(0)
    with pytest.raises(ValueError, match="no indexer keys.*extra_width"):
        latent.index_keys(0)
