"""Routing-only harness for attention-FFN disaggregation: bytes per step between nodes and
inside an F node for the three dispatch modes (direct per expert, direct per rank, two-stage),
counted by the real planning (pipeserve.disaggregation.afd.routing) without expert compute.

Tokens of one decode step (default 64: bench-deepseek's 64 requests) are spread over the A
workers and routed two ways: uniform (random logits, softmax top-k) and DeepSeek-V3
group-limited (random logits and correction bias, grouped top-k). A second, larger pass
(--tokens-for-stats) measures the mean distinct F nodes and F workers per token next to the
analytic expectation for uniform routing. Checks that two-stage stage 1 sends exactly one
copy per distinct destination node of each token. Prints and saves JSON.

    python benchmarks/afd_routing.py --json out/afd_routing.json
"""

from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path
from typing import Any

import torch

from pipeserve.disaggregation.afd.routing import AfdTopology, DispatchMode, plan_dispatch
from pipeserve.disaggregation.afd.traffic import Link, LinkTraffic, count_traffic
from pipeserve.layers.moe import GroupedRouting, select_experts, select_experts_grouped
from pipeserve.moe.dispatcher.placement import ExpertPlacement

ROUTINGS = ("uniform", "grouped")
N_GROUP, TOPK_GROUP = 8, 4  # DeepSeek-V3's group-limited routing
BIAS_STD = 0.1  # random e_score_correction_bias, N(0, BIAS_STD)
SCALING_FACTOR = 2.5  # routed_scaling_factor (weights only: no effect on bytes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-tokens", type=int, default=64, help="tokens per decode step")
    p.add_argument("--tokens-for-stats", type=int, default=4096, help="tokens of the stats pass")
    p.add_argument("--attention-size", type=int, default=1, help="A workers")
    p.add_argument("--ffn-nodes", type=int, default=2)
    p.add_argument("--ffn-per-node", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="save the report here")
    return p.parse_args(argv)


