"""The timing summary every benchmark run reports, pipeserve's and the baselines' alike."""

from __future__ import annotations

import statistics


def summarize(
    ttfts: list[float], total_s: float, input_tokens: int, output_tokens: int, num_prompts: int
) -> dict[str, float]:
    """Prefill span = until the last request has its first token; decode span = the rest."""
    prefill_s = max(ttfts)
    decode_s = total_s - prefill_s
    decode_tokens = output_tokens - num_prompts
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "input_throughput_tok_s": input_tokens / prefill_s,
        "output_throughput_tok_s": decode_tokens / decode_s if decode_tokens > 0 else 0.0,
    }
