"""The DeepSeek issue's closing figures on bench-deepseek (bf16, one thread), pipeserve vs
Hugging Face transformers on the same checkpoint. Prints and saves JSON.

- kv: cache bytes per token, MLA's latent layout vs per-head K/V of GQA and MHA models of the
  same width (16 query heads of 64; 4 and 16 KV heads), from the engine's own pool sizing.
- prefill: time to first token of one prompt per length. transformers runs the prompt in one
  forward where its attention fits in memory, else (--hf-piece) in pieces through its cache.
- decode: 32 requests at an 8K context (one shared 8191-token prefix and a distinct last token
  each, so transformers prefills once: its cache is then copied to a batch of 32; pipeserve
  reads the prefix from its radix cache, one copy for all). Output tokens per second over the
  decode span.

    python benchmarks/deepseek_bench.py --prefill 8192 --decode --json out/deepseek.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from pipeserve.bench.offline import make_prompts
from pipeserve.device import DTYPES, best_dtype
from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig
from pipeserve.models.presets import preset_path
from pipeserve.runner.kv_layout import kv_bytes_per_token

PRESET = "bench-deepseek"
# what the engine computes in here by default (bf16 with native bf16 products, else float32)
DTYPE_NAME = best_dtype(torch.device("cpu"))
DTYPE = DTYPES[DTYPE_NAME]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def kv_report(arch: ArchConfig) -> dict[str, Any]:
    dtype, layers = DTYPE, arch.num_layers
    gqa = dataclasses.replace(arch, mla=None, indexer=None, num_kv_heads=4, head_dim=64)
    mha = dataclasses.replace(gqa, num_kv_heads=16)
    rows = {
        name: kv_bytes_per_token(a, layers, 1, dtype)
        for name, a in (("mla", arch), ("gqa_16q_4kv_d64", gqa), ("mha_16_d64", mha))
    }
    out = {name: {"per_token": b, "per_token_per_layer": b // layers} for name, b in rows.items()}
    for name in ("gqa_16q_4kv_d64", "mha_16_d64"):
        out[name]["mla_ratio"] = rows["mla"] / rows[name]
    return out


def engine() -> Engine:
    return Engine(PRESET, threads_per_worker=1, max_total_tokens=40000)


def pipeserve_ttft(length: int) -> float:
    with engine() as e:
        e.generate(input_ids=[list(range(64))], sampling_params={**GREEDY, "max_new_tokens": 2})
        ids = make_prompts(e.arch.vocab_size, 1, length, seed=0)
        out = e.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 1})
    return float(out[0]["meta_info"]["ttft_s"])


def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(preset_path(PRESET), dtype=DTYPE).eval()


@torch.inference_mode()
def hf_prefill(model: Any, ids: list[int], piece: int) -> tuple[float, Any, int]:
    """Seconds to the first token, its cache, and the greedy first token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    for s in range(0, len(ids), piece):
        x = torch.tensor([ids[s : s + piece]])
        logits = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = int(logits[0, -1].argmax())
    return time.perf_counter() - start, cache, token


@dataclasses.dataclass(frozen=True)
class HFPieces:
    """transformers runs a prompt in one forward up to `max_forward` tokens, else in pieces of
    `piece` through its cache (one forward's attention scores grow as the square)."""

    max_forward: int
    piece: int

    def size(self, n: int) -> int:
        return n if n <= self.max_forward else self.piece


def same_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens equal before each request's first difference (bfloat16 near-ties flip)."""
    agree = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
        for p, q in zip(a, b, strict=True)
    ]
    return {
        "identical_requests": sum(n == len(p) for n, p in zip(agree, a, strict=True)),
        "requests": len(a),
        "agreeing_prefix_tokens": agree,
    }


