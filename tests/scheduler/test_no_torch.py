"""The scheduler and what it hands an executor are plain Python: importing them (the PD
transfer destination that slices carry included) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_the_scheduler_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import pipeserve.scheduler.scheduler, pipeserve.disaggregation.pd.kv_remap\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
