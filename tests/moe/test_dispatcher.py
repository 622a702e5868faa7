"""Expert-parallel dispatch and combine on real gloo groups of 2 and 4 processes.

Every rank runs the same scenarios (fp32, bf16, an explicit placement table, a rank that
receives nothing, tokens whose experts all sit on one rank, two dispatchers in flight at
once); the test process rebuilds each rank's expected rows, counts, bytes and combined
output from the global routing, with loops of its own, and compares. Each half of a
dispatch and a combine logs one communication span with its layer and bytes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from moe_helpers import multi_process, run_ranks

from pipeserve.moe.dispatcher import (
    AllToAllDispatcher,
    Dispatcher,
    ExpertPlacement,
    LocalDispatcher,
    make_dispatcher,
)
from pipeserve.timeline import drain_comm

HIDDEN, TOP_K, EXPERTS_PER_RANK = 6, 3, 3
ROW_EXTRA_BYTES = TOP_K * (8 + 4)  # long local ids + float32 weights ride with each row


def dispatch_row_bytes(elem: int) -> int:
    """One packed dispatch row: ids and weights, the hidden state, padded to 8 bytes."""
    return -(-(ROW_EXTRA_BYTES + HIDDEN * elem) // 8) * 8
LAYER = 7


@dataclass(frozen=True)
class Case:
    """One dispatch: per rank, hidden [n, H], topk_ids [n, k], topk_weights [n, k]."""

    table: tuple[int, ...]  # global expert -> rank
    hidden: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]


def contiguous_table(world: int) -> tuple[int, ...]:
    return tuple(e // EXPERTS_PER_RANK for e in range(world * EXPERTS_PER_RANK))


def interleaved_table(world: int) -> tuple[int, ...]:
    return tuple((3 * e + 1) % world for e in range(world * EXPERTS_PER_RANK))


def make_case(
    world: int, seed: int, dtype: torch.dtype, tokens: list[int], table: tuple[int, ...],
    allowed: list[int] | None = None, one_rank: bool = False,
) -> Case:
    """Random distinct top-k experts per token from `allowed` (default: all); with
    `one_rank`, rank r's tokens pick all their experts among rank (r + 1) % world's."""
    gen = torch.Generator().manual_seed(seed)
    hidden, ids, weights = [], [], []
    for r, n in enumerate(tokens[:world]):
        pool = allowed or list(range(len(table)))
        if one_rank:
            pool = [e for e, owner in enumerate(table) if owner == (r + 1) % world]
        pick = [torch.randperm(len(pool), generator=gen)[:TOP_K] for _ in range(n)]
        ids.append(torch.tensor([[pool[i] for i in p] for p in pick], dtype=torch.long)
                   .reshape(n, TOP_K))
        hidden.append(torch.randn(n, HIDDEN, generator=gen).to(dtype))
        weights.append(torch.rand(n, TOP_K, generator=gen))
    return Case(table, hidden, ids, weights)


def cases(world: int) -> dict[str, Case]:
    even, odd = contiguous_table(world), interleaved_table(world)
    not_last = [e for e, owner in enumerate(even) if owner != world - 1]
    return {
        "fp32": make_case(world, 1, torch.float32, [5, 0, 7, 3], even),
        "bf16": make_case(world, 2, torch.bfloat16, [4, 6, 0, 2], even),
        "table": make_case(world, 3, torch.float32, [6, 3, 4, 0], odd),
        "last_gets_nothing": make_case(world, 4, torch.float32, [4, 3, 0, 5], even, not_last),
        "one_rank": make_case(world, 5, torch.float32, [3, 2, 4, 1], even, one_rank=True),
        "tbo_a": make_case(world, 6, torch.bfloat16, [3, 5, 2, 4], even),
        "tbo_b": make_case(world, 7, torch.bfloat16, [2, 0, 6, 1], odd),
    }


# --- what each rank runs ------------------------------------------------------------------


def run_experts(d: Dispatcher, hidden: torch.Tensor, local_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """Expert e multiplies by (e + 1); [R, H] weighted and summed over this rank's experts."""
    global_ids = torch.tensor(d.local_experts, dtype=torch.long)[local_ids.clamp(min=0)]
    scale = torch.where(local_ids >= 0, weights * (global_ids + 1), 0.0).sum(dim=1)
    return (hidden.float() * scale[:, None]).to(hidden.dtype)


