"""Architecture -> model class. `ArchConfig` has chosen the architecture: the first one that
config.json's `architectures` names and pipeserve reads, else the one of its `model_type`."""

from __future__ import annotations

import torch

from pipeserve.models.arch import ArchConfig
from pipeserve.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from pipeserve.models.llama import LlamaForCausalLM
from pipeserve.models.qwen2 import Qwen2ForCausalLM
from pipeserve.models.qwen3 import Qwen3ForCausalLM
from pipeserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
}


def model_class(arch: ArchConfig) -> type[LlamaForCausalLM]:
    cls = MODELS.get(arch.architecture)
    if cls is None:  # ArchConfig reads only the architectures listed here
        supported = ", ".join(MODELS)
        raise ValueError(f"{arch.architecture} is not supported; pipeserve runs {supported}")
    return cls


def build_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    cls = model_class(arch)
    with torch.device(device):
        return cls(arch, dtype)
