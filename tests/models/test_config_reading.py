"""config.json is read the way transformers reads it: configs saved by transformers' own
`save_pretrained` (5.x names: `num_local_experts`, `rope_parameters`, `dtype`) and the same
settings under their 4.x or hand-written names (`num_experts`, `rope_theta` + `rope_scaling`,
`type`, `torch_dtype`) give equal ArchConfigs; a field left out takes the configuration class's
default. Ends with a Qwen3-MoE checkpoint written by transformers 5 served next to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf_parity import GREEDY, LAYOUTS, LOGPROB_ATOL, hf_run, prompts, run_engine

from pipeserve.layers.rotary import RopeScaling
from pipeserve.models.arch import MODEL_TYPES, ArchConfig, RopeConfig
from pipeserve.models.registry import build_model, model_class

transformers = pytest.importorskip("transformers")

HF_CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "deepseek_v32": "DeepseekV32Config",
}
YARN = {  # DeepSeek-V3's released rope_scaling, in transformers 5's form
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
# Settings each case gives its configuration class; the rest are the class's defaults.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("qwen3_moe", {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "llama3-rope": ("llama", {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_parameters": LLAMA3, "eos_token_id": [5, 7],
    }),
    "qwen2": ("qwen2", {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "tie_word_embeddings": True,
    }),
    "deepseek-v3-yarn": ("deepseek_v3", {
        "num_hidden_layers": 5, "first_k_dense_replace": 2, "q_lora_rank": None,
        "n_routed_experts": 16, "rope_parameters": YARN, "max_position_embeddings": 163840,
    }),
    "deepseek-v32-yarn": ("deepseek_v32", {
        "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 32,
        "index_topk": 64, "rope_parameters": YARN,
    }),
}
# Per model type, the other name a config.json may give its expert count (attribute_map).
EXPERTS_ALIAS = {
    "qwen3_moe": ("num_local_experts", "num_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts"),
    "deepseek_v32": ("n_routed_experts", "num_experts"),
}


def saved_by_transformers(tmp_path: Path, model_type: str, **settings: Any) -> dict[str, Any]:
    """config.json as a model of this type saves it (naming its architecture)."""
    architecture = MODEL_TYPES[model_type].architecture
    config = getattr(transformers, HF_CONFIGS[model_type])(**settings)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def case_config(tmp_path: Path, case: str) -> dict[str, Any]:
    model_type, settings = CASES[case]
    return saved_by_transformers(tmp_path, model_type, **settings)


def legacy(cfg: dict[str, Any]) -> dict[str, Any]:
    """A 5.x config.json rewritten the 4.x way: rope_theta + rope_scaling with `type`, the
    expert count under its other name, torch_dtype."""
    out = dict(cfg)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    if cfg["model_type"] in EXPERTS_ALIAS:
        name, alias = EXPERTS_ALIAS[cfg["model_type"]]
        out[alias] = out.pop(name)
    out["torch_dtype"] = out.pop("dtype", "bfloat16")
    return out


# -- configs saved by transformers --------------------------------------------------------


@pytest.mark.parametrize("model_type", list(HF_CONFIGS))
def test_defaults_are_transformers_defaults(tmp_path: Path, model_type: str) -> None:
    """A config.json naming only its class reads like the one transformers saves for its
    default configuration (which writes every field out)."""
    saved = saved_by_transformers(tmp_path, model_type)
    bare = {k: saved[k] for k in ("architectures", "model_type")}
    assert ArchConfig.from_dict(saved) == ArchConfig.from_dict(bare)


def test_qwen3_moe_reads_num_local_experts(tmp_path: Path) -> None:
    cfg = case_config(tmp_path, "qwen3-moe")
    assert cfg["num_local_experts"] == 8 and "num_experts" not in cfg  # transformers 5's name
    a = ArchConfig.from_dict(cfg)
    assert (a.architecture, a.num_experts, a.num_experts_per_tok) == ("Qwen3MoeForCausalLM", 8, 2)
    assert [a.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert (a.moe_intermediate_size, a.norm_topk_prob, a.head_dim) == (32, True, 16)
    assert a.rope == RopeConfig("default", 1000000.0) and a.rope_scaling is None
    assert (a.qk_norm, a.qkv_bias, a.num_kv_heads) == (True, False, 2)


def test_llama3_rope_parameters(tmp_path: Path) -> None:
    a = ArchConfig.from_dict(case_config(tmp_path, "llama3-rope"))
    assert a.rope == RopeConfig(
        "llama3", 500000.0, factor=8.0, original_max_position_embeddings=256,
        low_freq_factor=1.0, high_freq_factor=4.0,
    )
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == RopeScaling("llama3", 8.0, 256, 1.0, 4.0)
    assert (a.head_dim, a.num_kv_heads, a.eos_token_ids, a.num_experts) == (16, 2, (5, 7), 0)


def test_qwen2(tmp_path: Path) -> None:
    a = ArchConfig.from_dict(case_config(tmp_path, "qwen2"))
    assert (a.architecture, a.qkv_bias, a.qk_norm, a.tie_word_embeddings) == (
        "Qwen2ForCausalLM", True, False, True,
    )
    assert (a.head_dim, a.num_kv_heads, a.max_position_embeddings) == (16, 1, 32768)
    assert a.rope == RopeConfig("default", 10000.0)


def test_deepseek_v3_fields(tmp_path: Path) -> None:
    a = ArchConfig.from_dict(case_config(tmp_path, "deepseek-v3-yarn"))
    assert a.architecture == "DeepseekV3ForCausalLM" and a.indexer is None
    assert a.mla is not None and a.routing is not None
    assert (a.mla.q_lora_rank, a.mla.kv_lora_rank, a.mla.qk_head_dim, a.mla.v_head_dim) == (
        0, 512, 192, 128,
    )
    assert a.mla.rope_interleave and a.head_dim == a.mla.qk_rope_head_dim == 64
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (16, 8, 2048)
    assert [a.is_moe_layer(i) for i in range(5)] == [False, False, True, True, True]
    r = a.routing
    assert (r.n_shared_experts, r.n_group, r.topk_group, r.routed_scaling_factor) == (1, 8, 4, 2.5)
    assert (r.scoring_func, r.topk_method, r.first_k_dense_replace) == ("sigmoid", "noaux_tc", 2)
    assert a.rope == RopeConfig(
        "yarn", 10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=1.0, truncate=True,
    )


def test_deepseek_v32_fields(tmp_path: Path) -> None:
    cfg = case_config(tmp_path, "deepseek-v32-yarn")
    a = ArchConfig.from_dict(cfg)
    assert a.architecture == "DeepseekV32ForCausalLM" and a.mla is not None
    assert (a.mla.q_lora_rank, a.mla.rope_interleave, a.max_position_embeddings) == (
        1536, True, 163840,
    )
    assert a.indexer is not None
    assert (a.indexer.n_heads, a.indexer.head_dim, a.indexer.topk) == (64, 128, 64)
    assert a.num_experts == 32
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert a.rope.rope_type == "yarn" and a.rope.mscale_all_dim == 1.0
    # `mlp_layer_types`, which transformers 5 saves, wins over first_k_dense_replace
    cfg["mlp_layer_types"] = ["dense", "sparse", "dense", "sparse"]
    assert ArchConfig.from_dict(cfg).mlp_only_layers == (0, 2)


def test_deepseek_v3_released_config_reads() -> None:
    """The fields of DeepSeek-V3's released config.json (4.x names, remote-code fields)."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "n_routed_experts": 256, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": 1536, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {k if k != "rope_type" else "type": v for k, v in YARN.items()
                         if k != "rope_theta"},
        "torch_dtype": "bfloat16", "ep_size": 1, "num_nextn_predict_layers": 1,
    }
    a = ArchConfig.from_dict(cfg)
    assert a.mlp_only_layers == (0, 1, 2) and a.rope.factor == 40.0 and a.rope.theta == 10000.0
    # DeepSeek's rule for moe_layer_freq > 1: MoE on layers >= k with layer % freq == 0
    b = ArchConfig.from_dict({**cfg, "num_hidden_layers": 8, "moe_layer_freq": 2})
    assert [b.is_moe_layer(i) for i in range(8)] == [False] * 4 + [True, False, True, False]


