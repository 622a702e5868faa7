"""Config settings that change what a layer computes, each either run as transformers runs
it or refused at start-up, never ignored: an o_proj bias (attention_bias on Llama, Qwen3 and
Qwen3-MoE, whose o_proj transformers builds with it; Qwen2 biases q/k/v only), Llama's
mlp_bias, an activation other than SiLU; and a checkpoint bias that the model its
config.json describes would not read. Found by a sweep of held-out configs against
transformers (2026-12-01), where each of them ran silently wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeserve import Engine
from pipeserve.models.arch import ArchConfig

pytestmark = pytest.mark.timeout(300)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
ATOL = 1e-4
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-attention-bias": ("tiny-llama", {"attention_bias": True}),
    "llama-mlp-bias": ("tiny-llama", {"mlp_bias": True}),
    "qwen3-attention-bias": ("tiny-qwen3", {"attention_bias": True}),
    "qwen3-moe-attention-bias": ("tiny-qwen3-moe", {"attention_bias": True}),
}
LAYOUTS = {
    "native": {"chunked_prefill_size": 32},
    "torch": {"chunked_prefill_size": 32, "attention_backend": "torch"},
    "tp2": {"chunked_prefill_size": 32, "tp_size": 2},  # a row-parallel bias added once
}
RUNS = [(c, "native") for c in CASES] + [
    ("llama-attention-bias", "torch"),
    ("llama-attention-bias", "tp2"),
    ("llama-mlp-bias", "tp2"),
]


def prompt() -> list[int]:
    return torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(7)).tolist()


def hf_logprobs(path: Path, ids: list[int], zero_biases: tuple[str, ...] = ()) -> torch.Tensor:
    """transformers' prompt logprobs of `ids` over `path` (the biases whose names end in one
    of `zero_biases` set to zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(zero_biases):
                p.zero_()
        x = torch.tensor([ids])
        logits = model(x, attention_mask=torch.ones_like(x)).logits[0]
    return torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]


@pytest.fixture(scope="module")
def checkpoints(model_dir) -> dict[str, Path]:
    return {name: model_dir(preset, **over) for name, (preset, over) in CASES.items()}


@pytest.mark.parametrize(("case", "layout"), RUNS)
def test_biases_are_computed_as_transformers_does(
    checkpoints: dict[str, Path], case: str, layout: str
) -> None:
    """Prompt logprobs within ATOL of transformers on the same checkpoint, where the same
    model with the setting's biases zeroed is 100x further off (so they matter here)."""
    path, ids = checkpoints[case], prompt()
    biases = ("o_proj.bias",) if "attention" in case else ("proj.bias",)
    names = load_file(path / "model.safetensors").keys()
    assert any(n.endswith(biases) for n in names)  # the checkpoint holds them
    with Engine(str(path), dtype="float32", **LAYOUTS[layout]) as engine:
        out = engine.generate(input_ids=[ids], sampling_params=GREEDY, return_logprob=True)[0]
    want = hf_logprobs(path, ids)
    got = torch.tensor(out["prompt_logprobs"], dtype=torch.float32)
    assert (got - want).abs().max() < ATOL
    assert (hf_logprobs(path, ids, biases) - want).abs().max() > 100 * ATOL


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_an_activation_other_than_silu_is_refused(model_type: str) -> None:
    base = {"model_type": model_type}
    assert ArchConfig.from_dict({**base, "hidden_act": "swish"})  # ACT2FN's other SiLU
    assert ArchConfig.from_dict(base)  # transformers' default: silu
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ArchConfig.from_dict({**base, "hidden_act": "gelu"})


def test_o_bias_follows_each_model_type_as_transformers_builds_it() -> None:
    on = {"attention_bias": True}
    assert ArchConfig.from_dict({"model_type": "llama", **on}).o_bias
    assert not ArchConfig.from_dict({"model_type": "qwen2", **on}).o_bias  # q/k/v only
    assert not ArchConfig.from_dict({"model_type": "qwen2"}).o_bias
    assert ArchConfig.from_dict({"model_type": "llama", "mlp_bias": True}).mlp_bias
    assert not ArchConfig.from_dict({"model_type": "qwen3", "mlp_bias": True}).mlp_bias


@pytest.mark.parametrize(
    "extra", ["model.layers.1.self_attn.o_proj.bias", "model.layers.0.input_layernorm.bias"]
)
def test_a_bias_the_model_has_no_place_for_is_refused(
    model_dir, tmp_path: Path, extra: str
) -> None:
    """A checkpoint holding a bias beside a weight the model reads, where the model its
    config.json describes has none, is refused at load, naming it (was: ignored)."""
    src, path = model_dir("tiny-llama"), tmp_path / "extra-bias"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    tensors[extra] = torch.ones(json.loads((path / "config.json").read_text())["hidden_size"])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"no place for: {extra.replace('.', '[.]')}"):
        Engine(str(path), dtype="float32")
