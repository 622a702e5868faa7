"""Checkpoint directories made once and shared: built presets, converted GGUF files."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def made_once(path: Path, build: Callable[[Path], object], what: str) -> Path:
    """`path`, made on first use by `build(directory)`: written into a private directory
    beside it, then renamed into place, so processes making the same one at once never read
    a half-written one (the slower copy is dropped). Its config.json, written last, marks it
    complete."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stick to the shared directory
    try:
        build(tmp)
        with contextlib.suppress(OSError):  # another process's copy got there first
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (path / "config.json").is_file():
        raise OSError(f"{path} holds an incomplete {what}: remove it and run again")
    return path
