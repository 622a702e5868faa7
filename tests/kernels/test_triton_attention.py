"""The Triton kernels (pipeserve/kernels/triton_*.py: attention, and the fused norms and q/k
norm + rotary + KV write) on a GPU (-m cuda), compiled at real sizes; the checks here are
shared with triton_interpreted.py, which test_interpreted.py runs on a CPU through Triton's
interpreter (never skipped: triton is a test dependency)."""

from __future__ import annotations

import pytest
import torch


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
    )
    from pipeserve.layers.attention_parts import SlotRuns

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
        return SlotRuns.build(per_seq, dev).expand()

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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_on_a_gpu(dtype: torch.dtype) -> None:
    """The Triton path's fused RMSNorm and q/k norm + rotary + KV write, compiled, against the
    torch ops they replace at a served model's shapes: hidden 5120, a prefill-sized batch of
    tokens, 32 query heads over 8 KV heads of 128, a pool of 48K slots."""
    dev = torch.device("cuda")
    check_norms(dev, dtype, tokens=1031, hidden=5120)
    for qk_norm in (False, True):
        check_norm_rope_store(dev, dtype, 1031, (32, 8, 128), 48 * 1024, qk_norm)


STEPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}  # see assert_rounded_alike
EXACT = {torch.bfloat16: 0.99, torch.float16: 0.99, torch.float32: 0.0}


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` rounded where the torch ops round `want`: bitwise equal on at least EXACT of the
    values (a float32 sum in another order tips a rounding now and then; in float32 itself
    that moves many values by an ulp), and within STEPS steps of the dtype everywhere (of the
    value, or of its row's largest: a product rounded the other way before a sum)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    step = STEPS[want.dtype] * torch.finfo(want.dtype).eps
    over = (g - w).abs() - step * (w.abs() + w.abs().amax(-1, keepdim=True))
    assert over.max().item() <= 0, f"off by more than {STEPS[want.dtype]} steps somewhere"
    same = (got == want).float().mean().item()
    assert same >= EXACT[want.dtype], f"only {same:.4f} of the values are bitwise equal"


def _weight(n: int, dev: torch.device, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (1 + 0.3 * torch.randn(n, device=dev, generator=g)).to(dtype)


def check_norms(dev: torch.device, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    """triton_norm's RMSNorm, alone and after the residual add, against RMSNorm's torch ops
    (a weight not all ones, rows strided as a slice of a wider tensor)."""
    from pipeserve.kernels.triton_norm import add_rms_norm, rms_norm
    from pipeserve.layers.layernorm import RMSNorm

    g = torch.Generator(device=dev).manual_seed(1)
    norm = RMSNorm(hidden, 1e-6, dtype).to(dev)
    norm.weight.data = _weight(hidden, dev, dtype, g)
    wide = (3 * torch.randn(tokens, hidden + 7, device=dev, generator=g)).to(dtype)
    x = wide[:, :hidden]
    residual = torch.randn(tokens, hidden, device=dev, generator=g).to(dtype)
    assert_rounded_alike(rms_norm(x, norm.weight, norm.eps), norm(x))
    got, total = add_rms_norm(x, residual, norm.weight, norm.eps)
    want, want_total = norm.add_and_norm(x, residual)
    assert torch.equal(total, want_total)
    assert_rounded_alike(got, want)


def check_norm_rope_store(
    dev: torch.device,
    dtype: torch.dtype,
    tokens: int,
    shape: tuple[int, int, int],
    slots_total: int,
    qk_norm: bool,
) -> None:
    """triton_rope's one launch against the torch ops of LlamaAttention.forward and
    PagedAttention's write: q, k, v as views of one QKV row, Llama-3-scaled cos/sin at
    scattered positions, the tokens' slots shuffled over a pool of `slots_total` whose other
    slots must keep their values; shape: (heads, kv heads, head dim)."""
    from pipeserve.kernels.triton_rope import norm_rope_store
    from pipeserve.layers.layernorm import RMSNorm
    from pipeserve.layers.rotary import RopeScaling, RotaryEmbedding, apply_rotary

    h, hk, d = shape
    g = torch.Generator(device=dev).manual_seed(2)
    qkv = torch.randn(tokens, (h + 2 * hk) * d, device=dev, generator=g).to(dtype)
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(tokens, h, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
    scaling = RopeScaling("llama3", 8.0, 256, low_freq_factor=1.0, high_freq_factor=4.0)
    positions = torch.randint(0, 8192, (tokens,), device=dev, generator=g)
    rope = RotaryEmbedding(d, 500000.0, scaling).cos_sin(positions, dtype)
    pool = [torch.randn(hk, slots_total, d, device=dev, generator=g).to(dtype) for _ in "kv"]
    slots = torch.randperm(slots_total, device=dev, generator=g)[:tokens]
    norms = None
    if qk_norm:
        norms = (RMSNorm(d, 1e-6, dtype).to(dev), RMSNorm(d, 1e-6, dtype).to(dev))
        for n in norms:
            n.weight.data = _weight(d, dev, dtype, g)
        q_ref, k_ref = apply_rotary(norms[0](q), *rope), apply_rotary(norms[1](k), *rope)
    else:
        q_ref, k_ref = apply_rotary(q, *rope), apply_rotary(k, *rope)
    want_k, want_v = pool[0].clone(), pool[1].clone()
    want_k[:, slots] = k_ref.transpose(0, 1)
    want_v[:, slots] = v.transpose(0, 1)
    weights = None if norms is None else (norms[0].weight, norms[1].weight, 1e-6)
    got_q = norm_rope_store(q, k, v, *rope, *pool, slots, weights)  # writes pool in place
    assert_rounded_alike(got_q, q_ref)
    assert torch.equal(pool[1], want_v)  # the values: copied as they are
    untouched = torch.ones(slots_total, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert torch.equal(pool[0][:, untouched], want_k[:, untouched])
    assert_rounded_alike(pool[0][:, slots], want_k[:, slots])
