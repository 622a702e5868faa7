"""The same workload on Hugging Face transformers (a test/benchmark-time dependency only)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.offline import summarize


def run_hf(
    model_path: Path, prompts: list[list[int]], output_len: int, dtype: torch.dtype
) -> dict[str, Any]:
    """`generate` on all prompts as one batch (equal lengths, no padding), greedy. A logits
    processor stamps each step, so the prefill (until the first step) and decode spans are
    measured inside the one call."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        # An explicit mask: token id 0 may occur in the prompts and must not read as padding.
        model.generate(
            ids[:1, :64], attention_mask=torch.ones_like(ids[:1, :64]), max_new_tokens=2, **kwargs
        )  # warm-up
        stamp = Stamp()
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            logits_processor=LogitsProcessorList([stamp]),
            **kwargs,
        )
        total = time.perf_counter() - start
    ttft = stamp.times[0] - start
    stats = summarize(
        [ttft] * len(prompts), total, ids.numel(), len(prompts) * output_len, len(prompts)
    )
    stats["output_ids"] = out[:, ids.shape[1] :].tolist()
    return stats
