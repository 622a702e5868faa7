"""The matmul peak probe (pipeserve/bench/peak.py) is bounded in work whatever the dtype's
speed, and large enough on a GPU to read a big card's dense peak. Products are counted and
timed by a stand-in clock, not the wall."""

from __future__ import annotations

import math

import pytest
import torch

from pipeserve.bench import peak


def fake_timer(flops_per_s: float, calls: list[int]):
    def time_one(size: int) -> float:
        calls.append(size)
        return 2.0 * size**3 / flops_per_s

    return time_one


@pytest.mark.parametrize(
    ("device", "rate", "final"),
    [
        ("cpu", 80e9, 2048),  # float32 on a core: every doubling fits
        ("cpu", 1e9, 512),  # emulated bf16: 1024^3 would take 2.1 s, over the budget
        ("cpu", 30e9, 1024),
        ("cuda", 790e12, 8192),  # a large GPU: grows to the size that reaches its peak
    ],
)
def test_the_probe_grows_only_while_a_product_fits_its_budget(device, rate, final) -> None:
    calls: list[int] = []
    flops = peak.matmul_peak_flops(
        torch.float32, torch.device(device), repeats=5, timer=fake_timer(rate, calls)
    )
    assert max(calls) == final and calls.count(final) == 6  # sized once, then the repeats
    doublings = int(math.log2(peak.MAX_SIZE[device] / peak.FIRST_SIZE))
    assert calls == sorted(calls) and len(calls) <= 1 + doublings + 5
    assert flops == pytest.approx(rate)
    probe_seconds = sum(2.0 * n**3 / rate for n in calls)
    assert probe_seconds <= len(calls) * peak.PRODUCT_BUDGET_S  # no product over budget


def test_the_real_probe_measures_something_positive() -> None:
    assert peak.matmul_peak_flops(torch.float32, torch.device("cpu"), repeats=1) > 0
