"""Linear layers, replicated or sharded over the tensor-parallel group.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that copies this rank's
slice of a checkpoint tensor into it; the loader never needs to know how a layer is sharded.
Loaded tensors are `LazyTensor`s: narrowing one reads only that slice from disk.

FP8 checkpoints kept in FP8 (`--fp8-weights keep`, built inside `keeping_fp8_weights`): a
layer's weight is float8_e4m3fn with its block scales beside it (`scale_inv`, a buffer, one
float32 per 128 x 128 block of this rank's weight) and it multiplies through
kernels/triton_fp8.py. That needs every 128 x 128 block of the rank's weight to be one block of
the checkpoint's: a part or TP slice that starts inside a block, or a checkpoint tensor stored
unquantised, turns the layer back to the compute dtype as it loads (dequantised, like every
layer of the default path). Layers whose weight other code reads as a matrix are built with
`fp8=False`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pipeserve.backends.base import TORCH_LINEARS, LinearKernels
from pipeserve.distributed.communication import tp_all_reduce
from pipeserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pipeserve.distributed.partition import kv_heads_of_rank
from pipeserve.model_loader import copy_into

if TYPE_CHECKING:
    from pipeserve.config import EngineConfig
    from pipeserve.model_loader import LazyTensor
    from pipeserve.models.arch import ArchConfig

BLOCK = 128  # the FP8 checkpoints' block size (models/quantization.py)
_keep_fp8 = False  # whether layers built now keep FP8 checkpoint weights in FP8


def fp8_kept(config: EngineConfig, arch: ArchConfig) -> bool:
    """Whether this run keeps its checkpoint's weights in FP8: --fp8-weights keep on an FP8
    block-quantised checkpoint."""
    return config.model.fp8_weights == "keep" and arch.quantization is not None


def keeps_fp8() -> bool:
    """Whether layers built now keep FP8 checkpoint weights in FP8 (`keeping_fp8_weights`)."""
    return _keep_fp8


@contextlib.contextmanager
def keeping_fp8_weights(enabled: bool) -> Iterator[None]:
    """Linear layers built inside keep an FP8 checkpoint's weights in FP8 (where `enabled`)."""
    global _keep_fp8
    before, _keep_fp8 = _keep_fp8, enabled
    try:
        yield
    finally:
        _keep_fp8 = before


