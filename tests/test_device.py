"""Device choice and memory budget (pipeserve/device.py) against a stand-in for torch.cuda:
one GPU per worker, CUDA_VISIBLE_DEVICES's count respected, the KV budget from the worker's
own GPU."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from pipeserve import device as dev


class FakeGpus:
    """`count` visible GPUs of `total` bytes, `used` of each in use; records set_device."""

    def __init__(self, count: int, total: int = 80 * 2**30, used: int = 0, cached: int = 0) -> None:
        self.count, self.total, self.used = count, total, used
        self.cached = cached  # of `used`: freed by this process, kept by its allocator
        self.current = 0
        self.set_to: list[torch.device] = []
        self.streams: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda: Any = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "set_device", self._set)
        monkeypatch.setattr(
            cuda, "mem_get_info", lambda d=None: (self.total - self.used, self.total)
        )
        monkeypatch.setattr(cuda, "empty_cache", self._empty_cache)
        monkeypatch.setattr(cuda, "Stream", lambda device: f"stream on {device}")
        monkeypatch.setattr(cuda, "set_stream", self.streams.append)

    def _empty_cache(self) -> None:
        self.used -= self.cached
        self.cached = 0

    def _set(self, device: torch.device) -> None:
        self.set_to.append(device)
        self.current = device.index


def test_each_worker_takes_its_own_gpu(monkeypatch) -> None:
    gpus = FakeGpus(4)
    gpus.install(monkeypatch)
    for i in range(4):
        got = dev.bind_device("cuda", i)
        assert got == torch.device("cuda", i)
        assert gpus.set_to[-1] == got  # made current before anything is allocated
        assert dev.resolve_device("cuda") == got  # later lookups find the same GPU
        assert dev.resolve_device("auto") == got


def test_more_workers_than_visible_gpus_is_refused(monkeypatch) -> None:
    FakeGpus(2).install(monkeypatch)
    with pytest.raises(ValueError, match="worker 2 of this node has no GPU of its own: 2 visible"):
        dev.bind_device("cuda", 2)


def test_a_fixed_gpu_index_for_workers_is_refused(monkeypatch) -> None:
    FakeGpus(2).install(monkeypatch)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        dev.bind_device("cuda:1", 0)


def test_cpu_workers_share_the_cpu(monkeypatch) -> None:
    FakeGpus(0).install(monkeypatch)
    assert dev.bind_device("auto", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        dev.bind_device("cuda", 0)


def test_gpu_budget_is_the_fraction_less_what_is_already_used(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    FakeGpus(1, total=100, used=0).install(monkeypatch)
    assert dev.memory_budget(gpu, 0.8, local_workers=8) == pytest.approx(80)  # its own GPU
    FakeGpus(1, total=100, used=30).install(monkeypatch)  # another process holds 30
    assert dev.memory_budget(gpu, 0.8, local_workers=1) == pytest.approx(50)


def test_gpu_budget_counts_what_this_process_freed_as_free(monkeypatch) -> None:
    # 30 in use, 20 of them freed by this process (a layer-cost probe) but still cached
    FakeGpus(1, total=100, used=30, cached=20).install(monkeypatch)
    assert dev.memory_budget(torch.device("cuda", 0), 0.8, 1) == pytest.approx(70)


class _Held:
    """Device memory an object holds until it is collected (a runner in a reference cycle)."""

    def __init__(self, gpus: FakeGpus, size: int) -> None:
        self.gpus, self.size = gpus, size
        self.me = self  # the cycle: only the collector frees it
        gpus.used += size

    def __del__(self) -> None:
        self.gpus.cached += self.size  # freed into the caching allocator


def test_gpu_budget_counts_memory_held_only_by_garbage_as_free(monkeypatch) -> None:
    """An earlier engine's runner that reference cycles keep alive is collected first: on an
    H200 the next engine in the process otherwise got a negative budget."""
    gpus = FakeGpus(1, total=100, used=10)
    gpus.install(monkeypatch)
    _Held(gpus, 40)
    gc.disable()  # the collector must not run by chance before the budget is read
    try:
        assert dev.memory_budget(torch.device("cuda", 0), 0.8, 1) == pytest.approx(70)
    finally:
        gc.enable()


def test_threads_get_the_worker_gpu_and_their_own_stream(monkeypatch) -> None:
    gpus = FakeGpus(2)
    gpus.install(monkeypatch)
    gpu = torch.device("cuda", 1)
    dev.bind_thread(gpu)
    assert gpus.set_to == [gpu] and gpus.streams == []
    dev.bind_thread(gpu, own_stream=True)  # a receive on it holds up no other thread
    assert gpus.streams == ["stream on cuda:1"]
    dev.bind_thread(torch.device("cpu"), own_stream=True)
    assert len(gpus.set_to) == 2 and len(gpus.streams) == 1


def test_cpu_budget_splits_ram_among_local_workers(monkeypatch) -> None:
    monkeypatch.setattr(dev, "total_memory", lambda d: 1000)
    assert dev.memory_budget(torch.device("cpu"), 0.5, local_workers=4) == pytest.approx(125)


def test_collective_backend_per_tensor_device() -> None:
    assert dev.dist_backend(torch.device("cpu")) == "gloo"
    assert dev.dist_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert dev.comm_group_options("gloo", 8) is None


def test_attention_ffn_disaggregation_is_refused_on_gpus() -> None:
    from types import SimpleNamespace

    from pipeserve.config import EngineConfig
    from pipeserve.distributed import worker

    config = EngineConfig.from_flags(afd_attention_size=1, afd_ffn_size=1)
    args: Any = SimpleNamespace(rank=0, init_method="file:///nonexistent")
    with pytest.raises(ValueError, match="attention-FFN disaggregation runs on CPU workers"):
        worker._init_groups(args, config, torch.device("cuda", 0))
