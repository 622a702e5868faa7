"""Vocabulary-parallel embedding and LM head: each TP rank owns a contiguous block of the
(padded) vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.backends.base import TORCH_LINEARS, LinearKernels
from pipeserve.distributed.communication import tp_all_gather, tp_all_reduce
from pipeserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pipeserve.layers.block_quant import block_format, row_values
from pipeserve.model_loader import copy_into

if TYPE_CHECKING:
    from pipeserve.model_loader import LazyTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.dtype = dtype  # what lookups give, whatever form the LM head keeps a tied weight in
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp)  # ceil: the last rank's block may be padded
        self.start = rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.tp_size = tp
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        rows = self.end - self.start
        copy_into(param.data[:rows], loaded.narrow(0, self.start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(ids)
        local = (ids >= self.start) & (ids < self.end)
        out = self._rows(torch.where(local, ids - self.start, 0))
        out.masked_fill_(~local.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` in the compute dtype, whatever form a tied LM head keeps it
        in (bfloat16, GGUF blocks: `LinearKernels.store`)."""
        if (fmt := block_format(self.weight)) is not None:
            return row_values(self.weight, fmt, ids).to(self.dtype)
        return F.embedding(ids, self.weight).to(self.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (gathered from the TP ranks), the
    product on `linears` (the run's, `use_linear_kernels`)."""

    linears: LinearKernels = TORCH_LINEARS

    def stored_weights(self) -> list[nn.Parameter]:
        return [self.weight]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [tokens, hidden] -> [tokens, vocab]
        out = self.linears.linear(hidden, self.weight)
        if self.tp_size > 1:
            out = tp_all_gather(out, dim=-1)
        return out[:, : self.vocab_size]
