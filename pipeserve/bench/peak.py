"""This machine's matmul peak for a dtype and thread count, measured on the spot."""

from __future__ import annotations

import time

import torch


def matmul_peak_flops(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5
) -> float:
    """Best FLOP/s of a size^3 matmul over a few repeats (first call excluded)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
