"""The one choice of a run's attention backend (pipeserve/backends/registry.py), for every
device, dtype, head dim, device count and flag, with the native kernels' availability and
flashinfer's import faked where they decide; the errors that say what to do; a backend
registered by name."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from pipeserve.backends import registry
from pipeserve.backends.flashinfer_backend import FlashInferBackend
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.backends.registry import (
    AUTO_TRITON_PROMPT_MAX_KEYS,
    register_backend,
    select_backend,
)
from pipeserve.backends.split import LongPromptSplit, PrefillDecodeSplit
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.backends.torch_ops import SDPA, attention_with_lse
from pipeserve.backends.triton_backend import TritonBackend
from pipeserve.config import ATTENTION_BACKENDS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16 = torch.bfloat16


def no_flashinfer() -> None:
    return None


def trivial_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    return torch.zeros_like(q), torch.zeros(q.shape[:2], device=q.device)


TRIVIAL_FLASHINFER = types.SimpleNamespace(single_prefill_with_kv_cache=trivial_prefill)


def fake_loader(module: Any) -> Any:
    def load() -> Any:
        load.calls += 1  # type: ignore[attr-defined]
        return module

    load.calls = 0  # type: ignore[attr-defined]
    return load


@pytest.fixture
def native_kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The native kernels as the test sets them: {"decode": built, "prefill": built for
    every dtype} (both by default)."""
    built = {"decode": True, "prefill": True}
    kernel = lambda *a: None  # noqa: E731  (never called: only their presence decides)
    monkeypatch.setattr(
        registry, "native_decode_kernel", lambda: kernel if built["decode"] else None
    )
    monkeypatch.setattr(
        registry, "native_prefill_kernel", lambda dtype: kernel if built["prefill"] else None
    )
    monkeypatch.setattr(registry, "import_flashinfer", no_flashinfer)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return built


def test_cpu_auto_takes_the_native_kernels_where_they_build(native_kernels: dict) -> None:
    assert type(select_backend("auto", CPU, BF16, 64)) is NativeBackend
    assert type(select_backend("native", CPU, torch.float32, 64)) is NativeBackend
    odd = select_backend("auto", CPU, BF16, 72)  # no prefill kernel for a head dim of 72
    assert isinstance(odd, PrefillDecodeSplit)
    assert isinstance(odd.prefill, TorchBackend) and isinstance(odd.decode, NativeBackend)
    # the pair's linears and direct kernels are the native decode backend's, its dense
    # prefill kernel the torch prompt chunks' (none)
    assert odd.linears is odd.decode.linears and odd.kernels.prefill(BF16) is None
    assert odd.kernels.sparse_latent is odd.decode.kernels.sparse_latent
    native_kernels["prefill"] = False
    assert isinstance(select_backend("auto", CPU, BF16, 64), PrefillDecodeSplit)
    native_kernels["decode"] = False
    fallback = select_backend("auto", CPU, BF16, 64)
    assert type(fallback) is TorchBackend
    with pytest.raises(ValueError, match="native CPU kernel could not be built"):
        select_backend("native", CPU, BF16, 64)


def test_cpu_torch_is_the_blockwise_and_fused_cpu_kernels(native_kernels: dict) -> None:
    torch_cpu = select_backend("torch", CPU, BF16, 64)
    assert type(torch_cpu) is TorchBackend
    assert torch_cpu.blockwise and torch_cpu.dense is attention_with_lse
    assert torch_cpu.kernels.prefill(BF16) is None
    assert select_backend("native", CPU, BF16, 64).kernels.prefill(BF16) is not None


