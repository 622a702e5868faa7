"""This machine's matmul peak for a dtype and thread count, measured on the spot, in bounded
time whatever the dtype's speed."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeserve.device import synchronize

FIRST_SIZE = 256
# The largest product timed: big enough to reach the device's dense peak. A CPU core is
# there by 2048^3; a large GPU is not (an H200 reads 332 TFLOP/s at 2048^3 in bf16 and
# ~790 at 8192^3).
MAX_SIZE = {"cpu": 2048, "cuda": 8192}
PRODUCT_BUDGET_S = 0.5  # the size doubles only while one product is predicted to fit this


def matmul_peak_flops(
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 8,
    timer: Callable[[int], float] | None = None,
) -> float:
    """Best FLOP/s of a square matmul over `repeats` timings at the largest size whose
    product takes at most PRODUCT_BUDGET_S (up to the device's MAX_SIZE). Sizes double from
    FIRST_SIZE while 8x the last product's time fits the budget, so no product timed takes
    much over it, and there are at most 2 per size (an untimed first call and a timing) plus
    the repeats: ~6 s at most, also where the dtype is emulated (bf16 on a CPU without
    AVX512-BF16 or AMX: ~1 GFLOP/s); a float32 core takes ~2 s. The best of the repeats
    counts: a shared machine's slow moments do not. `timer(size)`: seconds of one product
    (default: timed here, after an untimed first call at each size)."""
    time_one = timer or _product_timer(dtype, device)
    cap = MAX_SIZE.get(device.type, MAX_SIZE["cuda"])
    size = FIRST_SIZE
    seconds = time_one(size)  # warms the library up too
    while 2 * size <= cap and 8 * seconds <= PRODUCT_BUDGET_S:
        size *= 2
        seconds = time_one(size)
    best = min([seconds, *(time_one(size) for _ in range(repeats))])
    return 2.0 * size**3 / best


def _product_timer(dtype: torch.dtype, device: torch.device) -> Callable[[int], float]:
    operands: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def time_one(size: int) -> float:
        if size not in operands:
            operands.clear()  # one pair at a time: 8192^2 fp32 is 256 MiB each
            a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
            operands[size] = a, b
            torch.matmul(a, b)  # first call at this shape (kernel choice, packing)
        a, b = operands[size]
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        return time.perf_counter() - start

    return time_one
