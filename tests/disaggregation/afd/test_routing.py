"""AFD dispatch and combine planning: the routing tables of the three modes on a hand-made
case, two-stage stage 1 to the same local index on each node and stage 2 to exactly the
workers holding a row's experts, every mode's combine against the direct reference, the
counted rows and bytes, topology errors, and the routing harness end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pipeserve.disaggregation.afd.routing import (
    AfdTopology,
    DispatchMode,
    DispatchPlan,
    combine_at_attention,
    combine_in_node,
    plan_dispatch,
    plan_forward,
    weighted_partials,
)
from pipeserve.disaggregation.afd.traffic import Link, LinkTraffic, count_traffic
from pipeserve.moe.dispatcher.placement import ExpertPlacement

# 8 experts over 2 F nodes of 2 workers: worker w holds experts 2w and 2w + 1; node 0
# holds experts 0..3 (workers 0, 1), node 1 experts 4..7 (workers 2, 3).
TOPO = AfdTopology(num_attention=2, ffn_nodes=2, ffn_per_node=2)
PLACEMENT = ExpertPlacement.contiguous(8, 4)
IDS = torch.tensor(
    [
        [0, 5, 1],  # workers 0, 2, 0; nodes 0, 1
        [2, 3, 7],  # workers 1, 1, 3; nodes 0, 1
        [6, 4, 7],  # workers 3, 2, 3; node 1 only
        [1, 0, 3],  # workers 0, 0, 1; node 0 only
    ]
)
WEIGHTS = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.4, 0.2], [0.7, 0.2, 0.1]])


def plan(mode: str, a_rank: int = 1, ids: torch.Tensor = IDS) -> DispatchPlan:
    return plan_dispatch(ids, WEIGHTS[: ids.shape[0]], a_rank, TOPO, PLACEMENT, mode)


def rows(p: DispatchPlan) -> list[tuple[int, int, list[int]]]:
    """(destination, token, ids) per row, in plan order."""
    return list(zip(p.dest.tolist(), p.token.tolist(), p.ids.tolist(), strict=True))


def test_direct_sends_one_row_per_expert_to_its_worker() -> None:
    p = plan("direct")
    assert p.counts == (4, 3, 2, 3)
    assert rows(p) == [
        (0, 0, [0]), (0, 0, [1]), (0, 3, [1]), (0, 3, [0]),
        (1, 1, [0]), (1, 1, [1]), (1, 3, [1]),
        (2, 0, [1]), (2, 2, [0]),
        (3, 1, [1]), (3, 2, [0]), (3, 2, [1]),
    ]  # fmt: skip
    assert p.weights[:4, 0].tolist() == pytest.approx([0.5, 0.2, 0.7, 0.2])


def test_direct_rank_sends_one_row_per_worker_with_its_share() -> None:
    p = plan("direct-rank")
    assert p.counts == (2, 2, 2, 2)
    assert rows(p) == [
        (0, 0, [0, -1, 1]), (0, 3, [1, 0, -1]),
        (1, 1, [0, 1, -1]), (1, 3, [-1, -1, 1]),
        (2, 0, [-1, 1, -1]), (2, 2, [-1, 0, -1]),
        (3, 1, [-1, -1, 1]), (3, 2, [0, -1, 1]),
    ]  # fmt: skip
    assert p.weights[1].tolist() == pytest.approx([0.7, 0.2, 0.0])


def test_two_stage_sends_one_row_per_node_to_the_same_local_index() -> None:
    p = plan("two-stage", a_rank=1)  # local index 1: workers 1 and 3
    assert p.counts == (0, 3, 0, 3)
    assert rows(p) == [
        (1, 0, [0, -1, 1]), (1, 1, [2, 3, -1]), (1, 3, [1, 0, 3]),
        (3, 0, [-1, 5, -1]), (3, 1, [-1, -1, 7]), (3, 2, [6, 4, 7]),
    ]  # fmt: skip
    assert plan("two-stage", a_rank=0).counts == (3, 0, 3, 0)


def test_a_token_on_one_node_sends_one_stage_one_row() -> None:
    p = plan("two-stage", ids=IDS[2:])  # tokens on node 1 only, node 0 only
    assert p.token.tolist() == [1, 0] and p.dest.tolist() == [1, 3]


@pytest.mark.parametrize(
    ("num_attention", "per_node", "ffn_per_node", "peers"),
    [
        (4, 2, 2, [[0, 2], [1, 3], [0, 2], [1, 3]]),  # two A nodes of 2
        (3, None, 2, [[0, 2], [1, 3], [0, 2]]),  # local index 2 wraps to 0
        (2, None, 3, [[0, 3], [1, 4]]),
    ],
)
def test_stage_one_peer_is_the_local_index_on_every_node(
    num_attention: int, per_node: int | None, ffn_per_node: int, peers: list[list[int]]
) -> None:
    topo = AfdTopology(num_attention, 2, ffn_per_node, per_node)
    placement = ExpertPlacement.contiguous(4 * ffn_per_node, topo.num_ffn)
    ids = torch.tensor([[0, 4 * ffn_per_node - 1]])  # one expert on each node
    for a in range(num_attention):
        p = plan_dispatch(ids, torch.ones(1, 2), a, topo, placement, "two-stage")
        assert p.dest.tolist() == peers[a] == [topo.stage_one_peer(a, n) for n in (0, 1)]


def test_stage_two_forwards_each_row_to_the_workers_holding_its_experts() -> None:
    p = plan("two-stage")
    node0 = plan_forward(p.ids[:3], p.weights[:3], 1, TOPO, PLACEMENT)
    assert node0.counts == (2, 2) and node0.local_copies == 2
    assert list(zip(node0.dest.tolist(), node0.row.tolist(), node0.ids.tolist(), strict=True)) == [
        (0, 0, [0, -1, 1]), (0, 2, [1, 0, -1]), (1, 1, [0, 1, -1]), (1, 2, [-1, -1, 1]),
    ]  # fmt: skip
    node1 = plan_forward(p.ids[3:], p.weights[3:], 3, TOPO, PLACEMENT)
    assert list(zip(node1.dest.tolist(), node1.row.tolist(), node1.ids.tolist(), strict=True)) == [
        (2, 0, [-1, 1, -1]), (2, 2, [-1, 0, -1]), (3, 1, [-1, -1, 1]), (3, 2, [0, -1, 1]),
    ]  # fmt: skip
    assert node1.weights[3].tolist() == pytest.approx([0.4, 0.0, 0.2])


def test_stage_two_refuses_experts_of_another_node() -> None:
    with pytest.raises(ValueError, match="expert 5 of F node 1"):
        plan_forward(torch.tensor([[0, 5]]), torch.ones(1, 2), 1, TOPO, PLACEMENT)


# --- combine: every mode against the reference sum_j w_j * expert_{id_j}(x) ---------------


def random_routing(n: int, k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] distinct experts per token, the first token's experts 0..k-1."""
    ids = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :k]
    if n:
        ids[0] = torch.arange(k)
    return ids


