"""Expert parallelism through the engine: `Engine(path, ep_size=2)` and PP2 x EP2 give the
greedy tokens of one in-process engine and its logprobs within 1e-4 (float32), on Qwen3-MoE
and DeepSeek-V3. Several requests of different lengths are in flight, long prompts in many
chunks; the requests are spread over both attention ranks (data-parallel attention), and one
rank runs steps with no tokens of its own (its requests finished earlier) while the other
still decodes, so an idle rank joins the experts' collectives. Some steps route so few tokens
that some experts receive none. Faults: an abort on one rank, and a killed rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
from engine_cases import Workload, kill_during_prefill

from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig, routed_expert_params
from pipeserve.scheduler.data_parallel import DataParallelScheduler
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.timeline import Event

pytestmark = pytest.mark.timeout(180)

MODELS = {"qwen3-moe": ("tiny-qwen3-moe", {"num_hidden_layers": 5}),
          "deepseek-v3": ("tiny-deepseek-v3", {"num_hidden_layers": 4})}
VOCAB = 512
FLAGS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": 32,
                         "max_running_requests": 8, "max_total_tokens": 4096}
# the requests of one rank end long before the last one of the other: idle steps
WORK = Workload((150, 41, 7, 96, 23, 64), (3, 4, 30, 2, 3, 5), seed=11)
PROMPT_LENS, NEW_TOKENS, SAMPLING = list(WORK.prompt_lens), list(WORK.new_tokens), WORK.sampling
LAYOUTS = {"ep2": {"ep_size": 2}, "pp2xep2": {"pp_size": 2, "ep_size": 2}}
prompts, run = WORK.prompts, WORK.run


def first_stage_forwards(events: list[Event]) -> dict[int, list[Event]]:
    """Forward events of the first stage, by attention rank."""
    out: dict[int, list[Event]] = {}
    for e in events:
        if e.kind == "forward" and e.stage == 0:
            out.setdefault(e.tp_rank, []).append(e)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_expert_parallel_layout_matches_one_process(models, reference, model: str,
                                                    layout: str) -> None:
    flags = LAYOUTS[layout]
    with Engine(str(models[model]), **FLAGS, **flags) as engine:
        backend = engine.backend
        assert isinstance(backend, WorkerBackend)
        assert len(backend.workers.procs) == flags.get("pp_size", 1) * 2
        assert backend.stats()["attention_ranks"] == 2
        expert_bytes = backend.expert_bytes_per_rank()
        out = run(engine)
        events = backend.timeline()
        stats = backend.stats()
        procs = backend.workers.procs
    assert not any(p.is_alive() for p in procs)

    WORK.assert_matches(out, reference[model], atol=1e-4)
    chunks = [o["meta_info"]["chunk_sizes"] for o in out]
    assert [sum(c) for c in chunks] == PROMPT_LENS and max(map(max, chunks)) <= 32
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]

    by_rank = first_stage_forwards(events)
    assert sorted(by_rank) == [0, 1]
    served = [{r for e in by_rank[rank] for r in e.rids} for rank in (0, 1)]
    assert served[0] and served[1] and not served[0] & served[1]  # each request on one rank
    # every micro-batch runs on both ranks (the same ids): a rank without work runs it empty
    ids = [sorted(e.batch_id for e in by_rank[rank]) for rank in (0, 1)]
    assert ids[0] == ids[1]
    idle = [e for rank in (0, 1) for e in by_rank[rank] if not e.rids]
    assert idle, "no step ran with one attention rank idle"
    arch = ArchConfig.load(models[model])
    all_experts = routed_expert_params(arch) * 4  # float32
    if "pp_size" in flags:  # the busier stage holds more than half of the MoE layers
        assert all_experts / 4 <= expert_bytes < all_experts / 2
    else:
        assert expert_bytes == all_experts / 2  # each rank holds half of the routed experts
    tokens_per_step: dict[int, int] = {}
    for e in by_rank[0] + by_rank[1]:
        tokens_per_step[e.batch_id] = tokens_per_step.get(e.batch_id, 0) + sum(e.tokens)
    # a step of n tokens reaches at most n * top_k experts: the others receive no tokens
    assert min(tokens_per_step.values()) * arch.num_experts_per_tok < arch.num_experts


def test_abort_on_one_attention_rank_leaves_the_other_rank_s_requests(models,
                                                                      reference) -> None:
    """A request aborted in the middle of its chunked prefill: the requests of both ranks get
    the reference tokens, and every page of both ranks' pools comes back."""
    ids = prompts()
    with Engine(str(models["qwen3-moe"]), **FLAGS, ep_size=2) as engine:
        backend = engine.backend
        reqs = [Req(f"r{i}", p, SamplingParams(**s), return_logprob=False)
                for i, (p, s) in enumerate(zip(ids, SAMPLING, strict=True))]
        victim = Req("victim", ids[0] * 3, SamplingParams(max_new_tokens=5, temperature=0.0))
        for r in [victim, *reqs]:
            r.arrival_time = time.perf_counter()
            backend.submit(r)
        assert isinstance(backend.scheduler, DataParallelScheduler)
        owners = {backend.scheduler.owner[r.rid] for r in [victim, *reqs]}
        assert owners == {0, 1}
        tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        while len(finished) < len(reqs) + 1:
            if victim.num_chunks >= 2 and "victim" not in finished:
                backend.abort("victim")
            for u in backend.step():
                tokens.setdefault(u.rid, []).extend(u.new_token_ids)
                if u.finish_reason is not None:
                    finished[u.rid] = u.finish_reason
        stats = backend.stats()
    assert finished["victim"] == "abort"
    assert [tokens[r.rid] for r in reqs] == [o["output_ids"] for o in reference["qwen3-moe"]]
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]


def test_a_killed_expert_rank_fails_the_engine_and_leaves_no_process(models) -> None:
    """Rank 1 dies while rank 0 prefills a long prompt (rank 1 idle, both inside every MoE
    layer's all-to-all): the scheduler raises within a bounded time and no worker is left."""
    with Engine(str(models["qwen3-moe"]), **FLAGS, ep_size=2) as engine:
        kill_during_prefill(engine, 1, VOCAB)
