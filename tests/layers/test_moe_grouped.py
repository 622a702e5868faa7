"""FusedMoE's two ways to run its experts: grouped GEMMs whose group sizes stay on the
device (the CUDA default) against one product per expert (the CPU default), on CPU; which
weights the grouped path refuses; and that it, the routers and the whole ep-size-1 block
read nothing on the host."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from host_sync import HostSyncError, no_host_sync

from pipeserve.distributed import parallel_state
from pipeserve.layers import batch_invariant, moe
from pipeserve.layers.moe import (
    DeepseekV3MoE,
    FusedMoE,
    GroupedRouting,
    can_group_experts,
    grouped_by_default,
    select_experts,
)

EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 32, 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # x |expected| max: sums rounded apart


@pytest.fixture(autouse=True)
def one_process() -> Iterator[None]:
    with parallel_state.standalone():
        yield


def make_experts(dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER) -> FusedMoE:
    experts = FusedMoE(EXPERTS, TOP_K, hidden, inter, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (experts.w13, experts.w2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts


def rows(n: int, hidden: int = HIDDEN, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def randint(low: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(low, EXPERTS, (n, TOP_K), generator=torch.Generator().manual_seed(seed))


IDS: dict[str, Callable[[], torch.Tensor]] = {  # [rows, k] local ids, -1: expert elsewhere
    "random": lambda: randint(0, 40, seed=2),
    "some-elsewhere": lambda: randint(-1, 40, seed=3),
    "all-elsewhere": lambda: torch.full((5, TOP_K), -1),
    "zero-rows": lambda: torch.empty(0, TOP_K, dtype=torch.long),
    "one-expert-takes-all": lambda: torch.tensor([[4, 4, 4]] * 7),
    "last-expert-only": lambda: torch.tensor([[EXPERTS - 1, -1, -1]] * 3),
    "most-experts-idle": lambda: torch.tensor([[0, 2, -1], [2, -1, 0], [0, 2, 2]]),
    "one-row": lambda: torch.tensor([[1, -1, 6]]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(IDS))
def test_grouped_experts_equal_the_per_expert_loop(dtype: torch.dtype, case: str) -> None:
    experts = make_experts(dtype)
    ids = IDS[case]()
    x = rows(ids.shape[0]).to(dtype)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4))
    weights = weights.masked_fill(ids < 0, 0.0)
    assert can_group_experts(experts.w13, experts.w2)
    with torch.no_grad():
        expected = experts.run_local(x, weights, ids, grouped=False)
        got = experts.run_local(x, weights, ids, grouped=True)
    assert got.dtype == dtype and got.shape == x.shape
    atol = TOLERANCE[dtype] * max([1.0, *expected.abs().flatten().tolist()])
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    assert not got[(ids < 0).all(dim=1)].any()  # rows with no local expert stay zero


def test_experts_elsewhere_are_zeroed_not_multiplied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped GEMMs leave the rows past the last local expert's undefined: NaN there must
    not reach the output (NaN * weight 0 is NaN)."""
    real = moe._GROUPED_MM

    def nan_tail(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = real(a, b, offs=offs)
        ends = torch.arange(out.shape[0]) >= offs[-1]
        return out.masked_fill(ends[:, None], float("nan"))

    monkeypatch.setattr(moe, "_GROUPED_MM", nan_tail)
    experts = make_experts(torch.float32)
    ids = IDS["some-elsewhere"]()
    weights = torch.rand(ids.shape).masked_fill(ids < 0, 0.0)
    with torch.no_grad():
        got = experts.run_local(rows(ids.shape[0]), weights, ids, grouped=True)
    assert not got.isnan().any()


@pytest.mark.parametrize(
    ("dtype", "hidden", "inter"),
    [(torch.bfloat16, 36, 16), (torch.bfloat16, 32, 12), (torch.float32, 30, 16)],
    ids=["bf16-hidden-36", "bf16-inter-12", "fp32-hidden-30"],
)
def test_unaligned_experts_run_the_loop(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, hidden: int, inter: int
) -> None:
    """grouped_mm needs every row a multiple of 16 bytes; otherwise the loop runs."""
    experts = make_experts(dtype, hidden, inter)
    assert not can_group_experts(experts.w13, experts.w2)
    monkeypatch.setattr(FusedMoE, "_run_grouped", refuse)
    ids = IDS["some-elsewhere"]()
    x = rows(ids.shape[0], hidden).to(dtype)
    with torch.no_grad():
        got = experts.run_local(x, torch.rand(ids.shape), ids, grouped=True)
    assert got.shape == x.shape


def test_without_grouped_mm_the_loop_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = make_experts(torch.bfloat16)
    monkeypatch.setattr(moe, "_GROUPED_MM", None)
    assert not can_group_experts(experts.w13, experts.w2)
    monkeypatch.setattr(FusedMoE, "_run_grouped", refuse)
    ids = IDS["random"]()
    with torch.no_grad():
        experts.run_local(rows(ids.shape[0]).bfloat16(), torch.rand(ids.shape), ids, grouped=True)


def test_other_dtypes_and_non_contiguous_weights_are_refused() -> None:
    assert not can_group_experts(
        torch.zeros(2, 32, 32, dtype=torch.float64), torch.zeros(2, 32, 16)
    )
    w13 = torch.zeros(2, 32, 64)[:, :, :32]
    assert not can_group_experts(w13, torch.zeros(2, 32, 16))
    assert not can_group_experts(torch.zeros(0, 32, 32), torch.zeros(0, 32, 16))


def test_grouped_by_default_on_cuda_only_and_never_when_deterministic() -> None:
    assert not grouped_by_default(torch.device("cpu"))
    assert grouped_by_default(torch.device("cuda"))
    with batch_invariant.enabled_in(True):
        assert not grouped_by_default(torch.device("cuda"))
    assert grouped_by_default(torch.device("cuda"))  # only inside


def test_cpu_runs_the_loop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = make_experts(torch.float32)
    monkeypatch.setattr(FusedMoE, "_run_grouped", refuse)
    ids = IDS["random"]()
    with torch.no_grad():
        experts.run_local(rows(ids.shape[0]), torch.rand(ids.shape), ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_experts_read_nothing_on_the_host(dtype: torch.dtype) -> None:
    experts = make_experts(dtype)
    ids = IDS["some-elsewhere"]()
    x, weights = rows(ids.shape[0]).to(dtype), torch.rand(ids.shape)
    with torch.no_grad(), no_host_sync():
        experts.run_local(x, weights, ids, grouped=True)
        experts.run_local(x[:0], weights[:0], ids[:0], grouped=True)
    with torch.no_grad(), no_host_sync(), pytest.raises(HostSyncError, match="tolist"):
        experts.run_local(x, weights, ids, grouped=False)  # the check sees the loop's read


def test_ep_size_one_block_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's block (grouped top-k router, shared experts, local dispatcher) with its
    experts grouped as on CUDA, and the softmax router."""
    routing = GroupedRouting(EXPERTS, TOP_K, 4, 2, True, 2.5)
    block = DeepseekV3MoE(HIDDEN, INTER, 1, routing, torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = rows(17)
    with torch.no_grad():
        expected = block(x)
        monkeypatch.setattr(moe, "grouped_by_default", lambda device: True)
        monkeypatch.setattr(FusedMoE, "_run_looped", refuse)
        with no_host_sync():
            got = block(x)
            select_experts(rows(9, EXPERTS), TOP_K, renormalize=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def refuse(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("this path should not run")


@pytest.mark.cuda
def test_grouped_experts_never_sync_on_cuda() -> None:
    """CUDA's own sync detector around the default (grouped) path; the loop agrees."""
    experts = make_experts(torch.bfloat16).cuda()
    if not can_group_experts(experts.w13, experts.w2):
        pytest.skip(f"no grouped bf16 kernel on {torch.cuda.get_device_name()}")
    ids = randint(-1, 300, seed=6).cuda()
    x, weights = rows(ids.shape[0]).bfloat16().cuda(), torch.rand(ids.shape).cuda()
    with torch.no_grad():
        expected = experts.run_local(x, weights, ids, grouped=False)
        experts.run_local(x, weights, ids)  # first call: kernel set-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = experts.run_local(x, weights, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    atol = TOLERANCE[torch.bfloat16] * max([1.0, *expected.abs().flatten().tolist()])
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
