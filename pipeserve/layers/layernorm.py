from __future__ import annotations

import torch
from torch import nn

from pipeserve.backends.base import TORCH_NORMS, NormKernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, the result cast back before the weight is applied, by the
    kernels the batch's attention backend offers (`NormKernels`; PyTorch's ops by default)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: NormKernels = TORCH_NORMS) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: NormKernels = TORCH_NORMS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual step: returns (norm(x + residual), x + residual)."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)
