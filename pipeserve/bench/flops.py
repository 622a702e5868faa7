"""Analytic FLOP counts from the architecture (the cost model of spec 06)."""

from __future__ import annotations

from pipeserve.models.arch import ArchConfig


def linear_flops_per_token(a: ArchConfig) -> int:
    """2 * (weights a token is multiplied by) over all layers; MoE layers count the router
    and the top-k experts only. Embedding lookup is free; the LM head is counted apart."""
    h = a.hidden_size
    attn = h * (a.q_size + 2 * a.kv_size) + a.q_size * h
    total = 0
    for layer in range(a.num_layers):
        if a.is_moe_layer(layer):
            mlp = h * a.num_experts + a.num_experts_per_tok * 3 * h * a.moe_intermediate_size
        else:
            mlp = 3 * h * a.intermediate_size
        total += attn + mlp
    return 2 * total


def attention_flops(a: ArchConfig, prefix_len: int, chunk_len: int) -> float:
    """QK^T and PV of a chunk of x tokens after L cached ones, causal within the chunk:
    4 * x * (L + x/2) * heads * head_dim per layer."""
    x = chunk_len
    return 4.0 * x * (prefix_len + x / 2) * a.num_heads * a.head_dim * a.num_layers


def prefill_flops(a: ArchConfig, prompt_len: int) -> float:
    """A whole prompt (chunking does not change the total): linear layers for every token,
    attention over the causal triangle, and the LM head for the one sampled position."""
    lm_head = 2 * a.hidden_size * a.vocab_size
    return linear_flops_per_token(a) * prompt_len + attention_flops(a, 0, prompt_len) + lm_head


def chunk_flops(a: ArchConfig, prefix_len: int, chunk_len: int) -> float:
    return linear_flops_per_token(a) * chunk_len + attention_flops(a, prefix_len, chunk_len)
