"""The attention kernels off the CPU, exercised on a CPU: the chunked fallback against a float64
softmax reference (GQA, causal, bool and additive masks, Lq != Lk, ragged blocks, bfloat16) and
the float32 memory it holds; the rule that picks PyTorch's fused CUDA kernels and their calls,
through fakes with the CUDA kernels' semantics and through the real ops on the meta device;
PagedAttention on the torch backend for "cuda" against the CPU path (the backend choice:
test_registry.py). The `cuda` tests compare the real kernels on a GPU at 32K keys (make
test-gpu)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeserve.backends import registry, torch_backend, torch_ops
from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.registry import select_backend
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.backends.torch_ops import (
    SdpaAttention,
    SdpaOps,
    attention_with_lse,
    chunked_attention_with_lse,
    efficient_bias,
    fused_kernels,
)
from pipeserve.layers.attention import PagedAttention, plan_attention
from pipeserve.mem_cache.kv_pool import KVPool

CPU = torch.device("cpu")


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: Any = CPU):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def math_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: whole [B, H, Lq, Lk] scores in `dtype`; GQA by repeating key heads; causal
    top-left. -> (out, lse) in `dtype`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).to(dtype), v.repeat_interleave(group, 1).to(dtype)
    scores = q.to(dtype) @ k.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        bool_mask = mask.dtype == torch.bool
        scores = scores.masked_fill(~mask, float("-inf")) if bool_mask else scores + mask.to(dtype)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def make_mask(kind: str, b: int, lq: int, lk: int, dtype: torch.dtype) -> torch.Tensor | None:
    """None, or a random [b, 1, lq, lk] mask (broadcast over heads) keeping key 0 readable."""
    if kind == "none":
        return None
    keep = torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(5)) > 0.3
    keep[..., 0] = True
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


# -- the chunked fallback -------------------------------------------------------------------

SHAPES = {  # (batch, heads, kv heads, Lq, Lk)
    "gqa-short-queries": (2, 4, 2, 7, 50),
    "more-queries-than-keys": (1, 3, 3, 50, 7),
    "gqa4-square": (2, 8, 2, 33, 33),
    "decode-row": (3, 2, 1, 1, 70),
}
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 1e-4)}  # (out, lse) atol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("blocks", [(5, 6), (64, 1), (None, None)], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunked_matches_math(
    shape: str, causal: bool, mask_kind: str, blocks: tuple, dtype: torch.dtype
) -> None:
    b, h, hk, lq, lk = SHAPES[shape]
    q, k = rand(b, h, lq, 16, seed=1, dtype=dtype), rand(b, hk, lk, 16, seed=2, dtype=dtype)
    v = rand(b, hk, lk, 24, seed=3, dtype=dtype)  # a value width of its own
    mask = make_mask(mask_kind, b, lq, lk, dtype)
    out, lse = chunked_attention_with_lse(q, k, v, causal, 0.3, mask, *blocks)
    assert out.dtype == dtype and out.shape == (b, h, lq, 24)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, lq)
    want, want_lse = math_attention_with_lse(q, k, v, causal, 0.3, mask)
    atol, lse_atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=lse_atol, rtol=0)


def test_chunked_query_without_readable_keys_gets_zeros_and_minus_inf() -> None:
    q, k, v = rand(1, 2, 3, 8, seed=1), rand(1, 2, 9, 8, seed=2), rand(1, 2, 9, 8, seed=3)
    keep = torch.ones(1, 1, 3, 9, dtype=torch.bool)
    keep[0, 0, 1] = False  # query 1 reads nothing
    out, lse = chunked_attention_with_lse(q, k, v, False, 0.5, keep, block_k=4)
    assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == float("-inf")).all()
    want, want_lse = math_attention_with_lse(q, k, v, False, 0.5, keep)
    torch.testing.assert_close(out[:, :, [0, 2]].double(), want[:, :, [0, 2]], atol=1e-6, rtol=0)
    out, lse = chunked_attention_with_lse(q, k[:, :, :0], v[:, :, :0], False, 0.5)  # no keys
    assert (out == 0).all() and (lse == float("-inf")).all()


class Float32Sizes(TorchDispatchMode):
    """Records the shape of every float32 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.shapes.append(tuple(t.shape))
        return out

    def largest(self) -> int:
        return max(torch.Size(s).numel() for s in self.shapes)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_never_holds_queries_by_keys_in_float32(causal: bool) -> None:
    """No float32 tensor of the chunked kernel is larger than O((Lq + Lk) * D) per head; the
    scores of one block are [.., 32, 32]. The same probe on the math version sees its
    [B, H, Lq, Lk] scores (so a fallback replaced by it fails here)."""
    b, h, lq, lk, d = 1, 4, 512, 640, 16
    q, k, v = (rand(b, h, n, d, seed=i, dtype=torch.bfloat16) for i, n in enumerate((lq, lk, lk)))
    with Float32Sizes() as probe:
        chunked_attention_with_lse(q, k, v, causal, 0.25, block_q=32, block_k=32)
    assert probe.largest() <= b * h * max(lq, lk) * d
    assert (b, h, 32, 32) in probe.shapes  # one block of scores
    with Float32Sizes() as probe:
        math_attention_with_lse(q, k, v, causal, 0.25, dtype=torch.float32)
    assert probe.largest() >= b * h * lq * lk