def prefill_report(lengths: list[int], hf: bool, pieces: HFPieces) -> list[dict[str, Any]]:
    model = hf_model() if hf else None
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"length": n, "pipeserve_ttft_s": pipeserve_ttft(n)}
        if model is not None:
            ids = make_prompts(model.config.vocab_size, 1, n, seed=0)[0]
            row["hf_ttft_s"], _, _ = hf_prefill(model, ids, pieces.size(n))
            row["hf_piece"] = pieces.size(n)
            row["ratio"] = row["pipeserve_ttft_s"] / row["hf_ttft_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode_prompts(vocab: int, context: int, requests: int) -> tuple[list[int], list[list[int]]]:
    prefix = make_prompts(vocab, 1, context - 1, seed=1)[0]
    return prefix, [prefix + [(7 * i + 11) % vocab] for i in range(requests)]


def pipeserve_decode(context: int, requests: int, steps: int) -> dict[str, Any]:
    with engine() as e:
        prefix, prompts = decode_prompts(e.arch.vocab_size, context, requests)
        e.generate(input_ids=[prefix], sampling_params={**GREEDY, "max_new_tokens": 1})
        start = time.perf_counter()
        out = e.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": steps})
        total = time.perf_counter() - start
    first = max(o["meta_info"]["ttft_s"] for o in out)
    cached = min(o["meta_info"]["cached_tokens"] for o in out)
    return {
        "decode_tok_s": requests * (steps - 1) / (total - first),
        "first_token_s": first,
        "cached_tokens_min": cached,
        "output_ids": [o["output_ids"] for o in out],
    }


@torch.inference_mode()
def hf_decode(context: int, requests: int, steps: int, pieces: HFPieces) -> dict[str, Any]:
    model = hf_model()
    prefix, prompts = decode_prompts(model.config.vocab_size, context, requests)
    _, cache, _ = hf_prefill(model, prefix, pieces.size(len(prefix)))
    cache.batch_repeat_interleave(requests)
    x = torch.tensor([[p[-1]] for p in prompts])
    tokens, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(x, past_key_values=cache, use_cache=True).logits
        x = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
        tokens.append(x[:, 0].tolist())
    decode_time = sum(times[1:])  # the first step yields the first tokens (the prefill's end)
    return {
        "decode_tok_s": requests * (steps - 1) / decode_time,
        "step_s": times,
        "output_ids": [list(t) for t in zip(*tokens, strict=True)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="", help="prompt lengths, e.g. 8192,32768")
    ap.add_argument("--decode", action="store_true", help="32 requests at an 8K context")
    ap.add_argument("--decode-requests", type=int, default=32)
    ap.add_argument("--decode-context", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true", help="pipeserve only")
    ap.add_argument(
        "--hf-max-forward",
        type=int,
        default=8192,
        help="transformers runs longer prompts in pieces of --hf-piece tokens",
    )
    ap.add_argument("--hf-piece", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    arch = ArchConfig.load(preset_path(PRESET))
    report: dict[str, Any] = {
        "model": PRESET,
        "dtype": DTYPE_NAME,
        "threads": 1,
        "kv_bytes": kv_report(arch),
    }
    print(json.dumps(report["kv_bytes"], indent=1))
    if args.prefill:
        lengths = [int(x) for x in args.prefill.split(",")]
        pieces = HFPieces(args.hf_max_forward, args.hf_piece)
        report["prefill"] = prefill_report(lengths, not args.no_hf, pieces)
    if args.decode:
        spec = (args.decode_context, args.decode_requests, args.decode_steps)
        d: dict[str, Any] = {"pipeserve": pipeserve_decode(*spec)}
        if not args.no_hf:
            d["hf"] = hf_decode(*spec, HFPieces(args.hf_max_forward, args.hf_piece))
            d["ratio"] = d["pipeserve"]["decode_tok_s"] / d["hf"]["decode_tok_s"]
            d["same_tokens"] = same_tokens(d["pipeserve"]["output_ids"], d["hf"]["output_ids"])
        report["decode"] = d
        print(
            json.dumps(
                {k: v for k, v in d.items() if k not in ("pipeserve", "hf")}
                | {
                    "pipeserve_tok_s": d["pipeserve"]["decode_tok_s"],
                    "hf_tok_s": d.get("hf", {}).get("decode_tok_s"),
                }
            ),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
