"""The same greedy tokens and prompt logprobs (float32) in every parallel layout: PP2, PP3
with an uneven split (default rule and an explicit list), TP2 and PP2 x TP2, against one
in-process engine, for a dense and a MoE model of 7 layers. Several requests of different
lengths are in flight at once: long prompts in many chunks, requests spread over several
micro-batches, finishing at different times. Also `--pp-layer-partition auto` and the
errors of a bad partition (raised inside a worker); the KV pool size for a fixed config,
computed by hand."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.config import EngineConfig, SettingsError
from pipeserve.engine.backend import WorkerBackend
from pipeserve.engine.engine import Engine
from pipeserve.kernels import native
from pipeserve.models.arch import ArchConfig, param_count
from pipeserve.runner.kv_layout import kv_pool_pages
from pipeserve.runner.layer_costs import measure_layer_costs

pytestmark = pytest.mark.timeout(120)

LAYERS = 7
MODELS = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe"}
VOCAB = 512
# max_running_requests 4: with PP2 at most 2 requests per micro-batch, so decode steps
# spread over several micro-batches and one request waits for a free place.
FLAGS: dict[str, Any] = {
    "dtype": "float32",
    "chunked_prefill_size": 32,
    "max_running_requests": 4,
    "max_total_tokens": 4096,
}
PROMPT_LENS = [300, 97, 5, 180, 33]
NEW_TOKENS = [12, 20, 16, 3, 7]
SAMPLING = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in NEW_TOKENS]

LAYOUTS: dict[str, tuple[dict[str, Any], list[int]]] = {  # flags, expected partition
    "pp2": ({"pp_size": 2}, [3, 4]),
    "pp3-default": ({"pp_size": 3}, [2, 2, 3]),
    "pp3-1,4,2": ({"pp_size": 3, "pp_layer_partition": "1,4,2"}, [1, 4, 2]),
    "tp2": ({"tp_size": 2}, [7]),
    "pp2xtp2": ({"pp_size": 2, "tp_size": 2}, [3, 4]),
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run(engine: Engine) -> list[dict[str, Any]]:
    out = engine.generate(input_ids=prompts(), sampling_params=SAMPLING, return_logprob=True)
    assert isinstance(out, list)
    return out


def worker_backend(engine: Engine) -> WorkerBackend:
    assert isinstance(engine.backend, WorkerBackend)
    return engine.backend


def assert_pages_back(engine: Engine) -> None:
    stats = engine.backend.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]


def assert_same_outputs(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert [len(o["output_ids"]) for o in got] == NEW_TOKENS
    assert [len(o["prompt_logprobs"]) for o in got] == [n - 1 for n in PROMPT_LENS]
    for key in ("prompt_logprobs", "output_logprobs"):
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(
                torch.tensor(g[key]), torch.tensor(r[key]), atol=1e-4, rtol=0
            )


@pytest.fixture(scope="module")
def models(model_dir) -> dict[str, Path]:
    return {kind: model_dir(preset, num_hidden_layers=LAYERS) for kind, preset in MODELS.items()}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """One in-process (PP1 TP1) run per model."""
    out = {}
    for kind, path in models.items():
        with Engine(str(path), **FLAGS) as engine:
            out[kind] = run(engine)
            assert_pages_back(engine)
            chunks = [o["meta_info"]["chunk_sizes"] for o in out[kind]]
            assert [sum(c) for c in chunks] == list(PROMPT_LENS)
            assert all(max(c) <= 32 for c in chunks)
            assert [len(c) > 1 for c in chunks] == [n > 32 for n in PROMPT_LENS]
    return out


# Every layout on the MoE model; the dense model in the two that differ most from one process
# (each multi-process engine start costs seconds).
CASES = [("moe", layout) for layout in LAYOUTS] + [("dense", "pp3-1,4,2"), ("dense", "pp2xtp2")]


@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_layout_gives_the_same_tokens_and_logprobs(
    models, reference, kind: str, layout: str
) -> None:
    flags, partition = LAYOUTS[layout]
    with Engine(str(models[kind]), **FLAGS, **flags) as engine:
        assert worker_backend(engine).partition == partition
        assert engine.backend.stats()["loop"] == ("pipeline" if flags.get("pp_size") else "overlap")
        if flags.get("tp_size") and native() is not None:  # one machine: shared memory
            info = worker_backend(engine).workers.info
            assert {i.tp_all_reduce for i in info.values()} == {"shared memory"}
        out = run(engine)
        assert_same_outputs(out, reference[kind])
        assert_pages_back(engine)
        procs = worker_backend(engine).workers.procs
        assert len(procs) == flags.get("pp_size", 1) * flags.get("tp_size", 1)
    assert not any(p.is_alive() for p in procs)


# Loaded at start-up by every Python process with its directory on PYTHONPATH, the fork
# server the engine's workers come from included: `--pp-layer-partition auto` then balances
# these per-layer costs instead of timed ones.
INJECT_LAYER_COSTS = """
from pipeserve.distributed import worker
from pipeserve.runner.layer_costs import LayerCosts

