"""The architecture description parsed from a checkpoint's `config.json` (no transformers).

One setting can reach config.json in several forms: under another name (transformers'
`attribute_map`: Qwen3-MoE's `num_experts` is saved as `num_local_experts` by transformers 5),
not at all (the configuration class's default then applies), and RoPE as `rope_theta` +
`rope_scaling` (4.x) or one `rope_parameters` dict (5.x). `MODEL_TYPES` holds, per model type,
the names and defaults of transformers' configuration class, so that a config saved by either
version, or written by hand with either name, reads into the same `ArchConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeserve.models.quantization import Fp8Blocks, checkpoint_quantization

if TYPE_CHECKING:
    from pipeserve.layers.rotary import RopeScaling


@dataclass(frozen=True)
class ModelType:
    """How transformers' configuration class of one `model_type` reads config.json."""

    architecture: str  # the model class; also chosen when config.json names no architectures
    defaults: dict[str, Any]  # field -> value when config.json lacks it
    aliases: dict[str, str] = field(default_factory=dict)  # other name -> field (attribute_map)


_COMMON: dict[str, Any] = {
    "num_key_value_heads": None,  # None: one KV head per attention head
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "eos_token_id": None,
}
_QWEN: dict[str, Any] = {
    **_COMMON,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}
_DEEPSEEK: dict[str, Any] = {
    **_COMMON,
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "max_position_embeddings": 4096,
    "eos_token_id": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "rope_interleave": True,
    # Not fields of transformers' class (its model always routes this way); DeepSeek's own
    # config.json carries them.
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}

