"""Load a model's weights from a Hugging Face safetensors checkpoint.

Loading is driven by the model's own parameters: each parameter names the checkpoint
tensors it is made of, so a pipeline stage reads only its layers' tensors and a TP rank
reads only its slice of each (safetensors files are memory-mapped; a narrowed tensor reads
just the bytes of that slice). Peak memory is the model shard plus one tensor.

FP8 block-quantised checkpoints (models/quantization.py): a weight stored with a
`<name>_scale_inv` beside it is dequantised as it is read, the slice a rank reads times the
block scales that cover it; config.json must declare the quantisation, and an fp8 tensor with
no scale is refused.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from pipeserve.models.quantization import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    Fp8Blocks,
    checkpoint_quantization,
    dequantize_blocks,
)


class LazyTensor:
    """A checkpoint tensor, or a slice of one, not read until `load()`. With `scales` (the
    whole scale grid of an FP8 block-quantised weight, and its block size) `load()` gives the
    dequantised values of the slice, float32."""

    def __init__(
        self,
        handle: Any,
        name: str,
        slices: tuple[slice, ...] | None = None,
        scales: tuple[LazyTensor, tuple[int, int]] | None = None,
    ) -> None:
        self._handle, self.name = handle, name
        self.shape: list[int] = list(handle.get_slice(name).get_shape())
        if scales is not None and slices is None:
            _check_grid(name, self.shape, *scales)
        self._scales = scales
        self._slices = slices or tuple(slice(0, n) for n in self.shape)
        for d, s in enumerate(self._slices):
            self.shape[d] = s.stop - s.start

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"checkpoint tensor {self.name} has size {self.shape[dim]} in dim {dim}; "
                f"cannot take [{start}, {start + length})"
            )
        slices = list(self._slices)
        base = slices[dim].start
        slices[dim] = slice(base + start, base + start + length)
        return LazyTensor(self._handle, self.name, tuple(slices), self._scales)

    @property
    def quantized(self) -> bool:
        """Whether this is (a slice of) an FP8 block-quantised weight."""
        return self._scales is not None

    def starts(self) -> tuple[int, ...]:
        """Where the slice starts in the checkpoint tensor, per dimension."""
        return tuple(s.start for s in self._slices)

    def load(self) -> torch.Tensor:
        values = self._handle.get_slice(self.name)[self._slices]
        if self._scales is None:
            return values
        start = (self._slices[0].start, self._slices[1].start)
        return dequantize_blocks(values, self._cover(), start, self._scales[1])

    def load_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight's slice as stored: (fp8 values, the rows and columns of the scale grid
        that cover it, from the block holding its first element)."""
        assert self._scales is not None, f"{self.name} is not block-quantised"
        return self._handle.get_slice(self.name)[self._slices], self._cover().float()

    def _cover(self) -> torch.Tensor:
        assert self._scales is not None
        grid, block = self._scales
        cover = grid
        for dim, (s, b) in enumerate(zip(self._slices, block, strict=True)):
            first, last = s.start // b, (max(s.stop, s.start + 1) - 1) // b
            cover = cover.narrow(dim, first, last - first + 1)
        return cover.load()


def _check_grid(name: str, shape: list[int], grid: LazyTensor, block: tuple[int, int]) -> None:
    """An FP8 weight must be 2-D and its scale grid must have one scale per block."""
    if len(shape) != 2:
        raise ValueError(f"checkpoint tensor {name}: an fp8 block-quantised weight must be 2-D")
    want = [-(-n // b) for n, b in zip(shape, block, strict=True)]
    if grid.shape != want:
        raise ValueError(
            f"checkpoint tensor {grid.name} has shape {grid.shape}; {name} {shape} in "
            f"{block[0]}x{block[1]} blocks needs {want}"
        )


class ShardedModel(Protocol):
    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]: ...


def checkpoint_index(model_path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the sharded index or the files' headers."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_path / file for name, file in weight_map.items()}
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update({name: file for name in f.keys()})  # noqa: SIM118
    return out


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    path = Path(model_path)
    index = checkpoint_index(path)
    quant = checkpoint_quantization(json.loads((path / "config.json").read_text()))
    wanted = [
        (param, ckpt, shard)
        for name, param in model.named_parameters()
        for ckpt, shard in model.checkpoint_names(name)  # type: ignore[operator]
    ]
    missing = sorted({ckpt for _, ckpt, _ in wanted if ckpt not in index})
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint {path} is missing tensor(s): {shown}")
    if unread := unread_biases({ckpt for _, ckpt, _ in wanted}, index):
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        raise ValueError(
            f"checkpoint {path} has bias tensor(s) the model its config.json describes has "
            f"no place for: {shown}; running without them would compute something else "
            "(a config flag such as attention_bias or mlp_bias left off?)"
        )
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}

        def handle(name: str) -> Any:
            file = index[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            return handles[file]

        for param, ckpt, shard in wanted:
            lazy = _lazy(handle, ckpt, index, quant)
            loader = getattr(param, "weight_loader", _copy_whole)
            loader(param, lazy, shard)


def unread_biases(read: set[str], index: dict[str, Path]) -> list[str]:
    """The checkpoint's biases of modules whose weight is read (`read`) that are not read
    themselves: a layer built without the bias its checkpoint holds (a projection's, a
    LayerNorm's). Modules the rank does not hold (other stages' layers, other ranks'
    experts, DeepSeek's multi-token-prediction layers) read neither and are not named."""
    return sorted(
        bias
        for name in read
        if name.endswith(".weight")
        and (bias := name.removesuffix("weight") + "bias") in index
        and bias not in read
    )


def _lazy(handle: Any, name: str, index: dict[str, Path], quant: Fp8Blocks | None) -> LazyTensor:
    """Checkpoint tensor `name`, dequantised on load where a block-scale grid is beside it."""
    scale_name = name + SCALE_SUFFIX
    if scale_name in index:
        if quant is None:
            raise ValueError(
                f"checkpoint tensor {name} has block scales ({scale_name}) but config.json "
                f"declares no fp8 quantization_config"
            )
        grid = LazyTensor(handle(scale_name), scale_name)
        return LazyTensor(handle(name), name, scales=(grid, quant.block))
    dtype = handle(name).get_slice(name).get_dtype()
    if dtype in FP8_DTYPES:
        raise ValueError(
            f"checkpoint tensor {name} is fp8 ({dtype}) with no {scale_name} beside it"
        )
    return LazyTensor(handle(name), name)


def copy_into(dst: torch.Tensor, loaded: LazyTensor) -> None:
    """Copy (and cast) a checkpoint tensor into `dst`; shapes must agree exactly."""
    if list(dst.shape) != loaded.shape:
        raise ValueError(
            f"checkpoint tensor {loaded.name} has shape {loaded.shape}, expected {list(dst.shape)}"
        )
    dst.copy_(loaded.load())


def _copy_whole(param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
    copy_into(param.data, loaded)
