"""Operations and stages: one forward definition that runs in order, or interleaved over
micro-batches.

A layer declares its forward as named operations; a plan (strategies.py) orders them and puts
`YIELD` markers between them. Cutting the planned list at the markers gives stages. Each
operation takes the micro-batch's `State` and, as keyword arguments, the outputs of the
operation before it, and returns its outputs (a dict; None passes its inputs on unchanged).
Values needed further on go through the state, which refuses to overwrite a key (a consumer
pops what it reads). Run in order (`run_in_order`), the markers are ignored: that is the
forward without overlap. `execute` runs N micro-batches, micro-batch i lagging i * delta
stages behind the first: with two, A runs alone for `delta` stages, then A and B alternate,
then B runs alone for `delta` stages, so one's communication waits while the other computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipeserve.timeline import now, record_op, set_micro_batch

Outputs = dict[str, Any]


class State(dict[str, Any]):
    """A micro-batch's values between operations; each key is written once, then popped by
    the operation that consumes it."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise KeyError(
                f"state key {key!r} is written twice: an operation must pop it before another "
                "writes it (the same key in two layers means the earlier layer never read it)"
            )
        super().__setitem__(key, value)


OpFn = Callable[..., Outputs | None]


@dataclass(frozen=True)
class Op:
    name: str
    fn: OpFn

    def __call__(self, state: State, inputs: Outputs) -> Outputs:
        out = self.fn(state, **inputs)
        return inputs if out is None else out


@dataclass(frozen=True)
class Yield:
    """A stage boundary: another micro-batch may run here."""


YIELD = Yield()
Plan = Sequence[str | Yield]


def arrange(ops: dict[str, OpFn], plan: Plan) -> list[Op | Yield]:
    """The operations in the plan's order, with its stage markers. Names the layer does not
    have (e.g. shared experts in a model without them) are skipped; every operation the layer
    has must be placed."""
    missing = set(ops) - {p for p in plan if isinstance(p, str)}
    if missing:
        raise ValueError(f"the plan places no step for operation(s) {sorted(missing)}")
    return [
        p if isinstance(p, Yield) else Op(p, ops[p])
        for p in plan
        if isinstance(p, Yield) or p in ops
    ]


def split_stages(items: Sequence[Op | Yield]) -> list[list[Op]]:
    """Cut at the markers; a stage is never empty (consecutive markers collapse)."""
    stages: list[list[Op]] = [[]]
    for item in items:
        if isinstance(item, Yield):
            if stages[-1]:
                stages.append([])
        else:
            stages[-1].append(item)
    return [s for s in stages if s]


def run_in_order(items: Sequence[Op | Yield], state: State, **inputs: Any) -> Outputs:
    """The forward without overlap: every operation in order, markers ignored (each one's
    span goes to the timeline, as in `run_stage`)."""
    for item in items:
        if isinstance(item, Op):
            start = now()
            inputs = item(state, inputs)
            record_op(item.name, start)
    return inputs


def run_stage(stage: list[Op], state: State, inputs: Outputs, micro_batch: int) -> Outputs:
    """One stage of an overlapped forward; each operation's span goes to the timeline, and
    the communication spans inside it carry the micro-batch."""
    set_micro_batch(micro_batch)
    try:
        for op in stage:
            start = now()
            inputs = op(state, inputs)
            record_op(op.name, start)
    finally:
        set_micro_batch(-1)
    return inputs


def schedule(num_stages: int, num_micro_batches: int, delta: int) -> Iterator[tuple[int, int]]:
    """(micro-batch, stage) in execution order: at tick t micro-batch i runs stage t - i*delta
    (if it has one), micro-batches in index order."""
    last_tick = num_stages - 1 + (num_micro_batches - 1) * delta
    for tick in range(last_tick + 1):
        for mb in range(num_micro_batches):
            stage = tick - mb * delta
            if 0 <= stage < num_stages:
                yield mb, stage


def execute(
    stages: list[list[Op]], states: list[State], inputs: list[Outputs], delta: int
) -> list[Outputs]:
    """Run every micro-batch through `stages` interleaved (see `schedule`); each
    micro-batch's final outputs, in micro-batch order."""
    if delta < 0:
        raise ValueError(f"delta {delta} must be >= 0")
    if len(states) != len(inputs):
        raise ValueError(f"{len(states)} states for {len(inputs)} micro-batches")
    carried = list(inputs)
    for mb, k in schedule(len(stages), len(inputs), delta):
        carried[mb] = run_stage(stages[k], states[mb], carried[mb], mb)
    return carried
