"""GGUF tensors as Hugging Face checkpoint tensors: llama.cpp's names mapped, every type the
`gguf` library reads dequantised (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
K-quants Q2_K..Q8_K among them) in [out, in] order and stored in the dtype asked for, and for
Llama models the query/key rows put back in the order the Hugging Face model expects."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m and m[2] in _LAYER:
        return f"model.layers.{m[1]}.{_LAYER[m[2]]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart pipeserve knows")


def to_numpy(t: ReaderTensor) -> np.ndarray:
    """The tensor dequantised to float32 (F16 kept as it is), shaped [out, in]: GGUF lists
    dimensions fastest first. Not for BF16, which numpy has no type for (`to_torch`)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data).reshape(shape)
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def to_torch(t: ReaderTensor) -> torch.Tensor:
    if t.tensor_type is GGMLQuantizationType.BF16:  # numpy has no bfloat16: keep the bits
        bits = np.asarray(t.data).view(np.int16).reshape(tuple(int(d) for d in reversed(t.shape)))
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(to_numpy(t), copy=True))  # writable, contiguous


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's query (key) rows from the halves layout
    [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to pairs [x_0, y_0, x_1, y_1, ...] for its rotary kernel;
    put them back (rows of `heads` heads, any trailing dims)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensors(
    reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its Hugging Face name, in `dtype`, Llama's Q/K
    un-permuted (weights and biases). A Llama file with q/k/v biases and none on its output
    projection (a "llamafied" Qwen's) gets a zero o_proj bias: transformers' Llama has the
    four biases together (attention_bias), and a zero one changes nothing."""
    llama = config["model_type"] == "llama"
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = to_torch(t)
        proj = name.split(".")[-2]
        if llama and proj in heads:
            w = unpermute(w, heads[proj])
        out[name] = w.to(dtype)
    if llama and config.get("attention_bias"):
        for i in range(config["num_hidden_layers"]):
            o = f"model.layers.{i}.self_attn.o_proj"
            if o + ".bias" not in out:
                out[o + ".bias"] = torch.zeros(out[o + ".weight"].shape[0], dtype=dtype)
    return out