def route(kind: str, n: int, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """[n, k] expert ids for n tokens with random router logits."""
    logits = torch.randn(n, args.experts, generator=gen)
    if kind == "uniform":
        return select_experts(logits, args.top_k, renormalize=True)[1]
    grouped = GroupedRouting(args.experts, args.top_k, N_GROUP, TOPK_GROUP, True, SCALING_FACTOR)
    bias = torch.randn(args.experts, generator=gen) * BIAS_STD
    return select_experts_grouped(logits, bias, grouped)[1]


def step_traffic(
    ids: torch.Tensor,
    topo: AfdTopology,
    placement: ExpertPlacement,
    mode: DispatchMode,
    args: argparse.Namespace,
) -> LinkTraffic:
    """The whole step's traffic: the tokens cut into near-equal parts, one per A worker."""
    total, dtype = LinkTraffic(), getattr(torch, args.dtype)
    for a, part in enumerate(ids.tensor_split(topo.num_attention)):
        total += count_traffic(part, a, topo, placement, mode, args.hidden, dtype)
    return total


def check_one_copy_per_node(
    ids: torch.Tensor, topo: AfdTopology, placement: ExpertPlacement
) -> None:
    """Two-stage stage 1 sends each token exactly once to each F node holding any of its
    experts, and nowhere else (node sets taken from the placement, not the planning)."""
    node_of = torch.tensor(placement.rank_of) // topo.ffn_per_node
    for a, part in enumerate(ids.tensor_split(topo.num_attention)):
        plan = plan_dispatch(part, torch.ones(part.shape), a, topo, placement, "two-stage")
        wanted = torch.zeros(part.shape[0], topo.ffn_nodes, dtype=torch.long)
        wanted.scatter_(1, node_of[part], 1)
        sent = torch.zeros_like(wanted)
        sent.index_put_(
            (plan.token, plan.dest // topo.ffn_per_node), torch.ones_like(plan.dest), True
        )
        assert torch.equal(sent, wanted), (
            f"A worker {a}: two-stage stage 1 did not send exactly one copy per distinct "
            f"destination node of each token ({int((sent != wanted).any(dim=1).sum())} tokens off)"
        )


def expected_distinct(group_sizes: list[int], k: int) -> float:
    """Expected distinct groups holding k experts drawn without replacement, all experts
    equally likely: sum over groups g of 1 - C(E - |g|, k) / C(E, k)."""
    experts = sum(group_sizes)
    return sum(1 - comb(experts - size, k) / comb(experts, k) for size in group_sizes)


def analytic_uniform(topo: AfdTopology, placement: ExpertPlacement, k: int) -> dict[str, float]:
    ranks = [len(placement.experts_on(r)) for r in range(topo.num_ffn)]
    per = topo.ffn_per_node
    nodes = [sum(ranks[n * per : (n + 1) * per]) for n in range(topo.ffn_nodes)]
    distinct_nodes, distinct_ranks = expected_distinct(nodes, k), expected_distinct(ranks, k)
    return {
        "distinct_nodes": distinct_nodes,
        "distinct_ranks": distinct_ranks,
        "two_stage_over_direct_rows": distinct_nodes / k,
        "two_stage_over_direct_rank_rows": distinct_nodes / distinct_ranks,
    }


def link_report(dispatch: Link, combine: Link) -> dict[str, int]:
    return {
        "dispatch": dispatch.nbytes,
        "combine": combine.nbytes,
        "total": dispatch.nbytes + combine.nbytes,
        "dispatch_rows": dispatch.rows,
        "combine_rows": combine.rows,
    }


def megabytes(link: dict[str, int]) -> str:
    return "/".join(f"{link[part] / 1e6:.3f}" for part in ("dispatch", "combine", "total"))


def mode_report(t: LinkTraffic) -> dict[str, Any]:
    return {
        "between_nodes": link_report(t.dispatch_between_nodes, t.combine_between_nodes),
        "inside_node": link_report(t.dispatch_inside_node, t.combine_inside_node),
        "counts_bytes": {
            "between_nodes": t.counts_between_nodes.nbytes,
            "inside_node": t.counts_inside_node.nbytes,
        },
        "local_copies": t.local_copies,
    }


def measure(
    ids: torch.Tensor, topo: AfdTopology, placement: ExpertPlacement, args: argparse.Namespace
) -> dict[str, Any]:
    """One routing's report: per mode bytes and rows, ratios and means per token."""
    check_one_copy_per_node(ids, topo, placement)
    n = max(ids.shape[0], 1)
    traffic = {m: step_traffic(ids, topo, placement, m, args) for m in DispatchMode}
    between = {m: max(t.between_nodes.nbytes, 1) for m, t in traffic.items()}
    rows = {m: t.dispatch_between_nodes.rows for m, t in traffic.items()}
    two = DispatchMode.TWO_STAGE
    return {
        "modes": {str(m): mode_report(t) for m, t in traffic.items()},
        "two_stage_between_nodes_over": {
            "direct": between[two] / between[DispatchMode.DIRECT],
            "direct_rank": between[two] / between[DispatchMode.DIRECT_RANK],
        },
        "mean_per_token": {
            "experts": rows[DispatchMode.DIRECT] / n,
            "distinct_ranks": rows[DispatchMode.DIRECT_RANK] / n,
            "distinct_nodes": rows[two] / n,
        },
    }


def run_pass(
    n: int, topo: AfdTopology, placement: ExpertPlacement, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    routings = {
        kind: measure(route(kind, n, args, gen), topo, placement, args) for kind in ROUTINGS
    }
    return {"num_tokens": n, "routings": routings}


def print_pass(name: str, result: dict[str, Any], analytic: dict[str, float]) -> None:
    print(f"\n[{name}: {result['num_tokens']} tokens]")
    print(
        f"{'routing':9} {'mode':12} {'between nodes MB disp/comb/total':>34}"
        f" {'inside node MB disp/comb/total':>32}"
    )
    for kind, r in result["routings"].items():
        for mode, m in r["modes"].items():
            between, inside = megabytes(m["between_nodes"]), megabytes(m["inside_node"])
            print(f"{kind:9} {mode:12} {between:>34} {inside:>32}")
    for kind, r in result["routings"].items():
        ratio, mean = r["two_stage_between_nodes_over"], r["mean_per_token"]
        print(
            f"{kind}: two-stage between-node bytes = {ratio['direct']:.3f}x direct, "
            f"{ratio['direct_rank']:.3f}x direct-rank; per token: {mean['experts']:.2f} "
            f"experts, {mean['distinct_ranks']:.3f} ranks, {mean['distinct_nodes']:.3f} nodes"
        )
    uniform = result["routings"]["uniform"]["mean_per_token"]
    print(
        f"uniform analytic: {analytic['distinct_ranks']:.3f} ranks, "
        f"{analytic['distinct_nodes']:.3f} nodes per token; rows two-stage/direct "
        f"{analytic['two_stage_over_direct_rows']:.3f} (measured "
        f"{uniform['distinct_nodes'] / uniform['experts']:.3f}), two-stage/direct-rank "
        f"{analytic['two_stage_over_direct_rank_rows']:.3f} (measured "
        f"{uniform['distinct_nodes'] / uniform['distinct_ranks']:.3f})"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    topo = AfdTopology(args.attention_size, args.ffn_nodes, args.ffn_per_node)
    placement = ExpertPlacement.contiguous(args.experts, topo.num_ffn)
    analytic = analytic_uniform(topo, placement, args.top_k)
    report = {
        "config": {key: value for key, value in vars(args).items() if key != "json"},
        "analytic_uniform": analytic,
        "step": run_pass(args.num_tokens, topo, placement, args, args.seed),
        "stats": run_pass(args.tokens_for_stats, topo, placement, args, args.seed + 1),
    }
    print(
        f"AFD routing: {args.attention_size} A worker(s) -> {args.ffn_nodes} F nodes x "
        f"{args.ffn_per_node} workers, {args.experts} experts top-{args.top_k}, hidden "
        f"{args.hidden} {args.dtype}; counts messages not included"
    )
    print_pass("one decode step", report["step"], analytic)
    print_pass("statistics", report["stats"], analytic)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nsaved {args.json}")
    return report


if __name__ == "__main__":
    main()