def record(dispatched: Any, dispatch_traffic: Any, combine_traffic: Any,
           out: torch.Tensor) -> dict[str, Any]:
    plan = dispatched.plan
    return {
        # the three share one received buffer (dispatch packs them into one transfer)
        "hidden": dispatched.hidden.clone(), "local_ids": dispatched.local_ids.clone(),
        "weights": dispatched.weights.clone(), "send_counts": list(plan.send_counts),
        "recv_counts": list(plan.recv_counts), "out": out,
        "dispatch_traffic": dataclasses.astuple(dispatch_traffic),
        "combine_traffic": dataclasses.astuple(combine_traffic),
    }


def one_dispatch(d: Dispatcher, case: Case, rank: int) -> dict[str, Any]:
    sent = d.dispatch_a(case.hidden[rank], case.ids[rank], case.weights[rank])
    got = d.dispatch_b(sent)
    back = d.combine_a(run_experts(d, got.hidden, got.local_ids, got.weights), got)
    return record(got, sent.traffic, back.traffic, d.combine_b(back))


def two_in_flight(da: Dispatcher, db: Dispatcher, a: Case, b: Case,
                  rank: int) -> list[dict[str, Any]]:
    """Two-batch overlap's order: launch A, launch B, wait A, wait B; the same for combine."""
    sa = da.dispatch_a(a.hidden[rank], a.ids[rank], a.weights[rank])
    sb = db.dispatch_a(b.hidden[rank], b.ids[rank], b.weights[rank])
    ga, gb = da.dispatch_b(sa), db.dispatch_b(sb)
    ba = da.combine_a(run_experts(da, ga.hidden, ga.local_ids, ga.weights), ga)
    bb = db.combine_a(run_experts(db, gb.hidden, gb.local_ids, gb.weights), gb)
    oa, ob = da.combine_b(ba), db.combine_b(bb)
    return [record(ga, sa.traffic, ba.traffic, oa), record(gb, sb.traffic, bb.traffic, ob)]


def dispatcher_for(case: Case, world: int, rank: int) -> Dispatcher:
    return make_dispatcher(ExpertPlacement.from_table(case.table, world), rank)


def logged_spans(case: Case, world: int, rank: int) -> dict[str, Any]:
    """One dispatch and combine of layer 7: the spans it logged and its handles' traffic."""
    drain_comm()
    d = make_dispatcher(ExpertPlacement.from_table(case.table, world), rank, layer=LAYER)
    done = one_dispatch(d, case, rank)
    spans = [(kind, end >= start, layer, sent, recv)
             for kind, start, end, layer, sent, recv, _ in drain_comm()]
    return {"spans": spans, "dispatch_traffic": done["dispatch_traffic"],
            "combine_traffic": done["combine_traffic"]}


