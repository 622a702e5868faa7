"""The FlashInfer adapter on a CPU, through a fake `flashinfer` module put in sys.modules: its
`single_prefill_with_kv_cache` has the real signature (flashinfer-python 0.7) and semantics
(GQA in the kernel, NHD/HND layouts read through their strides, causal aligned bottom-right,
log-sum-exp in base 2) and checks what the real kernel demands (half precision, layouts,
unit-stride rows). PagedAttention through it equals the torch path; `auto` picks it on CUDA."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from pipeserve.backends import registry
from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.flashinfer_backend import FlashInferBackend
from pipeserve.backends.registry import select_backend
from pipeserve.layers.attention import PagedAttention, plan_attention
from pipeserve.mem_cache.kv_pool import KVPool

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
KV_HEADS, D = 2, 64


class FakeFlashInfer(types.ModuleType):
    """flashinfer, as far as the adapter uses it; every call is logged as (layout, causal,
    query rows, key rows)."""

    def __init__(self) -> None:
        super().__init__("flashinfer")
        self.calls: list[tuple[str, bool, int, int]] = []

    def single_prefill_with_kv_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale_q: torch.Tensor | None = None,
        scale_k: torch.Tensor | None = None,
        scale_v: torch.Tensor | None = None,
        o_dtype: torch.dtype | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        kv_layout: str = "NHD",
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        backend: str = "auto",
        return_lse: bool = False,
    ) -> Any:
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert q.dim() == k.dim() == v.dim() == 3
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "rows must be unit-stride"
        assert kv_layout in ("NHD", "HND") and pos_encoding_mode == "NONE"
        if kv_layout == "NHD":
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # -> [kv_heads, L, d]
        n, heads, d = q.shape
        kv_heads, length = k.shape[:2]
        assert heads % kv_heads == 0 and k.shape[2] == d
        self.calls.append((kv_layout, causal, n, length))
        scale = d**-0.5 if sm_scale is None else sm_scale
        group = heads // kv_heads
        kr, vr = k.repeat_interleave(group, 0).double(), v.repeat_interleave(group, 0).double()
        scores = q.transpose(0, 1).double() @ kr.transpose(1, 2) * scale  # [heads, n, L]
        if causal:  # bottom-right: query i sits at position L - n + i
            keep = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
            scores = scores.masked_fill(~keep, float("-inf"))
        lse = scores.logsumexp(-1)
        out = (torch.exp(scores - lse[..., None]) @ vr).transpose(0, 1).to(q.dtype)
        lse2 = (lse / math.log(2)).transpose(0, 1).float()  # [n, heads], base 2
        return (out, lse2) if return_lse else out


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    module = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def rand(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).bfloat16()


def test_auto_on_cuda_picks_an_importable_flashinfer(fake: FakeFlashInfer) -> None:
    """For the library kernels: a layout of several devices, or long prompt chunks."""
    backend = select_backend("auto", CUDA, torch.bfloat16, D, devices=2)
    assert isinstance(backend, FlashInferBackend) and backend.fi is fake
    assert registry.import_flashinfer() is fake


REQUESTS = [  # (runs of slots, prefix length, new tokens)
    ([(16, 9)], 8, 1),  # decode: gathered keys only
    ([(40, 300), (700, 3), (900, 1)], 303, 1),  # decode: a long run in place + gathered
    ([(1100, 20), (1200, 7)], 0, 27),  # a chunk without prefix
    ([(1300, 280), (1600, 12)], 280, 12),  # a chunk over a view of its prefix
    ([(2000, 270), (2300, 5), (2400, 100)], 275, 100),  # over a view and gathered slots
]


def run(group: int, backend: AttentionBackend | None) -> torch.Tensor:
    pool = KVPool(3000, range(0, 1), KV_HEADS, D, torch.bfloat16, CPU, page_size=1)
    k_cache, v_cache = pool.buffers(0)
    segments, qs, ks, vs, new, row = [], [], [], [], [], 0
    for i, (runs, prefix, n) in enumerate(REQUESTS):
        slots = [s for start, m in runs for s in range(start, start + m)]
        k, v = rand(prefix + n, KV_HEADS, D, seed=10 * i), rand(prefix + n, KV_HEADS, D, seed=i)
        k_cache[:, slots[:prefix]] = k[:prefix].transpose(0, 1)
        v_cache[:, slots[:prefix]] = v[:prefix].transpose(0, 1)
        qs.append(rand(n, KV_HEADS * group, D, seed=10 * i + 2))
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        new += slots[prefix:]
        segments.append((row, n, prefix, runs))
        row += n
    plan = plan_attention(segments, CPU, torch.bfloat16, backend)
    q, k, v = (torch.cat(x) for x in (qs, ks, vs))
    attn = PagedAttention(0, KV_HEADS * group, KV_HEADS, D)
    return attn(q, k, v, pool, torch.tensor(new), plan)


@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_through_flashinfer_matches_torch_path(
    fake: FakeFlashInfer, group: int
) -> None:
    got = run(group, select_backend("flashinfer", CUDA, torch.bfloat16, D))
    want = run(group, None)  # the CPU's torch backend
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    decode = [("HND", False, 1, 9), ("HND", False, 1, 300), ("HND", False, 1, 4)]
    chunks = [
        ("NHD", True, 27, 27),
        ("HND", False, 12, 280),
        ("NHD", True, 12, 12),
        ("HND", False, 100, 270),
        ("HND", False, 100, 5),
        ("NHD", True, 100, 100),
    ]
    assert fake.calls == decode + chunks  # cached parts in the pool's layout, in place


def test_lse_is_merged_in_the_engine_base(fake: FakeFlashInfer) -> None:
    """Two halves of the keys merged equal one call over all of them (a base-2 lse merged as
    a natural one would weigh the halves wrongly)."""
    kernels = FlashInferBackend(fake)
    q, k, v = rand(5, 4, D, seed=1), rand(KV_HEADS, 64, D, seed=2), rand(KV_HEADS, 64, D, seed=3)
    whole, whole_lse = kernels.attend_part(q, k, v, "HND", False, 0.125)
    halves = [
        kernels.attend_part(q, k[:, s : s + 32], v[:, s : s + 32], "HND", False, 0.125)
        for s in (0, 32)
    ]
    merged_lse = torch.logsumexp(torch.stack([lse for _, lse in halves]), 0)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=0)
    scores = q.transpose(0, 1).double() @ k.repeat_interleave(2, 0).double().transpose(1, 2)
    torch.testing.assert_close(
        whole_lse.double(), (scores * 0.125).logsumexp(-1).T, atol=1e-5, rtol=0
    )
