"""`no_host_sync()`: inside it, Python code that reads a tensor's value on the host raises
`HostSyncError`. On a GPU each such read waits for the device to finish everything queued
before it; on CPU nothing waits, so a test on CPU catches the read itself.

Caught: `t.tolist()`, `t.item()`, `t.cpu()`, `t.numpy()`, and the conversions Python makes
implicitly: `bool(t)` (`if t:`, `t and ...`, `assert t`), `int(t)`, `float(t)`,
`operator.index(t)` (`range(t)`, `seq[t]`, `x[:t]`). Shapes (`t.shape[0]`, `t.numel()`) are
host metadata and stay allowed. Not caught: `t.to("cpu")`, and values read inside torch's C++
(on CUDA `torch.bincount` and `nonzero` size their output from the data); keep those off a
path tested with this helper.

    with no_host_sync():
        out = experts.run_local(x, weights, ids, grouped=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest
import torch

SYNCING = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSyncError(AssertionError):
    """A tensor's value was read on the host inside `no_host_sync()`."""


def _refuse(name: str) -> Callable[..., NoReturn]:
    def read(self: torch.Tensor, *args: object, **kwargs: object) -> NoReturn:
        raise HostSyncError(
            f"Tensor.{name} read a {tuple(self.shape)} {self.dtype} tensor on the host, a "
            "device sync on a GPU; keep the value on the device"
        )

    return read


@contextmanager
def no_host_sync() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in SYNCING:
            patch.setattr(torch.Tensor, name, _refuse(name))
        yield
