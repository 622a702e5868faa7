"""The same workload on Hugging Face transformers (a test/benchmark-time dependency only)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.summary import summarize
from pipeserve.device import synchronize


def run_hf(
    model_path: Path,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """`generate` on all prompts as one batch (equal lengths, no padding), greedy. A logits
    processor stamps each step, so the prefill (until the first step) and decode spans are
    measured inside the one call. On a GPU: transformers' SDPA attention, and each stamp
    waits for the device (the step's logits exist then)."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            synchronize(scores.device)
            self.times.append(time.perf_counter())
            return scores

    device = device or torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()  # type: ignore[arg-type]
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        # An explicit mask: token id 0 may occur in the prompts and must not read as padding.
        model.generate(
            ids[:1, :64], attention_mask=torch.ones_like(ids[:1, :64]), max_new_tokens=2, **kwargs
        )  # warm-up
        stamp = Stamp()
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            logits_processor=LogitsProcessorList([stamp]),
            **kwargs,
        )
        synchronize(device)
        total = time.perf_counter() - start
    ttft = stamp.times[0] - start
    stats = summarize(
        [ttft] * len(prompts), total, ids.numel(), len(prompts) * output_len, len(prompts)
    )
    stats["output_ids"] = out[:, ids.shape[1] :].tolist()
    return stats
