"""bfloat16 as accurate as transformers' bfloat16, on every CPU: pipeserve's prompt logprobs
in bfloat16 are no further from transformers' float32 ones than transformers' own bfloat16
ones are, within 1.1x in the mean and 1.25x in the max over three texts pooled (one text's
max is noisy). The built-in model on English texts, and random-weight Llama, Qwen3,
Qwen3-MoE and DeepSeek-V3 configs on random tokens; at PP1 and across a pipeline (PP2).

Whatever kernels this CPU runs in bfloat16 run here: the native AVX512-BF16 prefill and
decode kernels where the CPU has them (PIPESERVE_NATIVE_KERNELS=0 turns them off, to compare),
the AVX2 kernel on bfloat16 storage elsewhere. Issue 48 saw a max error 1.65x transformers'
on one README text of the built-in model on a Zen 4; measured since, exact attention rounded
to bfloat16 gives that text the same max (one sensitive position decides it), so the bound is
on three texts pooled. The kernels' own accuracy is bounded layer by layer in
tests/kernels/test_prefill_kernel.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.models.resolve import resolve_model_path

pytestmark = pytest.mark.timeout(600)

MEAN_BOUND, MAX_BOUND = 1.1, 1.25
TEXTS = [
    "The river rose through the night, and by morning the low fields by the mill were a "
    "single sheet of brown water. The miller's daughter walked the dike with a lantern, "
    "counting the posts that still showed above the flood, and wrote each number down.",
    "A compiler turns source code into machine instructions in stages: the text is split "
    "into tokens, the tokens are parsed into a tree, the tree is checked for types, and an "
    "intermediate form is optimised before registers are assigned and code is emitted.",
    "Photosynthesis takes carbon dioxide from the air and water from the soil, and with the "
    "energy of sunlight builds sugars in the leaves; oxygen is released as a by-product, "
    "which is why forests and oceans matter so much for the air that animals breathe.",
]


def hf_logprobs(path: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(x, attention_mask=torch.ones_like(x)).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]


def errors(path: Path, texts: list[list[int]], **flags: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute prompt-logprob errors against transformers' float32, all texts pooled:
    (pipeserve in bfloat16, transformers in bfloat16)."""
    with Engine(str(path), dtype="bfloat16", chunked_prefill_size=64, **flags) as engine:
        outs = engine.generate(
            input_ids=texts, sampling_params={"max_new_tokens": 1}, return_logprob=True
        )
    assert isinstance(outs, list)
    ours, theirs = [], []
    for out, ids in zip(outs, texts, strict=True):
        exact = hf_logprobs(path, ids, torch.float32)
        ours.append((torch.tensor(out["prompt_logprobs"]) - exact).abs())
        theirs.append((hf_logprobs(path, ids, torch.bfloat16) - exact).abs())
    return torch.cat(ours), torch.cat(theirs)


def assert_within_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    figures = {
        "mean": (ours.mean().item(), theirs.mean().item()),
        "max": (ours.max().item(), theirs.max().item()),
    }
    assert figures["mean"][0] <= MEAN_BOUND * figures["mean"][1], figures
    assert figures["max"][0] <= MAX_BOUND * figures["max"][1], figures


def random_texts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (96, 160, 200)]


@pytest.mark.parametrize(
    ("preset", "layout"),
    [
        ("tiny-llama", {}),
        ("tiny-qwen3", {}),
        ("tiny-qwen3-moe", {}),
        ("tiny-deepseek-v3", {}),
        ("tiny-llama", {"pp_size": 2}),
    ],
    ids=["llama", "qwen3", "qwen3-moe", "deepseek-v3", "llama-pp2"],
)
def test_random_configs_in_bfloat16_within_transformers_rounding(
    model_dir, preset: str, layout: dict[str, Any]
) -> None:
    path = model_dir(preset)
    assert_within_rounding(*errors(path, random_texts(512), **layout))


@pytest.mark.slow
def test_the_built_in_model_in_bfloat16_within_transformers_rounding() -> None:
    path = resolve_model_path(None, "bfloat16")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = [tokenizer.encode(t).ids for t in TEXTS]
    assert all(len(ids) >= 40 for ids in texts)
    assert_within_rounding(*errors(path, texts))