# -- the same settings under legacy or alternative names ---------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_legacy_names_read_the_same(tmp_path: Path, case: str) -> None:
    cfg = case_config(tmp_path, case)
    old = legacy(cfg)
    hf = getattr(transformers, HF_CONFIGS[cfg["model_type"]])
    # transformers itself reads the legacy form to the same rope and expert count
    hf_new, hf_old = hf.from_dict(cfg), hf.from_dict(old)
    assert {**hf_old.rope_parameters, "type": None} == {**hf_new.rope_parameters, "type": None}
    assert getattr(hf_old, "num_local_experts", 0) == getattr(hf_new, "num_local_experts", 0)
    assert ArchConfig.from_dict(old) == ArchConfig.from_dict(cfg)


def test_rope_type_key_and_theta_precedence() -> None:
    base = {"model_type": "llama", "max_position_embeddings": 4096}
    scaling = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}
    with_type = ArchConfig.from_dict(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    )
    assert with_type == ArchConfig.from_dict({**base, "rope_parameters": LLAMA3})
    # `rope_type` wins over `type`; the dict's own theta over the top-level one
    both = {"rope_type": "llama3", "type": "linear", "rope_theta": 500000.0, **scaling}
    assert ArchConfig.from_dict({**base, "rope_theta": 1.0, "rope_parameters": both}) == with_type


