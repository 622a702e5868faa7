"""The Triton attention kernels (pipeserve/kernels/triton_attention.py) checked on CPU through
Triton's interpreter: triton_interpreted.py in a process of its own, since TRITON_INTERPRET
must be set before triton is first imported. Never skipped: triton is a test dependency."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("triton_interpreted.py")


@pytest.mark.timeout(300)
def test_triton_kernels_match_float64_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    cmd += ["-W", "ignore::DeprecationWarning"]  # the interpreter's numpy scalar conversions
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def _reference(q, k, v, q_pos, scale):
    """q [n, h, d] at positions q_pos over k/v [hk, L, d] (position = index), causal, float32
    on the device (the GPU case's contexts are too long for float64 in time)."""
    h, hk = q.shape[1], k.shape[0]
    kk = k.float().repeat_interleave(h // hk, dim=0)
    vv = v.float().repeat_interleave(h // hk, dim=0)
    s = torch.einsum("nhd,hld->hnl", q.float(), kk) * scale
    keys = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(keys[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", torch.softmax(s, dim=-1), vv)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Within `tol` of the reference's largest value: over 32K random keys the outputs are
    small, so an absolute bound alone would pass zeros."""
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_kernels_on_a_gpu(dtype: torch.dtype) -> None:
    """Compiled, bfloat16 included, long contexts (32K keys, split-KV), pages of 16 shuffled
    over the pool; GQA 4 heads per KV head, head dim 128."""
    check_kernels(
        torch.device("cuda"),
        dtype,
        lengths=[1, 300, 32768, 4000],
        chunks=[(0, 512), (8000, 256), (100, 1), (20, 77)],
        slots_total=48 * 1024,
        shape=(8, 4, 128),
    )


TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def check_kernels(
    dev: torch.device,
    dtype: torch.dtype,
    lengths: list[int],
    chunks: list[tuple[int, int]],
    slots_total: int,
    shape: tuple[int, int, int],
) -> None:
    """paged_decode over requests of `lengths` keys and paged_extend over `chunks` (prefix
    length, query rows), KV in pages of 16 shuffled over a pool of `slots_total` slots;
    shape: (kv heads, group, head dim). (Also run on small CPU shapes in the interpreter.)"""
    from pipeserve.kernels.triton_attention import (
        extend_blocks,
        paged_decode,
        paged_extend,
        slot_table,
    )

    hk, group, d, page = *shape, 16
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(hk, slots_total, d, device=dev, generator=g).to(dtype)
    v_cache = torch.randn(hk, slots_total, d, device=dev, generator=g).to(dtype)
    pages = torch.randperm(slots_total // page).tolist()

    def runs_for(n: int) -> list[tuple[int, int]]:
        out = []
        while n > 0:
            out.append((pages.pop() * page, min(page, n)))
            n -= page
        return out

    def table(per_seq: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(dev) for t in slot_table(per_seq))

    def slots_of(runs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n, device=dev) for s, n in runs])

    per_request = [runs_for(n) for n in lengths]
    indptr, indices = table(per_request)
    q = torch.randn(len(lengths), hk, group, d, device=dev, generator=g).to(dtype)
    got = paged_decode(q, k_cache, v_cache, indptr, indices, d**-0.5)
    for i, req_runs in enumerate(per_request):
        s = slots_of(req_runs)
        one = torch.tensor([len(s)], device=dev)
        q_i = q[i].reshape(1, hk * group, d)
        want = _reference(q_i, k_cache[:, s], v_cache[:, s], one, d**-0.5)[0]
        close(got[i].reshape(hk * group, d), want, TOL[dtype])
    per_chunk = [runs_for(p + n) for p, n in chunks]
    indptr, indices = table(per_chunk)
    q = torch.randn(sum(n for _, n in chunks), hk * group, d, device=dev, generator=g).to(dtype)
    starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    rows = [(s, n, p) for s, (p, n) in zip(starts, chunks, strict=True)]
    spec = torch.tensor(rows, dtype=torch.int32, device=dev)
    blocks = [t.to(dev) for t in extend_blocks([n for _, n in chunks])]
    got = paged_extend(q, k_cache, v_cache, indptr, indices, spec, *blocks, d**-0.5)
    for (p, n), s, chunk_runs in zip(chunks, starts, per_chunk, strict=True):
        sl = slots_of(chunk_runs)
        pos = torch.arange(p, p + n, device=dev)
        want = _reference(q[s : s + n], k_cache[:, sl], v_cache[:, sl], pos, d**-0.5)
        close(got[s : s + n], want, TOL[dtype])
