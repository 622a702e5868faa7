"""bfloat16's accuracy on this CPU: prompt-logprob error against transformers' float32 on the
same checkpoint, for transformers' own bfloat16 and for pipeserve's bfloat16 through each
attention path (`auto`: the native kernels this CPU has; `torch`: the torch backend), as the
mean and the max over all texts pooled, and each as a ratio to transformers' bfloat16.
The built-in model reads four 256-token pieces of README.md; the random-weight presets read
random tokens. Prints and saves JSON.

    python benchmarks/bf16_accuracy.py --json out.json
    python benchmarks/bf16_accuracy.py --models builtin --paths auto

What a max means: one sensitive position decides it. On the built-in model, exact attention
(float64, rounded to bfloat16) put into transformers' bfloat16 forward moved one README
position by 0.63 where transformers' own fused kernel moved it by 0.07 (issue 48), so read
the max over several texts, beside the mean."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeserve.engine.engine import Engine
from pipeserve.models.presets import make_model
from pipeserve.models.resolve import resolve_model_path

PRESETS = {
    "llama": ("tiny-llama", {}),
    "qwen3": ("tiny-qwen3", {}),
    "qwen3-moe": ("tiny-qwen3-moe", {}),
    "deepseek-v3": ("tiny-deepseek-v3", {}),
    "llama-pp2": ("tiny-llama", {"pp_size": 2}),
}
PATHS = ("auto", "torch")


def hf_logprobs(path: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(x).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0]


def pipeserve_logprobs(path: Path, texts: list[list[int]], backend: str, **flags: Any) -> list:
    with Engine(
        str(path), dtype="bfloat16", attention_backend=backend, chunked_prefill_size=64, **flags
    ) as engine:
        outs = engine.generate(
            input_ids=texts, sampling_params={"max_new_tokens": 1}, return_logprob=True
        )
    assert isinstance(outs, list)
    return [torch.tensor(o["prompt_logprobs"]) for o in outs]


def figures(errors: list[torch.Tensor]) -> dict[str, float]:
    pooled = torch.cat(errors)
    return {"mean": pooled.mean().item(), "max": pooled.max().item()}


def measure(path: Path, texts: list[list[int]], paths: list[str], **flags: Any) -> dict:
    exact = [hf_logprobs(path, ids, torch.float32) for ids in texts]
    hf_bf16 = [hf_logprobs(path, ids, torch.bfloat16) for ids in texts]
    theirs = figures([(h - e).abs() for h, e in zip(hf_bf16, exact, strict=True)])
    row: dict[str, Any] = {"transformers-bf16": theirs}
    for backend in paths:
        ours = pipeserve_logprobs(path, texts, backend, **flags)
        got = figures([(o - e).abs() for o, e in zip(ours, exact, strict=True)])
        got["mean_ratio"] = got["mean"] / theirs["mean"]
        got["max_ratio"] = got["max"] / theirs["max"]
        row[f"pipeserve-{backend}"] = got
    return row


def built_in_texts(path: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    return [ids[i * 256 : (i + 1) * 256] for i in range(4)]


def random_texts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (96, 160, 200)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(["builtin", *PRESETS]))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    paths = args.paths.split(",")
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    out: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": [
            f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
        ],
        "torch": torch.__version__,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "builtin":
                path = resolve_model_path(None, "bfloat16")
                row = measure(path, built_in_texts(path), paths)
            else:
                preset, layout = PRESETS[name]
                path = make_model(preset, Path(tmp) / name)
                row = measure(path, random_texts(512), paths, **layout)
            out["models"][name] = row
            hf = row["transformers-bf16"]
            cells = [f"transformers {hf['mean']:.4f}/{hf['max']:.3f}"]
            for backend in paths:
                r = row[f"pipeserve-{backend}"]
                cells.append(
                    f"{backend} {r['mean']:.4f}/{r['max']:.3f} "
                    f"({r['mean_ratio']:.2f}x/{r['max_ratio']:.2f}x)"
                )
            print(f"{name:12s} " + "  ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
