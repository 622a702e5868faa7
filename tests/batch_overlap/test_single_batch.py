"""Single-batch overlap settings and where they put the shared experts."""

from __future__ import annotations

import pytest

from pipeserve.batch_overlap.operations import YIELD
from pipeserve.batch_overlap.single_batch import DOWN_BLOCKS, OFF, SingleBatchOverlap
from pipeserve.batch_overlap.strategies import DECODE, IN_ORDER, PREFILL, block_plan, layer_plan


@pytest.mark.parametrize(("modes", "blocks", "shared_after"), [
    ("combine-down", DOWN_BLOCKS, None),
    ("dispatch-shared", 1, "dispatch_a"),
    ("combine-shared", 1, "combine_a"),
    ("combine-shared, dispatch-shared", 1, "dispatch_a"),  # the shared experts run once
    ("combine-down,combine-shared", DOWN_BLOCKS, "combine_a"),
])
def test_modes(modes: str, blocks: int, shared_after: str | None) -> None:
    assert SingleBatchOverlap.from_modes(modes) == SingleBatchOverlap(blocks, shared_after)


@pytest.mark.parametrize("modes", ["", "combine-up", "dispatch-shared,nope"])
def test_unknown_modes_are_refused(modes: str) -> None:
    with pytest.raises(ValueError, match="single-batch-overlap-modes"):
        SingleBatchOverlap.from_modes(modes)


def stage_of(plan: tuple, name: str) -> list[str]:
    stage: list[str] = []
    for item in plan:
        if item is YIELD:
            if name in stage:
                return stage
            stage = []
        else:
            stage.append(item)
    return stage


def test_without_overlap_the_shared_experts_wait_for_the_combine() -> None:
    order = list(block_plan(OFF))
    assert order.index("shared_experts") > order.index("combine_b")
    assert layer_plan(PREFILL) == PREFILL.plan and layer_plan(DECODE) == DECODE.plan


@pytest.mark.parametrize("strategy", [IN_ORDER, PREFILL, DECODE], ids=lambda s: s.name)
@pytest.mark.parametrize(("modes", "launch", "wait"), [
    ("dispatch-shared", "dispatch_a", "dispatch_b"),
    ("combine-shared", "combine_a", "combine_b"),
])
def test_shared_experts_run_right_after_the_launch_they_overlap(strategy, modes: str,
                                                                launch: str, wait: str) -> None:
    plan = layer_plan(strategy, SingleBatchOverlap.from_modes(modes))
    names = [p for p in plan if p is not YIELD]
    assert names.count("shared_experts") == 1
    assert names[names.index(launch) + 1] == "shared_experts"  # same stage, before any wait
    assert "shared_experts" in stage_of(plan, launch)
    assert names.index("shared_experts") < names.index(wait)
    # the stage structure is the strategy's
    assert plan.count(YIELD) == strategy.plan.count(YIELD)


def test_combine_down_blocks_only_in_steps_with_enough_tokens() -> None:
    from pipeserve.batch_overlap.single_batch import combine_down_blocks

    assert combine_down_blocks(4, 256, [300, 0]) == 4  # one rank's batch is enough
    assert combine_down_blocks(4, 256, [200, 255]) == 1
    assert combine_down_blocks(4, 256, []) == 1
    assert combine_down_blocks(1, 0, [1000]) == 1  # combine-down off