MODEL_TYPES: dict[str, ModelType] = {
    "llama": ModelType(
        "LlamaForCausalLM",
        {
            **_COMMON,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 2048,
            "eos_token_id": 2,
        },
    ),
    "qwen2": ModelType("Qwen2ForCausalLM", _QWEN),
    "qwen3": ModelType("Qwen3ForCausalLM", {**_QWEN, "head_dim": 128}),
    "qwen3_moe": ModelType(
        "Qwen3MoeForCausalLM",
        {
            **_QWEN,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_key_value_heads": 4,
            "head_dim": None,
            "num_local_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        {"num_experts": "num_local_experts"},
    ),
    "deepseek_v3": ModelType(
        "DeepseekV3ForCausalLM", _DEEPSEEK, {"num_local_experts": "n_routed_experts"}
    ),
    "deepseek_v32": ModelType(
        "DeepseekV32ForCausalLM",
        {
            **_DEEPSEEK,
            "num_key_value_heads": 128,
            "max_position_embeddings": 163840,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 2048,
        },
        {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"},
    ),
}
_MODEL_TYPE_OF = {spec.architecture: name for name, spec in MODEL_TYPES.items()}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPE_OF)
_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32")

# The rope types `layers.rotary` computes, the parameters of each as transformers (and
# RopeScaling) names them, and those it requires.
_ROPE_PARAMS: dict[str, tuple[str, ...]] = {
    "default": (),
    # mscale_all_dim: DeepSeek's attention scales its softmax by it under any rope type
    "linear": ("factor", "mscale_all_dim"),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "mscale_all_dim",
    ),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding in one form, whether config.json gave transformers 5's
    `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`. Parameters the type does not use
    stay None; those transformers fills in when absent are filled in here too."""

    rope_type: str = "default"  # default (no scaling), linear, llama3 or yarn
    theta: float = 10000.0
    factor: float | None = None  # context extension factor (every type but default)
    original_max_position_embeddings: int | None = None  # llama3, yarn: pretraining context
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn: dims rotating faster than this keep their frequency
    beta_slow: float | None = None  # yarn: dims rotating slower than this are interpolated
    # yarn (DeepSeek): attention scale m(mscale) / m(mscale_all_dim), m(x) = 0.1 x ln(factor) + 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: explicit attention scale
    truncate: bool | None = None  # yarn: round the ramp's ends to whole dims

    @classmethod
    def from_config(cls, cfg: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        # As transformers: a legacy `rope_scaling` replaces `rope_parameters` whole; the
        # dict's own theta comes before the top-level `rope_theta`; `rope_type` before `type`.
        params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
        if kind not in _ROPE_PARAMS:
            raise ValueError(f"rope type {kind!r} is not supported ({', '.join(_ROPE_PARAMS)} are)")
        values = {name: params.get(name) for name in _ROPE_PARAMS[kind]}
        missing = [name for name in _ROPE_REQUIRED.get(kind, ()) if values[name] is None]
        if missing:
            raise ValueError(f"rope type {kind!r} needs {', '.join(missing)} in config.json")
        return cls(kind, float(theta), **_rope_defaults(kind, values, max_position_embeddings))

    @property
    def scaling(self) -> RopeScaling | None:
        """What `layers.rotary` computes: None without scaling, else the type's parameters,
        those left None at RopeScaling's defaults."""
        from pipeserve.layers.rotary import RopeScaling  # here: reading config.json needs no torch

        if self.rope_type == "default":
            return None
        params = {name: getattr(self, name) for name in _ROPE_PARAMS[self.rope_type]}
        return RopeScaling(self.rope_type, **{k: v for k, v in params.items() if v is not None})


def _rope_defaults(kind: str, values: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """The parameters transformers fills in when config.json leaves them out."""
    if kind in ("llama3", "yarn"):
        values["original_max_position_embeddings"] = (
            values["original_max_position_embeddings"] or max_positions
        )
    if kind == "yarn":  # a null factor is the context's extension ratio
        values["factor"] = (
            values["factor"] or max_positions / values["original_max_position_embeddings"]
        )
        values["beta_fast"] = values["beta_fast"] or 32
        values["beta_slow"] = values["beta_slow"] or 1
        values["truncate"] = True if values["truncate"] is None else values["truncate"]
    return values


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are up-projected from one
    compressed latent per token; each head's query/key is a no-position part and a rotary part."""

    q_lora_rank: int  # rank of the query compression; 0: queries projected directly
    kv_lora_rank: int  # width of the cached KV latent
    qk_nope_head_dim: int  # per-head query/key dims without rotary position
    qk_rope_head_dim: int  # per-head query/key dims with rotary position (key shared by heads)
    v_head_dim: int
    rope_interleave: bool  # rotary pairs channels (2i, 2i+1), not (i, i + d/2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoERouting:
    """DeepSeek's routing, beyond the top-k of `ArchConfig`: experts scored by `scoring_func`,
    picked only from the best `topk_group` of `n_group` expert groups (`topk_method`), their
    weights times `routed_scaling_factor`, plus `n_shared_experts` every token goes through."""

    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3: a learned bias steers the choice) or "greedy"
    first_k_dense_replace: int  # the first k layers keep a dense MLP
    moe_layer_freq: int  # after those, every n-th layer is MoE


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer: small heads score the cached tokens, and attention
    reads only the `topk` best of them."""

    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class ArchConfig:
    """A model's shapes and variants, read once from config.json by `from_dict`."""

    architecture: str  # model class name, e.g. "Qwen3MoeForCausalLM"
    hidden_size: int
    intermediate_size: int  # of dense MLPs
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # MLA models: the rotary part, qk_rope_head_dim (as transformers sets it)
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool
    qk_norm: bool  # RMSNorm over each query and key head (Qwen3)
    torch_dtype: str  # dtype of the saved weights
    eos_token_ids: tuple[int, ...] = ()
    # A bias on o_proj (transformers' attention_bias on Llama, Qwen3, Qwen3-MoE; Qwen2 has
    # q/k/v biases only; DeepSeek's o_proj follows qkv_bias) and on the dense MLP's three
    # projections (Llama's mlp_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    # Mixture of experts (num_experts == 0: dense model)
    num_experts: int = 0  # routed experts
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1  # MoE on layers with (layer + 1) % step == 0 ...
    # ... except these, which stay dense (DeepSeek: from first_k_dense_replace, moe_layer_freq)
    mlp_only_layers: tuple[int, ...] = field(default=())
    routing: MoERouting | None = None  # DeepSeek's grouped routing and shared experts
    mla: MLAConfig | None = None  # DeepSeek's latent attention (replaces q/k/v projections)
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2's sparse attention
    quantization: Fp8Blocks | None = None  # how the checkpoint's weights are stored

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_scaling(self) -> RopeScaling | None:
        return self.rope.scaling

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
        arch = _architecture(cfg)
        model_type = _MODEL_TYPE_OF[arch]
        v = _resolve(cfg, MODEL_TYPES[model_type])
        if v.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        if (act := v.get("hidden_act", "silu")) not in SILU_NAMES:
            raise ValueError(
                f"hidden_act {act!r} is not supported: pipeserve's MLPs and experts compute "
                "SiLU (hidden_act silu)"
            )
        heads = v["num_attention_heads"]
        mla = _mla(v, model_type) if model_type in _DEEPSEEK_TYPES else None
        return cls(
            architecture=arch,
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=v["num_key_value_heads"] or heads,
            head_dim=mla.qk_rope_head_dim if mla else (v["head_dim"] or v["hidden_size"] // heads),
            vocab_size=v["vocab_size"],
            rms_norm_eps=v["rms_norm_eps"],
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=bool(v["tie_word_embeddings"]),
            rope=RopeConfig.from_config(cfg, v["max_position_embeddings"]),
            qkv_bias=model_type == "qwen2" or bool(v["attention_bias"]),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            o_bias=model_type in _O_BIAS_TYPES and bool(v["attention_bias"]),
            mlp_bias=model_type == "llama" and bool(v.get("mlp_bias")),
            # transformers keeps `dtype` (5.x) over the older `torch_dtype` when both are given
            torch_dtype=str(v.get("dtype") or v.get("torch_dtype") or "bfloat16"),
            eos_token_ids=_eos(v["eos_token_id"]),
            mla=mla,
            quantization=checkpoint_quantization(cfg),
            **_moe_fields(v, model_type),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    """The first architecture config.json names that pipeserve reads; if it names none, the
    one of its `model_type` (as transformers' Auto classes choose)."""
    archs, model_type = cfg.get("architectures") or [], cfg.get("model_type")
    if archs:
        found = next((a for a in archs if a in _MODEL_TYPE_OF), None)
    else:
        found = MODEL_TYPES[model_type].architecture if model_type in MODEL_TYPES else None
    if found is None:
        named = archs or f"(none given) and model_type {model_type!r}"
        supported = ", ".join(
            f"{m.architecture} (model_type {t!r})" for t, m in MODEL_TYPES.items()
        )
        raise ValueError(f"unsupported architecture {named}; pipeserve supports {supported}")
    return found


# transformers' names of the activation pipeserve's MLPs compute (ACT2FN: both are SiLU)
SILU_NAMES = ("silu", "swish")
# model types whose attention_bias also puts a bias on o_proj (as transformers builds them)
_O_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe")


def _resolve(cfg: dict[str, Any], spec: ModelType) -> dict[str, Any]:
    """config.json's values under the field names of `spec`, its defaults filled in where a
    field is absent. A null is kept, as transformers keeps it (q_lora_rank: null means no
    query compression)."""
    for alias, name in spec.aliases.items():
        if alias in cfg and name in cfg and cfg[alias] != cfg[name]:
            raise ValueError(
                f"config.json sets both {alias}={cfg[alias]} and {name}={cfg[name]}, two "
                f"names of one setting; keep {name}"
            )
    return {**spec.defaults, **{spec.aliases.get(k, k): v for k, v in cfg.items()}}


def _eos(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _moe_fields(v: dict[str, Any], model_type: str) -> dict[str, Any]:
    if model_type == "qwen3_moe":
        return {
            "num_experts": v["num_local_experts"],
            "num_experts_per_tok": v["num_experts_per_tok"],
            "moe_intermediate_size": v["moe_intermediate_size"],
            "norm_topk_prob": bool(v["norm_topk_prob"]),
            "decoder_sparse_step": v["decoder_sparse_step"] or 1,
            "mlp_only_layers": tuple(v["mlp_only_layers"] or ()),
        }
    if model_type in _DEEPSEEK_TYPES:
        return {
            "num_experts": v["n_routed_experts"],
            "num_experts_per_tok": v["num_experts_per_tok"],
            "moe_intermediate_size": v["moe_intermediate_size"],
            "norm_topk_prob": bool(v["norm_topk_prob"]),
            "mlp_only_layers": _deepseek_dense_layers(v),
            "routing": _routing(v),
            "indexer": _indexer(v) if model_type == "deepseek_v32" else None,
        }
    return {}


def _deepseek_dense_layers(v: dict[str, Any]) -> tuple[int, ...]:
    """V3.2's `mlp_layer_types` where given (transformers 5 saves it), else DeepSeek's rule:
    dense before `first_k_dense_replace` and off the `moe_layer_freq` grid."""
    if v.get("mlp_layer_types"):
        return tuple(i for i, kind in enumerate(v["mlp_layer_types"]) if kind == "dense")
    first, freq = v["first_k_dense_replace"] or 0, v["moe_layer_freq"] or 1
    return tuple(i for i in range(v["num_hidden_layers"]) if i < first or i % freq)


def _mla(v: dict[str, Any], model_type: str) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=v["q_lora_rank"] or 0,  # null (transformers' None) or 0: no compression
        kv_lora_rank=v["kv_lora_rank"],
        qk_nope_head_dim=v["qk_nope_head_dim"],
        qk_rope_head_dim=v["qk_rope_head_dim"],
        v_head_dim=v["v_head_dim"],
        # V3.2's model always interleaves; V3's follows the config
        rope_interleave=model_type == "deepseek_v32" or bool(v["rope_interleave"]),
    )


def _routing(v: dict[str, Any]) -> MoERouting:
    return MoERouting(
        n_shared_experts=v["n_shared_experts"],
        n_group=v["n_group"] or 1,  # null: one group, no group limit
        topk_group=v["topk_group"] or 1,
        routed_scaling_factor=float(v["routed_scaling_factor"] or 1.0),
        scoring_func=v["scoring_func"],
        topk_method=v["topk_method"],
        first_k_dense_replace=v["first_k_dense_replace"] or 0,
        moe_layer_freq=v["moe_layer_freq"] or 1,
    )


def _indexer(v: dict[str, Any]) -> IndexerConfig:
    return IndexerConfig(v["index_n_heads"], v["index_head_dim"], v["index_topk"])


def attention_matmul_weights(a: ArchConfig) -> int:
    """Weights of one layer's attention projections, biases and norms left out: the
    multiply-adds one token costs in them. MLA: the query path (q_a + q_b, or q_proj),
    kv_a_proj_with_mqa, kv_b_proj (once per token: the expanded form) and o_proj; V3.2 adds the
    indexer's wq_b, wk and weights_proj."""
    h = a.hidden_size
    if a.mla is None:
        return h * (a.q_size + 2 * a.kv_size) + a.q_size * h
    m, heads, r = a.mla, a.num_heads, a.mla.q_lora_rank
    q = (h * r + r * heads * m.qk_head_dim) if r else h * heads * m.qk_head_dim
    kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    total = q + kv_a + kv_b + heads * m.v_head_dim * h
    if a.indexer:
        i = a.indexer
        total += r * i.n_heads * i.head_dim + h * i.head_dim + h * i.n_heads
    return total


def attention_other_params(a: ArchConfig) -> int:
    """One layer's attention biases and norms, with the layer's two RMSNorms."""
    h, total = a.hidden_size, 2 * a.hidden_size
    if a.mla is None:
        total += a.q_size + 2 * a.kv_size if a.qkv_bias else 0
        total += h if a.o_bias else 0
        return total + (2 * a.head_dim if a.qk_norm else 0)
    m = a.mla
    total += m.q_lora_rank + m.kv_lora_rank  # q_a_layernorm (0 without it), kv_a_layernorm
    if a.qkv_bias:  # q_a_proj, kv_a_proj_with_mqa, o_proj
        total += m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + h
    return total + (2 * a.indexer.head_dim if a.indexer else 0)  # k_norm: weight and bias


def mlp_matmul_weights(a: ArchConfig, layer: int, active: bool = False) -> int:
    """Weights of one layer's MLP: dense, or router + routed experts (the top-k when `active`,
    else all) + shared experts."""
    h = a.hidden_size
    if not a.is_moe_layer(layer):
        return 3 * h * a.intermediate_size
    routed = a.num_experts_per_tok if active else a.num_experts
    shared = a.routing.n_shared_experts if a.routing else 0
    return h * a.num_experts + (routed + shared) * 3 * h * a.moe_intermediate_size


def _params(a: ArchConfig, active: bool) -> int:
    h = a.hidden_size
    attn = attention_matmul_weights(a) + attention_other_params(a)
    total = a.vocab_size * h * (1 if a.tie_word_embeddings else 2) + h  # + the final norm
    for layer in range(a.num_layers):
        total += attn + mlp_matmul_weights(a, layer, active)
        if a.routing and a.is_moe_layer(layer):
            total += a.num_experts  # e_score_correction_bias
    return total


def param_count(a: ArchConfig) -> int:
    """Parameters of the whole model as its checkpoint stores them (embeddings and LM head
    included, once when tied). DeepSeek's `e_score_correction_bias` counts (pipeserve holds it
    as a parameter; transformers as a buffer, outside its `num_parameters()`)."""
    return _params(a, active=False)


def routed_expert_params(a: ArchConfig) -> int:
    """Parameters of the routed experts of every MoE layer (what expert parallelism splits)."""
    per_expert = 3 * a.hidden_size * a.moe_intermediate_size
    return sum(a.num_experts * per_expert for layer in range(a.num_layers) if a.is_moe_layer(layer))


def active_param_count(a: ArchConfig) -> int:
    """The parameters one token uses: `param_count` less, in each MoE layer, the routed experts
    beyond its top-k. Everything else counts whole: shared experts, routers, norms, and the
    embedding table and LM head (once when tied), though a token reads one embedding row."""
    return _params(a, active=True)
