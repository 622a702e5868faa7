"""The native backend's rotary embedding and KV write in one call (kernels/rope_store.cpp):
bitwise what the torch ops give (apply_rotary on q and k, the indexed writes of k and v into
the pool), on the QKV projection's strided views, float32 and bfloat16; no other slot of the
pool touched; bad input refused; layers with q/k norms (Qwen3) normed first by the backend's
norms, bitwise the torch ops too; layers it does not take handed to the torch ops."""

from __future__ import annotations

import pytest
import torch

from pipeserve.backends.base import TORCH_NORMS
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.device import native_rope_store
from pipeserve.layers.rotary import RotaryEmbedding, apply_rotary

ROPE_STORE = native_rope_store()
needs_kernel = pytest.mark.skipif(ROPE_STORE is None, reason="the native kernels do not build")
HEADS, KV_HEADS, D, SLOTS = 6, 2, 64, 40


def layer_inputs(tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
    positions = torch.randint(0, 5000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(D, 10000.0, None).cos_sin(positions, dtype)
    pool = [torch.randn(KV_HEADS, SLOTS, D, generator=gen).to(dtype) for _ in range(2)]
    return {
        "q": q.view(tokens, HEADS, D),  # strided rows, as the layer's views
        "k": k.view(tokens, KV_HEADS, D),
        "v": v.view(tokens, KV_HEADS, D),
        "rope": (cos, sin),
        "pool": pool,
        "slots": torch.randperm(SLOTS, generator=gen)[:tokens],
    }


def torch_ops(a: dict, norms: tuple | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What the layer computes without the kernel (models/llama.py, layers/attention.py)."""
    q, k = a["q"], a["k"]
    if norms is not None:  # Qwen3's RMSNorms over each head, by the torch ops
        q, k = (
            TORCH_NORMS.rms_norm(q, norms[0], norms[2]),
            TORCH_NORMS.rms_norm(k, norms[1], norms[2]),
        )
    q, k = apply_rotary(q, *a["rope"]), apply_rotary(k, *a["rope"])
    pool = [t.clone() for t in a["pool"]]
    pool[0][:, a["slots"]] = k.transpose(0, 1)
    pool[1][:, a["slots"]] = a["v"].transpose(0, 1)
    return q, pool


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_one_call_is_bitwise_the_torch_ops(dtype: torch.dtype, tokens: int) -> None:
    a = layer_inputs(tokens, dtype, seed=tokens)
    want_q, want_pool = torch_ops(a)
    pool = [t.clone() for t in a["pool"]]
    got = NativeBackend().rope_and_store(
        (a["q"], a["k"], a["v"]), a["rope"], pool, a["slots"], None
    )
    assert got is not None and got.shape == (tokens, HEADS, D)
    assert torch.equal(got, want_q)
    for mine, theirs in zip(pool, want_pool, strict=True):
        assert torch.equal(mine, theirs)  # the batch's slots written, no other


@needs_kernel
def test_bad_input_is_refused() -> None:
    assert ROPE_STORE is not None
    a = layer_inputs(3, torch.float32)
    args = [a["q"], a["k"], a["v"], *a["rope"], *a["pool"]]
    with pytest.raises(RuntimeError, match="outside the pool"):
        ROPE_STORE(*args, torch.tensor([0, 1, SLOTS]))
    with pytest.raises(RuntimeError, match="one dtype"):
        ROPE_STORE(a["q"], a["k"], a["v"].double(), *a["rope"], *a["pool"], a["slots"])
    with pytest.raises(RuntimeError, match="whole head"):
        half = [t[..., : D // 2].contiguous() for t in a["rope"]]
        ROPE_STORE(a["q"], a["k"], a["v"], *half, *a["pool"], a["slots"])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])  # the compiled norms, torch's
def test_q_k_norms_then_the_call_are_bitwise_the_torch_ops(
    dtype: torch.dtype, deterministic: bool
) -> None:
    a = layer_inputs(5, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    norms = tuple((1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) for _ in range(2))
    norms = (*norms, 1e-6)
    want_q, want_pool = torch_ops(a, norms)
    pool = [t.clone() for t in a["pool"]]
    got = NativeBackend(deterministic).rope_and_store(
        (a["q"], a["k"], a["v"]), a["rope"], pool, a["slots"], norms
    )
    assert got is not None and torch.equal(got, want_q)
    for mine, theirs in zip(pool, want_pool, strict=True):
        assert torch.equal(mine, theirs)


@needs_kernel
def test_layers_it_does_not_take_run_the_torch_ops() -> None:
    a = layer_inputs(2, torch.float32)
    qkv, pool = (a["q"], a["k"], a["v"]), a["pool"]
    backend = NativeBackend()
    partial = tuple(t[..., : D // 2] for t in a["rope"])
    assert backend.rope_and_store(qkv, partial, pool, a["slots"], None) is None
    f64 = tuple(t.double() for t in qkv)
    assert backend.rope_and_store(f64, a["rope"], pool, a["slots"], None) is None
