"""Attention-FFN disaggregation through the engine: attention workers with their own requests
and KV cache, FFN workers holding the routed experts and nothing else. `Engine(path,
afd_attention_size=A, afd_ffn_size=F)` gives the greedy tokens of one in-process engine and
its logprobs within 1e-4 (float32), on Qwen3-MoE and DeepSeek-V3, with 1 A + 1 F, 1 A + 2 F,
2 A + 2 F (two FFN nodes of one) and 2 A + 1 F, in direct-rank and direct dispatch, and in
two-stage dispatch with 1 A + 2 F (one node of two) and 2 A + 4 F (two nodes of two): a
stage-1 row carries global expert ids that only the two-stage FFN side reads right, and the
experts of the worker that is not an attention worker's peer are reached only by forwarding,
so the tokens match only if both stages work. Requests
of different lengths start and finish at different steps, so an attention worker runs steps
with no tokens of its own while the other decodes. A killed FFN worker fails the engine."""

from __future__ import annotations

from typing import Any

import pytest
from engine_cases import Workload, kill_during_prefill

from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig, routed_expert_params
from pipeserve.timeline import (
    Event,
    afd_bytes_per_step,
    afd_idle_shares,
    afd_in_node_bytes_per_step,
)

pytestmark = pytest.mark.timeout(240)

MODELS = {
    "qwen3-moe": ("tiny-qwen3-moe", {"num_hidden_layers": 4}),
    "deepseek-v3": ("tiny-deepseek-v3", {"num_hidden_layers": 3}),
}
FLAGS: dict[str, Any] = {
    "dtype": "float32",
    "chunked_prefill_size": 32,
    "max_running_requests": 8,
    "max_total_tokens": 4096,
}
WORK = Workload((150, 41, 7, 96, 23, 64), (3, 4, 30, 2, 3, 5), seed=11)
CASES = [
    ("qwen3-moe", {"afd_attention_size": 1, "afd_ffn_size": 1}),
    ("deepseek-v3", {"afd_attention_size": 1, "afd_ffn_size": 2}),
    ("qwen3-moe", {"afd_attention_size": 2, "afd_ffn_size": 2, "afd_ffn_nodes": 2}),
    ("deepseek-v3", {"afd_attention_size": 2, "afd_ffn_size": 1, "afd_dispatch_mode": "direct"}),
    # micro-batches: some empty (6 requests over 2 workers, 3 micro-batches; lone chunks)
    ("qwen3-moe", {"afd_attention_size": 1, "afd_ffn_size": 1, "afd_micro_batches": 2}),
    ("deepseek-v3", {"afd_attention_size": 2, "afd_ffn_size": 2, "afd_micro_batches": 3}),
    (
        "qwen3-moe",
        {
            "afd_attention_size": 2,
            "afd_ffn_size": 1,
            "afd_micro_batches": 3,
            "afd_dispatch_mode": "direct",
        },
    ),
    # two-stage: one copy per FFN node, forwarded inside it
    ("qwen3-moe", {"afd_attention_size": 1, "afd_ffn_size": 2, "afd_dispatch_mode": "two-stage"}),
    (
        "deepseek-v3",
        {
            "afd_attention_size": 2,
            "afd_ffn_size": 4,
            "afd_ffn_nodes": 2,
            "afd_dispatch_mode": "two-stage",
            "afd_micro_batches": 2,
        },
    ),
]


@pytest.mark.parametrize(
    ("model", "layout"),
    CASES,
    ids=[
        f"{m}-a{f['afd_attention_size']}f{f['afd_ffn_size']}"
        f"-{f.get('afd_dispatch_mode', 'direct-rank')}"
        f"-mb{f.get('afd_micro_batches', 1)}"
        for m, f in CASES
    ],
)
def test_afd_matches_one_process(models, reference, model: str, layout: dict[str, Any]) -> None:
    with Engine(str(models[model]), **FLAGS, **layout) as engine:
        out = WORK.run(engine)
        stats = engine.backend.stats()
        info = engine.backend.workers.info
        events = engine.backend.timeline()
    WORK.assert_matches(out, reference[model], atol=1e-4)
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]
    # the FFN workers hold every routed expert between them, the attention workers none
    na, nf = layout["afd_attention_size"], layout["afd_ffn_size"]
    arch = ArchConfig.load(models[model])
    per_expert = routed_expert_params(arch) * 4 // arch.num_experts  # float32
    held = [info[r].expert_bytes for r in range(na + nf)]
    assert held[:na] == [0] * na
    assert sum(held[na:]) == per_expert * arch.num_experts
    # every worker ran the steps; rows went out and partial sums came back
    assert set(afd_idle_shares(events, na)) == set(range(na + nf))
    assert afd_bytes_per_step(events, na) > 0
    # rows and partial sums move inside an FFN node only under two-stage dispatch
    two_stage = layout.get("afd_dispatch_mode") == "two-stage"
    assert (afd_in_node_bytes_per_step(events) > 0) == two_stage
    n = layout.get("afd_micro_batches", 1)
    moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
    assert served_per_step(events, na) == {n * moe_layers}  # every FFN worker, every step
    # the FFN side runs its operations per micro-batch too (they show in the trace)
    ffn_ops = {e.micro_batch for e in events if e.kind == "op:experts" and e.tp_rank >= na}
    assert ffn_ops == set(range(n))
    if n > 1:  # the last micro-batch starts a layer before the first one's next layer
        assert interleaved_forwards(events, n)


def served_per_step(events: list[Event], first_ffn: int) -> set[int]:
    """Per forward of an FFN worker: how many (layer, micro-batch) rows it waited for."""
    counts = set()
    for fwd in (e for e in events if e.kind == "forward" and e.tp_rank >= first_ffn):
        counts.add(
            sum(
                1
                for e in events
                if e.kind == "dispatch_wait"
                and e.tp_rank == fwd.tp_rank
                and fwd.start <= e.start <= fwd.end
            )
        )
    return counts


def interleaved_forwards(events: list[Event], n: int) -> list[Event]:
    """Forwards of attention worker 0 in which micro-batch n-1 ran an operation before
    micro-batch 0's last one."""
    ops = [e for e in events if e.kind.startswith("op:") and e.tp_rank == 0]
    found = []
    for fwd in (e for e in events if e.kind == "forward" and e.tp_rank == 0):
        inside = [e for e in ops if fwd.start <= e.start and e.end <= fwd.end]
        first_last = max((e.end for e in inside if e.micro_batch == 0), default=None)
        last_first = min((e.start for e in inside if e.micro_batch == n - 1), default=None)
        if first_last is not None and last_first is not None and last_first < first_last:
            found.append(fwd)
    return found


@pytest.mark.parametrize(
    ("victim", "micro_batches"), [(1, 1), (0, 3)], ids=["ffn-worker", "attention-worker-3bo"]
)
def test_a_killed_worker_fails_the_engine_and_leaves_no_process(
    models, victim: int, micro_batches: int
) -> None:
    """The FFN worker (or, under three micro-batches, the attention worker) dies while a long
    prompt is prefilled (inside a MoE layer's transfers, or between steps): the scheduler
    raises within a bounded time, naming a worker, and no worker is left (the survivor is
    not left waiting for rows or partial sums)."""
    with Engine(
        str(models["qwen3-moe"]),
        **FLAGS,
        afd_attention_size=1,
        afd_ffn_size=1,
        afd_micro_batches=micro_batches,
    ) as engine:
        kill_during_prefill(engine, victim, 512)
