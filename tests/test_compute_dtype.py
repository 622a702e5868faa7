"""`--dtype best` (the default): bfloat16 on GPUs and on CPUs with native bf16 products,
float32 on other CPUs; chosen once where the run is launched, handed to every worker, and
agreed across nodes. Both CPU branches run on any machine (PIPESERVE_CPU_BF16)."""

from __future__ import annotations

import logging
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve import device as dev
from pipeserve.config import EngineConfig

CPU = torch.device("cpu")


@pytest.fixture
def cpu_flags(monkeypatch):
    """set(avx512_bf16=..., amx=...): what the CPU's flags say, PIPESERVE_CPU_BF16 unset."""
    monkeypatch.delenv("PIPESERVE_CPU_BF16", raising=False)

    def set_flags(avx512_bf16: bool, amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        dev._cpu_flags_bf16.cache_clear()

    yield set_flags
    dev._cpu_flags_bf16.cache_clear()


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "dtype"),
    [(True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")],
    ids=["avx512-bf16", "amx", "avx2-only"],
)
def test_a_cpu_computes_in_bf16_only_with_native_bf16_products(
    cpu_flags, avx512_bf16, amx, dtype
) -> None:
    cpu_flags(avx512_bf16, amx)
    assert dev.best_dtype(CPU) == dtype
    assert dev.resolve_dtype("best", "bfloat16", "cpu") == dev.DTYPES[dtype]
    # 'auto' keeps meaning the checkpoint's, explicit names are taken as they are
    assert dev.resolve_dtype("auto", "float16", "cpu") == torch.float16
    assert dev.resolve_dtype("bfloat16", "float32", "cpu") == torch.bfloat16


def test_the_environment_forces_either_branch(cpu_flags, monkeypatch) -> None:
    cpu_flags(True, True)
    monkeypatch.setenv("PIPESERVE_CPU_BF16", "0")
    assert dev.best_dtype(CPU) == "float32"
    cpu_flags(False, False)
    monkeypatch.setenv("PIPESERVE_CPU_BF16", "1")
    assert dev.best_dtype(CPU) == "bfloat16"
    monkeypatch.setenv("PIPESERVE_CPU_BF16", "maybe")
    with pytest.raises(ValueError, match="PIPESERVE_CPU_BF16='maybe'"):
        dev.best_dtype(CPU)


def test_gpus_compute_in_bf16_or_fp16_where_bf16_is_missing(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert dev.best_dtype(gpu) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert dev.best_dtype(gpu) == "float16"


def test_the_launching_process_makes_best_concrete(cpu_flags, caplog) -> None:
    cpu_flags(False, False)
    config = EngineConfig.from_flags(device="cpu")
    assert config.model.dtype == "best"  # the default
    with caplog.at_level(logging.INFO, logger="pipeserve.device"):
        chosen = dev.with_compute_dtype(config)
    assert chosen.model.dtype == "float32" and chosen.flags()["dtype"] == "float32"
    assert "compute dtype: float32" in caplog.text and "no native bfloat16" in caplog.text
    explicit = EngineConfig.from_flags(device="cpu", dtype="bfloat16")
    assert dev.with_compute_dtype(explicit) is explicit


def test_the_built_in_model_computes_in_float32_on_every_cpu(cpu_flags, caplog) -> None:
    """Its demo's margins (0.10 nats on the first answer) are inside bfloat16's rounding: on
    a CPU with native bf16 --dtype best gives it float32; other models, and an explicit
    --dtype bfloat16, compute in bf16."""
    cpu_flags(True, True)
    for built_in in ({}, {"model_path": "smollm2"}):
        config = EngineConfig.from_flags(device="cpu", **built_in)
        with caplog.at_level(logging.INFO, logger="pipeserve.device"):
            assert dev.with_compute_dtype(config).model.dtype == "float32"
        assert "demo answers' margins" in caplog.text
    other = EngineConfig.from_flags(device="cpu", model_path="bench")
    assert dev.with_compute_dtype(other).model.dtype == "bfloat16"
    forced = EngineConfig.from_flags(device="cpu", dtype="bfloat16")
    assert dev.with_compute_dtype(forced).model.dtype == "bfloat16"


def test_the_built_in_model_is_converted_for_the_dtype_it_computes_in(
    cpu_flags, monkeypatch
) -> None:
    """`resolve_model_path` under --dtype best (what bench and tune call with the name)
    converts the built-in GGUF for the dtype the run computes in: float32 on a CPU with
    native bf16 too, not a second, bfloat16 copy (a Zen 4 found the two paths differ)."""
    from pipeserve.models import resolve

    converted = []
    monkeypatch.setattr(resolve, "converted_checkpoint", lambda f, dtype: converted.append(dtype))
    monkeypatch.setattr(resolve, "resolve_device", lambda: CPU)
    cpu_flags(True, False)
    for name in (None, "smollm2"):
        resolve.resolve_model_path(name, "best")
    resolve.resolve_model_path(None, "bfloat16")
    assert converted == ["float32", "float32", "bfloat16"]


def test_explicit_bf16_on_a_cpu_without_it_warns_with_the_slowdown(
    cpu_flags, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(dev, "bf16_slowdown", lambda: 93.0)
    cpu_flags(False, False)
    with caplog.at_level(logging.WARNING, logger="pipeserve.device"):
        dev.warn_if_emulated(torch.bfloat16, CPU)
    assert "93x slower than float32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeserve.device"):
        dev.warn_if_emulated(torch.float32, CPU)
        cpu_flags(True, False)
        dev.warn_if_emulated(torch.bfloat16, CPU)
    assert caplog.text == ""


def test_the_slowdown_probe_compares_bf16_with_fp32(monkeypatch) -> None:
    calls: list[torch.dtype] = []
    real = torch.matmul

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.dtype)
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", counting)
    assert dev.bf16_slowdown(size=64, repeats=2) > 0
    assert calls == [torch.float32] * 3 + [torch.bfloat16] * 3  # bounded: 3 products each


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forced", ["0", "1"])
def test_engine_and_workers_compute_in_the_chosen_dtype(model_dir, monkeypatch, forced) -> None:
    """In process, the model, the KV pool and the config say the chosen dtype; for worker
    processes the launcher hands over the concrete name, not 'best'."""
    from pipeserve.engine import workers
    from pipeserve.engine.engine import Engine

    monkeypatch.setenv("PIPESERVE_CPU_BF16", forced)
    want = torch.bfloat16 if forced == "1" else torch.float32
    path = model_dir("tiny-qwen3")
    with Engine(str(path), max_total_tokens=256) as engine:
        runner = engine.backend.runner  # type: ignore[attr-defined]
        assert engine.config.model.dtype == str(want).removeprefix("torch.")
        assert runner.dtype == want and runner.kv_pool.dtype == want
        # every parameter in the compute dtype, but the linear weights the native backend
        # keeps in bfloat16 in a float32 run (the checkpoint's own values)
        stored = {
            id(p)
            for m in runner.model.modules()
            if hasattr(m, "stored_weights")
            for p in m.stored_weights()
        }
        assert {p.dtype for p in runner.model.parameters() if id(p) not in stored} == {want}
        assert {p.dtype for p in runner.model.parameters() if id(p) in stored} <= {
            want,
            torch.bfloat16,
        }
    handed: list[dict[str, Any]] = []

    def capture(config: EngineConfig, *args: Any) -> list[Any]:
        handed.append(config.flags())
        raise RuntimeError("captured")

    monkeypatch.setattr(workers, "start_workers", capture)
    with pytest.raises(RuntimeError, match="captured"):
        Engine(str(path), pp_size=2, max_total_tokens=256)
    assert handed[0]["dtype"] == str(want).removeprefix("torch.")


def _agree(rank: int, init: str, dtype: str, model: str, out: Any) -> None:
    import torch.distributed as dist

    from pipeserve.distributed import worker

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        config = EngineConfig.from_flags(model_path=model, dtype=dtype, device="cpu")
        agreed, path = worker._agree_on_dtype(config, model, CPU)
        out.put((rank, agreed.model.dtype, path))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_nodes_with_different_cpus_compute_in_rank_0s_dtype(model_dir, tmp_path: Path) -> None:
    """A node whose own choice differs (another CPU kind) takes rank 0's dtype."""
    path = str(model_dir("tiny-qwen3"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [
        ctx.Process(target=_agree, args=(r, init, d, path, out))
        for r, d in ((0, "float32"), (1, "bfloat16"))
    ]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=100) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == [(0, "float32", path), (1, "float32", path)]
