"""Test files of Triton kernels run through Triton's interpreter, in a process of their own:
TRITON_INTERPRET must be set before triton is first imported, which this process has done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(cases: list[Path], timeout: int) -> None:
    """Run the pytest files `cases` with TRITON_INTERPRET=1 in one process (one import of
    torch and triton); every case must pass, none skip."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, cases)]
    cmd += ["-W", "ignore::DeprecationWarning"]  # the interpreter's numpy scalar conversions
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
