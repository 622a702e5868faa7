"""A GGUF file as a Hugging Face checkpoint directory: config.json, generation_config.json,
model.safetensors (dequantised), tokenizer.json, tokenizer_config.json and, when the file
has one, chat_template.jinja. `pipeserve convert GGUF OUT_DIR` writes one; `Engine("x.gguf")`
loads one made once per file under the cache directory (keyed by the file's path, size and
modification time; the directory is named as the file, which a server serves it as), so
worker processes and later runs share it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from gguf import GGUFReader
from safetensors.torch import save_file

from pipeserve import envs
from pipeserve.models.gguf.config import config_from_gguf
from pipeserve.models.gguf.tensors import hf_tensors
from pipeserve.models.gguf.vocab import tokenizer_from_gguf


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: a .gguf file, or a directory holding exactly one and no
    config.json (None: not a GGUF checkpoint)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise ValueError(f"{p} holds several GGUF files ({names}); name one")
        return found[0] if found else None
    return None


def convert(gguf_path: str | Path, out: str | Path) -> Path:
    """Write the checkpoint directory; returns it."""
    reader = GGUFReader(str(gguf_path))
    config = config_from_gguf(reader)
    tokenizer, tok_config = tokenizer_from_gguf(reader)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(reader, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)
    tokenizer.save(str(out / "tokenizer.json"))
    template = tok_config.pop("chat_template", None)
    if template:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    eos = config["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: marks completion
    return out


def converted_checkpoint(gguf_path: str | Path) -> Path:
    """The cached conversion of a GGUF file, made on first use (written to a private
    directory, then renamed into place: processes converting the same file at once never
    read a half-written one)."""
    src = Path(gguf_path).resolve()
    stat = src.stat()
    key = f"{src}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = envs.cache_dir() / "gguf" / digest / src.stem  # named as the file: the model's name
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.stem}-", dir=path.parent))
    try:
        convert(src, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would stick to the cached checkpoint
        with contextlib.suppress(OSError):  # another process's copy got there first
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