def copy_fp8(weight: torch.Tensor, grid: torch.Tensor, row: int, part: LazyTensor) -> None:
    """`part`'s raw fp8 values into `weight` [R, C] from row `row` on (a multiple of 128, as
    `part`'s first row and column are), and the scale-grid rows that cover them into `grid`."""
    values, cover = part.load_fp8()
    weight.narrow(0, row, values.shape[0]).copy_(values)
    grid.narrow(0, row // BLOCK, cover.shape[0]).copy_(cover)


def dequantized(
    weight: torch.Tensor, grid: torch.Tensor, dtype: torch.dtype, loader: object
) -> nn.Parameter:
    """A parameter of `weight`'s real values (fp8 [R, C] with its grid, or stacked [E, R, C]
    with [E, ...] grids) in `dtype` on its device, loaded by `loader`."""
    from pipeserve.models.quantization import dequantize_blocks

    def real(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return dequantize_blocks(w.cpu(), g.cpu(), (0, 0), (BLOCK, BLOCK))

    if weight.dim() == 2:
        values = real(weight, grid)
    else:
        values = torch.empty(weight.shape)
        for w, g, out in zip(weight, grid, values, strict=True):
            out.copy_(real(w, g))
    param = nn.Parameter(values.to(weight.device, dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def use_linear_kernels(model: nn.Module, kernels: LinearKernels, keep_blocks: bool = True) -> None:
    """Every linear layer of `model`, and its LM head, computes its products with `kernels`
    (the run's, chosen with its attention backend), over weights kept in the form they
    choose (`LinearKernels.store`; `keep_blocks`: --gguf-weights keep) where only those
    products read them (`stored_weights`; a weight shared by two modules, as tied
    embeddings, changes once, in place)."""
    for module in model.modules():
        if not isinstance(getattr(module, "linears", None), LinearKernels):
            continue
        cast(Any, module).linears = kernels
        for param in cast(Any, module).stored_weights():
            param.data = kernels.store(param.data, keep_blocks)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tp-size {denominator}")
    return numerator // denominator


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [out_local, in_local]. Subclasses say where a checkpoint
    tensor's slice goes (`place`); the copy (raw fp8 and its scales, or values) is here.
    The products run on `linears` (the run's, `use_linear_kernels`)."""

    scale_inv: torch.Tensor | None
    linears: LinearKernels = TORCH_LINEARS

    def __init__(
        self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype, fp8: bool = True
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.own_weight = fp8  # only this layer's products read the weight (see the module)
        kept = _keep_fp8 and fp8
        self.weight = _param(out_local, in_local, dtype=torch.float8_e4m3fn if kept else dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        grid = (-(-out_local // BLOCK), -(-in_local // BLOCK))
        self.register_buffer(
            "scale_inv", torch.zeros(grid, dtype=torch.float32) if kept else None, False
        )
        self.bias = _param(out_local, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def stored_weights(self) -> list[nn.Parameter]:
        """The weights `linears` may keep in a form of its own: this layer's, where no other
        code reads it as a matrix and it is not kept in fp8."""
        return [self.weight] if self.own_weight and self.scale_inv is None else []

    def place(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        """Where checkpoint tensor `loaded` (a weight) goes: (first row of this rank's weight,
        the slice of `loaded` that fills the rows from there)."""
        return 0, loaded

    def place_bias(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        return self.place(loaded, shard_id)

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:
            assert self.bias is not None
            row, part = self.place_bias(loaded, shard_id)
            copy_into(self.bias.data.narrow(0, row, part.shape[0]), part)
            return
        row, part = self.place(loaded, shard_id)
        if self.scale_inv is not None and not self._load_fp8(row, part):
            self._dequantize()
        if self.scale_inv is None:
            copy_into(self.weight.data.narrow(0, row, part.shape[0]), part)

    def _load_fp8(self, row: int, part: LazyTensor) -> bool:
        """The raw fp8 values and block scales of `part` into rows [row, ...), where each of
        this rank's blocks is one block of the checkpoint's; False (nothing copied) if not."""
        starts = part.starts()
        if not part.quantized or row % BLOCK or any(s % BLOCK for s in starts):
            return False
        rows = part.shape[0]
        if part.shape[1] != self.weight.shape[1] or row + rows > self.weight.shape[0]:
            raise ValueError(
                f"checkpoint tensor {part.name} has shape {part.shape}, expected "
                f"[{min(rows, self.weight.shape[0] - row)}, {self.weight.shape[1]}]"
            )
        assert self.scale_inv is not None
        copy_fp8(self.weight.data, self.scale_inv, row, part)
        return True

    def _dequantize(self) -> None:
        """Back to the compute dtype (what is loaded so far kept, as its real values)."""
        assert self.scale_inv is not None
        self.weight = dequantized(self.weight.data, self.scale_inv, self.dtype, self.weight_loader)
        self.scale_inv = None

    def matmul(self, x: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """x W[start:end]^T, no bias, no reduction."""
        w = self.weight if start == 0 and end is None else self.weight[start:end]
        if self.scale_inv is None:
            return self.linears.linear(x, w)
        return self.linears.fp8_linear(x, w, self.scale_inv[start // BLOCK :], start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_inv is None:
            return self.linears.linear(x, self.weight, self.bias)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    def __init__(
        self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype, fp8: bool = True
    ) -> None:
        super().__init__(in_size, out_size, bias, dtype, fp8)


class ColumnParallelLinear(LinearBase):
    """Output features split over TP ranks; the output stays sharded."""

    def __init__(
        self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype, fp8: bool = True
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        out_local = divide(out_size, self.tp_size, "output size")
        super().__init__(in_size, out_local, bias, dtype, fp8)

    def place(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        rows = self.weight.shape[0]
        return 0, loaded.narrow(0, self.tp_rank * rows, rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (e.g. gate and up projections).
    Each rank holds [part_0 slice; part_1 slice; ...]."""

    def __init__(
        self, in_size: int, out_sizes: list[int], bias: bool, dtype: torch.dtype, fp8: bool = True
    ) -> None:
        super().__init__(in_size, sum(out_sizes), bias, dtype, fp8)
        self.local_sizes = [divide(s, self.tp_size, "output size") for s in out_sizes]

    def place(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        assert isinstance(shard_id, int)
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), loaded.narrow(0, self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Query heads are split over TP ranks; KV heads too when
    there are at least as many as ranks, otherwise each rank keeps a replica of one."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        tp = get_tp_size()
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "number of KV heads")
        else:
            divide(tp, num_kv_heads, "KV-head replication: --tp-size")
            self.num_kv_heads = 1
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, dtype)
        self.total_kv_heads = num_kv_heads

    def project(self, x: torch.Tensor, start: int, end: int | None) -> torch.Tensor:
        """Output features [start, end) only (e.g. K and V before Q)."""
        bias = self.bias[start:end] if self.bias is not None else None
        if self.scale_inv is None:
            return self.linears.linear(x, self.weight[start:end], bias)
        y = self.matmul(x, start, end)
        return y if bias is None else y + bias

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _kv_head_start(self) -> int:
        return kv_heads_of_rank(self.total_kv_heads, self.tp_size, self.tp_rank)[0]

    def place(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        d = self.head_dim
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self._kv_head_start() * d
        else:
            raise ValueError(f"QKV shard id must be q, k or v, got {shard_id!r}")
        return offset, loaded.narrow(0, start, size)


class RowParallelLinear(LinearBase):
    """Input features split over TP ranks; partial outputs are summed with an all-reduce."""

    def __init__(
        self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype, fp8: bool = True
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        in_local = divide(in_size, self.tp_size, "input size")
        super().__init__(in_local, out_size, bias, dtype, fp8)

    def place(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        cols = self.weight.shape[1]
        return 0, loaded.narrow(1, self.tp_rank * cols, cols)

    def place_bias(self, loaded: LazyTensor, shard_id: object) -> tuple[int, LazyTensor]:
        return 0, loaded  # the bias is added once, after the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
