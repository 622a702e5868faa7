"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`) as a `tokenizers` tokenizer.

Byte-level BPE (`tokenizer.ggml.model` gpt2): the tokens, the merges, control tokens as
special tokens and user-defined ones as added tokens. The pre-tokenizer is the one llama.cpp
applies for `tokenizer.ggml.pre`: llama.cpp splits the text with a sequence of regular
expressions, each refining the pieces of the one before (SmolLM's, StarCoder's: every digit
on its own, then GPT-2's pattern) — which a tokenizer that assumes GPT-2's pattern alone gets
wrong for numbers. A `pre` not listed here is refused rather than guessed.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipeserve.models.gguf.config import field

GPT2 = "gpt2"  # GPT-2's pattern, which pre_tokenizers.ByteLevel(use_regex=True) applies
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS = r"\p{N}"
# tokenizer.ggml.pre -> llama.cpp's regular expressions, in order
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), (GPT2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), (DIGITS, GPT2)
    ),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral"), (LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (QWEN2,)),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)}); "
            "pass --tokenizer-path with the model's tokenizer.json"
        )
    steps: list[pre_tokenizers.PreTokenizer] = []
    for expr in PRE_TOKENIZERS[pre]:
        if expr != GPT2:
            steps.append(pre_tokenizers.Split(Regex(expr), behavior="isolated"))
    gpt2_last = PRE_TOKENIZERS[pre][-1] == GPT2
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_last))
    return pre_tokenizers.Sequence(steps)


def tokenizer_from_gguf(reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and its tokenizer_config.json (special tokens, chat template)."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', is); "
            "pass --tokenizer-path with the model's tokenizer.json"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = _pre_tokenizer(str(field(reader, "tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type", [])
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=t == CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (CONTROL, USER_DEFINED)
        ]
    )
    config = _special_tokens(reader, tokens)
    if field(reader, "tokenizer.ggml.add_bos_token", False) and config.get("bos_token"):
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return tok, config


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
