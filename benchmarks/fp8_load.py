"""Loading an FP8 block-quantised checkpoint against the same weights stored in bfloat16: load
time and the peak memory the load adds beyond the model, into a bfloat16 model, each load in
a fresh process. Prints and saves JSON.

    python benchmarks/fp8_load.py --params 1.0 --json out.json   # ~1 GB of fp8 weights

The checkpoint is a random-weight Llama-shaped model of about `--params` billion parameters
(hidden 2048, intermediate 8192, 16 heads of 128, GQA 16:4) whose layer linears are stored as
float8_e4m3fn with 128x128 block scales, as DeepSeek's and Qwen's FP8 releases are; the
bfloat16 checkpoint holds the same weights dequantised. Peak memory is the process's resident
high-water mark during the load minus its resident size before it (the model's own pages
already touched): the checkpoint's pages as they are read, plus what the load allocates."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeserve.models.presets import make_model
from pipeserve.models.quantization import write_fp8_checkpoint

PROBE = """
import json, sys, time, torch
from pathlib import Path
from pipeserve.model_loader import load_weights
from pipeserve.models.arch import ArchConfig
from pipeserve.models.registry import build_model

def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
model = build_model(ArchConfig.load(path), torch.bfloat16, torch.device("cpu"))
for p in model.parameters():
    p.data.zero_()
before = rss("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
start = time.perf_counter()
load_weights(model, path)
seconds = time.perf_counter() - start
size = sum(p.numel() * p.element_size() for p in model.parameters())
extra = rss("VmHWM") - before
print(json.dumps({"load_s": seconds, "peak_extra_bytes": extra, "model_bytes": size}))
"""


def shapes(params_b: float) -> dict[str, Any]:
    hidden, inter = 2048, 8192
    per_layer = 2 * hidden * hidden + 2 * hidden * 512 + 3 * hidden * inter
    layers = max(1, round(params_b * 1e9 / per_layer))
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": layers,
        "vocab_size": 512,
    }


def load(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["file_bytes"] = (path / "model.safetensors").stat().st_size
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.0, help="billions of parameters")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = make_model("tiny-llama", root / "src", overrides=shapes(args.params))
        write_fp8_checkpoint(src, root / "fp8", root / "bf16", torch.bfloat16)
        report = {"fp8": load(root / "fp8"), "bf16": load(root / "bf16")}
    report["fp8_over_bf16_load_s"] = report["fp8"]["load_s"] / report["bf16"]["load_s"]
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
