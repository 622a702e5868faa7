"""Every documented layout and feature starts with default flags and serves: no chunk size,
pool size, page size or thread count given, so each picks its own at start-up (the chunk
size from a start-up profile under PP, TP and CP, which runs: its cache is off), as a user's
first run does. The greedy tokens of two requests (one prompt of several default chunks)
are the one-process engine's. Float32, so layouts agree to the token. CP and PP x CP with
default flags are in tests/context_parallel/test_cp_engine.py, HiCache in
tests/mem_cache/test_host_tier.py."""

from __future__ import annotations

from typing import Any

import pytest
from engine_cases import Workload

from pipeserve.engine.engine import Engine

pytestmark = pytest.mark.timeout(240)

MODELS = {
    "dense": ("tiny-llama", {"num_hidden_layers": 2}),
    "moe": ("tiny-qwen3-moe", {"num_hidden_layers": 2}),
    "mla": ("tiny-deepseek-v3", {"num_hidden_layers": 2}),
}
WORK = Workload((2500, 40), (4, 4), seed=13)  # 2500 tokens: two chunks at the default 2048
CASES = [
    ("dense", {"pp_size": 2}),
    ("dense", {"tp_size": 2}),
    ("dense", {"pp_size": 2, "enable_dynamic_chunking": True}),
    ("dense", {"cp_size": 2, "enable_dynamic_chunking": True}),
    ("dense", {"cp_size": 2, "enable_sharded_cp": True}),
    ("moe", {"ep_size": 2}),
    ("moe", {"cp_size": 2, "enable_sharded_cp": True}),
    ("moe", {"ep_size": 2, "enable_two_batch_overlap": True}),
    ("moe", {"ep_size": 2, "enable_single_batch_overlap": True}),
    ("moe", {"afd_attention_size": 1, "afd_ffn_size": 1, "afd_micro_batches": 3}),
    ("mla", {"cp_size": 2}),
]


def _id(model: str, flags: dict[str, Any]) -> str:
    return model + "-" + "-".join(f"{k}={v}" for k, v in flags.items())


@pytest.fixture(scope="module")
def references(models) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in models.items():
        with Engine(str(path), dtype="float32") as engine:
            out[name] = [o["output_ids"] for o in WORK.run(engine)]
    return out


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[_id(*c) for c in CASES])
def test_a_layout_starts_with_default_flags_and_serves(
    models, references, monkeypatch, model: str, layout: dict[str, Any]
) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    with Engine(str(models[model]), dtype="float32", **layout) as engine:
        got = [o["output_ids"] for o in WORK.run(engine)]
    assert got == references[model]