def measured(arch, dtype, device, chunk):
    return LayerCosts({costs!r}, 0.0, 0.0)

worker.measure_layer_costs = measured
"""


@pytest.mark.parametrize(
    ("costs", "partition"),
    [([1.0, 1, 1, 1, 1, 10, 10], [5, 1, 1]), ([10.0, 10, 1, 1, 1, 1, 1], [1, 1, 5])],
    ids=["dear-last-layers", "dear-first-layers"],
)
def test_auto_partition_follows_the_measured_costs(
    models, reference, monkeypatch, tmp_path, costs: list[float], partition: list[int]
) -> None:
    """Two layers ten times dearer than the rest: each gets a stage of its own (the only
    split whose slowest stage costs 10), far from the default 2,2,3."""
    (tmp_path / "sitecustomize.py").write_text(INJECT_LAYER_COSTS.format(costs=costs))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    restart_fork_server()  # workers fork from a server started with this PYTHONPATH
    try:
        with Engine(str(models["moe"]), **FLAGS, pp_size=3, pp_layer_partition="auto") as e:
            assert worker_backend(e).partition == partition
            assert_same_outputs(run(e), reference["moe"])
            assert_pages_back(e)
    finally:
        restart_fork_server()  # later tests' workers: without the injection


def restart_fork_server() -> None:
    """The next worker starts a fork server of its own: a fresh interpreter that imports its
    sitecustomize (multiprocessing keeps one server per process, started on first use)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]


def test_layer_costs_are_measured_per_layer_kind(models) -> None:
    """What `auto` balances when nothing is injected: a positive cost per layer, one
    measurement per kind (the MoE model's dense layer 1 and its MoE layers)."""
    arch = ArchConfig.load(models["moe"])
    costs = measure_layer_costs(arch, torch.float32, torch.device("cpu"), chunk=32)
    assert len(costs.per_layer) == LAYERS and min(costs.per_layer) > 0
    assert costs.embed > 0 and costs.head > 0
    assert len({costs.per_layer[i] for i in range(LAYERS) if arch.is_moe_layer(i)}) == 1
    assert not arch.is_moe_layer(1) and arch.is_moe_layer(0)


@pytest.mark.parametrize(
    ("pilot_s", "chunk", "expected"),
    [
        (0.5, 2048, 2048),  # 2 x 0.5 s x 16 = 16 s: within the 20 s budget
        (2.0, 2048, 512),  # 64 s at 2048, 32 s at 1024, 16 s at 512
        (30.0, 2048, 128),  # even the pilot is over: its measurement stands
        (0.5, 64, 64),  # a chunk under the pilot's size is the pilot
    ],
)
def test_layer_costs_measure_a_chunk_that_fits_the_budget(pilot_s, chunk, expected) -> None:
    from pipeserve.runner.layer_costs import affordable_chunk

    assert affordable_chunk(pilot_s, chunk, budget_s=20.0) == expected


