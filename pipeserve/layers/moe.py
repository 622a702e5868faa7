"""Routed experts and their routers.

Qwen3-MoE routes by softmax top-k (`select_experts`). DeepSeek-V3 routes by grouped top-k
over sigmoid scores (`select_experts_grouped`) and adds shared experts that every token runs
(`DeepseekV3MoE`). Under TP every rank holds every expert with its intermediate dimension
split (expert parallelism is a later layout); a block's output is all-reduced once, in its
forward."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.distributed.communication import tp_all_reduce
from pipeserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pipeserve.layers import batch_invariant
from pipeserve.layers.activation import silu_and_mul
from pipeserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear, divide
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


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3 routing settings (the checkpoint config's names in brackets)."""

    num_experts: int  # routed experts (n_routed_experts)
    top_k: int  # experts per token (num_experts_per_tok)
    n_group: int  # experts are split into this many equal groups, in index order
    topk_group: int  # groups a token may pick its experts from
    renormalize: bool  # chosen weights scaled to sum 1 (norm_topk_prob)
    scaling_factor: float  # applied to the weights last (routed_scaling_factor)

    def __post_init__(self) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts {self.num_experts} cannot be split into n_group "
                f"{self.n_group} equal groups"
            )
        if self.group_size < 2:
            raise ValueError(
                f"n_group {self.n_group} leaves {self.group_size} expert(s) per group; a "
                "group's score is the sum of its top 2 experts, so it needs at least 2"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group {self.n_group}]")
        reachable = self.topk_group * self.group_size
        if not 1 <= self.top_k <= reachable:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, {reachable}]: topk_group "
                f"{self.topk_group} x {self.group_size} experts per group"
            )

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, largest first; among equal values the
    lower index wins. (torch.topk leaves ties unspecified: on CPU it does not favour the
    lower index, so a stable sort is used instead.)"""
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def _kept_groups(choice: torch.Tensor, r: GroupedRouting) -> torch.Tensor:
    """[tokens, experts] bool: the expert lies in one of the token's `topk_group` best groups,
    a group's score being the sum of its two best scores."""
    grouped = choice.view(choice.shape[0], r.n_group, r.group_size)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [tokens, n_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, top_indices(group_scores, r.topk_group), True)
    return kept[:, :, None].expand_as(grouped).reshape_as(choice)


def select_experts_grouped(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, r: GroupedRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped top-k. The bias-corrected sigmoid scores choose the groups, then
    the experts within them; the chosen experts are weighted by their uncorrected scores.
    Ties go to the lower group, then the lower expert index (`top_indices`).
    Returns weights [tokens, k] (float32) and expert ids [tokens, k], best choice first."""
    scores = router_logits.float().sigmoid()  # [tokens, experts]
    choice = scores + correction_bias
    choice = choice.masked_fill(~_kept_groups(choice, r), float("-inf"))
    ids = top_indices(choice, r.top_k)
    weights = scores.gather(1, ids)
    if r.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scaling_factor, ids


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
        return tp_all_reduce(self.partial(x, weights, expert_ids))

    def partial(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, hidden]; each token's output is the routing-weighted sum of its experts,
        over this rank's slice of their intermediate dimension (not yet all-reduced)."""
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
        return out


def expert_checkpoint_names(param_name: str, num_experts: int) -> list[tuple[str, object]] | None:
    """Hugging Face checkpoints store routed experts one by one
    (`<prefix>.experts.<e>.{gate,up,down}_proj.weight`); our `<prefix>.experts.w13` / `.w2`
    are made of those, with `FusedMoE.weight_loader` shard ids. None for other parameters."""
    m = re.fullmatch(r"(.*\.experts)\.(w13|w2)", param_name)
    if m is None:
        return None
    prefix, which = m.groups()
    parts = [("gate_proj", 0), ("up_proj", 1)] if which == "w13" else [("down_proj", 2)]
    return [
        (f"{prefix}.{e}.{name}.weight", (e, part))
        for e in range(num_experts)
        for name, part in parts
    ]


class GroupedTopKRouter(nn.Module):
    """Router weight [experts, hidden] and `e_score_correction_bias` [experts], replicated on
    every TP rank. Both are kept in float32: the logits are computed in float32 (as the
    reference implementation does), so the weight is cast once, at load time."""

    def __init__(self, hidden: int, routing: GroupedRouting) -> None:
        super().__init__()
        self.routing = routing
        n = routing.num_experts
        self.weight = nn.Parameter(torch.empty(n, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(n), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = batch_invariant.linear(x.float(), self.weight)  # [tokens, experts]
        return select_experts_grouped(logits, self.e_score_correction_bias, self.routing)


class SharedExperts(nn.Module):
    """A SwiGLU MLP every token runs, sharded like the routed experts (intermediate dim over
    TP ranks). `partial` leaves the all-reduce to the block, which sums it with the routed
    experts' output first."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        h = silu_and_mul(self.gate_up_proj(x))
        return batch_invariant.linear(h, self.down_proj.weight)  # down_proj's unreduced part


class DeepseekV3MoE(nn.Module):
    """Routed experts chosen by grouped top-k, plus `n_shared_experts` shared experts fused
    into one MLP of width moe_intermediate * n_shared_experts: output = routed + shared.
    Parameter names follow the checkpoint's `mlp.gate`, `mlp.experts`, `mlp.shared_experts`
    (see `expert_checkpoint_names`; shared gate/up load into `gate_up_proj` shards 0/1)."""

    def __init__(
        self,
        hidden: int,
        moe_intermediate: int,
        n_shared_experts: int,
        routing: GroupedRouting,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if n_shared_experts < 1:
            raise ValueError(f"n_shared_experts is {n_shared_experts}; DeepSeek-V3 needs >= 1")
        self.gate = GroupedTopKRouter(hidden, routing)
        self.experts = FusedMoE(routing.num_experts, hidden, moe_intermediate, dtype)
        self.shared_experts = SharedExperts(hidden, moe_intermediate * n_shared_experts, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]."""
        weights, ids = self.gate(x)
        routed = self.experts.partial(x, weights, ids)
        return tp_all_reduce(routed + self.shared_experts.partial(x))
