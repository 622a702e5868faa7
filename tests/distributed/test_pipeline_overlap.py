"""Pipeline stages compute at the same time: a structural property of the recorded per-stage
timeline (not a wall-time assertion), checked on a real PP2 run and shown to fail on the
same run with the pipeline serialised (one micro-batch in flight)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeserve.engine import pipeline_loop
from pipeserve.engine.engine import Engine
from pipeserve.timeline import Event, stage_overlap

pytestmark = pytest.mark.timeout(180)

FLAGS: dict[str, Any] = {"pp_size": 2, "chunked_prefill_size": 256, "max_total_tokens": 8192,
                         "dtype": "bfloat16"}
PROMPT_LEN = 4000  # 16 chunks: an ideal 2-stage pipeline overlaps 15/16 of a stage's time
MIN_OVERLAP = 0.5


def forward(stage: int, start: float, end: float) -> Event:
    return Event("forward", stage, 0, start, end)


def test_overlap_of_synthetic_timelines() -> None:
    pipelined = [forward(s, k + s, k + s + 1) for k in range(4) for s in range(2)]
    serial = [forward(s, 2 * k + s, 2 * k + s + 1) for k in range(4) for s in range(2)]
    assert stage_overlap(pipelined) == pytest.approx(3 / 4)
    assert stage_overlap(serial) == 0.0
    assert stage_overlap([forward(0, 0, 1)]) == 1.0


@pytest.fixture(scope="module")
def model(model_dir):
    # big enough that a chunk's forward (~10 ms) outweighs the per-micro-batch overheads
    return model_dir("tiny-qwen3", hidden_size=256, intermediate_size=1024,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_hidden_layers=4)


def prefill_overlap(model, monkeypatch: pytest.MonkeyPatch | None = None) -> float:
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    with Engine(str(model), **FLAGS) as engine:
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
        engine.backend.timeline()  # drop the warm-up
        out = engine.generate(input_ids=prompt.tolist(), sampling_params={"max_new_tokens": 1})
        assert len(out["meta_info"]["chunk_sizes"]) == 16
        return stage_overlap(engine.backend.timeline())


def test_pp2_stages_compute_at_the_same_time(model) -> None:
    assert prefill_overlap(model) >= MIN_OVERLAP


def test_a_serialised_pipeline_fails_the_overlap_check(model, monkeypatch) -> None:
    """The same run with one micro-batch in flight (each chunk waits for the previous one's
    report): the check above must catch it."""
    init = pipeline_loop.PipelineLoop.__init__

    def one_in_flight(self, scheduler, workers, depth, future, cpu) -> None:
        init(self, scheduler, workers, 1, future, cpu)

    monkeypatch.setattr(pipeline_loop.PipelineLoop, "__init__", one_in_flight)
    assert prefill_overlap(model) < 0.1
