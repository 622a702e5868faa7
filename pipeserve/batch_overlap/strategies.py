"""Operation plans: the order of a layer's operations and where its stages end.

A MoE decoder layer offers the operations `attention` (norms and attention), `gate`,
`dispatch_a`, `dispatch_b`, `experts`, `combine_a`, `combine_b`, `shared_experts` (models
that have them), `output` and `layer_output`; a dense layer offers one, `layer`. The plans
below order them (names a layer lacks are skipped) and place the stage markers:

- in order: no markers, the forward without overlap (each transfer waited for before the
  shared experts run, unless single-batch overlap places them beside it);
- prefill (delta 0), three stages per MoE layer: attention ... dispatch_a | dispatch_b,
  experts, combine_a | shared experts, combine_b, output;
- decode (delta 2), six stages per MoE layer: attention | gate | dispatch_a, shared experts
  | dispatch_b, experts, combine_a | combine_b | output. (The reference design cuts its
  first stage inside attention, between the projections and the attention kernel; here
  attention is one operation, so the cut falls after it.)

Single-batch overlap moves the shared experts beside the dispatch or the combine (see
single_batch.py) and, in combine-down mode, fuses experts and combine_a into blocks.

A forward's stages run across layers: a layer's last stage and the next layer's first are
one stage (no marker between layers), and dense layers add no markers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pipeserve.batch_overlap.operations import YIELD, Op, OpFn, Plan, Yield, arrange, split_stages
from pipeserve.batch_overlap.single_batch import OFF, SingleBatchOverlap

EXPERTS_IN_ORDER: Plan = ("dispatch_a", "dispatch_b", "experts", "combine_a", "combine_b")
DENSE_LAYER: Plan = ("layer",)
MOE_BLOCK_OPS = ("gate", *EXPERTS_IN_ORDER, "shared_experts", "output")


@dataclass(frozen=True)
class Strategy:
    name: str
    plan: Plan  # of a MoE decoder layer
    delta: int  # stages micro-batch i + 1 lags behind micro-batch i


IN_ORDER = Strategy(
    "in order",
    ("attention", "gate", *EXPERTS_IN_ORDER, "shared_experts", "output", "layer_output"),
    0,
)
PREFILL = Strategy(
    "prefill",
    (
        "attention", "gate", "dispatch_a", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "shared_experts", "combine_b", "output", "layer_output",
    ),
    0,
)  # fmt: skip
DECODE = Strategy(
    "decode",
    (
        "attention", YIELD,
        "gate", YIELD,
        "dispatch_a", "shared_experts", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "combine_b", YIELD,
        "output", "layer_output",
    ),
    2,
)  # fmt: skip


AFD_ATTENTION = Strategy(
    "afd attention",
    (
        "attention", "gate", "dispatch_a", YIELD,
        "dispatch_b", "experts", "combine_a", "shared_experts", "combine_b", "output",
        "layer_output",
    ),
    0,
)  # fmt: skip
# Attention-FFN disaggregation, attention side: one stage per MoE layer, from the shared
# experts of one layer (the experts ran on the FFN workers meanwhile) to the dispatch of the
# next; dispatch_b, experts and combine_a have no rows here.
AFD_FFN_DELAY: Plan = ("delay", YIELD)
AFD_FFN_LAYER: Plan = ("receive", "experts", "send", YIELD)
# Attention-FFN disaggregation, FFN side: a delay stage (the attention workers run their
# first layers), then a stage per MoE layer: take the micro-batch's rows, run the experts,
# send the partial sums back. Run stage-major like the attention side, the FFN worker serves
# (layer, micro-batch) in the order the attention workers dispatch; with point-to-point
# transfers (matched per pair, in order) no nop stage is needed to align collectives, and
# its receiver thread takes the next micro-batch's rows before this one's are sent back.


def layer_plan(strategy: Strategy, sbo: SingleBatchOverlap = OFF) -> Plan:
    """The strategy's plan, with the shared experts moved right after the launch they
    overlap when single-batch overlap says so (same stage: they run while it is in flight)."""
    if sbo.shared_after is None:
        return strategy.plan
    items = [p for p in strategy.plan if p != "shared_experts"]
    i = items.index(sbo.shared_after) + 1
    return (*items[:i], "shared_experts", *items[i:])


def block_plan(sbo: SingleBatchOverlap = OFF) -> Plan:
    """A MoE block's own operations in order (its forward without two-batch overlap)."""
    return tuple(p for p in layer_plan(IN_ORDER, sbo) if p in MOE_BLOCK_OPS)


class HasOperations(Protocol):
    def operations(self) -> dict[str, OpFn]: ...


def layer_items(
    layer: HasOperations, strategy: Strategy, sbo: SingleBatchOverlap = OFF
) -> list[Op | Yield]:
    ops = layer.operations()
    return arrange(ops, DENSE_LAYER if "layer" in ops else layer_plan(strategy, sbo))


def forward_stages(
    layers: Iterable[HasOperations], strategy: Strategy, sbo: SingleBatchOverlap = OFF
) -> list[list[Op]]:
    """The stages of a forward through `layers` under `strategy`."""
    items = [item for layer in layers for item in layer_items(layer, strategy, sbo)]
    return split_stages(items)
