"""Built-in models: ordinary Hugging Face checkpoints with deterministic random weights.

`pipeserve make-model --preset NAME --out DIR` writes config.json, safetensors (sharded with
an index when large), tokenizer.json and tokenizer_config.json. Tiny presets cover every
supported architecture for tests; `bench` is sized so long-prompt prefill is compute-bound;
the others copy the configs of released models so real shapes are exercised.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeserve import envs
from pipeserve.models.arch import ArchConfig
from pipeserve.models.made_once import made_once
from pipeserve.tokenizer import CHAT_TEMPLATE_FILE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, over the special tokens above; saved as chat_template.jinja, as transformers does
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny(arch: str, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.2,
        **extra,
    }


def _tiny_deepseek(arch: str, **extra: Any) -> dict[str, Any]:
    """Three layers (the first dense), MLA with compressed queries, grouped sigmoid routing
    over 8 experts plus a shared one, and DeepSeek's YaRN (scales both cos/sin and softmax)."""
    base = {k: v for k, v in _tiny(arch).items() if k != "head_dim"}  # MLA: qk_rope_head_dim
    return {
        **base,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        "attention_bias": False,
        **extra,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": _tiny(
        "LlamaForCausalLM",
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "tiny-qwen2": _tiny("Qwen2ForCausalLM", model_type="qwen2", num_key_value_heads=1),
    "tiny-qwen3": _tiny(
        "Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=True, attention_bias=False
    ),
    "tiny-qwen3-moe": _tiny(
        "Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        attention_bias=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "tiny-deepseek-v3": _tiny_deepseek(
        "DeepseekV3ForCausalLM", model_type="deepseek_v3", rope_interleave=True
    ),
    # V3.2's model always interleaves rotary pairs (it reads no rope_interleave). 16 indexer
    # heads: with 4, a fifth of a 600-token prompt's queries tie exactly at the top-k boundary
    # (index scores are sums of ReLUs, so all-zero sums are common) and which tied key is kept
    # is unspecified in transformers.
    "tiny-deepseek-v32": _tiny_deepseek(
        "DeepseekV32ForCausalLM",
        model_type="deepseek_v32",
        index_n_heads=16,
        index_head_dim=32,
        index_topk=64,
    ),
    # ~57M parameters, 8 layers, GQA 12:4: long prompts are compute-bound on a CPU core.
    "bench": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
    "bench-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
    # 458M parameters, 150M active per token (84M without embeddings and LM head): MLA + MoE.
    "bench-deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 1024,
        "intermediate_size": 2048,  # the dense first layer's MLP
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 32,
        "moe_intermediate_size": 512,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": True,
        "vocab_size": 32000,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
    # Shapes of released models (random weights).
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "_init_std": 0.02,
    },
}


def preset_path(name: str) -> Path:
    """The cached checkpoint of a preset, made on first use. One cached before the presets
    shipped a chat template gets it (chat requests would otherwise be refused)."""
    path = made_once(
        envs.cache_dir() / "models" / name, lambda out: make_model(name, out), "checkpoint"
    )
    template = path / CHAT_TEMPLATE_FILE
    if not template.is_file():
        tmp = path / f".{CHAT_TEMPLATE_FILE}.{os.getpid()}"
        tmp.write_text(CHAT_TEMPLATE)
        tmp.replace(template)
    return path


