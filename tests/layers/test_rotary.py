"""Rotary embedding against transformers: YaRN frequencies and cos/sin, the rotated q/k of each
DeepSeek part in its layout (V3 MLA both ways, V3.2 MLA interleaved, V3.2 indexer half-split with
the rotary part first), the MLA softmax scale, and the Llama/Qwen schedules, in float32, at
positions up to DeepSeek-V3's 160K context (40x its original 4096)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV32Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from pipeserve.layers.rotary import (
    RopeScaling,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_part,
    inverse_frequencies,
    mla_softmax_scale,
    rope_attention_factor,
)
from pipeserve.models.arch import RopeConfig

ATOL = 1e-6
THETA = 10000.0
NOPE_DIM, ROPE_DIM = 32, 64  # qk_nope_head_dim, qk_rope_head_dim
MAX_POSITIONS = 163840
POSITIONS = torch.tensor([0, 1, 17, 4095, 4096, 4097, 10_000, 65_537, MAX_POSITIONS - 1])

YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1}
YARN_CASES: dict[str, dict[str, Any]] = {
    "deepseek-v3": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # V3's and V3.2's own
    "mscale-0.707": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},  # V2-Lite's
    "cos-sin-factor": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},  # factor != 1 on cos/sin
    "no-mscale-all-dim": {**YARN, "mscale": 0.707},  # cos/sin factor from `factor` alone
    "bare": dict(YARN),
    "no-truncate": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": False},
    "attention-factor": {**YARN, "attention_factor": 0.75, "mscale_all_dim": 1.0},
    "narrow-betas": {**YARN, "factor": 4, "beta_fast": 8, "beta_slow": 2, "mscale_all_dim": 0.5},
    "factor-from-context": {**YARN, "factor": None},  # 163840 / 4096
    # the ramp's edge cases: clamped below 0, clamped above dim - 1, zero width
    "short-original": {**YARN, "factor": 4, "original_max_position_embeddings": 64},
    "tiny-beta-slow": {**YARN, "beta_slow": 1e-6},
    "zero-width-ramp": {**YARN, "beta_fast": 4, "beta_slow": 4, "truncate": False},
}


def deepseek_config(cls: type, rope: dict[str, Any] | None) -> Any:
    """A tiny DeepSeek config whose rope dict is a copy of `rope` (transformers edits it)."""
    params = {**(rope or {"rope_type": "default"}), "rope_theta": THETA}
    return cls(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=NOPE_DIM, qk_rope_head_dim=ROPE_DIM,
        v_head_dim=32, max_position_embeddings=MAX_POSITIONS, rope_parameters=params,
    )


def scaling_of(rope: dict[str, Any] | None) -> RopeScaling | None:
    """`rope` read as config.json's rope_parameters, for a context of MAX_POSITIONS."""
    return RopeConfig.from_config({"rope_parameters": rope}, MAX_POSITIONS).scaling


def ours(rope: dict[str, Any] | None) -> RotaryEmbedding:
    return RotaryEmbedding(ROPE_DIM, THETA, scaling_of(rope))


