"""The DeepSeek presets as transformers reads them: the tiny checkpoints load into
DeepseekV3ForCausalLM / DeepseekV32ForCausalLM with no missing, unexpected or mismatched key,
and transformers' config reads like `ArchConfig`; `bench-deepseek`'s tensors (too large to
write here) match the names and shapes of a transformers model built on the meta device."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from pipeserve.models.arch import ArchConfig
from pipeserve.models.presets import PRESETS, weight_specs

TINY = ["tiny-deepseek-v3", "tiny-deepseek-v32"]


@pytest.fixture(scope="module")
def hf_model(model_dir: Any):
    """preset -> (transformers model loaded in float32, its loading info, checkpoint path)."""
    loaded: dict[str, tuple[Any, dict[str, Any], Path]] = {}

    def get(preset: str) -> tuple[Any, dict[str, Any], Path]:
        if preset not in loaded:
            path = model_dir(preset)
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, output_loading_info=True
            )
            loaded[preset] = model.eval(), info, path
        return loaded[preset]

    return get


def preset_arch(preset: str) -> ArchConfig:
    return ArchConfig.from_dict({k: v for k, v in PRESETS[preset].items() if k != "_init_std"})


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The model's tensors as save_pretrained writes them: the fused expert tensors
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) one expert at a time."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, (n, rows, cols) = name.removesuffix("gate_up_proj"), t.shape
            for e in range(n):
                shapes[f"{prefix}{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}{e}.up_proj.weight"] = (rows // 2, cols)
        elif name.endswith("experts.down_proj"):
            prefix, (n, rows, cols) = name.removesuffix("down_proj"), t.shape
            for e in range(n):
                shapes[f"{prefix}{e}.down_proj.weight"] = (rows, cols)
        else:
            shapes[name] = tuple(t.shape)
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


@pytest.mark.parametrize("preset", TINY)
def test_tiny_checkpoint_loads_in_transformers(hf_model: Any, preset: str) -> None:
    model, info, path = hf_model(preset)
    assert type(model).__name__ == PRESETS[preset]["architectures"][0]
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    arch = ArchConfig.load(path)
    moe = [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    assert moe
    for i in moe:
        bias = model.model.layers[i].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0, "the correction bias must be non-zero to be exercised"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        name = f"model.layers.{moe[0]}.mlp.gate.e_score_correction_bias"
        assert f.get_tensor(name).dtype == torch.float32  # as transformers saves it
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_uncompressed_queries_and_biases_load_in_transformers(model_dir: Any) -> None:
    """q_lora_rank null (one q_proj) and attention_bias (on q_a, kv_a and o): V3's variants."""
    path = model_dir("tiny-deepseek-v3", q_lora_rank=None, attention_bias=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    attn = model.model.layers[0].self_attn
    assert attn.q_proj is not None and attn.kv_a_proj_with_mqa.bias is not None


@pytest.mark.parametrize("preset", TINY)
def test_tiny_config_reads_alike(hf_model: Any, preset: str) -> None:
    model, _, path = hf_model(preset)
    cfg, arch = model.config, ArchConfig.load(path)
    layers = model.model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [
        arch.is_moe_layer(i) for i in range(arch.num_layers)
    ]
    assert [arch.is_moe_layer(i) for i in range(arch.num_layers)] == [False, True, True]
    sparse = next(layer.mlp for layer in layers if hasattr(layer.mlp, "experts"))
    assert sparse.experts.num_experts == cfg.n_routed_experts == arch.num_experts == 8
    assert sparse.gate.top_k == arch.num_experts_per_tok
    assert arch.routing is not None and arch.mla is not None
    assert (sparse.gate.num_group, sparse.gate.topk_group) == (
        arch.routing.n_group,
        arch.routing.topk_group,
    )
    assert sparse.gate.routed_scaling_factor == arch.routing.routed_scaling_factor
    assert sparse.shared_experts.intermediate_size == arch.moe_intermediate_size
    attn = layers[0].self_attn
    assert (attn.q_lora_rank, attn.kv_lora_rank) == (arch.mla.q_lora_rank, arch.mla.kv_lora_rank)
    assert (attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim) == (
        arch.mla.qk_nope_head_dim,
        arch.mla.qk_rope_head_dim,
        arch.mla.v_head_dim,
    )
    assert arch.mla.rope_interleave and getattr(cfg, "rope_interleave", True)
    # DeepSeek's YaRN scales both the cos/sin tables and the softmax
    assert cfg.rope_parameters["rope_type"] == arch.rope.rope_type == "yarn"
    assert cfg.rope_parameters["factor"] == arch.rope.factor
    assert model.model.rotary_emb.attention_scaling > 1.01
    assert attn.scaling > 1.1 * arch.mla.qk_head_dim**-0.5
    if preset == "tiny-deepseek-v32":
        assert arch.indexer is not None
        assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (
            arch.indexer.n_heads,
            arch.indexer.head_dim,
            arch.indexer.topk,
        )
        assert attn.indexer.index_topk == 64
    else:
        assert arch.indexer is None


@pytest.mark.parametrize("preset", [*TINY, "bench-deepseek"])
def test_weight_specs_match_transformers_on_meta(preset: str) -> None:
    start = time.monotonic()
    spec = {k: v for k, v in PRESETS[preset].items() if k != "_init_std"}
    config = AutoConfig.for_model(**spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = weight_specs(preset_arch(preset))
    assert {n: s.shape for n, s in specs.items()} == checkpoint_shapes(model)
    for name, s in specs.items():
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert s.dtype == want, name
    assert time.monotonic() - start < 5


def test_bench_deepseek_size() -> None:
    """The parameter counts its comment in presets.py states."""
    arch = preset_arch("bench-deepseek")
    sizes = {name: math.prod(s.shape) for name, s in weight_specs(arch).items()}
    total = sum(sizes.values())
    routed = sum(n for name, n in sizes.items() if ".experts." in name)
    active = total - routed * (1 - arch.num_experts_per_tok / arch.num_experts)
    assert (round(total / 1e6), round(active / 1e6)) == (458, 150)
