from __future__ import annotations

from pathlib import Path

import pytest

PRESET = "tiny-qwen3"


@pytest.fixture(scope="session")
def tiny_model(model_dir) -> Path:
    """The checkpoint every server test serves (float32 on the command line: no near-ties)."""
    return model_dir(PRESET)