def run_experts(
    worker: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mats: torch.Tensor,
    placement: ExpertPlacement,
) -> torch.Tensor:  # fmt: skip
    """Worker's partial per row: its local experts (global expert e: x @ mats[e])."""
    held = torch.tensor(placement.experts_on(worker), dtype=torch.long)
    out = torch.einsum("rh,rshg->rsg", x, mats[held[ids.clamp(min=0)]])  # [R, slots, H]
    return weighted_partials(out, ids, w)


def simulate(
    mode: DispatchMode, a: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
    topo: AfdTopology, placement: ExpertPlacement, mats: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One A worker's dispatch, expert compute (stage 2 and the in-node combine included)
    and combine, with each F worker computing only on the rows it was sent."""
    p = plan_dispatch(ids, w, a, topo, placement, mode)
    returned = []
    for f in range(topo.num_ffn):
        sent = p.rows_to(f)
        assert bool((p.dest[sent] == f).all())
        hidden, f_ids, f_w = x[p.token[sent]], p.ids[sent], p.weights[sent]
        if mode is not DispatchMode.TWO_STAGE:
            returned.append(run_experts(f, hidden, f_ids, f_w, mats, placement))
            continue
        fwd = plan_forward(f_ids, f_w, f, topo, placement)
        back = []
        for local in range(topo.ffn_per_node):
            g, rows = f - topo.local_of(f) + local, fwd.rows_to(local)
            assert bool((fwd.dest[rows] == g).all())
            back.append(run_experts(g, hidden[fwd.row[rows]], fwd.ids[rows], fwd.weights[rows],
                                    mats, placement))  # fmt: skip
        returned.append(combine_in_node(fwd, torch.cat(back)))
    return combine_at_attention(p, torch.cat(returned))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", list(DispatchMode))
def test_every_mode_combines_to_the_reference(mode: DispatchMode, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    topo = AfdTopology(3, ffn_nodes=2, ffn_per_node=3)
    experts, k, hidden = 24, 5, 8
    table = torch.randint(0, topo.num_ffn, (experts,), generator=gen)
    table[:k] = 0  # the first token of each A worker has all its experts on worker 0
    placement = ExpertPlacement.from_table(table.tolist(), topo.num_ffn)  # uneven
    mats = torch.randn(experts, hidden, hidden, generator=gen)
    for a, n in enumerate([7, 0, 12]):  # A worker 1 has no tokens
        x = torch.randn(n, hidden, generator=gen)
        ids = random_routing(n, k, experts, gen)
        w = torch.rand(n, k, generator=gen)
        want = torch.einsum("nh,nkhg,nk->ng", x, mats[ids], w)
        got = simulate(mode, a, x, ids, w, topo, placement, mats)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_partials_ignore_the_outputs_of_empty_slots() -> None:
    outputs = torch.tensor([[[1.0, 2.0], [float("nan"), float("inf")], [3.0, 4.0]]])
    ids, w = torch.tensor([[0, -1, 2]]), torch.tensor([[0.5, 0.0, 2.0]])
    assert weighted_partials(outputs, ids, w).tolist() == [[6.5, 9.0]]


def test_combine_refuses_a_wrong_number_of_partials() -> None:
    with pytest.raises(ValueError, match="for 6 dispatched rows"):
        combine_at_attention(plan("two-stage"), torch.zeros(5, 4))


# --- counted rows and bytes -------------------------------------------------------------


def traffic(mode: str) -> LinkTraffic:
    return count_traffic(IDS, 1, TOPO, PLACEMENT, mode, hidden=16, dtype=torch.float32)


def test_counted_bytes_of_the_hand_made_case() -> None:
    # hidden 16 x fp32 = 64 bytes; a dispatch row adds 12 bytes (long id + float32 weight)
    # per slot: direct 1 slot (76), the others 3 (100); a combine row is 64 bytes
    assert traffic("direct") == LinkTraffic(
        dispatch_between_nodes=Link(12, 12 * 76),
        combine_between_nodes=Link(12, 12 * 64),
        counts_between_nodes=Link(4, 32),  # one int64 count to each F worker
    )
    assert traffic("direct-rank") == LinkTraffic(
        dispatch_between_nodes=Link(8, 800),
        combine_between_nodes=Link(8, 512),
        counts_between_nodes=Link(4, 32),
    )
    # stage 1: 6 rows; stage 2: rows to workers 0 and 2 forwarded, 4 kept as local copies
    assert traffic("two-stage") == LinkTraffic(
        dispatch_between_nodes=Link(6, 600),
        dispatch_inside_node=Link(4, 400),
        combine_between_nodes=Link(6, 384),
        combine_inside_node=Link(4, 256),
        counts_between_nodes=Link(2, 16),  # one count to the peer on each node
        counts_inside_node=Link(2, 16),  # each peer to the other worker of its node
        local_copies=4,
    )
    assert traffic("two-stage").between_nodes == Link(12, 984)


def distinct_per_token(groups: torch.Tensor) -> torch.Tensor:
    ordered = groups.sort(dim=1).values
    return (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1) + 1


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_are_experts_ranks_and_nodes_per_token(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    topo, n, k = AfdTopology(1, ffn_nodes=3, ffn_per_node=4), 200, 6
    placement = ExpertPlacement.contiguous(60, topo.num_ffn)
    ids = random_routing(n, k, 60, gen)
    ranks = torch.tensor(placement.rank_of)[ids]
    nodes = ranks // topo.ffn_per_node
    expected = {"direct": n * k, "direct-rank": int(distinct_per_token(ranks).sum())}
    expected["two-stage"] = int(distinct_per_token(nodes).sum())
    for mode, want in expected.items():
        got = count_traffic(ids, 0, topo, placement, mode, 32, torch.bfloat16)
        assert got.dispatch_between_nodes.rows == got.combine_between_nodes.rows == want
    p = plan_dispatch(ids, torch.ones(n, k), 0, topo, placement, "two-stage")
    assert torch.equal(torch.bincount(p.token, minlength=n), distinct_per_token(nodes))
    fwd_total = count_traffic(ids, 0, topo, placement, "two-stage", 32, torch.bfloat16)
    forwarded = fwd_total.dispatch_inside_node.rows + fwd_total.local_copies
    assert forwarded == expected["direct-rank"]  # stage 2 reaches each (token, rank) once


# --- topology ---------------------------------------------------------------------------


def test_topology_layout() -> None:
    topo = AfdTopology.from_flags(attention_size=4, ffn_size=8, ffn_nodes=2, attention_per_node=2)
    assert (topo.num_ffn, topo.ffn_per_node) == (8, 4)
    assert (topo.node_of(5), topo.local_of(5)) == (1, 1)
    assert topo.attention_local(3) == 1 and topo.stage_one_peer(3, 1) == 5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: AfdTopology.from_flags(1, 8, 3),
         "--afd-ffn-nodes 3 does not divide --afd-ffn-size 8"),
        (lambda: AfdTopology(0, 2, 2), "--afd-attention-size is 0; it must be at least 1"),
        (lambda: AfdTopology(1, 0, 2), "--afd-ffn-nodes is 0"),
        (lambda: AfdTopology(1, 2, 0), "F workers per node"),
        (lambda: AfdTopology(4, 2, 2, 3), "--afd-attention-per-node 3 does not divide"),
        (lambda: TOPO.node_of(4), "F worker 4 does not exist: --afd-ffn-size gives 0..3"),
        (lambda: plan("direct", a_rank=2), "attention worker 2 does not exist"),
        (lambda: plan_dispatch(IDS, WEIGHTS, 0, TOPO, ExpertPlacement.contiguous(8, 2), "direct"),
         "spreads experts over 2 ranks but the AFD topology has 4 F workers"),
        (lambda: plan("direct", ids=IDS + 1), "range over 1..8 but the placement has experts 0..7"),
        (lambda: plan("broadcast"), "'broadcast' is not a valid DispatchMode"),
    ],
)  # fmt: skip
def test_bad_topologies_and_inputs_are_refused(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# --- the routing harness ----------------------------------------------------------------


def test_harness_counts_and_saves(tmp_path: Path) -> None:
    path = Path(__file__).parents[3] / "benchmarks" / "afd_routing.py"
    spec = importlib.util.spec_from_file_location("afd_routing", path)
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    out = tmp_path / "afd.json"
    # hidden states are never allocated: the default 7168 costs nothing
    harness.main(["--num-tokens", "16", "--tokens-for-stats", "256", "--attention-size", "2",
                  "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    stats = report["stats"]["routings"]["uniform"]
    assert stats["mean_per_token"]["experts"] == 8
    assert stats["mean_per_token"]["distinct_nodes"] == pytest.approx(
        report["analytic_uniform"]["distinct_nodes"], abs=0.05
    )
    assert stats["two_stage_between_nodes_over"]["direct"] < 0.30
