"""`param_count`, `active_param_count`, `linear_flops_per_token` and `attention_flops` against
transformers' models of the same configs: parameters against `num_parameters()` (built on the
meta device), FLOPs against `FlopCounterMode` over a real forward of T tokens.

FlopCounterMode counts matmuls only (mm/addmm/bmm; not norms, activations, softmax or RoPE,
whose k=1 outer product is no matmul). With eager attention, the linear layers are the mm and
addmm ops and attention the bmm ops, which cover the full T x T score matrix (the mask is
added afterwards): twice the x^2/2 triangle `attention_flops(a, 0, T)` counts. transformers'
expert loop multiplies only the (token, expert) pairs the router picked, top_k * T of them, so
the per-token MoE count must match whatever the routing was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeserve.bench.flops import attention_flops, linear_flops_per_token
from pipeserve.models.arch import ArchConfig, active_param_count, param_count

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(60)

T = 11
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}
DEEPSEEK: dict[str, Any] = {
    **TINY,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "moe_intermediate_size": 24,
    "first_k_dense_replace": 1,
}
INDEXER = {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 16}
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24}

CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**TINY, num_key_value_heads=2),
    "llama-tied": lambda: transformers.LlamaConfig(
        **TINY, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=24),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, num_key_value_heads=2, **QWEN3_MOE, mlp_only_layers=[1]
    ),
    "qwen3-moe-tied": lambda: transformers.Qwen3MoeConfig(
        **TINY, num_key_value_heads=2, **QWEN3_MOE, tie_word_embeddings=True
    ),
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=48, attention_bias=True
    ),
    "deepseek-v3-no-bias": lambda: transformers.DeepseekV3Config(**DEEPSEEK, q_lora_rank=48),
    "deepseek-v3-q-proj": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=None, attention_bias=True
    ),
    "deepseek-v3-q-proj-no-bias": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=None
    ),
    "deepseek-v32": lambda: transformers.DeepseekV32Config(
        **DEEPSEEK, q_lora_rank=48, **INDEXER
    ),
    "deepseek-v32-bias-tied": lambda: transformers.DeepseekV32Config(
        **DEEPSEEK, q_lora_rank=48, attention_bias=True, tie_word_embeddings=True, **INDEXER
    ),
}


def _load(name: str, tmp_path: Path) -> tuple[Any, ArchConfig]:
    config = CONFIGS[name]()
    config.save_pretrained(tmp_path)
    config._attn_implementation = "eager"  # attention as matmuls FlopCounterMode sees
    config._experts_implementation = "eager"  # the loop over the experts hit
    return config, ArchConfig.load(tmp_path)


def _model(config: Any) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_param_count_matches_transformers(name: str, tmp_path: Path) -> None:
    config, arch = _load(name, tmp_path)
    with torch.device("meta"):
        model = _model(config)
    # transformers keeps DeepSeek's e_score_correction_bias as a buffer; the checkpoint has it
    biases = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
    assert biases == (8 * 2 if name.startswith("deepseek") else 0)
    assert param_count(arch) == model.num_parameters() + biases

    idle = 0  # routed experts a token does not use: (E - k) / E of each expert bank
    for n, module in model.named_modules():
        if n.endswith("mlp.experts"):
            bank = sum(p.numel() for p in module.parameters())
            idle += bank * (arch.num_experts - arch.num_experts_per_tok) // arch.num_experts
    assert idle > 0 or arch.num_experts == 0
    assert active_param_count(arch) == param_count(arch) - idle


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_match_flop_counter(name: str, tmp_path: Path) -> None:
    config, arch = _load(name, tmp_path)
    torch.manual_seed(0)
    model = _model(config).eval()
    ids = torch.randint(0, arch.vocab_size, (1, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.addmm", "aten.bmm"}
    lm_head = 2 * arch.hidden_size * arch.vocab_size
    assert ops["aten.mm"] + ops.get("aten.addmm", 0) == (linear_flops_per_token(arch) + lm_head) * T
    assert ops["aten.bmm"] == _full_square_attention(arch)


def _full_square_attention(a: ArchConfig) -> float:
    """What eager attention multiplies for a prompt of T tokens: every (query, key) pair."""
    if a.indexer is None:
        return 2 * attention_flops(a, 0, T)
    assert a.mla is not None  # V3.2 computes the indexer and attention scores unmasked
    main = 2 * T * T * a.num_heads * (a.mla.qk_head_dim + a.mla.v_head_dim)
    scores = 2 * T * T * a.indexer.n_heads * (a.indexer.head_dim + 1)
    return (main + scores) * a.num_layers


def test_attention_flops_forms(tmp_path: Path) -> None:
    """GQA keeps 4 x (L + x/2) heads head_dim; MLA has QK^T over qk_head_dim and PV over
    v_head_dim; V3.2 reads min(p + 1, topk) keys per query p, and its indexer scores all."""
    _, llama = _load("llama", tmp_path / "llama")
    assert attention_flops(llama, 100, 30) == 4 * 30 * 115 * 4 * 16 * 3
    _, v3 = _load("deepseek-v3", tmp_path / "v3")
    assert attention_flops(v3, 100, 30) == 2 * 30 * 115 * 4 * (24 + 12) * 3
    _, v32 = _load("deepseek-v32", tmp_path / "v32")
    topk, index = 16, 2 * 4 * (32 + 1)
    for prefix, chunk in [(0, 1), (0, 5), (0, 16), (0, 40), (3, 20), (15, 1), (16, 1), (50, 7)]:
        read = sum(min(p + 1, topk) for p in range(prefix, prefix + chunk))
        expected = 2 * read * 4 * (24 + 12) + chunk * (prefix + chunk / 2) * index
        assert attention_flops(v32, prefix, chunk) == pytest.approx(expected * 3, rel=1e-12)


def test_deepseek_v3_linear_flops_by_hand(tmp_path: Path) -> None:
    """Layer 0 dense, layers 1-2 MoE; every term written out (kv_b_proj, shared expert)."""
    _, v3 = _load("deepseek-v3", tmp_path)
    h = 64
    attn = h * 48 + 48 * 4 * 24 + h * (32 + 8) + 32 * 4 * (16 + 12) + 4 * 12 * h
    dense = 3 * h * 96
    moe = h * 8 + (3 + 1) * 3 * h * 24  # router, top-3 routed and 1 shared expert
    assert linear_flops_per_token(v3) == 2 * (3 * attn + dense + 2 * moe)
