"""PIPESERVE_TORCH_PROFILER_DIR: each model runner writes its per-operation profile when the
engine shuts down, the forwards' operators and pipeserve's labelled regions included. The
forwards run on a compute thread (the overlap loop in-process, every worker process), which
a profiler started on another thread does not see unless told to: the tables must hold the
matmuls and attention regions, not just the scheduling thread's small ops."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeserve.engine.engine import Engine

pytestmark = pytest.mark.timeout(240)

FLAGS = {"dtype": "float32", "chunked_prefill_size": 32, "max_total_tokens": 2048, "page_size": 16}


def _calls(table: str, name: str) -> int:
    """The call count of `name`'s row (the table's last column); 0 when absent."""
    row = re.search(rf"^\s*{re.escape(name)}\s.*?(\d+)\s*$", table, re.MULTILINE)
    return int(row.group(1)) if row else 0


def _run(path: Path, out: Path, monkeypatch: pytest.MonkeyPatch, **flags) -> None:
    monkeypatch.setenv("PIPESERVE_TORCH_PROFILER_DIR", str(out))
    engine = Engine(str(path), **FLAGS, **flags)
    try:
        engine.generate(input_ids=[list(range(1, 80))], sampling_params={"max_new_tokens": 3})
    finally:
        engine.shutdown()


def test_in_process_profile_sees_the_compute_thread(model_dir, tmp_path, monkeypatch) -> None:
    path = model_dir("tiny-llama", num_hidden_layers=2)
    _run(path, tmp_path, monkeypatch, enable_overlap_schedule=True)
    table = (tmp_path / "op-profile-s0r0.txt").read_text()
    forwards = int(table.split(" forwards")[0])
    assert forwards >= 5  # three prompt chunks, then decode steps
    assert _calls(table, "pipeserve.forward") == forwards
    # decode steps alone run the layers as one native call (kernels/decode_stack.cpp), the
    # other forwards layer by layer
    stacked = _calls(table, "pipeserve.decode_stack")
    assert stacked > 0
    assert _calls(table, "pipeserve.attention") == 2 * (forwards - stacked)  # one per layer
    assert _calls(table, "aten::mm") > 0
    assert (tmp_path / "op-profile-s0r0.json").stat().st_size > 0


def test_every_worker_writes_its_profile(model_dir, tmp_path, monkeypatch) -> None:
    path = model_dir("tiny-deepseek-v3", num_hidden_layers=2)
    _run(path, tmp_path, monkeypatch, cp_size=2)
    for rank in (0, 1):
        table = (tmp_path / f"op-profile-s0r{rank}.txt").read_text()
        forwards = int(table.split(" forwards")[0])
        assert forwards >= 5
        assert _calls(table, "pipeserve.forward") == forwards
        assert _calls(table, "pipeserve.cp.finish") == 2 * forwards
        assert _calls(table, "aten::mm") > 0