def test_device_attention_off_the_cpu_is_not_the_math_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """attention_with_lse on a non-CPU tensor goes to the accelerator
    kernels (here on the meta device: the real fused ops' schemas, shapes only)."""
    calls: list[str] = []
    sdpa = SdpaAttention()
    real = sdpa._fused
    monkeypatch.setattr(sdpa, "_fused", lambda kind, *a: calls.append(kind) or real(kind, *a))
    monkeypatch.setattr(torch_ops, "SDPA", sdpa)
    q = torch.empty(2, 3, 37, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 3, 50, 64, device="meta", dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, k, False, 0.125)
    assert (out.shape, lse.shape, lse.dtype) == ((2, 3, 37, 64), (2, 3, 37), torch.float32)
    mask = torch.zeros(2, 1, 1, 50, device="meta", dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, k, False, 0.125, mask)  # lse padded to 64 by the op
    assert (out.shape, lse.shape) == ((2, 3, 37, 64), (2, 3, 37))
    assert calls == ["flash", "efficient"] and not sdpa.refused


# -- PyTorch's fused CUDA kernels: the rule and the calls ------------------------------------


def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def test_fused_kernel_rule() -> None:
    q, k = t(1, 2, 8, 64), t(1, 2, 40, 64)
    mask = t(1, 1, 8, 40)
    assert fused_kernels(q, k, k, False, None) == ["flash", "efficient"]
    assert fused_kernels(q, k, k, False, mask) == ["efficient"]  # flash takes no mask
    assert fused_kernels(q, k, k, True, None) == ["efficient"]  # flash: causal bottom-right
    assert fused_kernels(q, q, q, True, None) == ["flash", "efficient"]  # Lq == Lk: the same
    assert fused_kernels(q, k, k, True, mask) == []
    assert fused_kernels(q.float(), k.float(), k.float(), False, None) == ["efficient"]
    wide_q, wide_k = t(1, 1, 8, 576), t(1, 1, 40, 576)  # MLA's latent width: over flash's 256
    assert fused_kernels(wide_q, wide_k, wide_k, False, None) == ["efficient"]
    assert fused_kernels(q, t(1, 1, 40, 64), t(1, 1, 40, 64), False, None) == []  # GQA
    assert fused_kernels(t(1, 2, 8, 12), t(1, 2, 40, 12), t(1, 2, 40, 12), False, None) == []
    assert fused_kernels(q, k[:, :, :0], k[:, :, :0], False, None) == []  # no keys
    assert fused_kernels(q.double(), k.double(), k.double(), False, None) == []
    odd_view = t(1, 2, 40, 68)[..., :64]  # rows 68 apart: not 8-aligned strides
    assert fused_kernels(q, odd_view, odd_view, False, None) == []


