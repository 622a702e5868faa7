from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import PRESET

from pipeserve.engine.engine import Engine


@pytest.fixture(scope="module")
def model_path(model_dir) -> Path:
    return model_dir(PRESET)


@pytest.fixture
def make_engine(model_path: Path, request) -> Iterator[Callable[..., Engine]]:
    """make_engine(**flags) -> an Engine on the tiny model with the test module's BASE_FLAGS
    under `flags`, shut down after the test."""
    base: dict[str, Any] = request.module.BASE_FLAGS
    made: list[Engine] = []

    def make(**flags: Any) -> Engine:
        made.append(Engine(str(model_path), **{**base, **flags}))
        return made[-1]

    yield make
    for e in made:
        e.shutdown()