def hf_cos_sin(rotary: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' tables for POSITIONS as [tokens, 1, dim], the layout of ours."""
    cos, sin = rotary(torch.empty(0), POSITIONS[None])  # [1, tokens, dim]
    return cos[0, :, None], sin[0, :, None]


def hf_rotate(fn: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """A transformers rope function on [tokens, heads, dim] tensors (batch of one)."""
    q, k = fn(q[None], k[None], cos[:, 0][None], sin[:, 0][None], unsqueeze_dim=2)
    return q[0], k[0]


def random_qk(q_dim: int, k_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = len(POSITIONS)
    return torch.randn(n, 3, q_dim, generator=g), torch.randn(n, 1, k_dim, generator=g)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_cos_sin_match_transformers(case: str) -> None:
    rope = YARN_CASES[case]
    hf = hf_v3.DeepseekV3RotaryEmbedding(deepseek_config(DeepseekV3Config, rope))
    mine = ours(rope)
    torch.testing.assert_close(mine.inv_freq, hf.inv_freq, rtol=0, atol=0)
    assert mine.attention_factor == hf.attention_scaling
    assert not torch.allclose(mine.inv_freq, inverse_frequencies(ROPE_DIM, THETA, None))
    cos, sin = mine.cos_sin(POSITIONS, torch.float32)
    want_cos, want_sin = hf_cos_sin(hf)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=ATOL)


def test_yarn_cases_cover_both_cos_sin_factors() -> None:
    factors = {rope_attention_factor(scaling_of(r)) for r in YARN_CASES.values()}
    assert 1.0 in factors and len(factors) > 2, factors


@pytest.mark.parametrize("case", ["deepseek-v3", "cos-sin-factor", "bare"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_v3_mla_rotation_matches_transformers(case: str, interleaved: bool) -> None:
    """V3 MLA: the rotary part is the tail of each q head and the whole shared k head."""
    rope = YARN_CASES[case]
    hf = hf_v3.DeepseekV3RotaryEmbedding(deepseek_config(DeepseekV3Config, rope))
    q, k = random_qk(NOPE_DIM + ROPE_DIM, ROPE_DIM)
    cos, sin = ours(rope).cos_sin(POSITIONS, torch.float32)
    got_q = apply_rotary_part(q, cos, sin, start=NOPE_DIM, interleaved=interleaved)
    got_k = apply_rotary(k, cos, sin, interleaved=interleaved)

    fn = hf_v3.apply_rotary_pos_emb_interleave if interleaved else hf_v3.apply_rotary_pos_emb
    q_nope, q_rope = q.split((NOPE_DIM, ROPE_DIM), dim=-1)
    want_q_rope, want_k = hf_rotate(fn, q_rope, k, *hf_cos_sin(hf))
    torch.testing.assert_close(got_q, torch.cat((q_nope, want_q_rope), -1), rtol=0, atol=ATOL)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=ATOL)


def test_v32_mla_rotation_matches_transformers() -> None:
    """V3.2 MLA: as V3's, always interleaved."""
    rope = YARN_CASES["deepseek-v3"]
    hf = hf_v32.DeepseekV32RotaryEmbedding(deepseek_config(DeepseekV32Config, rope))
    q, k = random_qk(NOPE_DIM + ROPE_DIM, ROPE_DIM, seed=1)
    cos, sin = ours(rope).cos_sin(POSITIONS, torch.float32)
    got_q = apply_rotary_part(q, cos, sin, start=NOPE_DIM, interleaved=True)
    q_nope, q_rope = q.split((NOPE_DIM, ROPE_DIM), dim=-1)
    fn = hf_v32.apply_rotary_pos_emb_interleave
    want_q_rope, want_k = hf_rotate(fn, q_rope, k, *hf_cos_sin(hf))
    torch.testing.assert_close(got_q, torch.cat((q_nope, want_q_rope), -1), rtol=0, atol=ATOL)
    torch.testing.assert_close(apply_rotary(k, cos, sin, True), want_k, rtol=0, atol=ATOL)


def test_v32_indexer_rotation_matches_transformers() -> None:
    """V3.2 indexer: half-split, the rotary part the head of each q and k head."""
    rope, index_head_dim = YARN_CASES["deepseek-v3"], 128
    hf = hf_v32.DeepseekV32RotaryEmbedding(deepseek_config(DeepseekV32Config, rope))
    q, k = random_qk(index_head_dim, index_head_dim, seed=2)
    cos, sin = ours(rope).cos_sin(POSITIONS, torch.float32)
    got_q, got_k = (apply_rotary_part(x, cos, sin, start=0) for x in (q, k))
    (q_rope, q_pass), (k_rope, k_pass) = (x.split((ROPE_DIM, index_head_dim - ROPE_DIM), -1)
                                          for x in (q, k))
    want_q, want_k = hf_rotate(hf_v32.apply_rotary_pos_emb, q_rope, k_rope, *hf_cos_sin(hf))
    torch.testing.assert_close(got_q, torch.cat((want_q, q_pass), -1), rtol=0, atol=ATOL)
    torch.testing.assert_close(got_k, torch.cat((want_k, k_pass), -1), rtol=0, atol=ATOL)


SCALE_CASES: dict[str, dict[str, Any] | None] = {
    **YARN_CASES, "default": None, "linear-mscale-all-dim": {"rope_type": "linear", "factor": 4,
                                                            "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("case", list(SCALE_CASES))
@pytest.mark.parametrize("config_cls", [DeepseekV3Config, DeepseekV32Config],
                         ids=["v3", "v3.2"])
def test_mla_softmax_scale_matches_transformers(case: str, config_cls: type) -> None:
    rope = SCALE_CASES[case]
    attention = hf_v3.DeepseekV3Attention if config_cls is DeepseekV3Config \
        else hf_v32.DeepseekV32Attention
    want = attention(deepseek_config(config_cls, rope), layer_idx=0).scaling
    assert mla_softmax_scale(NOPE_DIM + ROPE_DIM, scaling_of(rope)) == want
    corrected = bool(rope and rope.get("mscale_all_dim"))
    assert (want != (NOPE_DIM + ROPE_DIM) ** -0.5) == corrected


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
EXISTING: dict[str, tuple[type, Any, float, dict[str, Any] | None]] = {
    "llama-default": (LlamaConfig, hf_llama, 500000.0, None),
    "llama3": (LlamaConfig, hf_llama, 500000.0, LLAMA3),
    "llama-linear": (LlamaConfig, hf_llama, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "qwen2": (Qwen2Config, hf_qwen2, 1e6, None),
    "qwen3": (Qwen3Config, hf_qwen3, 1e6, None),
    "qwen3-yarn": (Qwen3Config, hf_qwen3, 1e6, QWEN_YARN),
}


@pytest.mark.parametrize("case", list(EXISTING))
def test_llama_qwen_rope_match_transformers(case: str) -> None:
    """The path today's models take: a rope dict straight from config.json, full-head
    half-split rotation."""
    config_cls, module, theta, rope = EXISTING[case]
    head_dim = 128
    params = {**(rope or {"rope_type": "default"}), "rope_theta": theta}
    config = config_cls(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=head_dim, max_position_embeddings=131072,
                        rope_parameters=params)
    rotary_cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
    hf = rotary_cls(config)
    mine = RotaryEmbedding(head_dim, theta, scaling_of(rope))
    torch.testing.assert_close(mine.inv_freq, hf.inv_freq, rtol=0, atol=0)
    cos, sin = mine.cos_sin(POSITIONS, torch.float32)
    want_cos, want_sin = hf_cos_sin(hf)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=ATOL)
    q, k = random_qk(head_dim, head_dim, seed=3)
    want_q, want_k = hf_rotate(module.apply_rotary_pos_emb, q, k, want_cos, want_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), want_q, rtol=0, atol=ATOL)
    torch.testing.assert_close(apply_rotary(k, cos, sin), want_k, rtol=0, atol=ATOL)


def test_rope_scaling_checks_its_fields() -> None:
    """RopeConfig reads config.json; built directly, a RopeScaling still refuses what the
    frequencies above cannot be computed from."""
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        RopeScaling("yarn", 4)
    with pytest.raises(ValueError, match="'dynamic' is not one of linear, llama3, yarn"):
        RopeScaling("dynamic", 4)
