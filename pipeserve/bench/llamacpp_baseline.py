"""The same workload on llama.cpp, the engine a user of one CPU machine compares with, on the
same GGUF file (llama-cpp-python: a benchmark-time dependency only, `pip install
llama-cpp-python`, which builds llama.cpp for this CPU).

The binding runs one sequence at a time, so the prompts run one after another: each one's
TTFT counts from the start of the whole run (a later prompt waits, as in a queue); the
prefill and decode spans are the sums of each prompt's own. With one prompt (one
conversation, the comparison that matters on a CPU) all are the plain figures. Greedy,
flash attention on, the run's thread count for both the prompt and the steps; each prompt
starts from an empty KV cache (no prefix reuse)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

LLAMACPP_MISSING = (
    "--baseline llamacpp needs llama-cpp-python: pip install llama-cpp-python (it builds "
    "llama.cpp for this CPU, several minutes)"
)
WARM_UP = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids: a short first call loads and plans


def run_llamacpp(
    gguf: Path, prompts: list[list[int]], output_len: int, threads: int
) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeError(LLAMACPP_MISSING) from exc
    longest = max(len(p) for p in prompts) + output_len
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=max(longest, len(WARM_UP) + 4),
        n_batch=min(2048, longest),
        n_ubatch=min(512, longest),
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    _generate(llm, WARM_UP, 2)
    ttfts, outputs, prefill_s, decode_s = [], [], 0.0, 0.0
    start = time.perf_counter()
    for prompt in prompts:
        begin = time.perf_counter()
        first, tokens = _generate(llm, prompt, output_len)
        end = time.perf_counter()
        ttfts.append(first - start)
        prefill_s, decode_s = prefill_s + first - begin, decode_s + end - first
        outputs.append(tokens)
    total = time.perf_counter() - start
    decoded = sum(len(t) - 1 for t in outputs)
    stats: dict[str, Any] = {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total,
        "input_throughput_tok_s": sum(len(p) for p in prompts) / prefill_s,
        "output_throughput_tok_s": decoded / decode_s if decoded else 0.0,
        "output_ids": outputs,
    }
    stats["version"] = getattr(llama_cpp, "__version__", "unknown")
    return stats


def _generate(llm: Any, prompt: list[int], count: int) -> tuple[float, list[int]]:
    """`count` (at least 1) greedy tokens after `prompt` from an empty cache -> (when the
    first came, the tokens)."""
    if count < 1:
        raise ValueError("llama.cpp's baseline generates at least one token")
    llm.reset()  # forget the last sequence: its KV is not reused as a prefix
    tokens: list[int] = []
    first = 0.0
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
        if len(tokens) == count:
            break
    return first, tokens