def on_counts_group(case: Case, world: int, rank: int) -> dict[str, Any]:
    """One dispatch and combine with a separate counts group; which group each transfer used
    (True: the counts group) and the dtype and size it moved."""
    import torch.distributed as dist

    counts_group = dist.new_group(list(range(world)))
    d = make_dispatcher(ExpertPlacement.from_table(case.table, world), rank,
                        counts_group=counts_group)
    calls, launch = [], dist.all_to_all_single

    def spy(output, input, *args, group=None, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((group is counts_group, str(input.dtype), input.numel()))
        return launch(output, input, *args, group=group, **kwargs)

    dist.all_to_all_single = spy
    try:
        done = one_dispatch(d, case, rank)
    finally:
        dist.all_to_all_single = launch
    return {"calls": calls, "out": done["out"]}


def rank_results(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    all_cases, results = cases(world), {}
    for name in ["fp32", "bf16", "table", "last_gets_nothing", "one_rank"]:
        results[name] = one_dispatch(dispatcher_for(all_cases[name], world, rank),
                                     all_cases[name], rank)
    a, b = all_cases["tbo_a"], all_cases["tbo_b"]
    results["tbo_a"], results["tbo_b"] = two_in_flight(
        dispatcher_for(a, world, rank), dispatcher_for(b, world, rank), a, b, rank)
    results["spans"] = logged_spans(all_cases["fp32"], world, rank)
    results["counts_group"] = on_counts_group(all_cases["fp32"], world, rank)
    try:
        AllToAllDispatcher(ExpertPlacement.contiguous(8, world + 1), rank)
        results["wrong_group"] = ""
    except ValueError as exc:
        results["wrong_group"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def group(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    """(world, per-rank results), one spawn per world size for the whole module."""
    world = request.param
    return world, run_ranks(rank_results, world, tmp_path_factory.mktemp(f"ep{world}"))


# --- the expected results, from the global view -------------------------------------------


def local_index(table: tuple[int, ...], e: int) -> int:
    return sum(1 for f in range(e) if table[f] == table[e])


def expected_rows(case: Case, dest: int) -> list[tuple[int, int, list[int], list[float]]]:
    """(source, token, local ids, weights) per row `dest` receives, in the promised order."""
    rows = []
    for src, ids in enumerate(case.ids):
        for t, token_ids in enumerate(ids.tolist()):
            here = [case.table[e] == dest for e in token_ids]
            if any(here):
                weights = case.weights[src][t].tolist()
                local = [local_index(case.table, e) if h else -1
                         for e, h in zip(token_ids, here, strict=True)]
                w = [w if h else 0.0 for w, h in zip(weights, here, strict=True)]
                rows.append((src, t, local, w))
    return rows


def expected_counts(case: Case, src: int, dest: int) -> int:
    return sum(1 for row in expected_rows(case, dest) if row[0] == src)


def expected_out(case: Case, rank: int) -> torch.Tensor:
    """sum_k w_k * (e_k + 1) * x per token, in float32."""
    scale = (case.weights[rank] * (case.ids[rank] + 1).float()).sum(dim=1)
    return case.hidden[rank].float() * scale[:, None]


NAMES = ["fp32", "bf16", "table", "last_gets_nothing", "one_rank", "tbo_a", "tbo_b"]


# --- the tests ------------------------------------------------------------------------------


@multi_process
@pytest.mark.parametrize("name", NAMES)
def test_counts_are_exchanged_per_source(group, name: str) -> None:
    world, results = group
    case = cases(world)[name]
    for r in range(world):
        assert results[r][name]["send_counts"] == [expected_counts(case, r, d)
                                                   for d in range(world)]
        assert results[r][name]["recv_counts"] == [expected_counts(case, s, r)
                                                   for s in range(world)]


@multi_process
@pytest.mark.parametrize("name", NAMES)
def test_rows_arrive_by_source_then_token_order(group, name: str) -> None:
    """Hidden rows bit-exact (bf16 too), local expert ids and weights per slot, in order."""
    world, results = group
    case = cases(world)[name]
    for r in range(world):
        rows, got = expected_rows(case, r), results[r][name]
        hidden = [case.hidden[s][t] for s, t, _, _ in rows]
        want = torch.stack(hidden) if hidden else torch.empty(0, HIDDEN, dtype=got["hidden"].dtype)
        assert got["hidden"].dtype == case.hidden[r].dtype and torch.equal(got["hidden"], want)
        assert got["local_ids"].tolist() == [ids for _, _, ids, _ in rows]
        assert got["weights"].dtype == torch.float32
        assert got["weights"].tolist() == [w for _, _, _, w in rows]


@multi_process
@pytest.mark.parametrize("name", NAMES)
def test_combine_sums_weighted_expert_outputs_per_owner(group, name: str) -> None:
    world, results = group
    case = cases(world)[name]
    for r in range(world):
        out = results[r][name]["out"]
        assert out.dtype == case.hidden[r].dtype and out.shape == case.hidden[r].shape
        tol = 1e-2 if out.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.float(), expected_out(case, r), rtol=tol, atol=1e-5)


@multi_process
@pytest.mark.parametrize("name", NAMES)
def test_traffic_counts_each_token_once_per_other_rank(group, name: str) -> None:
    """Dispatch rows carry hidden + k ids + k weights; combine rows carry hidden only; the
    rows a rank keeps for itself do not count."""
    world, results = group
    case = cases(world)[name]
    elem = case.hidden[0].element_size()
    for r in range(world):
        out_rows = sum(expected_counts(case, r, d) for d in range(world) if d != r)
        in_rows = sum(expected_counts(case, s, r) for s in range(world) if s != r)
        row = HIDDEN * elem
        dispatch_row = dispatch_row_bytes(elem)
        assert results[r][name]["dispatch_traffic"] == (
            out_rows, in_rows, out_rows * dispatch_row, in_rows * dispatch_row)
        assert results[r][name]["combine_traffic"] == (in_rows, out_rows, in_rows * row,
                                                       out_rows * row)


@multi_process
def test_counts_go_on_their_own_group_and_data_in_one_transfer(group) -> None:
    """Dispatch: the counts (ep longs) on the counts group, then one packed transfer of bytes
    on the data group; combine: one transfer of hidden rows on the data group. The result is
    the same as with one group."""
    world, results = group
    for r in range(world):
        got = results[r]["counts_group"]
        calls = got["calls"]
        assert [c[:2] for c in calls] == [
            (True, "torch.int64"), (False, "torch.uint8"), (False, "torch.float32")]
        assert calls[0][2] == world
        torch.testing.assert_close(got["out"], results[r]["fp32"]["out"], rtol=0, atol=0)


@multi_process
def test_token_with_all_experts_on_one_rank_is_sent_once(group) -> None:
    world, results = group
    case = cases(world)["one_rank"]
    for r in range(world):
        n = case.hidden[r].shape[0]
        rows, _, sent, _ = results[r]["one_rank"]["dispatch_traffic"]
        assert (rows, sent) == (n, n * dispatch_row_bytes(4))
        assert results[(r + 1) % world]["one_rank"]["recv_counts"][r] == n


@multi_process
def test_ranks_without_tokens_or_without_work_take_part(group) -> None:
    """fp32 gives rank 1 no tokens; last_gets_nothing sends nothing to the last rank."""
    world, results = group
    empty = results[1]["fp32"]
    assert empty["send_counts"] == [0] * world
    assert empty["out"].shape == (0, HIDDEN) and empty["out"].dtype == torch.float32
    idle = results[world - 1]["last_gets_nothing"]
    assert idle["recv_counts"] == [0] * world
    assert idle["hidden"].shape == (0, HIDDEN) and idle["local_ids"].shape == (0, TOP_K)
    assert idle["weights"].shape == (0, TOP_K)


@multi_process
def test_group_of_another_size_is_refused(group) -> None:
    world, results = group
    assert f"expert-parallel size of {world + 1}" in results[0]["wrong_group"]


@multi_process
def test_each_half_logs_one_span_with_its_layer_and_traffic(group) -> None:
    """dispatch_launch, dispatch_wait, combine_launch, combine_wait, in that order; a launch
    carries its handle's bytes sent and received (the wait halves none)."""
    world, results = group
    for r in range(world):
        got = results[r]["spans"]
        _, _, d_sent, d_recv = got["dispatch_traffic"]
        _, _, c_sent, c_recv = got["combine_traffic"]
        assert got["spans"] == [
            ("dispatch_launch", True, LAYER, d_sent, d_recv),
            ("dispatch_wait", True, LAYER, 0, 0),
            ("combine_launch", True, LAYER, c_sent, c_recv),
            ("combine_wait", True, LAYER, 0, 0),
        ]
    assert sum(results[r]["spans"]["dispatch_traffic"][2] for r in range(world)) > 0


def test_local_dispatcher_passes_tokens_through() -> None:
    drain_comm()
    x = torch.randn(4, HIDDEN).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 3, 1]] * 4), torch.rand(4, TOP_K)
    d = LocalDispatcher(4)
    got = d.dispatch_b(d.dispatch_a(x, ids, w))
    assert got.hidden is x and torch.equal(got.local_ids, ids) and torch.equal(got.weights, w)
    out = run_experts(d, got.hidden, got.local_ids, got.weights)
    handle = d.combine_a(out, got)
    assert torch.equal(d.combine_b(handle), out) and handle.traffic.bytes_sent == 0
    case = Case((0,) * 4, [x], [ids], [w])
    torch.testing.assert_close(d.combine(out, got).float(), expected_out(case, 0), rtol=1e-2,
                               atol=1e-5)
    assert drain_comm() == []  # nothing moved, nothing logged


def test_ep_size_one_gets_the_local_dispatcher() -> None:
    d = make_dispatcher(ExpertPlacement.contiguous(8, 1))
    assert isinstance(d, LocalDispatcher) and d.local_experts == tuple(range(8))
