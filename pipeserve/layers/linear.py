"""Linear layers, replicated or sharded over the tensor-parallel group.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that copies this rank's
slice of a checkpoint tensor into it; the loader never needs to know how a layer is sharded.
Loaded tensors are `LazyTensor`s: narrowing one reads only that slice from disk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeserve.distributed.communication import tp_all_reduce
from pipeserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pipeserve.distributed.partition import kv_heads_of_rank
from pipeserve.layers import batch_invariant
from pipeserve.model_loader import copy_into

if TYPE_CHECKING:
    from pipeserve.model_loader import LazyTensor


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tp-size {denominator}")
    return numerator // denominator


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [out_local, in_local]."""

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_local, in_local, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = _param(out_local, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        copy_into(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_size, out_size, bias, dtype)


class ColumnParallelLinear(LinearBase):
    """Output features split over TP ranks; the output stays sharded."""

    def __init__(self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(in_size, divide(out_size, self.tp_size, "output size"), bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        rows = param.shape[0]
        copy_into(param.data, loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (e.g. gate and up projections).
    Each rank holds [part_0 slice; part_1 slice; ...]."""

    def __init__(self, in_size: int, out_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_size, sum(out_sizes), bias, dtype)
        self.local_sizes = [divide(s, self.tp_size, "output size") for s in out_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


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
        return batch_invariant.linear(x, self.weight[start:end], bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _kv_head_start(self) -> int:
        return kv_heads_of_rank(self.total_kv_heads, self.tp_size, self.tp_rank)[0]

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        d = self.head_dim
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self._kv_head_start() * d
        else:
            raise ValueError(f"QKV shard id must be q, k or v, got {shard_id!r}")
        copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split over TP ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(divide(in_size, self.tp_size, "input size"), out_size, bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            copy_into(param.data, loaded)
            return
        cols = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(batch_invariant.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