def make_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    shard_size_mb: int = 2048,
    overrides: dict[str, Any] | None = None,
) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    spec = {**PRESETS[preset], **(overrides or {})}
    std = spec.pop("_init_std")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec["vocab_size"])
    eos, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    config = {**spec, "eos_token_id": [im_end, eos], "bos_token_id": None}
    arch = ArchConfig.from_dict(config)
    _save_weights(random_weights(arch, std, seed), out, shard_size_mb)
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    tmp.replace(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": spec["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eos]}))
    (out / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: marks completion
    return out


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its shape and how `random_weights` fills it."""

    shape: tuple[int, ...]
    init: str = "normal"  # normal: N(0, std); norm: 1 + N(0, 0.1); router_bias: N(0, 0.1), fp32

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.init == "router_bias" else torch.bfloat16


def random_weights(arch: ArchConfig, std: float, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names and shapes of `arch`, filled deterministically in the order
    of `weight_specs`."""
    gen = torch.Generator().manual_seed(seed)

    def fill(spec: TensorSpec) -> torch.Tensor:
        x = torch.randn(*spec.shape, generator=gen)
        if spec.init == "norm":
            return (1.0 + 0.1 * x).to(torch.bfloat16)
        return (x * 0.1) if spec.init == "router_bias" else (x * std).to(torch.bfloat16)

    return {name: fill(spec) for name, spec in weight_specs(arch).items()}


def weight_specs(arch: ArchConfig) -> dict[str, TensorSpec]:
    """The checkpoint's tensors as transformers' `save_pretrained` writes them (experts one
    by one), in the order `random_weights` fills them."""
    h = arch.hidden_size
    w = {"model.embed_tokens.weight": TensorSpec((arch.vocab_size, h))}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        w.update(_mla_specs(p + "self_attn.", arch) if arch.mla else _attention_specs(p, arch))
        w[p + "input_layernorm.weight"] = TensorSpec((h,), "norm")
        w[p + "post_attention_layernorm.weight"] = TensorSpec((h,), "norm")
        if arch.is_moe_layer(i):
            w.update(_moe_specs(p + "mlp.", arch))
        else:
            w.update(_mlp(p + "mlp.", h, arch.intermediate_size, arch.mlp_bias))
    w["model.norm.weight"] = TensorSpec((h,), "norm")
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = TensorSpec((arch.vocab_size, h))
    return w


def _attention_specs(p: str, arch: ArchConfig) -> dict[str, TensorSpec]:
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    w: dict[str, TensorSpec] = {}
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        w[p + f"self_attn.{name}.weight"] = TensorSpec((rows, h))
        if arch.qkv_bias:
            w[p + f"self_attn.{name}.bias"] = TensorSpec((rows,))
    _linear(w, p + "self_attn.o_proj", h, q, arch.o_bias)
    if arch.qk_norm:
        w[p + "self_attn.q_norm.weight"] = TensorSpec((arch.head_dim,), "norm")
        w[p + "self_attn.k_norm.weight"] = TensorSpec((arch.head_dim,), "norm")
    return w


def _linear(w: dict[str, TensorSpec], name: str, rows: int, cols: int, bias: bool) -> None:
    w[name + ".weight"] = TensorSpec((rows, cols))
    if bias:
        w[name + ".bias"] = TensorSpec((rows,))


def _mla_specs(p: str, arch: ArchConfig) -> dict[str, TensorSpec]:
    """DeepSeek's latent attention (`p` ends in "self_attn.")."""
    assert arch.mla is not None
    m, h, heads, bias = arch.mla, arch.hidden_size, arch.num_heads, arch.qkv_bias
    w: dict[str, TensorSpec] = {}
    if m.q_lora_rank:
        _linear(w, p + "q_a_proj", m.q_lora_rank, h, bias)
        w[p + "q_a_layernorm.weight"] = TensorSpec((m.q_lora_rank,), "norm")
        _linear(w, p + "q_b_proj", heads * m.qk_head_dim, m.q_lora_rank, False)
    else:
        _linear(w, p + "q_proj", heads * m.qk_head_dim, h, False)
    _linear(w, p + "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h, bias)
    w[p + "kv_a_layernorm.weight"] = TensorSpec((m.kv_lora_rank,), "norm")
    _linear(w, p + "kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False)
    _linear(w, p + "o_proj", h, heads * m.v_head_dim, bias)
    if arch.indexer:
        w.update(_indexer_specs(p + "indexer.", arch))
    return w


def _indexer_specs(p: str, arch: ArchConfig) -> dict[str, TensorSpec]:
    """DeepSeek-V3.2's lightning indexer. transformers keeps `weights_proj` in float32 only
    when loading in float16; a bfloat16 model saves it in bfloat16, as here."""
    assert arch.mla is not None and arch.indexer is not None
    ix, q_rank, h = arch.indexer, arch.mla.q_lora_rank, arch.hidden_size
    if not q_rank:
        raise ValueError("DeepSeek-V3.2's indexer reads the query latent: q_lora_rank must be set")
    return {
        p + "wq_b.weight": TensorSpec((ix.n_heads * ix.head_dim, q_rank)),
        p + "wk.weight": TensorSpec((ix.head_dim, h)),
        p + "k_norm.weight": TensorSpec((ix.head_dim,), "norm"),
        p + "k_norm.bias": TensorSpec((ix.head_dim,)),
        p + "weights_proj.weight": TensorSpec((ix.n_heads, h)),
    }


def _moe_specs(p: str, arch: ArchConfig) -> dict[str, TensorSpec]:
    h, inter = arch.hidden_size, arch.moe_intermediate_size
    w = {p + "gate.weight": TensorSpec((arch.num_experts, h))}
    if arch.routing:  # DeepSeek: float32 like transformers saves it, non-zero to be exercised
        w[p + "gate.e_score_correction_bias"] = TensorSpec((arch.num_experts,), "router_bias")
    for e in range(arch.num_experts):
        w.update(_mlp(f"{p}experts.{e}.", h, inter))
    if arch.routing and arch.routing.n_shared_experts:
        w.update(_mlp(p + "shared_experts.", h, inter * arch.routing.n_shared_experts))
    return w


def _mlp(prefix: str, h: int, inter: int, bias: bool = False) -> dict[str, TensorSpec]:
    w: dict[str, TensorSpec] = {}
    _linear(w, prefix + "gate_proj", inter, h, bias)
    _linear(w, prefix + "up_proj", inter, h, bias)
    _linear(w, prefix + "down_proj", h, inter, bias)
    return w


def _save_weights(weights: dict[str, torch.Tensor], out: Path, shard_size_mb: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, limit = 0, shard_size_mb * 2**20
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# -- tokenizer ----------------------------------------------------------------------------

_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "na",
    "me",
    "lo",
    "su",
    "ve",
    "pa",
    "di",
    "qu",
    "ze",
    "bo",
    "mi",
    "ra",
    "te",
    "so",
    "lu",
    "ne",
    "ha",
    "ki",
    "mo",
    "ya",
    "re",
    "fu",
    "an",
    "el",
    "in",
    "on",
    "ur",
    "ost",
    "ing",
    "ter",
    "pro",
    "com",
    "ble",
]
_EXTRA_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "with",
    "that",
    "été",
    "über",
    "naïve",
    "façon",
    "你好",
    "世界",
    "こんにちは",
    "Привет",
    "🙂",
    "🚀",
    "λ",
    "π",
    "∑",
]


def _corpus(num_words: int = 60000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = []
    for _ in range(num_words):
        if rng.random() < 0.15:
            words.append(rng.choice(_EXTRA_WORDS))
        else:
            words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    lines = [
        " ".join(words[i : i + 12]) + rng.choice([".", ",", "!", "?", ":"])
        for i in range(0, len(words), 12)
    ]
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text is encodable; a multi-byte character may span tokens) trained
    on a fixed synthetic corpus up to min(vocab_size, 8192) tokens; special tokens come last."""
    target = min(vocab_size, 8192) - len(SPECIAL_TOKENS)
    if target < 256:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer (>= 259)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok
