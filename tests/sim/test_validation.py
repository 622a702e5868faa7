"""The simulator against real pipeserve runs recorded on this machine kind (data/
validation.json, written by benchmarks/sim_validate.py with the CPU calibration it used):
re-simulated now, every run's TTFT within the tolerance stated here of what was measured.
Not a wall-time assertion: the measured runs are recorded; the simulation is deterministic."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pipeserve.sim.hardware import HARDWARE, apply_calibration
from pipeserve.sim.run import SimSpec, simulate_with

DATA = Path(__file__).parent / "data" / "validation.json"
MEDIAN_TOLERANCE = 0.10  # the aim for the median error
WORST_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(DATA.read_text())


def test_recorded_runs_span_the_layouts(record: dict) -> None:
    layouts = {r["layout"] for r in record["rows"]}
    assert {"PP1 TP1", "PP2 TP1", "PP1 TP2"} <= layouts
    assert any("2 nodes" in name for name in layouts)
    assert any(r["flags"].get("enable_dynamic_chunking") for r in record["rows"])
    assert any(r["spec"]["num_prompts"] > 1 for r in record["rows"])
    assert len(record["rows"]) >= 8


def test_simulated_ttft_matches_the_recorded_runs(record: dict) -> None:
    hw = apply_calibration(HARDWARE["cpu"], record["calibration"])
    errors = []
    for row in record["rows"]:
        spec = SimSpec(**{**row["spec"], "calibration": None})
        simulated = simulate_with(row["flags"], spec, hw)["ttft_mean_s"]
        errors.append(simulated / row["measured_ttft_s"] - 1)
    worst = max(map(abs, errors))
    assert statistics.median(map(abs, errors)) <= MEDIAN_TOLERANCE, errors
    assert worst <= WORST_TOLERANCE, errors
