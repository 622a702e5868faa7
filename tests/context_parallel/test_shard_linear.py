"""Shard linear's plan: round-robin owners, the exact events of a forward (cyclic prefetch K
layers ahead, owners neither wait nor release), a forward ending with what it started with,
and a simulated peak per device equal to the analytic one (own layers + the K + 1 window,
less the device's own layers in it) over many layer, world and warm-layer counts."""

from __future__ import annotations

import pytest

from pipeserve.context_parallel.shard_linear import (
    Broadcast,
    Release,
    Run,
    ShardLinearPlan,
    Wait,
)


def small_plans() -> list[ShardLinearPlan]:
    return [
        ShardLinearPlan(num_layers, world, warm)
        for num_layers in range(1, 13)
        for world in range(1, 7)
        for warm in range(num_layers + 1)
    ]


def test_owners_are_round_robin() -> None:
    plan = ShardLinearPlan(7, 3, 1)
    assert [plan.owner(layer) for layer in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [list(plan.owned_layers(d)) for d in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert list(ShardLinearPlan(2, 4, 0).owned_layers(3)) == []  # more devices than layers


def test_events_of_four_layers_on_two_devices_one_warm() -> None:
    assert ShardLinearPlan(4, 2, 1).events() == [
        Broadcast(1, 1), Wait(0, 1), Run(0), Release(0, 1),
        Broadcast(2, 0), Wait(1, 0), Run(1), Release(1, 0),
        Broadcast(3, 1), Wait(2, 1), Run(2), Release(2, 1),
        Broadcast(0, 0, next_forward=True), Wait(3, 0), Run(3), Release(3, 0),
    ]  # fmt: skip


def test_events_of_five_layers_on_three_devices_two_warm() -> None:
    assert ShardLinearPlan(5, 3, 2).events() == [
        Broadcast(2, 2), Wait(0, 1), Wait(0, 2), Run(0), Release(0, 1), Release(0, 2),
        Broadcast(3, 0), Wait(1, 0), Wait(1, 2), Run(1), Release(1, 0), Release(1, 2),
        Broadcast(4, 1), Wait(2, 0), Wait(2, 1), Run(2), Release(2, 0), Release(2, 1),
        Broadcast(0, 0, next_forward=True), Wait(3, 1), Wait(3, 2), Run(3),
        Release(3, 1), Release(3, 2),
        Broadcast(1, 1, next_forward=True), Wait(4, 0), Wait(4, 2), Run(4),
        Release(4, 0), Release(4, 2),
    ]  # fmt: skip


def test_resident_layers_step_by_step() -> None:
    plan = ShardLinearPlan(4, 2, 1)
    start = frozenset({0, 2})  # device 0 owns 0 and 2; layer 0 is also the warm one
    assert plan.resident(0) == [
        start, {0, 1, 2}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2},
        {0, 1, 2}, {0, 1, 2}, {0, 1, 2}, start,
        {0, 2, 3}, {0, 2, 3}, {0, 2, 3}, {0, 2, 3},
        {0, 2, 3}, {0, 2, 3}, {0, 2, 3}, start,
    ]  # fmt: skip
    assert plan.resident(1)[:5] == [{0, 1, 3}, {0, 1, 3}, {0, 1, 3}, {0, 1, 3}, {1, 3}]


def test_no_warm_layers_broadcasts_each_layer_at_its_own_start() -> None:
    plan = ShardLinearPlan(3, 2, 0)
    assert plan.events() == [
        Broadcast(0, 0), Wait(0, 1), Run(0), Release(0, 1),  # at the forward's start
        Broadcast(1, 1), Wait(1, 0), Run(1), Release(1, 0),
        Broadcast(2, 0), Wait(2, 1), Run(2), Release(2, 1),
    ]  # fmt: skip
    assert plan.between_forwards(0) == {0, 2} and plan.between_forwards(1) == {1}


def test_all_layers_warm_moves_nothing() -> None:
    plan = ShardLinearPlan(4, 2, 4)
    assert plan.events() == [Run(0), Run(1), Run(2), Run(3)]
    assert all(held == {0, 1, 2, 3} for d in range(2) for held in plan.resident(d))


def test_one_device_moves_nothing() -> None:
    plan = ShardLinearPlan(5, 1, 2)
    assert plan.events() == [Run(layer) for layer in range(5)]
    assert plan.peak_layers(0) == plan.expected_peak_layers(0) == 5


def test_every_layer_is_broadcast_once_k_layers_ahead() -> None:
    for plan in small_plans():
        if plan.moves_weights:
            check_broadcasts(plan)


def check_broadcasts(plan: ShardLinearPlan) -> None:
    issued_at = {plan.layers_to_prefetch_at(at)[0]: at for at in range(plan.num_layers)}
    assert sorted(issued_at) == list(range(plan.num_layers))  # never past the last layer
    for layer, at in issued_at.items():  # a warm layer's: in the previous forward
        assert at == (layer - plan.warm_layers) % plan.num_layers, plan
    broadcasts = [e for e in plan.events() if isinstance(e, Broadcast)]
    assert [b.layer for b in broadcasts if b.next_forward] == list(range(plan.warm_layers))
    assert all(b.src == plan.owner(b.layer) for b in broadcasts)


def test_layers_run_where_held_and_owners_neither_wait_nor_release() -> None:
    for plan in small_plans():
        check_runs(plan)


def check_runs(plan: ShardLinearPlan) -> None:
    events = plan.events()
    for device in range(plan.world_size):
        held = plan.resident(device)
        waited: set[int] = set()
        for i, event in enumerate(events):
            if isinstance(event, Wait | Release) and event.device == device:
                assert plan.owner(event.layer) != device
            if isinstance(event, Wait) and event.device == device:
                waited.add(event.layer)
            if isinstance(event, Run):
                assert event.layer in held[i], plan  # held while it runs
                borrowed = plan.moves_weights and plan.owner(event.layer) != device
                assert not borrowed or event.layer in waited, plan  # and has arrived
        assert held[-1] == held[0] == plan.between_forwards(device)  # forwards repeat


def test_peak_is_own_layers_plus_the_window_and_nothing_else() -> None:
    for plan in small_plans():
        for device in range(plan.world_size):
            simulated = plan.peak_bytes(device, 3)
            assert simulated == plan.expected_peak_bytes(device, 3), (plan, device)


def test_peak_when_the_world_divides_the_layers() -> None:
    for world in range(1, 5):
        for num_layers in range(world, 25, world):
            for warm in range(num_layers - 1):
                plan = ShardLinearPlan(num_layers, world, warm)
                expected = num_layers // world + warm + 1 - (warm + 1) // world
                assert [plan.peak_layers(d) for d in range(world)] == [expected] * world
    assert ShardLinearPlan(8, 2, 1).peak_bytes(0, 10) == 50  # 4 own + 1 borrowed, 8 replicated


def test_helpers_for_the_engine() -> None:
    plan = ShardLinearPlan(8, 2, 2)
    assert [plan.layers_to_prefetch_at(layer) for layer in range(8)] == [
        (2,), (3,), (4,), (5,), (6,), (7,), (0,), (1,),
    ]  # fmt: skip
    assert plan.layers_to_release_after(3, 0) == (3,)
    assert plan.layers_to_release_after(3, 1) == ()
    assert plan.layers_to_wait_before(0, 1) == (0,)
    assert plan.layers_to_wait_before(0, 0) == ()
    assert plan.window == 3 and plan.between_forwards(1) == {0, 1, 3, 5, 7}


@pytest.mark.parametrize(
    ("layers", "world", "warm", "message"),
    [
        (8, 2, 9, "--shard-linear-warm-layers 9 exceeds the 8 layers"),
        (8, 2, -1, "--shard-linear-warm-layers -1 must be >= 0"),
        (0, 2, 0, "shard linear needs at least one layer, got 0"),
        (8, 0, 0, "shard linear needs at least one device, got 0"),
    ],
)
def test_invalid_plans(layers: int, world: int, warm: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardLinearPlan(layers, world, warm)


def test_out_of_range_layers_and_devices() -> None:
    plan = ShardLinearPlan(8, 2, 1)
    with pytest.raises(ValueError, match=r"layer 8 is outside the 8 layers \(0..7\)"):
        plan.owner(8)
    with pytest.raises(ValueError, match=r"layer -1 is outside"):
        plan.layers_to_prefetch_at(-1)
    with pytest.raises(ValueError, match=r"device 2 is outside the world of 2 \(0..1\)"):
        plan.resident(2)
    with pytest.raises(ValueError, match="device 5 is outside"):
        ShardLinearPlan(8, 2, 8).layers_to_release_after(0, 5)
