"""The same workload on Hugging Face transformers (a test/benchmark-time dependency only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.summary import summarize
from pipeserve.device import peak_memory, reset_peak_memory, synchronize


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
    waits for the device (the step's logits exist then), after a warm-up at the prompts'
    length (`warm_up_len`). Reported besides: the attention kernels SDPA ran in the warm-up
    (`sdpa_kernels`, from the profiler: flash, memory-efficient, cuDNN, or none seen: the
    math path) and the timed call's peak allocated memory."""
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
        def warm_up() -> None:
            few = ids[:1, : warm_up_len(ids.shape[1], device)]
            model.generate(few, attention_mask=torch.ones_like(few), max_new_tokens=2, **kwargs)

        if device.type == "cuda":
            kernels = attention_kernels_run(warm_up)
            reset_peak_memory(device)
        else:
            kernels = None
            warm_up()
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
    stats: dict[str, Any] = dict(
        summarize(
            [ttft] * len(prompts), total, ids.numel(), len(prompts) * output_len, len(prompts)
        )
    )
    stats["output_ids"] = out[:, ids.shape[1] :].tolist()
    stats["sdpa_kernels"] = kernels
    stats["peak_device_bytes"] = peak_memory(device)
    return stats


FULL_WARM_UP_MAX = 131072  # longer prompts warm up on 64 tokens: a plan is a small share there


def warm_up_len(length: int, device: torch.device) -> int:
    """The warm-up prompt's length. On a GPU the prompts' own (up to FULL_WARM_UP_MAX): SDPA's
    cuDNN kernels build a plan per new shape on its first call, which made transformers'
    32K prefill on an H200 take 0.71 s against 0.61 s at 128K when the warm-up was 64
    tokens; elsewhere 64 tokens."""
    if device.type == "cuda" and length <= FULL_WARM_UP_MAX:
        return length
    return min(length, 64)


ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attention", "cudnn")


def attention_kernels_run(fn: Callable[[], object]) -> list[str]:
    """What attention `fn` ran, as the profiler saw it: the SDPA ops dispatched to
    (aten::_scaled_dot_product_flash_attention, ..._efficient_attention, ..._cudnn_attention,
    or the math path's) and the GPU kernels that look like fused attention (flash, cutlass
    fmha, cuDNN)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    seen = set()
    for e in prof.events():
        name = e.name.lower()
        if e.device_type.name == "CUDA" and any(w in name for w in ATTENTION_KERNEL_WORDS):
            seen.add(e.name[:120])
        elif e.name.startswith("aten::_scaled_dot_product"):
            seen.add(e.name)
    return sorted(seen)