def test_rope_defaults_filled_as_transformers() -> None:
    """llama3/yarn's original context defaults to max_position_embeddings; yarn's betas to 32
    and 1, a null factor to the extension ratio."""
    base = {"model_type": "deepseek_v3", "max_position_embeddings": 163840}
    sparse = ArchConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4}})
    assert sparse.rope == RopeConfig(
        "yarn", 10000.0, factor=4, original_max_position_embeddings=163840, beta_fast=32,
        beta_slow=1, truncate=True,
    )
    # what rotary takes: the unset mscales and attention factor at RopeScaling's 0 / None
    assert sparse.rope_scaling == RopeScaling("yarn", 4, 163840, beta_fast=32, beta_slow=1)
    ratio = ArchConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}})
    assert ratio.rope.factor == 40.0


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, r"rope type 'longrope' is not supported"),
        # read by transformers, not computed by layers.rotary
        ({"type": "dynamic", "factor": 2.0}, r"'dynamic' is not supported \(default, linear, "
                                             r"llama3, yarn are\)"),
        ({"type": "llama3", "factor": 8.0}, r"'llama3' needs low_freq_factor, high_freq_factor"),
        ({"rope_type": "linear"}, r"'linear' needs factor"),
    ],
)
def test_bad_rope_is_rejected(rope: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_dict({"model_type": "llama", "rope_scaling": rope})


def test_both_names_of_one_setting_must_agree() -> None:
    cfg = {"model_type": "qwen3_moe", "num_experts": 8}
    assert ArchConfig.from_dict({**cfg, "num_local_experts": 8}).num_experts == 8
    with pytest.raises(ValueError, match=r"both num_experts=8 and num_local_experts=4"):
        ArchConfig.from_dict({**cfg, "num_local_experts": 4})


def test_dtype_wins_over_torch_dtype() -> None:
    cfg = {"model_type": "qwen3", "torch_dtype": "float16"}
    assert ArchConfig.from_dict(cfg).torch_dtype == "float16"
    assert ArchConfig.from_dict({**cfg, "dtype": "float32"}).torch_dtype == "float32"


# -- choosing the model class -------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_model_type_chooses_the_class_without_architectures(model_type: str) -> None:
    a = ArchConfig.from_dict({"model_type": model_type})
    assert a.architecture == MODEL_TYPES[model_type].architecture
    assert a.architecture == getattr(transformers, a.architecture).__name__  # a real HF class


def test_architectures_wins_over_model_type() -> None:
    assert ArchConfig.from_dict(
        {"architectures": ["Foo", "Qwen3ForCausalLM"], "model_type": "llama"}
    ).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"model_type": "gpt2"},
         r"unsupported architecture \(none given\) and model_type 'gpt2'; pipeserve supports "
         r"LlamaForCausalLM \(model_type 'llama'\), "),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "qwen3"},
         r"unsupported architecture \['GPT2LMHeadModel'\]; pipeserve supports LlamaForCausalLM"),
        ({}, r"unsupported architecture \(none given\) and model_type None"),
    ],
)
def test_unknown_model_is_rejected_naming_both(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_dict(cfg)


def test_registry_builds_from_model_type() -> None:
    a = ArchConfig.from_dict(
        {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "vocab_size": 64, "num_local_experts": 2, "num_experts_per_tok": 1,
         "moe_intermediate_size": 16}
    )
    assert model_class(a).__name__ == "Qwen3MoeForCausalLM"
    for model_type, name in (("deepseek_v3", "DeepseekV3ForCausalLM"),
                             ("deepseek_v32", "DeepseekV32ForCausalLM")):
        deepseek = ArchConfig.from_dict({"model_type": model_type})
        model = build_model(deepseek, torch.float32, torch.device("meta"))
        assert type(model).__name__ == name


# -- end to end ---------------------------------------------------------------------------


def test_qwen3_moe_saved_by_transformers_5_matches_hf(model_dir, tmp_path: Path) -> None:
    """The reported failure: a Qwen3-MoE checkpoint saved by transformers 5 stores its expert
    count as `num_local_experts`; read as dense, it failed on missing mlp.down_proj tensors."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
        max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1000000.0},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init, so the logits are far apart
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    path = tmp_path / "qwen3-moe-hf5"
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert saved["num_local_experts"] == 8 and "num_experts" not in saved
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the same 512-token vocabulary
        shutil.copy(model_dir("tiny-qwen3-moe") / name, path / name)
    ids = prompts()[:1]
    (got,) = run_engine(path, LAYOUTS["chunk128"], ids)
    logprobs, tokens = hf_run(model, ids[0])
    assert got["output_ids"] == tokens and len(tokens) == GREEDY["max_new_tokens"]
    torch.testing.assert_close(
        torch.tensor(got["prompt_logprobs"]), logprobs, atol=LOGPROB_ATOL, rtol=0
    )
