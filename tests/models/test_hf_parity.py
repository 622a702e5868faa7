"""Every tiny preset against Hugging Face transformers on the same random-weight checkpoint,
in float32: prompt logprobs within 1e-4 and 32 greedy tokens identical.

The prompts (40 and 600 tokens, in one batch) and the two layouts are chosen so that every
attention path runs: chunks of 128 take the blockwise kernel and later chunks read a cached
prefix both gathered (< VIEW_MIN_TOKENS) and as views; chunks of 16 take the fused kernel;
decode reads the 600-token run as a view. `test_every_attention_path_ran` checks that."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.backends import torch_backend
from pipeserve.backends.base import AttentionPlan
from pipeserve.backends.native_backend import RunChunk, RunSteps
from pipeserve.backends.split import SplitMeta
from pipeserve.backends.torch_backend import ChunkPlan, StepPlan
from pipeserve.device import native_prefill_kernel
from pipeserve.engine.engine import Engine
from pipeserve.layers.rotary import inverse_frequencies
from pipeserve.models.arch import ArchConfig
from pipeserve.models.presets import make_model
from pipeserve.runner import forward_batch

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]
VOCAB = 512  # of every tiny preset
PROMPT_LENS = (40, 600)
NEW_TOKENS = 32
LOGPROB_ATOL = 1e-4
LAYOUTS: dict[str, dict[str, Any]] = {
    # the native kernels (prompt chunks and decode) where they build, cached prefixes
    "chunk128": {"chunked_prefill_size": 128},
    # blockwise torch kernel for chunks over cached prefixes; decode on the pure-torch path,
    # each step read in place (its long runs as views, the rest gathered: ENV)
    "chunk128-torch": {"chunked_prefill_size": 128, "attention_backend": "torch"},
    # fused kernel for chunks; decode steps gathered a group of lengths at a time for one
    # call (ENV: a GPU's way)
    "chunk16-page16": {"chunked_prefill_size": 16, "page_size": 16, "attention_backend": "torch"},
}
ENV = {
    "chunk128-torch": {"PIPESERVE_DECODE_GATHER_MAX_BYTES": "0"},
    "chunk16-page16": {"PIPESERVE_DECODE_GATHER_MAX_BYTES": str(2**30)},
}
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
pytestmark = pytest.mark.timeout(300)  # a scheduling bug shows up as a hang: fail it fast


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


class PathRecorder:
    """Counts which attention paths a generate call took (the kernels are module functions,
    so wrapping them here also sees calls on the overlap loop's compute thread)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.seen: Counter[str] = Counter()
        plan, blockwise, fused = (
            forward_batch.plan_attention,
            torch_backend.blockwise_prefill,
            torch_backend.fused_prompt_chunk,
        )
        gathered, in_place = torch_backend.gathered_steps, torch_backend.in_place_parts

        def plan_spy(*args: Any, **kwargs: Any) -> AttentionPlan:
            p = plan(*args, **kwargs)
            metas = (
                [p.meta] if not isinstance(p.meta, SplitMeta) else [p.meta.prefill, p.meta.decode]
            )
            chunks = [c for m in metas if m is not None for c in m.chunks]
            decodes = [m.decode for m in metas if m is not None and m.decode is not None]
            ours = [c for c in chunks if isinstance(c, ChunkPlan)]  # the torch backend's
            natives = [c for c in chunks if isinstance(c, RunChunk)]
            self.seen["chunk_prefix_view"] += any(c.views for c in ours)
            self.seen["chunk_prefix_gathered"] += any(c.gather is not None for c in ours)
            self.seen["decode_torch"] += any(isinstance(d, StepPlan) for d in decodes)
            self.seen["decode_native"] += any(isinstance(d, RunSteps) for d in decodes)
            self.seen["chunk_native"] += bool(natives)
            self.seen["chunk_native_with_prefix"] += any(c.prefix_len > 0 for c in natives)
            return p

        def blockwise_spy(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: list, scale: float
        ) -> torch.Tensor:
            self.seen["blockwise"] += 1
            self.seen["blockwise_with_prefix"] += bool(cached)
            return blockwise(q, k, v, cached, scale)

        def fused_spy(
            layer: Any,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cached: list,
            *kernels: Any,
        ) -> torch.Tensor:
            self.seen["fused"] += 1
            self.seen["fused_with_prefix"] += bool(cached)
            return fused(layer, q, k, v, cached, *kernels)

        def gathered_spy(*args: Any) -> torch.Tensor:
            self.seen["decode_gathered"] += 1
            return gathered(*args)

        def in_place_spy(plan: Any, i: int) -> tuple[list, torch.Tensor | None]:
            views, rest = in_place(plan, i)
            self.seen["decode_in_place"] += 1
            self.seen["decode_view"] += bool(views)
            return views, rest

        mp.setattr(forward_batch, "plan_attention", plan_spy)
        mp.setattr(torch_backend, "gathered_steps", gathered_spy)
        mp.setattr(torch_backend, "in_place_parts", in_place_spy)
        mp.setattr(torch_backend, "blockwise_prefill", blockwise_spy)
        mp.setattr(torch_backend, "fused_prompt_chunk", fused_spy)


def run_engine(path: Path, layout: dict[str, Any], ids: list[list[int]]) -> list[dict[str, Any]]:
    with Engine(str(path), dtype="float32", max_total_tokens=4096, **layout) as engine:
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    assert isinstance(out, list)
    return out


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    """preset -> per prompt (prompt logprobs [n-1], greedy token ids [NEW_TOKENS])."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, list[tuple[torch.Tensor, list[int]]]] = {}

    def get(preset: str) -> list[tuple[torch.Tensor, list[int]]]:
        if preset not in cache:
            path = model_dir(preset)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            assert model.config.vocab_size == VOCAB
            cache[preset] = [hf_run(model, ids) for ids in prompts()]
        return cache[preset]

    return get


def hf_run(
    model: Any, ids: list[int], new_tokens: int = NEW_TOKENS
) -> tuple[torch.Tensor, list[int]]:
    """transformers' prompt logprobs of `ids` and its greedy continuation."""
    x = torch.tensor([ids])
    mask = torch.ones_like(x)  # token 0 occurs in the prompts: it must not read as padding
    with torch.inference_mode():
        logits = model(x, attention_mask=mask).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]
        out = model.generate(
            x,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return logprobs, out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def engine_run(model_dir):
    """(preset, layout) -> (outputs for both prompts, attention paths taken)."""
    cache: dict[tuple[str, str], tuple[list[dict[str, Any]], Counter[str]]] = {}

    def get(preset: str, layout: str) -> tuple[list[dict[str, Any]], Counter[str]]:
        if (preset, layout) not in cache:
            path = model_dir(preset)
            with pytest.MonkeyPatch.context() as mp:
                for name, value in ENV.get(layout, {}).items():
                    mp.setenv(name, value)
                rec = PathRecorder(mp)
                out = run_engine(path, LAYOUTS[layout], prompts())
            cache[preset, layout] = out, rec.seen
        return cache[preset, layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_prompt_logprobs_match_hf(engine_run, hf_reference, preset: str, layout: str) -> None:
    outputs, _ = engine_run(preset, layout)
    for out, (expected, _) in zip(outputs, hf_reference(preset), strict=True):
        got = torch.tensor(out["prompt_logprobs"])
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_match_hf(engine_run, hf_reference, preset: str, layout: str) -> None:
    outputs, _ = engine_run(preset, layout)
    for out, (_, expected) in zip(outputs, hf_reference(preset), strict=True):
        assert out["output_ids"] == expected
        assert out["meta_info"]["finish_reason"] == "length"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_attention_path_ran(engine_run, layout: str) -> None:
    _, seen = engine_run("tiny-qwen3", layout)
    if LAYOUTS[layout].get("attention_backend") == "torch":
        assert seen["decode_torch"] > 0 and seen["decode_native"] == 0, seen
        if ENV[layout]["PIPESERVE_DECODE_GATHER_MAX_BYTES"] != "0":  # every group gathered
            assert seen["decode_gathered"] > 0 and seen["decode_in_place"] == 0, seen
        else:  # every step in place, its long runs as views
            assert seen["decode_view"] > 0 and seen["decode_gathered"] == 0, seen
        assert seen["chunk_native"] == 0, seen
    elif native_prefill_kernel(torch.float32) is not None:  # AVX2: every x86 CPU here
        assert seen["decode_native"] > 0 and seen["chunk_native_with_prefix"] > 0, seen
        return
    else:
        assert seen["decode_native"] > 0, seen
    assert seen["chunk_prefix_view"] > 0 and seen["chunk_prefix_gathered"] > 0, seen
    if layout.startswith("chunk128"):
        assert seen["blockwise_with_prefix"] > 0, seen
    else:
        assert seen["blockwise"] == 0 and seen["fused_with_prefix"] > 0, seen


def test_llama3_rope_scaling_is_exercised(model_dir, hf_reference, tmp_path: Path) -> None:
    """tiny-llama carries Llama-3 rope scaling that changes its frequencies; the same weights
    without it disagree with HF, so the parity above really covers the scaling."""
    src = model_dir("tiny-llama")
    config = json.loads((src / "config.json").read_text())
    arch = ArchConfig.from_dict(config)
    assert arch.rope.rope_type == "llama3"
    head_dim, theta = arch.head_dim, arch.rope_theta
    assert not torch.allclose(
        inverse_frequencies(head_dim, theta, arch.rope_scaling),
        inverse_frequencies(head_dim, theta, None),
    )
    unscaled = tmp_path / "tiny-llama-unscaled"
    shutil.copytree(src, unscaled)
    del config["rope_scaling"]
    (unscaled / "config.json").write_text(json.dumps(config))
    short = prompts()[:1]
    out = run_engine(unscaled, LAYOUTS["chunk128"], short)[0]
    expected, _ = hf_reference("tiny-llama")[0]
    assert (torch.tensor(out["prompt_logprobs"]) - expected).abs().max() > 100 * LOGPROB_ATOL


@pytest.mark.parametrize("preset", PRESETS)
def test_sharded_checkpoint_loads_identically(model_dir, tmp_path: Path, preset: str) -> None:
    sharded = make_model(preset, tmp_path / preset, shard_size_mb=0)  # one tensor per file
    files = list(sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(files) > 10 and set(index["weight_map"].values()) == {f.name for f in files}
    ids = prompts()[:1]
    layout = LAYOUTS["chunk16-page16"]
    (got,) = run_engine(sharded, layout, ids)
    (expected,) = run_engine(model_dir(preset), layout, ids)
    assert got["output_ids"] == expected["output_ids"]
    assert got["prompt_logprobs"] == expected["prompt_logprobs"]
