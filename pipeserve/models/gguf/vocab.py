"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`) as a `tokenizers` tokenizer.

Byte-level BPE (`tokenizer.ggml.model` gpt2): the tokens, the merges, control tokens as
special tokens and user-defined ones as added tokens. The pre-tokenizer is the one llama.cpp
applies for `tokenizer.ggml.pre`: llama.cpp splits the text with a sequence of regular
expressions, each refining the pieces of the one before (SmolLM's, StarCoder's: every digit
on its own, then GPT-2's pattern) — which a tokenizer that assumes GPT-2's pattern alone gets
wrong for numbers. A `pre` not listed here is refused rather than guessed; so is a tokenizer
model other than BPE (SentencePiece's `llama`): the checkpoint is then converted without a
tokenizer, and --tokenizer-path or --skip-tokenizer-init say what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipeserve.models.gguf.config import field

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's handling of one `tokenizer.ggml.pre` family."""

    regexes: tuple[str, ...]  # applied in order, each splitting the pieces of the last
    ignore_merges: bool = False  # a word that is a token stays whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file does not say


_GPT2 = PreTokenizer((GPT2,))
# llama.cpp's "default" (also its choice when `pre` is missing)
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_DIGITS = PreTokenizer((r"\p{N}", GPT2))
_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2,))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _DIGITS),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _QWEN2),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def pre_tokenizer_of(pre: str) -> PreTokenizer:
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)}); "
            "pass --tokenizer-path with the model's tokenizer.json"
        )
    return PRE_TOKENIZERS[pre]


def _pre_tokenizer(family: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in family.regexes
    ]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def tokenizer_from_gguf(reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and its tokenizer_config.json (special tokens, chat template);
    ValueError for a tokenizer this module does not rebuild."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', is)"
        )
    family = pre_tokenizer_of(str(field(reader, "tokenizer.ggml.pre", "default")))
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=family.ignore_merges)
    )
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, field(reader, "tokenizer.ggml.token_type", []))
    config = _special_tokens(reader, tokens)
    if field(reader, "tokenizer.ggml.add_bos_token", family.add_bos) and "bos_token" in config:
        tok.post_processor = _with_bos(config["bos_token"], tokens.index(config["bos_token"]))
    return tok, config


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens (both matched
    whole before the pre-tokenizer runs, as llama.cpp does)."""
    added = [
        AddedToken(tokens[i], special=t == CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens(added)


def _with_bos(bos: str, index: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, index)]
    )


def _special_tokens(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (
        ("bos", "bos_token"),
        ("eos", "eos_token"),
        ("padding", "pad_token"),
        ("unknown", "unk_token"),
    ):
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            config[name] = tokens[int(index)]
    template = field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config
