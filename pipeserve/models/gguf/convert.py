"""A GGUF file as a Hugging Face checkpoint directory: config.json, generation_config.json,
model.safetensors (dequantised, in the dtype asked for), and when the file's tokenizer can be
rebuilt tokenizer.json, tokenizer_config.json and chat_template.jinja. `pipeserve convert
GGUF OUT_DIR` writes one; `Engine("x.gguf")` loads one made once per file and storage dtype
under the cache directory (keyed by the file's path, size and modification time and by this
converter's format version; the directory is named as the file, which a server serves it
as), so worker processes and later runs share it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from pipeserve import envs
from pipeserve.models.gguf.config import config_from_gguf
from pipeserve.models.gguf.tensors import hf_tensors
from pipeserve.models.gguf.vocab import tokenizer_from_gguf
from pipeserve.models.made_once import made_once

log = logging.getLogger(__name__)

FORMAT = 1  # bump when a conversion would come out differently: old caches are not reused
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def storage_dtype(run_dtype: str) -> str:
    """What a conversion for a run in `run_dtype` stores: float32 dequantised values
    exactly for float32 runs, else bfloat16 (what the default run casts them to anyway)."""
    return run_dtype if run_dtype in STORAGE_DTYPES else "bfloat16"


def convert(gguf_path: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the checkpoint directory; returns it. A tokenizer this converter cannot rebuild
    is left out, with a warning (then give --tokenizer-path or --skip-tokenizer-init)."""
    reader = GGUFReader(str(gguf_path))
    config = config_from_gguf(reader) | {"torch_dtype": dtype}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(reader, config, STORAGE_DTYPES[dtype])
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)
    del tensors
    _write_tokenizer(reader, out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"]})
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: marks completion
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _write_tokenizer(reader: GGUFReader, out: Path) -> None:
    for name in TOKENIZER_FILES:  # an earlier conversion's into this directory: not this one's
        (out / name).unlink(missing_ok=True)
    try:
        tokenizer, tok_config = tokenizer_from_gguf(reader)
    except ValueError as exc:
        log.warning("%s: converted without a tokenizer: %s", out.name, exc)
        return
    tokenizer.save(str(out / "tokenizer.json"))
    template = tok_config.pop("chat_template", None)
    if template:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def converted_checkpoint(gguf_path: str | Path, run_dtype: str = "bfloat16") -> Path:
    """The cached conversion of a GGUF file for a run in `run_dtype`, made on first use."""
    src = Path(gguf_path).resolve()
    stat = src.stat()
    dtype = storage_dtype(run_dtype)
    key = f"{FORMAT}:{src}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = envs.cache_dir() / "gguf" / digest / src.stem  # named as the file: the model's name
    return made_once(path, lambda out: convert(src, out, dtype), "conversion")
