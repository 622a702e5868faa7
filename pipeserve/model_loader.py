"""Load a model's weights from a Hugging Face safetensors checkpoint.

Loading is driven by the model's own parameters: each parameter names the checkpoint
tensors it is made of, so a pipeline stage reads only its layers' tensors and a TP rank
reads only its slice of each (safetensors files are memory-mapped; a narrowed tensor reads
just the bytes of that slice). Peak memory is the model shard plus one tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn


class LazyTensor:
    """A checkpoint tensor, or a slice of one, not read until `load()`."""

    def __init__(self, handle: Any, name: str, slices: tuple[slice, ...] | None = None) -> None:
        self._handle, self.name = handle, name
        self.shape: list[int] = list(handle.get_slice(name).get_shape())
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
        return LazyTensor(self._handle, self.name, tuple(slices))

    def load(self) -> torch.Tensor:
        return self._handle.get_slice(self.name)[self._slices]


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
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for param, ckpt, shard in wanted:
            file = index[ckpt]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            lazy = LazyTensor(handles[file], ckpt)
            loader = getattr(param, "weight_loader", _copy_whole)
            loader(param, lazy, shard)


def copy_into(dst: torch.Tensor, loaded: LazyTensor) -> None:
    """Copy (and cast) a checkpoint tensor into `dst`; shapes must agree exactly."""
    if list(dst.shape) != loaded.shape:
        raise ValueError(
            f"checkpoint tensor {loaded.name} has shape {loaded.shape}, expected {list(dst.shape)}"
        )
    dst.copy_(loaded.load())


def _copy_whole(param: nn.Parameter, loaded: LazyTensor, shard_id: object = None) -> None:
    copy_into(param.data, loaded)
