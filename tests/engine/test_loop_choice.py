"""Which one-stage event loop runs by default: the faster one for the device. In-process on
a CPU that is the plain loop (the overlap loop's compute thread and the scheduler share the
GIL and the cores); on an accelerator, or with the model in a worker process, the overlap
loop. The two flags override the default either way."""

from __future__ import annotations

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine import future_map
from pipeserve.engine.engine import Engine


@pytest.mark.parametrize(("device", "in_process", "expected"), [
    ("cpu", True, False),
    ("cpu", False, True),
    ("cuda", True, True),
    ("cuda", False, True),
])
@pytest.mark.parametrize("flag", [None, "enable_overlap_schedule", "disable_overlap_schedule"])
def test_the_rule_per_device_type(monkeypatch, device: str, in_process: bool, expected: bool,
                                  flag: str | None) -> None:
    monkeypatch.setattr(future_map, "resolve_device", lambda name: torch.device(device))
    config = EngineConfig.from_flags(**({flag: True} if flag else {}))
    want = {None: expected, "enable_overlap_schedule": True, "disable_overlap_schedule": False}
    assert future_map.use_overlap_schedule(config, in_process) is want[flag]


def test_contradicting_flags_are_rejected() -> None:
    with pytest.raises(ValueError, match="contradict"):
        EngineConfig.from_flags(enable_overlap_schedule=True, disable_overlap_schedule=True)


@pytest.mark.parametrize(("flags", "loop"), [
    ({}, "plain"),
    ({"enable_overlap_schedule": True}, "overlap"),
    ({"disable_overlap_schedule": True}, "plain"),
])
def test_an_in_process_cpu_engine_runs_the_chosen_loop(model_dir, flags, loop: str) -> None:
    with Engine(str(model_dir("tiny-qwen3")), device="cpu", dtype="float32", max_total_tokens=1024,
                **flags) as engine:
        assert engine.backend.stats()["loop"] == loop
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
