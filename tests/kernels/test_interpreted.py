"""The Triton kernels on a CPU through Triton's interpreter, in one process of their own: the
batched attention kernels, the fused norm and rotary kernels and the engine on the Triton path
(triton_interpreted.py, against float64 and the torch backend), and the FP8 products with
weights kept in FP8 (fp8_interpreted.py, against their block math)."""

from __future__ import annotations

from pathlib import Path

import pytest
from interpreted import run_interpreted

HERE = Path(__file__).parent


@pytest.mark.timeout(600)
def test_the_triton_kernels_match_their_references_under_the_interpreter() -> None:
    run_interpreted([HERE / "triton_interpreted.py", HERE / "fp8_interpreted.py"], timeout=540)
