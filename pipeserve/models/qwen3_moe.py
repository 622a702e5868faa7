"""Qwen3-MoE: Qwen3 whose MLP is, on sparse layers, a set of routed experts: a linear
router, softmax over experts, the top k kept (renormalised if `norm_topk_prob`), and the
output the routing-weighted sum of those experts' SwiGLU MLPs. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.layers.linear import ReplicatedLinear
from pipeserve.layers.moe import (
    FusedMoE,
    MoEBlock,
    expert_checkpoint_names,
    held_experts,
    select_experts,
)
from pipeserve.models.arch import ArchConfig
from pipeserve.models.llama import LlamaMLP
from pipeserve.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseBlock(MoEBlock):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, layer_id: int = -1) -> None:
        super().__init__()
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = ReplicatedLinear(arch.hidden_size, arch.num_experts, False, dtype)
        self.experts = FusedMoE(
            arch.num_experts,
            self.top_k,
            arch.hidden_size,
            arch.moe_intermediate_size,
            dtype,
            layer_id,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(self.gate(x), self.top_k, self.renormalize)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.arch.is_moe_layer(layer_id):
            return Qwen3MoeSparseBlock(self.arch, self.dtype, layer_id)
        return LlamaMLP(self.arch.hidden_size, self.arch.intermediate_size, self.dtype)

    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        n = self.arch.num_experts
        experts = expert_checkpoint_names(param_name, n, held_experts(n))
        return experts if experts is not None else super().checkpoint_names(param_name)
