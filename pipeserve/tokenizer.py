"""Tokenizer of a checkpoint (`tokenizer.json`, via the `tokenizers` library), its chat
template and end-of-sequence ids, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from pipeserve.config import ModelConfig

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers (4.43+) saves a template


class ChatTemplateMissing(ValueError):
    """A chat request for a model that has no chat template (and none was given)."""


def _byte_alphabet() -> dict[str, int]:
    """The printable stand-in of each byte in byte-level BPE vocabularies (GPT-2's table)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_alphabet()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class Tokenizer:
    def __init__(self, path: str | Path, chat_template: str | Path | None = None) -> None:
        """`path`: the directory holding tokenizer.json (the model's, or --tokenizer-path);
        `chat_template`: a template file overriding the checkpoint's (--chat-template)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json: pass --tokenizer-path DIR (a tokenizer from "
                "elsewhere) or --skip-tokenizer-init (token ids in, token ids out)"
            )
        self._tok = HFTokenizer.from_file(str(file))
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._config = _read_json(path / "tokenizer_config.json")
        self.eos_token_ids = self._eos_ids(path)
        # where the template came from ("" for none)
        template, self.chat_template_source = self._chat_template(path, chat_template)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if template is not None else None

    def _chat_template(self, path: Path, override: str | Path | None) -> tuple[str | None, str]:
        """(the template, where it came from): --chat-template, else chat_template.jinja
        beside the tokenizer, else tokenizer_config.json's chat_template (of a list of named
        ones, "default"); (None, "") if there is none."""
        if override:
            file = Path(override)
            if not file.is_file():
                raise FileNotFoundError(f"--chat-template {override}: no such file")
            return file.read_text(), str(file)
        file = path / CHAT_TEMPLATE_FILE
        if file.is_file():
            return file.read_text(), str(file)
        template = self._config.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return (template, str(path / "tokenizer_config.json")) if template else (None, "")

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens` False for text a chat template rendered (it placed its own
        BOS where it wants one)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([i for i in ids if i >= 0], skip_special_tokens=skip_special_tokens)

    def decode_stream(self) -> TextStream:
        """A fresh incremental decoder (skipping special tokens, as `decode` does)."""
        return TextStream(self._tok)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """A token as text; bytes that are no whole character show as \\xNN escapes, so
        distinct tokens never print the same."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ChatTemplateMissing(
                "the model has no chat template (no chat_template.jinja beside its tokenizer, "
                "none in tokenizer_config.json); give one with --chat-template FILE"
            )
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special("bos_token"),
            eos_token=self._special("eos_token"),
        )

    def _special(self, key: str) -> str:
        value = self._config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (
            _read_json(path / "generation_config.json"),
            _read_json(path / "config.json"),
        ):
            eos = source.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        token_id = self._tok.token_to_id(self._special("eos_token") or "")
        if token_id is not None:
            ids.add(token_id)
        return tuple(sorted(ids))


def load_tokenizer(config: ModelConfig, model_path: Path) -> Tokenizer | None:
    """The tokenizer the flags ask for: --tokenizer-path's or the model's, with
    --chat-template; None under --skip-tokenizer-init."""
    if config.skip_tokenizer_init:
        return None
    return Tokenizer(config.tokenizer_path or model_path, config.chat_template)


class TextStream:
    """`tokenizers`' incremental decoder bound to its tokenizer: one `step` per token gives
    the text it completes (None while a character waits for its last byte)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tok, token_id)
