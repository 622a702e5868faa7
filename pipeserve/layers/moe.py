"""Routed experts and their routers.

Qwen3-MoE routes by softmax top-k (`select_experts`). DeepSeek-V3 routes by grouped top-k
over sigmoid scores (`select_experts_grouped`) and adds shared experts that every token runs
(`DeepseekV3MoE`). Under TP every rank holds every expert with its intermediate dimension
split, and a block's output is all-reduced once, in its forward. Under expert parallelism
(ep size > 1, TP size 1) each rank holds whole experts, its block of the placement, and
`FusedMoE` sends the tokens to the ranks holding their experts and the outputs back (its
dispatcher); routers and shared experts are replicated and run on the rank's own tokens.
Under attention-FFN disaggregation an attention worker's `FusedMoE` holds no experts and
sends every token to the FFN workers (moe/dispatcher/afd.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.batch_overlap.operations import OpFn, Outputs, State, arrange, run_in_order
from pipeserve.batch_overlap.single_batch import get_single_batch_overlap, get_step_blocks
from pipeserve.batch_overlap.strategies import EXPERTS_IN_ORDER, block_plan
from pipeserve.device import grouped_gemm_pays, grouped_gemm_takes
from pipeserve.distributed.communication import tp_all_reduce
from pipeserve.distributed.parallel_state import (
    get_afd,
    get_ep_counts_group,
    get_ep_group,
    get_ep_rank,
    get_expert_placement,
    get_held_experts,
    get_tp_rank,
    get_tp_size,
)
from pipeserve.layers import batch_invariant
from pipeserve.layers.activation import silu_and_mul
from pipeserve.layers.linear import (
    BLOCK,
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_fp8,
    dequantized,
    divide,
    keeps_fp8,
)
from pipeserve.model_loader import copy_into
from pipeserve.moe.dispatcher import Dispatched, Dispatcher, LocalDispatcher, make_dispatcher
from pipeserve.moe.dispatcher.afd import AfdDispatcher

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
    """This rank's routed experts' weights stacked: w13 [local experts, 2*inter_local, hidden]
    (gate; up) and w2 [local experts, hidden, inter_local]. Local expert i is global expert
    `experts[i]`: all of them at ep size 1 (under TP with the intermediate dim split), else
    this ep rank's block of the placement (whole experts).

    Built inside `keeping_fp8_weights` with an intermediate slice that starts and splits on
    128-blocks, the weights are the checkpoint's fp8 values with their scale grids beside them
    (`w13_scale_inv` [local experts, ceil(2*inter_local / 128), ceil(hidden / 128)],
    `w2_scale_inv` likewise) and the experts run as two grouped block-scaled FP8 products
    (kernels/triton_fp8.py); an expert stored unquantised turns the layer back to the compute
    dtype as it loads."""

    w13_scale_inv: torch.Tensor | None
    w2_scale_inv: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        layer_id: int = -1,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.top_k, self.layer_id = top_k, layer_id
        self.inter = divide(intermediate, self.tp_size, "moe_intermediate_size")
        self.num_experts = num_experts  # routed experts of the whole model
        self._init_placement(num_experts)
        local = len(self.experts)
        self.dtype = dtype
        kept = keeps_fp8() and self.inter % BLOCK == 0  # then every slice starts on a block
        stored = torch.float8_e4m3fn if kept else dtype
        self.w13 = nn.Parameter(
            torch.empty(local, 2 * self.inter, hidden, dtype=stored), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(local, hidden, self.inter, dtype=stored), requires_grad=False
        )
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        for name, p in (("w13_scale_inv", self.w13), ("w2_scale_inv", self.w2)):
            grid = (local, -(-p.shape[1] // BLOCK), -(-p.shape[2] // BLOCK))
            self.register_buffer(name, torch.zeros(grid) if kept else None, False)

    def _init_placement(self, num_experts: int) -> None:
        """The experts held here and the layer's dispatcher (it keeps no state between calls,
        so one serves every forward). Under attention-FFN disaggregation an attention worker
        holds none and dispatches to the FFN workers; an FFN worker's layers are run by its
        FFN runner, not through a dispatcher."""
        placement, afd = get_expert_placement(num_experts), get_afd()
        self.experts = get_held_experts(num_experts)  # global ids, in local order
        self._local_index = {e: i for i, e in enumerate(self.experts)}
        self.dispatcher: Dispatcher
        if afd is not None and afd.is_attention:
            self.dispatcher = AfdDispatcher(placement, afd, self.layer_id)
        elif afd is not None:
            self.dispatcher = LocalDispatcher(num_experts, self.layer_id)
        else:
            self.dispatcher = make_dispatcher(
                placement, get_ep_rank(), get_ep_group(), self.layer_id, get_ep_counts_group()
            )

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor, shard_id: object = None
    ) -> None:
        """shard_id = (global expert id, part): part 0 gate, 1 up (rows of w13), 2 down (w2)."""
        assert isinstance(shard_id, tuple)
        expert, part = shard_id
        local = self._local(expert)
        start = self.tp_rank * self.inter
        row = 0 if part == 2 else part * self.inter
        src = (
            loaded.narrow(1, start, self.inter)
            if part == 2
            else loaded.narrow(0, start, self.inter)
        )
        if self.w13_scale_inv is not None and not src.quantized:
            self._dequantize()
        grids = self.w2_scale_inv if part == 2 else self.w13_scale_inv
        weight = (self.w2 if part == 2 else self.w13).data[local]
        dst = weight.narrow(0, row, src.shape[0])
        if grids is None:
            copy_into(dst, src)
            return
        if list(dst.shape) != src.shape:
            raise ValueError(
                f"checkpoint tensor {src.name} has shape {src.shape}, expected {list(dst.shape)}"
            )
        copy_fp8(weight, grids[local], row, src)

    def _dequantize(self) -> None:
        """Back to the compute dtype (what is loaded so far kept, as its real values)."""
        for name in ("w13", "w2"):
            weight, grids = getattr(self, name).data, getattr(self, f"{name}_scale_inv")
            setattr(self, name, dequantized(weight, grids, self.dtype, self.weight_loader))
            setattr(self, f"{name}_scale_inv", None)

    def _local(self, expert: int) -> int:
        if expert not in self._local_index:
            raise ValueError(
                f"expert {expert} is not on this expert-parallel rank, which holds experts "
                f"{self.experts[0]}..{self.experts[-1]}; list only this rank's experts in "
                "checkpoint_names (expert_checkpoint_names with held_experts)"
            )
        return self._local_index[expert]

    def partial(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, hidden], this rank's tokens; expert_ids [tokens, k] global. Each token's
        output is the routing-weighted sum of its experts: the token goes to the ranks holding
        them, they run their share (`run_local`), and the shares come back summed. Under TP,
        over this rank's slice of the intermediate dimension (not yet all-reduced)."""
        items = arrange(self.operations(), EXPERTS_IN_ORDER)
        return run_in_order(items, State(), x=x, weights=weights, ids=expert_ids)["routed"]

    def _blocked_experts(self, state: State, got: Dispatched) -> Outputs:
        """Single-batch overlap, combine-down: the experts in blocks of rows, each block's
        combine launched as soon as it is computed."""

        def run_rows(rows: torch.Tensor) -> torch.Tensor:
            return self.run_local(got.hidden[rows], got.weights[rows], got.local_ids[rows])

        blocks = get_step_blocks()
        state["moe_combine"] = self.dispatcher.combine_blocks_a(run_rows, got, blocks)
        return {}

    def operations(self) -> dict[str, OpFn]:
        """dispatch_a(x, weights, ids) -> dispatch_b -> experts -> combine_a -> combine_b
        -> {routed}; the handles wait in the micro-batch's state between the halves."""
        ops: dict[str, OpFn] = {
            "dispatch_a": self._dispatch_a,
            "dispatch_b": self._dispatch_b,
            "experts": self._experts,
            "combine_a": self._combine_a,
            "combine_b": self._combine_b,
        }
        if get_step_blocks() > 1:  # each block's combine_a is launched by the experts step
            del ops["combine_a"]
            ops["experts"] = self._blocked_experts
        return ops

    def _dispatch_a(
        self, state: State, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **_: Any
    ) -> Outputs:
        state["moe_dispatch"] = self.dispatcher.dispatch_a(x, ids, weights)
        return {}

    def _dispatch_b(self, state: State, **_: Any) -> Outputs:
        return {"got": self.dispatcher.dispatch_b(state.pop("moe_dispatch"))}

    def _experts(self, state: State, got: Dispatched) -> Outputs:
        return {"got": got, "out": self.run_local(got.hidden, got.weights, got.local_ids)}

    def _combine_a(self, state: State, got: Dispatched, out: torch.Tensor) -> Outputs:
        state["moe_combine"] = self.dispatcher.combine_a(out, got)
        return {}

    def _combine_b(self, state: State, **_: Any) -> Outputs:
        return {"routed": self.dispatcher.combine_b(state.pop("moe_combine"))}

    def join_idle(self) -> None:
        """A step in which this rank has no tokens of its own (data-parallel attention): it
        still takes part in the layer's dispatch and combine, and runs its experts on the
        tokens the other ranks send. Nothing to do when nothing is routed between ranks."""
        if isinstance(self.dispatcher, LocalDispatcher):
            return
        x = self.w13.new_empty((0, self.w13.shape[2]), dtype=self.dtype)
        ids = torch.empty((0, self.top_k), dtype=torch.long, device=x.device)
        self.partial(x, ids.float(), ids)

    def run_local(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local_ids: torch.Tensor,
        grouped: bool | None = None,
    ) -> torch.Tensor:
        """x [rows, hidden]; local_ids [rows, k] index this rank's experts, -1 for a slot whose
        expert is elsewhere (skipped). Per row, the weighted sum over its local experts.
        grouped: True runs them as grouped GEMMs, which never wait for the device, where
        `can_group_experts` allows; False one product per expert (group sizes read on the
        host); None: `grouped_by_default` for x's device."""
        if self.w13_scale_inv is not None:
            return self._run_grouped(x, weights, local_ids, fp8=True)
        if grouped is None:
            grouped = grouped_by_default(x.device)
        if grouped and can_group_experts(self.w13, self.w2):
            return self._run_grouped(x, weights, local_ids)
        return self._run_looped(x, weights, local_ids)

    def _run_looped(
        self, x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor:
        top_k = local_ids.shape[1]
        flat = local_ids.flatten() + 1  # bucket 0: experts elsewhere
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts) + 1).tolist()
        out = torch.zeros_like(x)
        start = counts[0]
        for expert, count in enumerate(counts[1:]):
            if count == 0:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            h = silu_and_mul(batch_invariant.linear(x[tokens], self.w13[expert]))
            h = batch_invariant.linear(h, self.w2[expert])
            out.index_add_(0, tokens, h * weights.flatten()[picks, None].to(x.dtype))
        return out

    def _run_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, fp8: bool = False
    ) -> torch.Tensor:
        """The (row, slot) pairs sorted by expert, experts elsewhere last, through two grouped
        GEMMs whose group ends are computed on the device (torch's, or with `fp8` the
        block-scaled FP8 kernel's); then each row's k outputs, back in slot order, weighted and
        summed by one product (no atomics: the same sum every run)."""
        rows, top_k = local_ids.shape
        if rows == 0:
            return torch.zeros_like(x)
        n = self.w13.shape[0]
        buckets, order = torch.where(local_ids < 0, n, local_ids).flatten().sort(stable=True)
        ends = torch.searchsorted(  # [n] int32: end of each expert's pairs
            buckets, torch.arange(n, device=x.device), right=True, out_int32=True
        )
        if fp8:
            from pipeserve.kernels.triton_fp8 import fp8_grouped_linear

            assert self.w13_scale_inv is not None and self.w2_scale_inv is not None
            h = fp8_grouped_linear(x[order // top_k], self.w13, self.w13_scale_inv, ends)
            y = fp8_grouped_linear(silu_and_mul(h), self.w2, self.w2_scale_inv, ends)
        else:
            mm = _GROUPED_MM
            assert mm is not None, "checked by can_group_experts"
            h = silu_and_mul(mm(x[order // top_k], self.w13.transpose(1, 2), offs=ends))
            y = mm(h, self.w2.transpose(1, 2), offs=ends)  # [rows * k, hidden]
        # pairs past ends[-1] (experts elsewhere) hold whatever was in memory, NaN included
        y = torch.where(buckets[:, None] < n, y, 0)
        by_slot = torch.empty_like(y).index_copy_(0, order, y).view(rows, top_k, -1)
        return torch.bmm(weights.to(x.dtype)[:, None], by_slot).squeeze(1)


# torch's grouped GEMM: public from torch 2.13, torch._grouped_mm before; None: neither
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_by_default(device: torch.device) -> bool:
    """Grouped GEMMs where they pay (`device.grouped_gemm_pays`: CUDA). Under deterministic
    inference the per-expert loop, whose products' independence of the row count the
    start-up check vouches for (`batch_invariant.check_linear_rows`)."""
    return grouped_gemm_pays(device) and not batch_invariant.enabled()


def can_group_experts(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether grouped GEMMs can run experts w13 [E, 2*inter, hidden], w2 [E, hidden, inter]
    without a host sync: torch has them, every weight row and activation row is a multiple
    of 16 bytes, and on CUDA the weights are bfloat16 on a device with a grouped kernel."""
    if _GROUPED_MM is None or w13.shape[0] == 0:
        return False
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    align = 16 // w13.element_size()
    if w13.shape[2] % align or w2.shape[2] % align:  # hidden, inter
        return False
    return grouped_gemm_takes(w13.device, w13.dtype)


def held_experts(num_experts: int) -> tuple[int, ...]:
    """Global ids of the routed experts this rank holds (all at ep size 1)."""
    return get_held_experts(num_experts)


def expert_checkpoint_names(
    param_name: str, num_experts: int, held: Sequence[int] | None = None
) -> list[tuple[str, object]] | None:
    """Hugging Face checkpoints store routed experts one by one
    (`<prefix>.experts.<e>.{gate,up,down}_proj.weight`); our `<prefix>.experts.w13` / `.w2`
    are made of those, with `FusedMoE.weight_loader` shard ids. `held`: the global ids of the
    experts to list (a model passes `held_experts`, so a rank reads only its own experts'
    tensors); None: all `num_experts`. None for other parameters."""
    m = re.fullmatch(r"(.*\.experts)\.(w13|w2)", param_name)
    if m is None:
        return None
    prefix, which = m.groups()
    parts = [("gate_proj", 0), ("up_proj", 1)] if which == "w13" else [("down_proj", 2)]
    return [
        (f"{prefix}.{e}.{name}.weight", (e, part))
        for e in (range(num_experts) if held is None else held)
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
        return self.down_proj.matmul(h)  # down_proj's unreduced part


class MoEBlock(nn.Module):
    """A MoE MLP as operations (see pipeserve/batch_overlap): gate (route the tokens), the
    experts' dispatch ... combine_b, shared experts where the model has them, output (sum and
    all-reduce under TP). Its forward runs them in order; two-batch overlap interleaves them
    with another micro-batch's."""

    experts: FusedMoE
    shared_experts: SharedExperts | None

    def __init__(self) -> None:
        super().__init__()
        self.shared_experts = None  # a subclass with shared experts sets them

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> routing weights [tokens, k] and global expert ids."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        items = arrange(self.operations(), block_plan(get_single_batch_overlap()))
        return run_in_order(items, State(), x=x)["out"]

    def operations(self) -> dict[str, OpFn]:
        ops = {"gate": self._gate, **self.experts.operations(), "output": self._output}
        if self.shared_experts is not None:
            ops["shared_experts"] = self._shared
        return ops

    def _gate(self, state: State, x: torch.Tensor) -> Outputs:
        state["moe_input"] = x
        weights, ids = self.route(x)
        return {"x": x, "weights": weights, "ids": ids}

    def _shared(self, state: State, **_: Any) -> None:
        assert self.shared_experts is not None
        state["moe_shared"] = self.shared_experts.partial(state["moe_input"])

    def _output(self, state: State, routed: torch.Tensor) -> Outputs:
        del state["moe_input"]
        shared = state.pop("moe_shared", None)
        return {"out": tp_all_reduce(routed if shared is None else routed + shared)}


class DeepseekV3MoE(MoEBlock):
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
        layer_id: int = -1,
    ) -> None:
        super().__init__()
        if n_shared_experts < 1:
            raise ValueError(f"n_shared_experts is {n_shared_experts}; DeepSeek-V3 needs >= 1")
        self.gate = GroupedTopKRouter(hidden, routing)
        self.experts = FusedMoE(
            routing.num_experts, routing.top_k, hidden, moe_intermediate, dtype, layer_id
        )
        self.shared_experts = SharedExperts(hidden, moe_intermediate * n_shared_experts, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)