def test_efficient_bias_is_additive_aligned_and_broadcast() -> None:
    q, k = t(3, 4, 1, 64), t(3, 4, 5, 64)
    keep = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    bias = efficient_bias(keep[:, None, None, :], q, k)
    assert bias.shape == (3, 4, 1, 5) and bias.dtype == torch.bfloat16
    assert bias.stride(-1) == 1 and bias.stride(1) == 0 and bias.stride(0) % 16 == 0
    assert bias.data_ptr() % 16 == 0
    assert torch.equal(bias[:, 0, 0] == 0, keep) and (bias[:, 0, 0][~keep] == float("-inf")).all()
    aligned = t(3, 1, 1, 32)
    k32 = t(3, 4, 32, 64)
    assert efficient_bias(aligned, q, k32).data_ptr() == aligned.data_ptr()  # no copy needed


class FakeCudaOps:
    """The fused CUDA kernels' semantics in plain torch, checking what the real ones demand:
    flash aligns its causal mask bottom-right; efficient wants an additive bias in q's dtype,
    [B, H, Lq, Lk] with 16-aligned rows, and pads its lse to a multiple of 32 (here with
    garbage)."""

    def __init__(self, refuse: str = "") -> None:
        self.calls: list[str] = []
        self.refuse = refuse

    def ops(self) -> SdpaOps:
        return SdpaOps(flash=self.flash, efficient=self.efficient)

    def flash(self, q, k, v, *, dropout_p, is_causal, return_debug_mask, scale):
        self.calls.append("flash")
        if self.refuse == "flash":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
        assert dropout_p == 0.0 and not return_debug_mask
        lq, lk = q.shape[2], k.shape[2]
        keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if is_causal else None
        out, lse = math_attention_with_lse(q, k, v, False, scale, keep, torch.float32)
        return out.to(q.dtype), lse, None, None, lq, lk, None, None, None

    def efficient(self, q, k, v, *, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale):
        self.calls.append("efficient")
        assert compute_log_sumexp and dropout_p == 0.0
        if attn_bias is not None:
            assert attn_bias.dtype == q.dtype and attn_bias.shape == (*q.shape[:3], k.shape[2])
            assert attn_bias.stride(-1) == 1 and all(s % 16 == 0 for s in attn_bias.stride()[:-1])
        out, lse = math_attention_with_lse(q, k, v, is_causal, scale, attn_bias, torch.float32)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), 7.0)
        padded[..., : lse.shape[2]] = lse
        return out.to(q.dtype), padded, None, None


