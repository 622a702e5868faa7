"""benchmarks/triton_tiles.py, the GPU check's timing of the attention kernels' tiles, on a CPU
through Triton's interpreter at toy sizes: each case times its default tiles first, then the
tiles before and their neighbours, and every candidate computes the default's output (a tile
that changed the result would fail the check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "triton_tiles.py"
CASES = ["bench decode", "bench-deepseek prefill"]


def test_each_tile_computes_the_default_s_output(tmp_path: Path) -> None:
    out = tmp_path / "tiles.json"
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--json", str(out), "--cases"]
    done = subprocess.run([*argv, *CASES], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [case["case"] for case in report["cases"]] == CASES
    for case in report["cases"]:
        tiles = [row["tiles"] for row in case["tiles"]]
        assert tiles[0] == case["default"] and [64, 4, 3] in tiles and len(tiles) >= 5
        assert case["outputs_agree"] and case["errors"] == []
        assert all(row["rel_diff"] <= 2e-2 for row in case["tiles"] if row["seconds"])
        assert case["fastest"] in tiles and case["default_over_fastest"] >= 1.0
