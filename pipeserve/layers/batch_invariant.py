"""Deterministic inference (`--enable-deterministic-inference`): every row of a forward is
computed the same way whatever else is in the batch, so greedy outputs and logprobs do not
depend on batch composition, chunking, prefix-cache hits or the parallel layout.

What makes a row's result depend on its batch, and what this mode does about it:
- matrix products: BLAS libraries switch to a matrix-vector kernel, which sums in another
  order, when a product has one row. Here a one-row product is computed as two rows. Whether
  every other row count sums alike is the library's business, so it is checked at start-up
  on the model's own weight shapes (`check_linear_rows`) and the mode refuses to run where
  it does not hold.
- attention: the native kernels score keys in blocks counted from sequence position 0, so
  neither the chunk boundaries nor where the pages of a request lie change the order of the
  sums; in this mode a one-token prompt chunk (a prefix-cache hit that leaves one token)
  runs the prompt kernel like every other prompt token, not the decode kernel.
- norms, activations, rotary embedding and the sampler work row by row; the TP all-reduce
  sums in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

# on while a deterministic runner's forward runs (in its context only: not process-wide)
_enabled: ContextVar[bool] = ContextVar("batch_invariant", default=False)
CHECK_ROWS = (1, 2, 3, 5, 8, 17, 64, 131)  # row counts compared at start-up


@contextmanager
def enabled_in(on: bool) -> Iterator[None]:
    """The mode `on` (or off) for what runs inside, on this thread."""
    token = _enabled.set(on)
    try:
        yield
    finally:
        _enabled.reset(token)


def enabled() -> bool:
    return _enabled.get()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; in deterministic mode a one-row product runs as two identical rows."""
    if _enabled.get() and x.numel() == x.shape[-1]:
        return F.linear(torch.cat([x, x]), weight, bias)[:1].view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


def check_linear_rows(weights: Iterable[torch.Tensor], seed: int = 0) -> None:
    """Raise unless a product's rows come out bitwise the same for every row count tried
    (each weight shape once), in deterministic mode."""
    with enabled_in(True):
        _check_rows(weights, seed)


def _check_rows(weights: Iterable[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seen: set[tuple[int, ...]] = set()
    for w in weights:
        if w.dim() != 2 or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        rows = max(CHECK_ROWS)
        x = torch.randn(rows, w.shape[1], generator=gen).to(w.device, w.dtype)
        full = linear(x, w)
        for n in CHECK_ROWS:
            start = rows - n
            if not torch.equal(linear(x[start:], w), full[start:]):
                raise RuntimeError(
                    f"--enable-deterministic-inference: this device's matrix product of "
                    f"{tuple(w.shape)} weights gives different results for a row computed "
                    f"among {n} rows and among {rows}; deterministic inference is not "
                    "available with this BLAS library"
                )
