"""Quantised checkpoints: which ones pipeserve runs, and how their weights are read.

Runs: FP8 block-quantised weights, the format of DeepSeek-V3, V3.1 and V3.2 and of Qwen3's FP8
releases. config.json says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

and each quantised weight W [R, C] is stored as float8_e4m3fn with a float32 tensor
`<name>_scale_inv` [ceil(R / 128), ceil(C / 128)] beside it: the real weight is the fp8 value
times its block's scale (blocks at the right and bottom edges are partial). Which tensors are
quantised is the checkpoint's business (a weight with a scale beside it is; embeddings, norms,
routers and the LM head usually are not), not a list of module names. pipeserve dequantises
each such tensor as it is read, slice by slice (a TP rank reads only its rows, which may cut a
block), and computes in the run's compute dtype: weight memory is that of the compute dtype,
as the engine's KV budget counts it. With `--fp8-weights keep` (GPUs with fp8 matrix units,
layers/linear.py, layers/moe.py) the linears and routed experts keep the fp8 values and
their scale grids instead and multiply by kernels/triton_fp8.py. The simulator counts what
the engine holds in each case.

Refused at start-up, in one line: every other quantisation (AWQ, GPTQ, bitsandbytes,
compressed-tensors, ...), and fp8 without 128 x 128 blocks (per-tensor or per-channel scales,
other block sizes) or with static activation scales.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SUPPORTED = (
    'FP8 with 128x128 block scales ({"quant_method": "fp8", "fmt": "e4m3", '
    '"weight_block_size": [128, 128], "activation_scheme": "dynamic"}: DeepSeek-V3/V3.1/V3.2 '
    "and Qwen3 FP8 releases); unquantised bfloat16, float16 or float32 checkpoints"
)
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # `<weight name>_scale_inv`: the weight's block scales
FP8_DTYPES = ("F8_E4M3",)  # safetensors' names of the stored fp8 dtype


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's FP8 block quantisation: `block` = (rows, columns) per scale."""

    block: tuple[int, int] = BLOCK

    def describe(self) -> str:
        return f"FP8 block-quantised weights ({self.block[0]}x{self.block[1]} blocks)"


def checkpoint_quantization(config: dict[str, Any]) -> Fp8Blocks | None:
    """The quantisation config.json declares: None for none, Fp8Blocks for the one pipeserve
    runs; raises ValueError (a start-up refusal) naming anything else and what is supported."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object, not {quant!r}")
    method = quant.get("quant_method")
    refused = f"is not supported; pipeserve runs {SUPPORTED}"
    if method != "fp8":
        raise ValueError(f"quantization_config: quant_method {method!r} {refused}")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fp8 format {fmt!r} {refused}")
    block = quant.get("weight_block_size")
    if block is None:
        raise ValueError(
            f"quantization_config: fp8 without weight_block_size (per-tensor or per-channel "
            f"scales) {refused}"
        )
    if list(block) != list(BLOCK):
        raise ValueError(f"quantization_config: fp8 weight_block_size {list(block)} {refused}")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config: fp8 activation_scheme {scheme!r} (static activation "
            f"scales) {refused}"
        )
    return Fp8Blocks()


def dequantize_blocks(
    weight: torch.Tensor,
    scales: torch.Tensor,
    first: tuple[int, int],
    block: tuple[int, int],
) -> torch.Tensor:
    """weight: a [r, c] slice of an fp8 weight starting at (row, column) `first`; scales: the
    rows and columns of the scale grid that cover it, from block (first[0] // block[0],
    first[1] // block[1]) on -> the slice's real values, float32. The slice is placed in a
    buffer of whole blocks and each block multiplied by its scale through a broadcast view: no
    per-element scale tensor is made. (torch converts fp8 to float32 at ~280M values/s per
    core here: most of an FP8 load's time.)"""
    (r, c), (bm, bn) = weight.shape, block
    top, left = first[0] % bm, first[1] % bn
    nr, nc = -(-(top + r) // bm), -(-(left + c) // bn)
    if scales.shape[0] < nr or scales.shape[1] < nc:
        raise ValueError("the scale grid does not cover the weight")
    out = torch.empty(nr * bm, nc * bn, dtype=torch.float32)  # what is around it is dropped
    inner = out[top : top + r, left : left + c]
    inner.copy_(weight)
    out.view(nr, bm, nc, bn).mul_(scales[:nr, :nc].float()[:, None, :, None])
    return inner.contiguous()  # the buffer itself where the slice is whole blocks


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an FP8 release stores for a weight [R, C]: the fp8 values and the float32 scale
    grid [ceil(R / bm), ceil(C / bn)], each block scaled so its largest magnitude is fp8's
    largest (448). For random FP8 checkpoints (`write_fp8_checkpoint`)."""
    bm, bn = block
    rows, cols = weight.shape
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], bm, grid[1], bn)
    top = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scales = top / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(grid[0] * bm, grid[1] * bn)[:rows, :cols].contiguous(), scales


def stored_as_fp8(name: str, t: torch.Tensor) -> bool:
    """Which tensors the FP8 releases store as fp8: the linears of attention, MLPs, experts and
    DeepSeek-V3.2's indexer; not embeddings, norms, the router, the indexer's head weights or
    the LM head."""
    return (
        t.dim() == 2
        and ".layers." in name
        and name.endswith(".weight")
        and "norm" not in name
        and not name.endswith("mlp.gate.weight")
        and "weights_proj" not in name
    )


def write_fp8_checkpoint(src: Path, out: Path, dequantised: Path, dtype: torch.dtype) -> int:
    """From the safetensors checkpoint `src` (a random-weight model; tests and benchmarks):
    `out` in the FP8 release format (`stored_as_fp8` tensors block-quantised, the rest in
    `dtype`, quantization_config declared) and `dequantised`, the same weights as that format
    means them, all in `dtype`, without quantization_config. -> how many tensors were
    quantised."""
    fp8: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                if stored_as_fp8(name, t):
                    q, scales = quantize_blocks(t.float())
                    fp8[name], fp8[name + SCALE_SUFFIX] = q, scales
                    plain[name] = dequantize_blocks(q, scales, (0, 0), BLOCK).to(dtype)
                else:
                    fp8[name] = plain[name] = t.to(dtype)
    config = json.loads((src / "config.json").read_text())
    declared = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    for d, weights, cfg in (
        (out, fp8, {**config, "quantization_config": declared}),
        (dequantised, plain, config),
    ):
        d.mkdir(parents=True)
        save_file(weights, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, d / name)
    return sum(1 for name in fp8 if name.endswith(SCALE_SUFFIX))
