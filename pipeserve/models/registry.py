"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

import torch

from pipeserve.models.arch import ArchConfig
from pipeserve.models.llama import LlamaForCausalLM
from pipeserve.models.qwen2 import Qwen2ForCausalLM
from pipeserve.models.qwen3 import Qwen3ForCausalLM
from pipeserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def build_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    with torch.device(device):
        return MODELS[arch.architecture](arch, dtype)
