"""The native CPU decode-attention kernel against the pure-torch path and a plain softmax."""

from __future__ import annotations

import pytest
import torch

from pipeserve.backends.native_backend import NativeBackend, RunSteps
from pipeserve.device import native_decode_kernel
from pipeserve.layers.attention import PagedAttention, plan_attention
from pipeserve.mem_cache.kv_pool import KVPool

pytestmark = pytest.mark.skipif(native_decode_kernel() is None, reason="native kernels unavailable")


def reference(q, pool, runs, scale):
    k_cache, v_cache = pool.buffers(0)
    idx = torch.cat([torch.arange(s, s + n) for s, n in runs])
    k, v = k_cache[:, idx].float(), v_cache[:, idx].float()  # [hk, n, d]
    hk, d = k.shape[0], k.shape[2]
    qh = q.float().view(hk, -1, d)  # [hk, g, d]
    p = torch.softmax(qh @ k.transpose(1, 2) * scale, dim=-1)
    return (p @ v).reshape(-1, d)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 3])
def test_kernel_matches_reference_and_torch_path(
    dtype: torch.dtype, tol: float, group: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    hk, d, batch = 2, 32, 4
    pool = KVPool(2048, range(1), hk, d, dtype, torch.device("cpu"), 1)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    # steps with one run, several runs, a long run (a view on the torch path) and a single key
    step_runs = [[(1, 40)], [(100, 300), (600, 7), (700, 1)], [(900, 600)], [(1600, 1)]]
    segments = [(i, 1, sum(n for _, n in r) - 1, r) for i, r in enumerate(step_runs)]
    q = torch.randn(batch, hk * group, d, generator=gen).to(dtype)
    k_new = torch.randn(batch, hk, d, generator=gen).to(dtype)
    v_new = torch.randn(batch, hk, d, generator=gen).to(dtype)
    slots = torch.tensor([r[-1][0] + r[-1][1] - 1 for r in step_runs])
    attn = PagedAttention(0, hk * group, hk, d)
    outs = {}
    for native in (False, True):
        backend = NativeBackend() if native else None
        plan = plan_attention(segments, torch.device("cpu"), dtype, backend)
        assert isinstance(plan.meta.decode, RunSteps) == native
        outs[native] = attn(q, k_new, v_new, pool, slots, plan).view(batch, hk * group, d)
    for i, runs in enumerate(step_runs):
        ref = reference(q[i], pool, runs, attn.scale)
        assert torch.allclose(outs[True][i].float(), ref, atol=tol, rtol=tol)
    assert torch.allclose(outs[True].float(), outs[False].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_invariant_to_where_the_kv_lives_and_to_the_batch(dtype: torch.dtype) -> None:
    """The same sequence laid out as one run or split into runs at odd places, alone or in a
    batch with others: bitwise the same output (blocks of keys are counted from position 0,
    not from the start of each run; the old kernel restarted them at every run)."""
    gen = torch.Generator().manual_seed(1)
    hk, d, group, length = 2, 32, 2, 203
    pool = KVPool(4096, range(1), hk, d, dtype, torch.device("cpu"), 1)
    seq_k = torch.randn(hk, length, d, generator=gen).to(dtype)
    seq_v = torch.randn(hk, length, d, generator=gen).to(dtype)
    layouts = [[(0, length)], [(300, 5), (400, 90), (600, 108)], [(1000, 33), (2000, 170)]]
    for runs in layouts:  # the same keys and values at each layout's slots
        idx = torch.cat([torch.arange(s, s + n) for s, n in runs])
        pool.k[0][:, idx], pool.v[0][:, idx] = seq_k, seq_v
    other = [(3000, 77)]
    q = torch.randn(1, hk, group, d, generator=gen).to(dtype)
    q_other = torch.randn(1, hk, group, d, generator=gen).to(dtype)
    kernel = native_decode_kernel()
    k_cache, v_cache = pool.buffers(0)

    def run(steps: list[list[tuple[int, int]]], queries: torch.Tensor) -> torch.Tensor:
        flat = torch.tensor([r for step in steps for r in step], dtype=torch.long)
        offsets = torch.tensor([0, *torch.tensor([len(s) for s in steps]).cumsum(0).tolist()])
        return kernel(queries, k_cache, v_cache, flat, offsets, d**-0.5)

    alone = run([layouts[0]], q)[0]
    for runs in layouts[1:]:
        assert torch.equal(run([runs], q)[0], alone), runs
        assert torch.equal(run([other, runs], torch.cat([q_other, q]))[1], alone), runs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d,group", [(64, 3), (20, 5), (128, 1), (3, 2)])
def test_head_widths_groups_and_lengths_against_a_plain_softmax(
    dtype: torch.dtype, tol: float, d: int, group: int
) -> None:
    """Head widths past, below and not a multiple of the kernel's 8 lanes and its 64
    registered channels, groups of 1-5 query heads per KV head, and sequences of 1 key, of a
    part of a block of 32, of whole blocks and past them (one run or several): the output of
    the kernel against softmax(q k^T) v in float64."""
    gen = torch.Generator().manual_seed(d + group)
    hk, n = 2, 1024
    k_cache = torch.randn(hk, n, d, generator=gen).to(dtype)
    v_cache = torch.randn(hk, n, d, generator=gen).to(dtype)
    steps = [[(5, 1)], [(10, 7)], [(40, 64)], [(200, 300), (600, 41)], [(700, 33)]]
    flat = torch.tensor([r for step in steps for r in step], dtype=torch.long)
    offsets = torch.tensor([0, *torch.tensor([len(s) for s in steps]).cumsum(0).tolist()])
    q = torch.randn(len(steps), hk, group, d, generator=gen).to(dtype)
    kernel = native_decode_kernel()
    assert kernel is not None
    out = kernel(q, k_cache, v_cache, flat, offsets, d**-0.5)
    for i, runs in enumerate(steps):
        idx = torch.cat([torch.arange(s, s + c) for s, c in runs])
        k, v = k_cache[:, idx].double(), v_cache[:, idx].double()
        p = torch.softmax(q[i].double() @ k.transpose(1, 2) * d**-0.5, dim=-1)
        torch.testing.assert_close(out[i].double(), p @ v, atol=tol, rtol=tol)


def test_a_nan_key_makes_its_request_s_output_nan_and_no_other() -> None:
    """A NaN in the cache (a bug upstream) shows in the output of the request that reads it,
    at any place in its blocks, not averaged away; other requests are untouched."""
    gen = torch.Generator().manual_seed(5)
    hk, d, group = 2, 32, 2
    k_cache = torch.randn(hk, 400, d, generator=gen)
    v_cache = torch.randn(hk, 400, d, generator=gen)
    k_cache[0, 70, 3] = float("nan")  # the second block of the first request
    steps = [[(0, 100)], [(200, 100)]]
    flat = torch.tensor([r for step in steps for r in step], dtype=torch.long)
    q = torch.randn(2, hk, group, d, generator=gen)
    kernel = native_decode_kernel()
    assert kernel is not None
    out = kernel(q, k_cache, v_cache, flat, torch.tensor([0, 1, 2]), d**-0.5)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()  # KV head 0 only
    assert not out[1].isnan().any()
