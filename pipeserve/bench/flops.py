"""Analytic FLOP counts from the architecture (the cost model of spec 06)."""

from __future__ import annotations

from pipeserve.models.arch import ArchConfig, attention_matmul_weights, mlp_matmul_weights


def linear_flops_per_token(a: ArchConfig) -> int:
    """2 * (weights a token is multiplied by) over all layers. Embedding lookup is free; the
    LM head is counted apart. MoE layers: the router, the top-k routed experts and the shared
    experts. MLA: the query path (q_a + q_b, or q_proj), kv_a_proj_with_mqa, o_proj and the
    K/V up-projection kv_b_proj in its expanded (prefill) form: each new token's latent is
    up-projected once, kv_lora_rank * heads * (qk_nope + v_head) multiply-adds. (The absorbed
    decode form instead folds kv_b_proj into the query and output, a cost per query and head,
    and attends over the latent.) DeepSeek-V3.2 adds the indexer's wq_b, wk and weights_proj."""
    attn = attention_matmul_weights(a)
    return 2 * sum(attn + mlp_matmul_weights(a, i, active=True) for i in range(a.num_layers))


def attention_flops(a: ArchConfig, prefix_len: int, chunk_len: int) -> float:
    """QK^T and PV of a chunk of x tokens after L cached ones, causal within the chunk, the
    triangle taken as x^2/2: x * (L + x/2) (query, key) pairs per layer.

    GQA: 4 * pairs * heads * head_dim per layer. MLA (expanded form): QK^T over qk_head_dim
    and PV over v_head_dim, 2 * pairs * heads * (qk_head_dim + v_head_dim).

    DeepSeek-V3.2: the indexer scores every earlier token, 2 * pairs * index_n_heads *
    (index_head_dim + 1) (the + 1: the per-head weighting of the scores), while main attention
    reads only the top-k: a query at position p attends to min(p + 1, topk) keys, summed
    exactly (x/2 pairs more than the triangle above when topk covers the whole context)."""
    pairs = chunk_len * (prefix_len + chunk_len / 2)
    if a.mla is None:
        return 4.0 * pairs * a.num_heads * a.head_dim * a.num_layers
    per_pair = a.num_heads * (a.mla.qk_head_dim + a.mla.v_head_dim)
    if a.indexer is None:
        return 2.0 * pairs * per_pair * a.num_layers
    i = a.indexer
    read = _capped_pairs(prefix_len + chunk_len, i.topk) - _capped_pairs(prefix_len, i.topk)
    return 2.0 * (read * per_pair + pairs * i.n_heads * (i.head_dim + 1)) * a.num_layers


def _capped_pairs(n: int, cap: int) -> int:
    """Keys read by queries 0..n-1, the one at p reading min(p + 1, cap)."""
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def prefill_flops(a: ArchConfig, prompt_len: int) -> float:
    """A whole prompt (chunking does not change the total): linear layers for every token,
    attention over the causal triangle, and the LM head for the one sampled position."""
    lm_head = 2 * a.hidden_size * a.vocab_size
    return linear_flops_per_token(a) * prompt_len + attention_flops(a, 0, prompt_len) + lm_head


def chunk_flops(a: ArchConfig, prefix_len: int, chunk_len: int) -> float:
    return linear_flops_per_token(a) * chunk_len + attention_flops(a, prefix_len, chunk_len)
