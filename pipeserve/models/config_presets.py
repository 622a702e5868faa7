"""Configs of released models too large to run here, for the simulator (`pipeserve simulate
--model NAME`) and `pipeserve make-model --preset NAME`, which writes just config.json.

The values are those of the models' published config.json files (FP8 checkpoints: the
`quantization_config` says so; the simulator then counts what the engine holds of them,
bfloat16 weights, or fp8 under --fp8-weights keep).
Qwen3-235B-A22B carries the YaRN scaling its model card gives for 131072 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

CONFIG_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3.1": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": _FP8,
    },
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "quantization_config": _FP8,
    },
}


def write_config(name: str, out: str | Path) -> Path:
    """A directory holding only the preset's config.json (no weights, no tokenizer)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG_PRESETS[name], indent=2))
    return out


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """config.json of a checkpoint directory, a config preset or a built-in model, and what
    it came from."""
    path = Path(model)
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), str(path.resolve())
    if model in CONFIG_PRESETS:
        return dict(CONFIG_PRESETS[model]), f"preset {model}"
    from pipeserve.models.presets import PRESETS  # the built-in random-weight models

    if model in PRESETS:
        spec = {k: v for k, v in PRESETS[model].items() if not k.startswith("_")}
        return spec, f"preset {model}"
    known = ", ".join([*CONFIG_PRESETS, *PRESETS])
    raise ValueError(f"--model {model}: not a directory with config.json nor a preset ({known})")


def weight_dtype(config: dict[str, Any]) -> str:
    """The checkpoint's weight dtype: fp8 where its quantization_config says so."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        return "fp8"
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
