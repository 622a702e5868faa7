"""Communication in `pipeserve bench`: layouts with an expert- or context-parallel size
(names, engine flags, devices in the efficiency), the per-layout report line, and the bytes a
TP2 engine's all-reduces log: the ring rule, 2 (T - 1) / T of the [rows, hidden] tensor per
rank per call, one call per layer's attention output, one per MLP output and one for the
embedding."""

from __future__ import annotations

from typing import Any

import pytest

from pipeserve.bench.offline import Layout, _layout_row, describe_comm
from pipeserve.engine.engine import Engine
from pipeserve.timeline import COMM_BYTES, Event, comm_bytes_per_forward


def test_layout_names_flags_and_devices_with_ep() -> None:
    assert Layout(1, 1).name == "PP1 TP1" and Layout(2, 2, spawn_workers=True).name == (
        "PP2 TP2 worker"
    )
    ep = Layout(2, 1, ep=2, threads=1)
    assert ep.name == "PP2 TP1 EP2 1thr" and ep.devices == 4
    assert ep.flags({"ep_size": 1})["ep_size"] == 2 and Layout(1, 2).flags({})["ep_size"] == 1


def test_efficiency_counts_expert_parallel_ranks_as_devices() -> None:
    stats: dict[str, Any] = {"prefill_s": 2.0}
    base = _layout_row(Layout(1, 1), stats, 8.0, 1.0, [])
    ep2 = _layout_row(Layout(1, 1, ep=2), {"prefill_s": 1.6}, 8.0, 1.0, [base])
    assert (ep2["layout"], ep2["ep_size"], base["ep_size"]) == ("PP1 TP1 EP2", 2, 1)
    assert ep2["speedup"] == pytest.approx(1.25) and ep2["efficiency"] == pytest.approx(0.625)
    assert ep2["prefill_flops_share_of_peak"] == pytest.approx(8.0 / 1.6 / 2)


def test_layout_names_flags_and_devices_with_cp() -> None:
    cp = Layout(2, 1, cp=2, spawn_workers=True, threads=1)
    assert cp.name == "PP2 TP1 CP2 worker 1thr" and cp.devices == 4
    flags = cp.flags({"cp_size": 1, "cp_prefix_mode": "merge"})
    assert (flags["pp_size"], flags["tp_size"], flags["ep_size"], flags["cp_size"]) == (2, 1, 1, 2)
    assert flags["cp_prefix_mode"] == "merge"  # the other flags as given
    assert Layout(1, 1).flags({"cp_size": 2})["cp_size"] == 1  # each layout sets its own


def test_efficiency_counts_context_parallel_ranks_as_devices() -> None:
    base = _layout_row(Layout(1, 1), {"prefill_s": 2.0}, 8.0, 1.0, [])
    cp2 = _layout_row(Layout(1, 1, cp=2), {"prefill_s": 1.6}, 8.0, 1.0, [base])
    assert (base["cp_size"], cp2["cp_size"], cp2["devices"]) == (1, 2, 2)
    assert cp2["layout"] == "PP1 TP1 CP2"
    assert cp2["speedup"] == pytest.approx(1.25) and cp2["efficiency"] == pytest.approx(0.625)
    assert cp2["prefill_flops_share_of_peak"] == pytest.approx(8.0 / 1.6 / 2)


def test_report_line_names_every_kind() -> None:
    row = {
        "comm_bytes_per_forward": dict.fromkeys(COMM_BYTES, 0.0),
        "exposed_comm_s": dict.fromkeys(COMM_BYTES, 0.0),
        "exposed_comm_share_of_forward": dict.fromkeys(COMM_BYTES, 0.0),
    }
    row["comm_bytes_per_forward"]["ep_dispatch"] = 3 * 2**10
    row["exposed_comm_s"]["ep_dispatch"], row["exposed_comm_share_of_forward"]["ep_dispatch"] = (
        0.25,
        0.3,
    )
    line = describe_comm(row)
    assert "ep_dispatch 3.0/0.250 (30%)" in line
    assert all(kind in line for kind in COMM_BYTES)


def within(span: Event, forward: Event) -> bool:
    return forward.start <= span.start and span.end <= forward.end


@pytest.mark.timeout(120)
def test_tp2_all_reduces_log_ring_bytes_per_call(model_dir) -> None:
    flags = {"dtype": "float32", "chunked_prefill_size": 32, "max_total_tokens": 4096}
    sampling = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    with Engine(str(model_dir("tiny-llama")), tp_size=2, **flags) as engine:
        engine.backend.timeline()  # start-up spans dropped
        engine.generate(input_ids=[list(range(1, 41)), [7, 8, 9]], sampling_params=sampling)
        events = engine.backend.timeline()
        arch = engine.arch
    calls_per_forward = 2 * arch.num_layers + 1
    row_bytes = arch.hidden_size * 4 * 2 * (2 - 1) // 2  # fp32, T = 2
    reduces = [e for e in events if e.kind == "tp_all_reduce"]
    forwards = [e for e in events if e.kind == "forward"]
    assert {(e.stage, e.tp_rank) for e in forwards} == {(0, 0), (0, 1)}
    for fwd in forwards:
        mine = [e for e in reduces if e.tp_rank == fwd.tp_rank and within(e, fwd)]
        assert [e.nbytes for e in mine] == [sum(fwd.tokens) * row_bytes] * calls_per_forward
    assert len(reduces) == calls_per_forward * len(forwards)
    rank0 = [f for f in forwards if f.tp_rank == 0]
    mean_rows = sum(sum(f.tokens) for f in rank0) / len(rank0)
    assert comm_bytes_per_forward(events)["tp_all_reduce"] == pytest.approx(
        calls_per_forward * mean_rows * row_bytes
    )
