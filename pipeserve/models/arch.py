"""The architecture description parsed from a checkpoint's `config.json` (no transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (num_experts == 0: dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default=())

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_length(self, override: int | None) -> int:
        return override or self.max_position_embeddings

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def load(cls, model_path: str | Path) -> ArchConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_path} is not a checkpoint directory: no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; "
                f"pipeserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            num_experts=cfg.get("num_experts", 0) if arch == "Qwen3MoeForCausalLM" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic `rope_theta`/`rope_scaling` keys or the newer
    `rope_parameters` dict."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params else None)
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return float(theta), scaling


def param_count(a: ArchConfig) -> int:
    """Parameters of the whole model (embeddings and LM head included)."""
    h, d = a.hidden_size, a.head_dim
    attn = h * (a.q_size + 2 * a.kv_size) + a.q_size * h + 2 * h
    attn += (a.q_size + 2 * a.kv_size) if a.qkv_bias else 0
    attn += 2 * d if a.qk_norm else 0
    total = a.vocab_size * h * (1 if a.tie_word_embeddings else 2) + h
    for layer in range(a.num_layers):
        if a.is_moe_layer(layer):
            mlp = a.num_experts * 3 * h * a.moe_intermediate_size + h * a.num_experts
        else:
            mlp = 3 * h * a.intermediate_size
        total += attn + mlp
    return total
