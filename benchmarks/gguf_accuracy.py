"""What computing on a GGUF checkpoint's kept blocks costs in accuracy: prompt-logprob error
against the same checkpoint's exact values in float32 (`--gguf-weights dequantize`), for
pipeserve's kept blocks (whose decode-sized products round x per block in two 8-bit parts,
kernels/skinny_linear.cpp) and for llama.cpp on the file itself (x in one 8-bit part), as the
mean and the max over all texts pooled. The built-in model (its Q4_1 GGUF) reads four
256-token pieces of README.md.

Prompt chunks of 16 tokens put every product of pipeserve's forward on the decode kernel (it
takes up to 16 rows; longer chunks run torch's GEMM on the exact values). llama.cpp (the
optional llama-cpp-python) quantises its activations for every product. Prints and saves JSON.

    python benchmarks/gguf_accuracy.py --json out.json"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch

from pipeserve.engine.engine import Engine
from pipeserve.models.resolve import gguf_file, resolve_model_path

KERNEL_ROWS = 16  # prompt chunk: every product on the kept blocks' decode kernel


def pipeserve_logprobs(texts: list[list[int]], **flags: Any) -> list[torch.Tensor]:
    with Engine(dtype="float32", **flags) as engine:
        outs = engine.generate(
            input_ids=texts, sampling_params={"max_new_tokens": 1}, return_logprob=True
        )
    assert isinstance(outs, list)
    return [torch.tensor(o["prompt_logprobs"]) for o in outs]


def llamacpp_logprobs(gguf: Path, texts: list[list[int]], threads: int) -> list[torch.Tensor]:
    import llama_cpp

    longest = max(len(t) for t in texts)
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=longest,
        n_batch=longest,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    out = []
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[: len(ids)]).float()
        target = torch.tensor(ids[1:])
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, target[:, None])[:, 0])
    return out


def figures(errors: list[torch.Tensor]) -> dict[str, float]:
    pooled = torch.cat(errors).abs()
    return {"mean": pooled.mean().item(), "max": pooled.max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    path = resolve_model_path(None, "float32")
    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    texts = [ids[i * 256 : (i + 1) * 256] for i in range(4)]
    flags = {"threads_per_worker": args.threads, "chunked_prefill_size": KERNEL_ROWS}
    exact = pipeserve_logprobs(texts, gguf_weights="dequantize", **flags)
    kept = pipeserve_logprobs(texts, **flags)
    results: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "texts": len(texts),
        "tokens_each": len(texts[0]),
        "pipeserve_kept_blocks": figures([a - b for a, b in zip(kept, exact, strict=True)]),
    }
    gguf = gguf_file(None)
    assert gguf is not None
    try:
        ours = llamacpp_logprobs(gguf, texts, args.threads)
    except ImportError:
        results["llamacpp"] = "llama-cpp-python is not installed"
    else:
        # llama.cpp scores every position of a text; pipeserve's start at the second token
        results["llamacpp"] = figures([a - b for a, b in zip(ours, exact, strict=True)])
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
