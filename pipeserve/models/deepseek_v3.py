"""DeepSeek-V3 and V3.2: a pre-norm decoder whose attention is multi-head latent attention over
a cache of one compressed latent per token, and whose MLP is, after the first
`first_k_dense_replace` dense layers, a mixture of experts routed by grouped top-k with a shared
expert beside them. V3.2 adds a lightning indexer to every attention layer: each query reads
only the `index_topk` cached tokens it scores highest (DeepSeek sparse attention).

The layers themselves live in pipeserve/layers: mla.py (latent attention, expanded for prompt
chunks and absorbed for decode steps), indexer.py, moe.py (routing, experts, shared experts).
Module and parameter names follow the Hugging Face checkpoints; routed experts are stored one by
one there and stacked here (`expert_checkpoint_names`).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.layers.mla import MLAttention
from pipeserve.layers.moe import (
    DeepseekV3MoE,
    GroupedRouting,
    expert_checkpoint_names,
    held_experts,
)
from pipeserve.models.arch import ArchConfig, MoERouting
from pipeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Rope
from pipeserve.runner.forward_batch import ForwardBatch


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's residual structure around latent attention; the layer reads its own rows of
    the latent (and indexer key) cache."""

    self_attn: MLAttention

    def __init__(self, arch: ArchConfig, layer_id: int, mlp: nn.Module, dtype: torch.dtype) -> None:
        assert arch.mla is not None
        attn = MLAttention(
            arch.hidden_size,
            arch.num_heads,
            arch.mla,
            arch.rope_scaling,
            dtype,
            arch.qkv_bias,
            arch.indexer,
        )
        super().__init__(attn, mlp, arch.hidden_size, arch.rms_norm_eps, dtype)
        self.layer_id = layer_id

    def attend(self, x: torch.Tensor, rope: Rope, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.kv_pool
        index = pool.index_keys(self.layer_id) if self.self_attn.indexer is not None else None
        cache = pool.latent(self.layer_id)
        kernels = fb.attn.backend.kernels  # its compiled kernels MLA and the indexer call
        if fb.cp is not None:
            return self.self_attn.forward_context_parallel(
                x, rope, fb.cp, self.layer_id, cache, index, kernels
            )
        return self.self_attn(
            x,
            rope,
            cache,
            fb.latent_segments,
            index_cache=index,
            kernels=kernels,
            batched=fb.attn if fb.attn.meta is not None else None,  # batched latent launches
            new_slots=fb.out_slots,
        )


def grouped_routing(arch: ArchConfig) -> GroupedRouting:
    r = arch.routing
    assert r is not None
    _check_routing(r)
    return GroupedRouting(
        num_experts=arch.num_experts,
        top_k=arch.num_experts_per_tok,
        n_group=r.n_group,
        topk_group=r.topk_group,
        renormalize=arch.norm_topk_prob,
        scaling_factor=r.routed_scaling_factor,
    )


def _check_routing(r: MoERouting) -> None:
    if r.scoring_func != "sigmoid" or r.topk_method != "noaux_tc":
        raise ValueError(
            f"scoring_func {r.scoring_func!r} with topk_method {r.topk_method!r} is not "
            "supported: pipeserve routes as DeepSeek-V3 does (sigmoid scores, noaux_tc)"
        )


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        return DeepseekV3DecoderLayer(self.arch, layer_id, self.make_mlp(layer_id), self.dtype)

    def make_mlp(self, layer_id: int) -> nn.Module:
        a = self.arch
        if not a.is_moe_layer(layer_id):
            return LlamaMLP(a.hidden_size, a.intermediate_size, self.dtype)
        assert a.routing is not None
        return DeepseekV3MoE(
            a.hidden_size,
            a.moe_intermediate_size,
            a.routing.n_shared_experts,
            grouped_routing(a),
            self.dtype,
            layer_id,
        )

    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        n = self.arch.num_experts
        experts = expert_checkpoint_names(param_name, n, held_experts(n))
        return experts if experts is not None else super().checkpoint_names(param_name)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3 with an indexer in every attention layer (`ArchConfig.indexer`)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        if arch.indexer is None:
            raise ValueError(
                "DeepseekV32ForCausalLM needs index_n_heads, index_head_dim and index_topk"
            )
        super().__init__(arch, dtype)
