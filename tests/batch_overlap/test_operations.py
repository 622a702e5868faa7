"""The operations framework: stages, the interleaving schedule, the executor, the state, and
the stages a forward gets under each strategy. Pure Python, no model."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.batch_overlap.operations import (
    YIELD,
    Op,
    Outputs,
    State,
    Yield,
    arrange,
    execute,
    run_in_order,
    run_stage,
    schedule,
    split_stages,
)
from pipeserve.batch_overlap.strategies import DECODE, PREFILL, forward_stages
from pipeserve.timeline import drain_comm, now, record_comm

A, B, C = 0, 1, 2


def noop(state: State, **inputs: Any) -> None:
    return None


def names(stages: list[list[Op]]) -> list[list[str]]:
    return [[op.name for op in stage] for stage in stages]


def ops_named(*names_: str) -> dict[str, Any]:
    return {n: noop for n in names_}


# -- stages -------------------------------------------------------------------------------


def test_markers_cut_stages() -> None:
    items = arrange(ops_named("a", "b", "c", "d"), ["a", "b", YIELD, "c", YIELD, "d"])
    assert names(split_stages(items)) == [["a", "b"], ["c"], ["d"]]


def test_consecutive_leading_and_trailing_markers_give_no_empty_stage() -> None:
    plan = [YIELD, YIELD, "a", YIELD, YIELD, YIELD, "b", YIELD, YIELD]
    assert names(split_stages(arrange(ops_named("a", "b"), plan))) == [["a"], ["b"]]
    assert split_stages([YIELD, YIELD]) == []
    assert split_stages([]) == []


def test_arrange_follows_the_plan_order_not_the_layer_order() -> None:
    items = arrange(ops_named("b", "a"), ["a", YIELD, "b"])
    assert [i.name if isinstance(i, Op) else i for i in items] == ["a", YIELD, "b"]


def test_arrange_skips_plan_names_the_layer_lacks() -> None:
    items = arrange(ops_named("a", "c"), ["a", "shared_experts", YIELD, "c", "missing"])
    assert names(split_stages(items)) == [["a"], ["c"]]


def test_arrange_raises_when_an_operation_of_the_layer_is_not_placed() -> None:
    with pytest.raises(ValueError, match="extra"):
        arrange(ops_named("a", "extra"), ["a", YIELD])


def test_arrange_keeps_any_yield_instance_as_a_marker() -> None:
    items = arrange(ops_named("a", "b"), ["a", Yield(), "b"])
    assert names(split_stages(items)) == [["a"], ["b"]]


# -- schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "mbs", "delta", "expected"),
    [
        (4, 2, 0, [(A, 0), (B, 0), (A, 1), (B, 1), (A, 2), (B, 2), (A, 3), (B, 3)]),
        (4, 3, 0, [(m, s) for s in range(4) for m in (A, B, C)]),
        (6, 2, 0, [(m, s) for s in range(6) for m in (A, B)]),
        (4, 2, 2, [(A, 0), (A, 1), (A, 2), (B, 0), (A, 3), (B, 1), (B, 2), (B, 3)]),
        (
            6,
            2,
            2,
            # A0 A1 A2 B0 A3 B1 A4 B2 A5 B3 B4 B5
            [(A, 0), (A, 1), (A, 2), (B, 0), (A, 3), (B, 1)]
            + [(A, 4), (B, 2), (A, 5), (B, 3), (B, 4), (B, 5)],
        ),
        (
            4,
            3,
            2,
            # A0 A1 A2 B0 A3 B1 B2 C0 B3 C1 C2 C3
            [(A, 0), (A, 1), (A, 2), (B, 0), (A, 3), (B, 1)]
            + [(B, 2), (C, 0), (B, 3), (C, 1), (C, 2), (C, 3)],
        ),
        (
            6,
            3,
            2,
            # A0 A1 A2 B0 A3 B1 A4 B2 C0 A5 B3 C1 B4 C2 B5 C3 C4 C5
            [(A, 0), (A, 1), (A, 2), (B, 0), (A, 3), (B, 1), (A, 4), (B, 2), (C, 0)]
            + [(A, 5), (B, 3), (C, 1), (B, 4), (C, 2), (B, 5), (C, 3), (C, 4), (C, 5)],
        ),
        (1, 2, 2, [(A, 0), (B, 0)]),
    ],
)
def test_schedule(stages: int, mbs: int, delta: int, expected: list[tuple[int, int]]) -> None:
    assert list(schedule(stages, mbs, delta)) == expected


# -- execute ------------------------------------------------------------------------------


def logging_stages(num_stages: int, log: list[tuple[int, str]]) -> list[list[Op]]:
    """Two operations per stage, each appending (micro-batch, its name) to `log`."""

    def op(name: str) -> Op:
        def fn(state: State, mb: int, **rest: Any) -> None:
            log.append((mb, name))

        return Op(name, fn)

    return [[op(f"s{k}a"), op(f"s{k}b")] for k in range(num_stages)]


@pytest.mark.parametrize(("num_stages", "mbs", "delta"), [(4, 2, 0), (6, 2, 2), (6, 3, 2)])
def test_execute_runs_operations_in_schedule_order(num_stages: int, mbs: int, delta: int) -> None:
    log: list[tuple[int, str]] = []
    stages = logging_stages(num_stages, log)
    execute(stages, [State() for _ in range(mbs)], [{"mb": m} for m in range(mbs)], delta)
    expected = [(m, op.name) for m, k in schedule(num_stages, mbs, delta) for op in stages[k]]
    assert log == expected
    assert len(log) == 2 * num_stages * mbs


@pytest.mark.parametrize("delta", [0, 1])  # B stashes while A still holds its value
def test_execute_carries_outputs_as_kwargs_and_keeps_states_separate(delta: int) -> None:
    seen: list[tuple[int, int]] = []

    def stash(state: State, x: int) -> Outputs:
        state["stashed"] = x  # a shared state would raise here on the second micro-batch
        return {"y": x + 1}

    def double(state: State, y: int) -> Outputs:
        return {"z": 2 * y}

    def unstash(state: State, z: int) -> Outputs:
        seen.append((state.pop("stashed"), z))
        return {"out": z * 100 + 1}

    stages = [[Op("stash", stash)], [Op("double", double)], [Op("unstash", unstash)]]
    states = [State(), State()]
    outs = execute(stages, states, [{"x": 1}, {"x": 5}], delta)
    assert outs == [{"out": 401}, {"out": 1201}]
    assert seen == [(1, 4), (5, 12)]
    assert states == [{}, {}]


def test_execute_returns_outputs_in_micro_batch_order() -> None:
    stages = [[Op("tag", lambda state, x: {"x": x, "len": len(x)})]]
    inputs: list[Outputs] = [{"x": "a"}, {"x": "bb"}, {"x": "ccc"}]
    assert execute(stages, [State() for _ in inputs], inputs, delta=0) == [
        {"x": "a", "len": 1},
        {"x": "bb", "len": 2},
        {"x": "ccc", "len": 3},
    ]


def test_execute_rejects_a_negative_delta() -> None:
    with pytest.raises(ValueError, match="delta"):
        execute([[Op("a", noop)]], [State(), State()], [{}, {}], delta=-1)


def test_execute_rejects_a_state_count_unlike_the_micro_batch_count() -> None:
    with pytest.raises(ValueError):
        execute([[Op("a", noop)]], [State()], [{}, {}], delta=0)


# -- state ----------------------------------------------------------------------------------


def test_state_refuses_a_second_write_naming_the_key() -> None:
    state = State()
    state["dispatch_handle"] = 1
    with pytest.raises(KeyError) as err:
        state["dispatch_handle"] = 2
    assert "'dispatch_handle'" in str(err.value)
    assert state["dispatch_handle"] == 1


def test_state_second_write_inside_a_forward_raises() -> None:
    def put(state: State, **inputs: Any) -> None:
        state["h"] = 0

    items = arrange({"put1": put, "put2": put}, ["put1", YIELD, "put2"])
    with pytest.raises(KeyError, match="'h'"):
        run_in_order(items, State())


def test_state_pop_then_write_works() -> None:
    state = State()
    state["h"] = 1
    assert state.pop("h") == 1
    state["h"] = 2
    assert state["h"] == 2


def test_an_operation_returning_none_passes_its_inputs_on() -> None:
    got: list[Outputs] = []

    def record(state: State, **inputs: Any) -> Outputs:
        got.append(inputs)
        return {"done": True}

    items = arrange({"first": noop, "second": record}, ["first", "second"])
    assert run_in_order(items, State(), x=3, y="v") == {"done": True}
    assert got == [{"x": 3, "y": "v"}]
    assert Op("n", noop)(State(), {"x": 3}) == {"x": 3}


# -- run in order -------------------------------------------------------------------------


def chain_ops() -> dict[str, Any]:
    def add(state: State, x: int) -> Outputs:
        state["orig"] = x
        return {"x": x + 3}

    def mul(state: State, x: int) -> Outputs:
        return {"x": x * 7}

    def log_only(state: State, **inputs: Any) -> None:
        return None

    def sub(state: State, x: int) -> Outputs:
        return {"x": x - state.pop("orig")}

    return {"add": add, "mul": mul, "log_only": log_only, "sub": sub}


def test_run_in_order_ignores_markers_and_matches_execute_with_one_micro_batch() -> None:
    items = arrange(chain_ops(), [YIELD, "add", YIELD, YIELD, "mul", "log_only", YIELD, "sub"])
    plain_state = State()
    plain = run_in_order(items, plain_state, x=2)
    assert plain == {"x": (2 + 3) * 7 - 2}
    assert plain == run_in_order([i for i in items if isinstance(i, Op)], State(), x=2)
    overlapped = execute(split_stages(items), [State()], [{"x": 2}], delta=2)
    assert overlapped == [plain]
    assert plain_state == {}


# -- timeline -----------------------------------------------------------------------------


def test_run_stage_records_one_span_per_operation_tagged_with_the_micro_batch() -> None:
    drain_comm()

    def with_comm(state: State, **inputs: Any) -> None:
        record_comm("dispatch_launch", now(), layer=3, nbytes=8, nbytes_recv=4)

    stage = [Op("gate", noop), Op("dispatch_a", with_comm)]
    before = now()
    run_stage(stage, State(), {}, micro_batch=1)
    after = now()
    spans = drain_comm()
    assert [(s[0], s[3:]) for s in spans] == [
        ("op:gate", (-1, 0, 0, 1)),
        ("dispatch_launch", (3, 8, 4, 1)),
        ("op:dispatch_a", (-1, 0, 0, 1)),
    ]
    for _, start, end, *_ in spans:
        assert before <= start <= end <= after


def test_run_stage_resets_the_micro_batch_tag() -> None:
    drain_comm()
    run_stage([Op("a", noop)], State(), {}, micro_batch=1)
    record_comm("after", now())
    assert [(s[0], s[6]) for s in drain_comm()] == [("op:a", 1), ("after", -1)]


def test_run_stage_resets_the_micro_batch_tag_when_an_operation_raises() -> None:
    def boom(state: State, **inputs: Any) -> None:
        raise RuntimeError("boom")

    drain_comm()
    with pytest.raises(RuntimeError):
        run_stage([Op("boom", boom)], State(), {}, micro_batch=1)
    record_comm("after", now())
    assert [(s[0], s[6]) for s in drain_comm()] == [("after", -1)]


def test_execute_tags_each_stage_with_its_micro_batch() -> None:
    drain_comm()
    stages = [[Op(f"s{k}", noop)] for k in range(3)]
    execute(stages, [State(), State()], [{}, {}], delta=2)
    got = [(s[0], s[6]) for s in drain_comm()]
    assert got == [(f"op:s{k}", mb) for mb, k in schedule(3, 2, 2)]


# -- strategies ---------------------------------------------------------------------------

MOE_OPS = (
    "attention",
    "gate",
    "dispatch_a",
    "dispatch_b",
    "experts",
    "combine_a",
    "combine_b",
    "shared_experts",
    "output",
    "layer_output",
)


class FakeLayer:
    def __init__(self, *op_names: str) -> None:
        self.op_names = op_names

    def operations(self) -> dict[str, Any]:
        return ops_named(*self.op_names)


def moe(shared: bool = True) -> FakeLayer:
    return FakeLayer(*(n for n in MOE_OPS if shared or n != "shared_experts"))


def dense() -> FakeLayer:
    return FakeLayer("layer")


def test_prefill_stages_of_one_moe_layer() -> None:
    assert names(forward_stages([moe()], PREFILL)) == [
        ["attention", "gate", "dispatch_a"],
        ["dispatch_b", "experts", "combine_a"],
        ["shared_experts", "combine_b", "output", "layer_output"],
    ]


def test_decode_stages_of_one_moe_layer() -> None:
    assert names(forward_stages([moe()], DECODE)) == [
        ["attention"],
        ["gate"],
        ["dispatch_a", "shared_experts"],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b"],
        ["output", "layer_output"],
    ]


def test_a_layers_last_stage_merges_with_the_next_layers_first() -> None:
    stages = names(forward_stages([moe(), moe()], PREFILL))
    assert stages[2] == [
        "shared_experts",
        "combine_b",
        "output",
        "layer_output",
        "attention",
        "gate",
        "dispatch_a",
    ]
    decode = names(forward_stages([moe(), moe()], DECODE))
    assert decode[5] == ["output", "layer_output", "attention"]


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5])
def test_stage_counts_of_moe_layers(num_layers: int) -> None:
    layers = [moe() for _ in range(num_layers)]
    assert len(forward_stages(layers, PREFILL)) == 2 * num_layers + 1
    assert len(forward_stages(layers, DECODE)) == 5 * num_layers + 1


@pytest.mark.parametrize("strategy", [PREFILL, DECODE])
def test_every_operation_of_every_layer_runs_once_in_layer_order(strategy: Any) -> None:
    layers = [moe(), dense(), moe(shared=False)]
    flat = [op.name for stage in forward_stages(layers, strategy) for op in stage]
    assert flat.count("layer") == 1
    assert flat.count("attention") == 2
    assert flat.count("shared_experts") == 1
    first_moe_end = flat.index("layer_output")
    assert flat.index("layer") == first_moe_end + 1
    assert flat[first_moe_end + 2] == "attention"
    assert len(flat) == len(MOE_OPS) + 1 + (len(MOE_OPS) - 1)


@pytest.mark.parametrize(("strategy", "per_layer"), [(PREFILL, 2), (DECODE, 5)])
def test_a_dense_layer_adds_one_operation_and_no_stage(strategy: Any, per_layer: int) -> None:
    moe_only = forward_stages([moe(), moe()], strategy)
    for layers in ([dense(), moe(), moe()], [moe(), dense(), moe()], [moe(), moe(), dense()]):
        stages = forward_stages(layers, strategy)
        assert len(stages) == 2 * per_layer + 1 == len(moe_only)
        assert sum(len(s) for s in stages) == sum(len(s) for s in moe_only) + 1
    assert names(forward_stages([dense(), dense()], strategy)) == [["layer", "layer"]]


def test_the_dense_layer_joins_the_stage_it_falls_in() -> None:
    stages = names(forward_stages([moe(), dense(), moe()], PREFILL))
    assert stages[2] == [
        "shared_experts",
        "combine_b",
        "output",
        "layer_output",
        "layer",
        "attention",
        "gate",
        "dispatch_a",
    ]


@pytest.mark.parametrize("strategy", [PREFILL, DECODE])
def test_a_layer_without_shared_experts_skips_that_name(strategy: Any) -> None:
    with_shared = names(forward_stages([moe()], strategy))
    without = names(forward_stages([moe(shared=False)], strategy))
    assert without == [[n for n in s if n != "shared_experts"] for s in with_shared]
    assert len(without) == len(with_shared)
    assert "shared_experts" not in [n for s in without for n in s]


def test_a_layer_with_an_unplanned_operation_raises() -> None:
    with pytest.raises(ValueError, match="mystery"):
        forward_stages([FakeLayer(*MOE_OPS, "mystery")], PREFILL)
