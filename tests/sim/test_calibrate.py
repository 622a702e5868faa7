"""Calibration: the CPU fit recovers efficiencies that generated its timings; the H20 table's
efficiencies are what the two published points give (refitted here), each point's simulated
TTFT is its published one, and the leave-one-out predictions are reported within 10%."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config
from pipeserve.sim.calibrate import (
    PUBLISHED,
    calibration_points,
    fit_efficiency,
    fit_published,
    leave_one_out,
)
from pipeserve.sim.cost_model import CostModel, Precision, SimLayout, SliceWork
from pipeserve.sim.hardware import HARDWARE, Efficiency, apply_calibration, calibration_json


@pytest.mark.parametrize("model", ["bench", "bench-deepseek", "bench-moe"])
def test_cpu_fit_recovers_the_efficiencies_behind_the_timings(model: str) -> None:
    arch = ArchConfig.from_dict(load_config(model)[0])
    # memory never binds here (as for chunks on a CPU): the fit is of the compute terms
    truth = Efficiency(gemm=0.31, moe=0.17, attention=0.083, memory=1e6, layer_overhead_s=0.0012)
    hw = replace(HARDWARE["cpu"], efficiency=truth)
    cm = CostModel(arch, hw, SimLayout(threads=2), Precision(), [arch.num_layers])
    points = calibration_points(16384)[1:]
    seconds = [cm.forward(0, [[SliceWork(L, x)]]).total for L, x in points]
    prior = HARDWARE["cpu"].efficiency
    if arch.num_experts:  # the dense classes known (from a dense model), the experts free
        known = replace(truth, moe=prior.moe)
        fit = fit_efficiency(arch, HARDWARE["cpu"], 2, points, seconds, known, free=("moe",))
        assert fit.efficiency.moe == pytest.approx(truth.moe, rel=1e-6)
    else:
        fit = fit_efficiency(arch, HARDWARE["cpu"], 2, points, seconds, prior)
        assert fit.efficiency.moe == prior.moe  # no expert ever ran: the class keeps its prior
    assert fit.efficiency.gemm == pytest.approx(truth.gemm, rel=1e-6)
    assert fit.efficiency.attention == pytest.approx(truth.attention, rel=1e-6)
    assert fit.efficiency.layer_overhead_s == pytest.approx(truth.layer_overhead_s, rel=1e-6)
    assert max(map(abs, fit.errors)) < 1e-6


def test_calibration_file_round_trip() -> None:
    hw = replace(
        HARDWARE["cpu"],
        thread_efficiency={"1t-shared": Efficiency(gemm=0.2)},
        peak_flops=HARDWARE["cpu"].peak_flops | {"bfloat16": 1e12},
    )
    back = apply_calibration(HARDWARE["cpu"], calibration_json(hw))
    assert back.efficiency_for(1, True).gemm == 0.2
    assert back.efficiency_for(1, False) == HARDWARE["cpu"].efficiency  # no fit: the prior
    assert back.peak("bfloat16", threads=2) == 2e12
    with pytest.raises(ValueError, match="not 'cpu'"):
        apply_calibration(HARDWARE["cpu"], {"hardware": "h20"})


@pytest.mark.timeout(300)
def test_h20_efficiencies_are_the_published_fit() -> None:
    base = replace(HARDWARE["h20"], efficiency=Efficiency())
    eff, final = fit_published(base)
    table = HARDWARE["h20"].efficiency
    assert eff.gemm == pytest.approx(table.gemm, abs=1e-3)
    assert eff.moe == pytest.approx(table.moe, abs=1e-3)
    assert eff.attention == pytest.approx(table.attention, abs=1e-3)
    assert final == pytest.approx([p.ttft_s for p in PUBLISHED], rel=1e-3)
    loo = leave_one_out(base)
    assert len(loo) == 2 and all(abs(r["error"]) < 0.10 for r in loo)
