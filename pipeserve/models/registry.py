"""Architecture -> model class. `ArchConfig` has chosen the architecture: the first one that
config.json's `architectures` names and pipeserve reads, else the one of its `model_type`."""

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


def model_class(arch: ArchConfig) -> type[LlamaForCausalLM]:
    cls = MODELS.get(arch.architecture)
    if cls is None:  # read by ArchConfig (DeepSeek) but not built yet
        raise ValueError(
            f"{arch.architecture} checkpoints are not supported yet (their config is read, the "
            f"model is not built); pipeserve runs {', '.join(MODELS)}"
        )
    return cls


def build_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    cls = model_class(arch)
    with torch.device(device):
        return cls(arch, dtype)