def test_cuda_auto_takes_triton_with_long_prompts_on_the_library(native_kernels: dict) -> None:
    """Auto on one CUDA device where triton imports: Triton, prompt chunks over the limit on
    the library kernels (FlashInfer where it imports, fits and runs, else torch's); several
    devices keep the library kernels; triton takes every step; torch none."""
    auto = select_backend("auto", CUDA, BF16, 128)
    assert isinstance(auto, LongPromptSplit) and isinstance(auto.primary, TritonBackend)
    assert auto.max_keys == AUTO_TRITON_PROMPT_MAX_KEYS and auto.capturable
    assert type(auto.fallback) is TorchBackend and auto.fallback.dense is SDPA
    assert not auto.fallback.blockwise
    assert type(select_backend("triton", CUDA, BF16, 128)) is TritonBackend
    assert type(select_backend("triton", CUDA, BF16, 128, devices=2)) is TritonBackend
    spread = select_backend("auto", CUDA, BF16, 128, devices=2)  # not measured: the library
    assert type(spread) is TorchBackend and not spread.capturable
    load = fake_loader(TRIVIAL_FLASHINFER)
    with_fi = select_backend("auto", CUDA, BF16, 128, devices=2, load_flashinfer=load)
    assert isinstance(with_fi, FlashInferBackend)
    for dtype, head_dim in ((torch.float32, 128), (torch.float16, 96)):  # flashinfer won't fit
        chosen = select_backend("auto", CUDA, dtype, head_dim, devices=2, load_flashinfer=load)
        assert type(chosen) is TorchBackend
    assert type(select_backend("torch", CUDA, BF16, 128, load_flashinfer=load)) is TorchBackend
    assert load.calls == 1  # only where flashinfer would fit


@pytest.mark.parametrize(
    ("name", "device", "dtype", "head_dim", "message"),
    [
        ("flashinfer", CPU, BF16, 128, "needs a CUDA device"),
        ("flashinfer", CUDA, BF16, 128, "pip install flashinfer-python"),
        ("flashinfer", CUDA, torch.float32, 128, "float16/bfloat16"),
        ("flashinfer", CUDA, BF16, 80, "head dim 80"),
        ("native", CUDA, BF16, 128, "compiled for the CPU"),
        ("triton", CPU, torch.float32, 64, "TRITON_INTERPRET"),
        ("flash", CUDA, BF16, 128, "not one of auto, native, torch, flashinfer"),
    ],
)
def test_backend_errors_say_what_to_do(
    native_kernels: dict,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        select_backend(name, device, dtype, head_dim)


def test_without_triton_auto_takes_the_library(
    native_kernels: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # triton not installed: import fails
    with pytest.raises(ValueError, match="triton does not import"):
        select_backend("triton", CUDA, BF16, 128)
    assert type(select_backend("auto", CUDA, BF16, 128)) is TorchBackend


def test_deterministic_inference_takes_the_native_kernels_for_every_step(
    native_kernels: dict,
) -> None:
    chosen = select_backend("auto", CPU, BF16, 64, deterministic=True)
    assert type(chosen) is NativeBackend and chosen.deterministic
    refusals = [
        (("torch", CPU, BF16, 64), "--attention-backend torch chose others"),
        (("auto", CUDA, BF16, 64), "could not be built here"),
        (("auto", CPU, BF16, 72), "head dim 72 is not a multiple of 16"),
    ]
    for args, message in refusals:
        with pytest.raises(ValueError, match=message):
            select_backend(*args, deterministic=True)
    native_kernels["prefill"] = False
    with pytest.raises(ValueError, match="no prefill kernel takes bfloat16"):
        select_backend("auto", CPU, BF16, 64, deterministic=True)


def test_a_registered_backend_is_chosen_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "REGISTERED", {})
    monkeypatch.setattr(registry, "ATTENTION_BACKENDS", list(ATTENTION_BACKENDS))
    made = []

    def factory(device: torch.device, dtype: torch.dtype, head_dim: int) -> TorchBackend:
        made.append((device, dtype, head_dim))
        return TorchBackend(device.type)

    register_backend("mine", factory)
    assert "mine" in registry.ATTENTION_BACKENDS
    assert type(select_backend("mine", CPU, BF16, 64)) is TorchBackend
    assert made == [(CPU, BF16, 64)]
    with pytest.raises(ValueError, match="built in"):
        register_backend("torch", factory)
