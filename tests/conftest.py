from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# One torch thread per engine/worker in tests: the suite runs on small shared machines where
# several OpenMP threads per process make tiny ops wait on descheduled threads. Inherited by
# spawned workers and servers.
os.environ.setdefault("PIPESERVE_NUM_THREADS", "1")

import pytest

from pipeserve.models.presets import make_model

TINY_PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


@pytest.fixture(autouse=True)
def _own_ram_claims(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each test sees only the host-RAM claims of the runs it starts (pipeserve/mem_cache/
    host_reservations.py), in a directory of its own (made only if a run claims): an engine
    that another test holds must not shrink this test's. Inherited by spawned processes."""
    folder = tmp_path_factory.getbasetemp() / "ram-claims" / str(abs(hash(request.node.nodeid)))
    monkeypatch.setenv("PIPESERVE_RESERVATIONS_DIR", str(folder))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """model_dir(preset) -> path of a checkpoint made once per test session."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(preset: str, **overrides) -> Path:
        key = preset + repr(sorted(overrides.items()))
        if key not in made:
            made[key] = make_model(preset, root / f"{preset}-{len(made)}", overrides=overrides)
        return made[key]

    return get


# For the MoE engine test modules (expert parallelism, batch overlap, attention-FFN
# disaggregation), which define MODELS ({name: (preset, config overrides)}), FLAGS (the
# reference run's engine flags) and WORK (an engine_cases.Workload).
@pytest.fixture(scope="module")
def models(request: pytest.FixtureRequest, model_dir) -> dict[str, Path]:
    """The module's MODELS as checkpoints."""
    presets = request.module.MODELS.items()
    return {name: model_dir(preset, **over) for name, (preset, over) in presets}


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, models: dict[str, Path]) -> dict[str, Any]:
    """Each model's WORK outputs from one in-process engine with the module's FLAGS."""
    return request.module.WORK.references(models, request.module.FLAGS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a GPU: skipped without one (make test-gpu runs them)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the native CPU kernels once, before any test's timeout starts counting (the
    first build compiles C++ for tens of seconds; later runs load it from the cache)."""
    from pipeserve.kernels import warm_up

    warm_up()
