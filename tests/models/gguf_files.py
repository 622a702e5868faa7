"""Writes a Hugging Face checkpoint as a GGUF file the way llama.cpp's converter does (for
the GGUF tests): tensors renamed, [out, in] stored fastest-dimension first, Llama's query and
key rows reordered into rotary pairs, the tokenizer as `tokenizer.ggml.*`; chosen tensors
quantised with `gguf` (Q8_0, Q4_0, Q4_1, F16, BF16) or, for the K-quants `gguf` cannot
write, filled with random blocks whose scales are small finite numbers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# K-quant block layouts: (bytes per 256 values, offsets of the f16 scale fields)
K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def rotary_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a head's rows: halves [x..., y...] -> pairs [x0, y0, ...]."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def random_k_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    block, scales = K_QUANTS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    for off in scales:  # a small positive f16 scale in every block
        raw[..., off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, cols // 256 * block)


def encode(w: np.ndarray, qtype: Q, seed: int) -> tuple[np.ndarray, Q | None]:
    if qtype in K_QUANTS:
        return random_k_blocks(w.shape[0], w.shape[1], qtype, seed), qtype
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(
    model_dir: Path,
    out: Path,
    types: dict[str, Q] | None = None,
    pre: str = "gpt2",
    chat_template: str | None = None,
    extra: dict[str, object] | None = None,
) -> Path:
    """`types`: GGUF tensor name -> storage type (default F32); the architecture is the
    checkpoint's model_type (llama, qwen2, qwen3; only llama's Q/K rows are reordered);
    `extra`: more metadata (key -> value)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, config)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_string(key, str(value))
    _tokenizer(w, model_dir, pre, chat_template)
    q, k = config["num_attention_heads"], config["num_key_value_heads"]
    heads = {"attn_q.weight": q, "attn_k.weight": k, "attn_q.bias": q, "attn_k.bias": k}
    if arch != "llama":
        heads = {}
    for i, (hf, tensor) in enumerate(sorted(load_file(model_dir / "model.safetensors").items())):
        name = gguf_name(hf)
        arr = tensor.to(torch.float32).numpy()
        suffix = name.split(".", 2)[-1]
        if suffix in heads:
            arr = rotary_pairs(arr, heads[suffix])
        data, raw = encode(np.ascontiguousarray(arr), (types or {}).get(name, Q.F32), seed=i)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _metadata(w: gguf.GGUFWriter, c: dict) -> None:
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, pre: str, template: str | None) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for piece, index in vocab.items():
        tokens[index] = piece
    types = [1] * len(tokens)  # normal
    for added in tok["added_tokens"]:
        while len(tokens) <= added["id"]:
            tokens.append("")
            types.append(1)
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    if "tokenizer.ggml.model" not in w.kv_data[0]:
        w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    if "tokenizer.ggml.add_bos_token" not in w.kv_data[0]:
        w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
