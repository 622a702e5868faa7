"""Qwen2: Llama with a bias on the q, k and v projections (`ArchConfig.qkv_bias`)."""

from __future__ import annotations

from pipeserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
