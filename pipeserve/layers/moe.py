"""Routed experts with top-k softmax routing. Under TP every rank holds every expert with
its intermediate dimension split (expert parallelism is a later layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.distributed.communication import tp_all_reduce
from pipeserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pipeserve.layers import batch_invariant
from pipeserve.layers.activation import silu_and_mul
from pipeserve.layers.linear import divide
from pipeserve.model_loader import copy_into

if TYPE_CHECKING:
    from pipeserve.model_loader import LazyTensor


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), keep the top k, optionally renormalise them.
    Returns weights [tokens, k] and expert ids [tokens, k]."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """All experts' weights stacked: w13 [experts, 2*inter_local, hidden] (gate; up) and
    w2 [experts, hidden, inter_local]."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.inter = divide(intermediate, self.tp_size, "moe_intermediate_size")
        self.num_experts = num_experts
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False
        )
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        """shard_id = (expert, part): part 0 gate, 1 up (rows of w13), 2 down (w2)."""
        assert isinstance(shard_id, tuple)
        expert, part = shard_id
        start = self.tp_rank * self.inter
        if part == 2:
            copy_into(param.data[expert], loaded.narrow(1, start, self.inter))
        else:
            rows = param.data[expert].narrow(0, part * self.inter, self.inter)
            copy_into(rows, loaded.narrow(0, start, self.inter))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, hidden]; each token's output is the routing-weighted sum of its experts."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            h = silu_and_mul(batch_invariant.linear(x[tokens], self.w13[expert]))
            h = batch_invariant.linear(h, self.w2[expert])
            out.index_add_(0, tokens, h * weights.flatten()[picks, None].to(x.dtype))
        return tp_all_reduce(out)