@pytest.mark.parametrize(
    ("spec", "via_env", "message"),
    [
        ("1,2,4", False, "--pp-layer-partition 1,2,4 has 3 parts but --pp-size is 2"),
        ("3,3", True, "--pp-layer-partition 3,3 sums to 6 but the model has 7 layers"),
    ],
    ids=["wrong-length", "wrong-sum-from-env"],
)
def test_invalid_partition_fails_cleanly(
    models, monkeypatch, spec: str, via_env: bool, message: str
) -> None:
    """Refused in the workers while loading: the engine constructor raises SettingsError
    with the check's text, and no worker process is left behind."""
    before = set(mp.active_children())
    flags: dict[str, Any] = {**FLAGS, "pp_size": 2}
    if via_env:
        monkeypatch.setenv("PIPESERVE_PP_LAYER_PARTITION", spec)
    else:
        flags["pp_layer_partition"] = spec
    with pytest.raises(SettingsError) as info:
        Engine(str(models["dense"]), **flags)
    assert str(info.value) == message
    left = set(mp.active_children()) - before
    assert not left, f"worker processes left behind: {left}"


def test_kv_pool_size_by_hand(models, monkeypatch) -> None:
    """300 MiB of memory, --mem-fraction-static 0.01, 3 local workers: a 1 MiB budget each.
    The dense model has 292,000 float32 parameters over 7 layers; split 1,4,2 the 4-layer
    stage decides: weights 292000 * 4 B * 4/7 = 667,428.6 B, KV per token K and V x 4 layers
    x 2 heads x 16 dims x 4 B = 1024 B, (1,048,576 - 667,428.6) // 1024 = 372 tokens, plus
    the padding page: 373 pages (page size 1). Split 2,2,3: 500,571.4 B of weights, 768 B
    per token, 713 tokens, 714 pages."""
    monkeypatch.setattr("pipeserve.device.total_memory", lambda device: 300 * 2**20)
    arch = ArchConfig.load(models["dense"])
    assert param_count(arch) == 292_000
    flags: dict[str, Any] = {
        "model_path": str(models["dense"]),
        "dtype": "float32",
        "pp_size": 3,
        "mem_fraction_static": 0.01,
    }
    uneven = EngineConfig.from_flags(**flags, pp_layer_partition="1,4,2")
    assert kv_pool_pages(uneven, arch, local_workers=3) == 373
    assert kv_pool_pages(EngineConfig.from_flags(**flags), arch, local_workers=3) == 714
    assert kv_pool_pages(EngineConfig.from_flags(**flags), arch, 3, [4, 2, 1]) == 373


@pytest.fixture(autouse=True)
def _no_leftover_workers() -> Iterator[None]:
    yield
    leftover = [p for p in mp.active_children() if p.name.startswith("pipeserve-worker")]
    for p in leftover:
        p.kill()
    assert not leftover, f"worker processes left running: {leftover}"


@pytest.mark.timeout(180)
def test_tp2_replicates_a_single_kv_head(model_dir) -> None:
    """tiny-qwen2 has one KV head: under TP2 each rank keeps a replica of it (and q/k/v carry
    a bias, sharded with its weight). Same tokens and logprobs as one process."""
    path = model_dir("tiny-qwen2")
    ids = prompts()[:3]
    sp = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (7, 3, 5)]
    outs = []
    for extra in ({}, {"tp_size": 2}):
        with Engine(str(path), **FLAGS, **extra) as engine:
            out = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
        assert isinstance(out, list)
        outs.append(out)
    ref, tp2 = outs
    assert [o["output_ids"] for o in tp2] == [o["output_ids"] for o in ref]
    for a, b in zip(ref, tp2, strict=True):
        torch.testing.assert_close(
            torch.tensor(b["prompt_logprobs"]),
            torch.tensor(a["prompt_logprobs"]),
            atol=1e-4,
            rtol=0,
        )
