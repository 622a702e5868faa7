"""Where a --model's checkpoint is: a directory as it is, a built-in preset made on first
use, a GGUF file converted once for the run's dtype, or the built-in default model."""

from __future__ import annotations

from pathlib import Path

from pipeserve.device import best_model_dtype, resolve_device
from pipeserve.models.default_model import default_model_file, names_built_in_model
from pipeserve.models.gguf import converted_checkpoint, find_gguf
from pipeserve.models.presets import PRESETS, preset_path


def resolve_model_path(model_path: str | None, dtype: str = "best") -> Path:
    """The checkpoint directory a --model names: a Hugging Face directory as it is, a built-in
    preset made on first use, a GGUF file (or a directory holding one) converted once into the
    cache (for a run in `dtype`); no model: the built-in default model (a GGUF)."""
    if dtype == "best":
        dtype, _ = best_model_dtype(model_path, resolve_device())
    gguf = gguf_file(model_path)
    if gguf is not None:
        return converted_checkpoint(gguf, dtype)
    path = Path(str(model_path))
    if not path.exists() and model_path in PRESETS:  # a built-in model, made on first use
        return preset_path(str(model_path))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model_path}: not a Hugging Face checkpoint directory (no config.json), "
            f"a .gguf file nor a built-in model ({', '.join(PRESETS)})"
        )
    return path


def gguf_file(model_path: str | None) -> Path | None:
    """The GGUF file a --model names (no model or its alias: the built-in model's), or None
    where it names something else."""
    if model_path is None or names_built_in_model(model_path):
        return default_model_file()
    return find_gguf(Path(model_path))
