from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, the result cast back before the weight is applied.
    `triton`: the Triton path's one-launch kernel (pipeserve/kernels/triton_norm.py, the same
    roundings) where it fits the tensors; the torch ops otherwise."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, triton: bool = False) -> torch.Tensor:
        if triton:
            from pipeserve.kernels import triton_norm

            if triton_norm.fits(x, self.weight):
                return triton_norm.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, triton: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual step: returns (norm(x + residual), x + residual)."""
        if triton:
            from pipeserve.kernels import triton_norm

            if triton_norm.fits(x, self.weight, residual):
                return triton_norm.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self(x), x