CASES = {  # (q, k, v shapes, causal, mask kind) -> the kernel that should run
    "prefix-part": ((1, 2, 24, 64), (1, 2, 300, 64), False, "none", "flash"),
    "chunk-self-causal": ((1, 4, 24, 64), (1, 4, 24, 64), True, "none", "flash"),
    "causal-more-keys": ((1, 2, 5, 64), (1, 2, 40, 64), True, "none", "efficient"),
    "decode-mask": ((3, 2, 4, 64), (3, 2, 21, 64), False, "additive", "efficient"),
    "bool-mask": ((2, 2, 9, 64), (2, 2, 33, 64), False, "bool", "efficient"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_calls_with_cuda_semantics_match_math(case: str) -> None:
    q_shape, k_shape, causal, mask_kind, kernel = CASES[case]
    q, k = (
        rand(*q_shape, seed=1, dtype=torch.bfloat16),
        rand(*k_shape, seed=2, dtype=torch.bfloat16),
    )
    v = rand(*k_shape, seed=3, dtype=torch.bfloat16)
    mask = make_mask(mask_kind, q.shape[0], q.shape[2], k.shape[2], torch.bfloat16)
    fake = FakeCudaOps()
    out, lse = SdpaAttention(fake.ops())(q, k, v, causal, 0.125, mask)
    assert fake.calls == [kernel]
    assert lse.shape == q.shape[:3]
    want, want_lse = math_attention_with_lse(q, k, v, causal, 0.125, mask)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0)


def test_a_refused_kernel_is_not_asked_again(caplog: pytest.LogCaptureFixture) -> None:
    q, k = rand(1, 2, 8, 64, seed=1, dtype=torch.bfloat16), rand(1, 2, 30, 64, seed=2)
    k = k.bfloat16()
    fake = FakeCudaOps(refuse="flash")
    sdpa = SdpaAttention(fake.ops())
    with caplog.at_level("WARNING"):
        first, _ = sdpa(q, k, k, False, 0.125)
        second, _ = sdpa(q, k, k, False, 0.125)
    assert fake.calls == ["flash", "efficient", "efficient"]
    assert "refused" in caplog.text
    assert torch.equal(first, second)


# -- PagedAttention on the forced accelerator kernels ---------------------------------------

KV_HEADS, D = 2, 64
BF16 = torch.bfloat16  # inputs are bfloat16 values whatever the dtype (runs compare alike)
REQUESTS = [  # (runs of slots, prefix length, new tokens)
    ([(16, 9)], 8, 1),  # a short decode step
    ([(40, 300), (700, 3), (900, 1)], 303, 1),  # decode: a long run read in place + gathered
    ([(1100, 20), (1200, 7)], 0, 27),  # a chunk without prefix
    ([(1300, 280), (1600, 12)], 280, 12),  # a chunk over a view of its prefix
    ([(2000, 270), (2300, 5), (2400, 100)], 275, 100),  # long: blockwise on a CPU
]


def paged_batch(
    group: int, dtype: torch.dtype, device: Any = CPU
) -> tuple[KVPool, list[tuple[int, int, int, list]], list[torch.Tensor]]:
    """A pool holding every request's prefix, the plan's segments, and q/k/v of the new
    tokens (all requests' rows)."""
    pool = KVPool(3000, range(0, 1), KV_HEADS, D, dtype, torch.device(device), page_size=1)
    k_cache, v_cache = pool.buffers(0)
    segments, qs, ks, vs, row = [], [], [], [], 0
    for i, (runs, prefix, n) in enumerate(REQUESTS):
        slots = [s for start, m in runs for s in range(start, start + m)]
        k = rand(prefix + n, KV_HEADS, D, seed=10 * i, dtype=BF16, device=device).to(dtype)
        v = rand(prefix + n, KV_HEADS, D, seed=10 * i + 1, dtype=BF16, device=device).to(dtype)
        k_cache[:, slots[:prefix]] = k[:prefix].transpose(0, 1)
        v_cache[:, slots[:prefix]] = v[:prefix].transpose(0, 1)
        q = rand(n, KV_HEADS * group, D, seed=10 * i + 2, dtype=BF16, device=device)
        qs.append(q.to(dtype))
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        segments.append((row, n, prefix, runs))
        row += n
    return pool, segments, [torch.cat(x) for x in (qs, ks, vs)]


def run_paged(
    group: int, dtype: torch.dtype, backend: AttentionBackend | None, device: Any = CPU
) -> torch.Tensor:
    pool, segments, (q, k, v) = paged_batch(group, dtype, device)
    plan = plan_attention(segments, torch.device(device), dtype, backend)
    new = [s for runs, prefix, _ in REQUESTS for s in _slots(runs)[prefix:]]
    slots = torch.tensor(new, device=device)
    return PagedAttention(0, KV_HEADS * group, KV_HEADS, D)(q, k, v, pool, slots, plan)


def _slots(runs: list[tuple[int, int]]) -> list[int]:
    return [s for start, n in runs for s in range(start, start + n)]


@contextmanager
def no_blockwise(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any) -> torch.Tensor:
        raise AssertionError("blockwise_prefill is the CPU's prompt kernel")

    with monkeypatch.context() as mp:
        mp.setattr(torch_backend, "blockwise_prefill", refuse)
        yield


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ops", ["chunked", "fused-fakes"])
def test_paged_attention_on_accelerator_kernels_matches_cpu_path(
    monkeypatch: pytest.MonkeyPatch, ops: str, dtype: torch.dtype, group: int
) -> None:
    """Decode steps and prompt chunks with prefixes (views and gathered slots) through the
    kernels a CUDA runner gets (the chunked fallback; the fused kernels' fakes) equal the CPU
    path's output; no blockwise CPU kernel on the way."""
    fake = FakeCudaOps()
    dense = SdpaAttention(ops=None if ops == "chunked" else fake.ops())
    with no_blockwise(monkeypatch):
        got = run_paged(group, dtype, TorchBackend("cuda", dense=dense))
    want = run_paged(group, dtype, None)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    if ops == "fused-fakes":
        assert set(fake.calls) == (
            {"efficient"} if dtype == torch.float32 else {"flash", "efficient"}
        )


# -- on a GPU --------------------------------------------------------------------------------

LONG = 32768


def gpu_case(seed: int, lq: int, lk: int, h: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        rand(1, h, n, d, seed=seed + i, dtype=dtype, device="cuda")
        for i, n in enumerate((lq, lk, lk))
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_kernels_match_math_at_32k_keys(dtype: torch.dtype) -> None:
    """The fused SDPA kernels (taking the inputs: nothing refused), the chunked fallback and
    FlashInfer (where it imports) against float32 math at 32K keys: a prefix part, a causal
    chunk over itself, a padded decode mask, MLA's shared 576-wide key head."""
    sdpa = SdpaAttention()
    atol = 5e-5 if dtype == torch.float32 else 2e-2
    q, k, v = gpu_case(1, 256, LONG, 8, 128, dtype)
    lengths = torch.tensor([LONG - 3, LONG - 1000, 17], device="cuda")
    keep = torch.arange(LONG - 5, device="cuda")[None, :] < lengths[:, None]  # [3, L - 5]
    decode_mask = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill_(
        ~keep, -torch.inf
    )
    qd, kd = gpu_case(4, 4, LONG - 5, 2, 128, dtype)[:2]
    qd, kd = qd.expand(3, -1, -1, -1).contiguous(), kd.expand(3, -1, -1, -1).contiguous()
    wide = gpu_case(7, 64 * 16, LONG, 1, 576, dtype)  # 64 queries x 16 heads folded in rows
    cases = [
        ("prefix", (q, k, v, False, None)),
        ("self-causal", (q, q, v[:, :, :256], True, None)),
        ("decode-mask", (qd, kd, kd, False, decode_mask[:, None, None, :])),
        ("mla-latent", (*wide, False, None)),
    ]
    for name, (qq, kk, vv, causal, mask) in cases:
        want, want_lse = math_attention_with_lse(qq, kk, vv, causal, 0.08, mask, torch.float32)
        for label, fn in (("sdpa", sdpa), ("chunked", chunked_attention_with_lse)):
            out, lse = fn(qq, kk, vv, causal, 0.08, mask)
            err = (out.float() - want).abs().max().item()
            assert err < atol, f"{name} {label}: max error {err}"
            assert (lse - want_lse).abs().max().item() < 1e-3, f"{name} {label} lse"
        del want
    assert sdpa.refused == set(), "a fused kernel refused inputs the rule let through"


@pytest.mark.cuda
def test_gpu_chunked_fallback_memory_is_bounded() -> None:
    """At 2K queries x 32K keys x 32 heads the math scores would be 8 GiB of float32; the
    chunked fallback stays within a few blocks."""
    q, k, v = gpu_case(1, 2048, LONG, 32, 128, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    chunked_attention_with_lse(q, k, v, False, 0.08)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1 << 30, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.cuda
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_paged_attention_backends_agree(group: int) -> None:
    """PagedAttention on a GPU: the torch kernels and FlashInfer (where it imports) against
    the float32 math path (the chunked fallback in float32)."""
    dtype = torch.bfloat16
    chunked = TorchBackend("cuda", dense=SdpaAttention(ops=None))
    torch32 = run_paged(group, torch.float32, chunked, "cuda")
    for backend in (TorchBackend("cuda"), _gpu_flashinfer()):
        if backend is None:
            continue
        got = run_paged(group, dtype, backend, "cuda")
        err = (got.float() - torch32).abs().max().item()
        assert err < 3e-2, f"{backend.name}: max error {err}"


def _gpu_flashinfer() -> AttentionBackend | None:
    if registry.import_flashinfer() is None:
        return None
    return select_backend("flashinfer", torch.device("cuda"), torch.bfloat16, D)
