"""config.json from a GGUF file's metadata (`general.architecture` and its `{arch}.*` keys),
for the architectures pipeserve runs: llama (Llama, Mistral, SmolLM), qwen2, qwen3."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import GGUFReader

# GGUF architecture -> (Hugging Face class, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
STOP_TOKEN_KEYS = ("eos", "eot", "eom")  # llama.cpp stops on each of these


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, number, list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def architecture(reader: GGUFReader) -> str:
    if int(field(reader, "split.count", 1)) > 1:
        raise ValueError(
            "this GGUF is one part of a split file; merge the parts first "
            "(llama.cpp's gguf-split --merge)"
        )
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (pipeserve reads "
            f"{', '.join(ARCHITECTURES)})"
        )
    return str(arch)


def config_from_gguf(reader: GGUFReader) -> dict[str, Any]:
    arch = architecture(reader)
    cls, model_type = ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "this GGUF stores its rope scaling as per-frequency factors (rope_freqs.weight, "
            "llama3 scaling), which pipeserve does not read; convert the original checkpoint"
        )
    get = _scalar_getter(reader, arch)
    config = {
        "architectures": [cls],
        "model_type": model_type,
        **_shapes(get),
        "vocab_size": vocab_size(reader),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and model_type == "llama",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_token_ids(reader),
    }
    scaling = rope_scaling(get)
    return config | ({"rope_scaling": scaling} if scaling else {})


def _scalar_getter(reader: GGUFReader, arch: str) -> Callable[..., Any]:
    def get(key: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):  # e.g. a per-layer head count (OpenELM-style)
            raise ValueError(f"GGUF {arch}.{key} varies by layer, which pipeserve does not run")
        return value

    return get


def _shapes(get: Callable[..., Any]) -> dict[str, Any]:
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
    }


def vocab_size(reader: GGUFReader) -> int:
    """The embedding's rows (the token list can be shorter or longer than the model's)."""
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embed.shape[-1])


def stop_token_ids(reader: GGUFReader) -> list[int]:
    ids = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in STOP_TOKEN_KEYS]
    return sorted({int(i) for i in ids if i is not None})


def rope_scaling(get: Callable[..., Any]) -> dict[str, Any] | None:
    """Linear and YaRN scaling as GGUF metadata gives them (`rope.scaling.*`)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn are)")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
    original = get("rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out
