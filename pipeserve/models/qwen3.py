"""Qwen3: Llama with an RMSNorm on every query and key head before the rotary embedding."""

from __future__ import annotations

import torch

from pipeserve.layers.layernorm import RMSNorm
from pipeserve.models.arch import ArchConfig
from pipeserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ArchConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__(arch, layer_id, dtype)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)

    def qk_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
