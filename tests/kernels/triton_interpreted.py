"""The Triton attention kernels on CPU tensors through Triton's interpreter, against float64
references: ragged batches, KV as scattered slots (runs of 1), pages of 16 and one long run,
GQA groups of 1, 3 (padded) and 4, head dims 16, 24 (padded) and 32, split-KV shares, chunks
with and without a cached prefix, float32, float16 and bfloat16 (the interpreter's bfloat16
dots and roundings made a GPU's: `gpu_bf16`; long contexts are checked on a GPU). The fused
kernels of the Triton path (triton_norm.py, triton_rope.py) against the torch ops they
replace, in float32 and bfloat16.

Run by test_triton_attention.py in a process of its own with TRITON_INTERPRET=1 (it must be
set before triton is imported); not collected on its own (no test_ prefix)."""

from __future__ import annotations

import os
import random

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_attention.py"

from pipeserve.kernels.triton_attention import (  # noqa: E402
    extend_blocks,
    paged_decode,
    paged_extend,
)
from pipeserve.layers.attention_parts import SlotRuns  # noqa: E402

SLOTS = 1024


def layout(lengths: list[int], page: int, seed: int) -> tuple[list[list[tuple[int, int]]], int]:
    """Each request's KV as runs over a shuffled pool: `page` slots per run (0: one run)."""
    rng = random.Random(seed)
    size = page or max(lengths)
    pages = list(range(SLOTS // size))
    rng.shuffle(pages)
    out = []
    for n in lengths:
        runs = []
        while n > 0:
            take = min(size, n)
            runs.append((pages.pop() * size, take))
            n -= take
        out.append(runs)
    return out, size


def slots_of(runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in runs])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """q [n, h, d] at positions q_pos over keys k/v [hk, L, d] (position = index), causal."""
    h, hk = q.shape[1], k.shape[0]
    kk = k.double().repeat_interleave(h // hk, dim=0)  # [h, L, d]
    vv = v.double().repeat_interleave(h // hk, dim=0)
    s = torch.einsum("nhd,hld->hnl", q.double(), kk) * scale
    keys = torch.arange(k.shape[1])
    s = s.masked_fill(keys[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", torch.softmax(s, dim=-1), vv)


def pool(hk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hk * 100 + d)
    return (
        torch.randn(hk, SLOTS, d, generator=g).to(dtype),
        torch.randn(hk, SLOTS, d, generator=g).to(dtype),
    )


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def gpu_bf16(monkeypatch) -> None:
    """bfloat16 as a GPU computes it. The interpreter keeps bfloat16 as the uint16 of its
    bits: its `tl.dot` multiplied those integers (a 16x16 product came out 2.8e10 off), and
    it truncates float32 to bfloat16 where GPUs and torch round to nearest even. With this,
    a dot widens bfloat16 operands to their float32 values first (what the tensor cores
    multiply, exactly), and a cast rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    plain_cast = interpreter.InterpreterBuilder.cast_impl
    plain_dot = interpreter.InterpreterBuilder.create_dot

    def cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return plain_cast(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # no NaNs here
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    def widened(h) -> np.ndarray:
        if h.dtype.scalar == tl.bfloat16:
            return (np.asarray(h.data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        return h.data

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(widened(a), widened(b), dtype=np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


# (dtype, run length (0: one run per request), kv heads, group, head dim, splits, lengths)
DECODE = [
    (F32, 1, 2, 3, 16, 1, [1, 9, 40]),
    (F32, 16, 1, 4, 24, 3, [1, 17, 70, 130]),  # shares of 44: three key blocks' worth
    (F16, 0, 4, 1, 16, 3, [2, 70]),  # fewer keys than shares for the first
    (F16, 16, 2, 3, 16, 1, [3, 33]),
    (BF16, 16, 2, 4, 32, 3, [1, 70, 130]),
]
# (dtype, run length, kv heads, group, head dim, chunks as (prefix_len, q_len))
EXTEND = [
    (F32, 1, 2, 3, 16, [(0, 9), (5, 1), (20, 12)]),
    (F32, 16, 1, 4, 24, [(0, 19), (37, 70), (150, 3)]),  # 70 rows: five blocks of queries
    (F16, 0, 2, 1, 32, [(64, 33), (0, 5)]),
    (F16, 16, 2, 3, 16, [(7, 20), (33, 2)]),
    (BF16, 16, 2, 4, 32, [(0, 19), (37, 70), (5, 1)]),
]


@pytest.mark.parametrize(("dtype", "page", "hk", "group", "d", "splits", "lengths"), DECODE)
def test_decode(dtype, page, hk, group, d, splits, lengths) -> None:
    per_request, _ = layout(lengths, page, seed=page + hk)
    indptr, indices = SlotRuns.build(per_request, torch.device("cpu")).expand()
    k_cache, v_cache = pool(hk, d, dtype)
    q = torch.randn(len(lengths), hk, group, d).to(dtype)
    scale = d**-0.5
    got = paged_decode(q, k_cache, v_cache, indptr, indices, scale, splits=splits)
    for i, req_runs in enumerate(per_request):
        slots = slots_of(req_runs)
        qi = q[i].reshape(1, hk * group, d)
        want = reference(
            qi, k_cache[:, slots], v_cache[:, slots], torch.tensor([len(slots)]), scale
        )
        torch.testing.assert_close(
            got[i].reshape(hk * group, d).double(), want[0], atol=TOL[dtype], rtol=TOL[dtype]
        )


@pytest.mark.parametrize(("dtype", "page", "hk", "group", "d", "chunks"), EXTEND)
def test_extend(dtype, page, hk, group, d, chunks) -> None:
    """Chunks of one batch: no prefix, a prefix shorter than a key block, a long prefix,
    one-token chunks, a chunk longer than a block of query rows."""
    per_request, _ = layout([p + n for p, n in chunks], page, seed=7 + page)
    indptr, indices = SlotRuns.build(per_request, torch.device("cpu")).expand()
    k_cache, v_cache = pool(hk, d, dtype)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, hk * group, d).to(dtype)
    starts, at = [], 0
    for _, n in chunks:
        starts.append(at)
        at += n
    table = torch.tensor(
        [(s, n, p) for s, (p, n) in zip(starts, chunks, strict=True)], dtype=torch.int32
    )
    chunk, first = extend_blocks([n for _, n in chunks])
    got = paged_extend(q, k_cache, v_cache, indptr, indices, table, chunk, first, d**-0.5)
    for (p, n), s, req_runs in zip(chunks, starts, per_request, strict=True):
        slots = slots_of(req_runs)
        want = reference(
            q[s : s + n], k_cache[:, slots], v_cache[:, slots], torch.arange(p, p + n), d**-0.5
        )
        torch.testing.assert_close(got[s : s + n].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_a_group_wider_than_a_program_s_heads(monkeypatch) -> None:
    """A KV head's query heads split over programs, a few of them each (the limits made small:
    MLA's 128 heads sharing one latent head, at a toy scale), the last program's heads
    padded; wide rows take fewer keys a step (decode at 272-wide values: 32 keys in float32,
    16 in float16 with more than 16 heads a program; extend at head dim 128: 32 keys in
    float16, 16 in float32)."""
    from pipeserve.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "DECODE_MAX_HEADS", 32)
    monkeypatch.setattr(ta, "EXTEND_MAX_HEADS", 2)
    assert ta.decode_tiles(32, 512)[0] == ta.BLOCK_N // 4
    assert ta.extend_tiles(16 * 2, 128)[0] == ta.BLOCK_N // 2
    test_decode(F32, 16, 1, 40, 272, 2, [3, 70])  # 40 heads: programs of 32 and 8
    test_decode(F16, 16, 1, 40, 272, 1, [3, 70])
    test_decode(F16, 1, 2, 3, 16, 1, [5, 33])  # within one program: as before
    test_extend(F32, 16, 2, 5, 16, [(0, 9), (20, 12)])  # 5 heads: programs of 2, 2 and 1
    test_extend(F16, 0, 1, 3, 128, [(40, 20), (0, 3)])
    test_extend(F32, 0, 1, 3, 128, [(40, 20), (0, 3)])


def test_an_empty_batch_launches_nothing() -> None:
    k_cache, v_cache = pool(2, 16, torch.float32)
    indptr, indices = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    out = paged_decode(torch.zeros(0, 2, 1, 16), k_cache, v_cache, indptr, indices, 0.25)
    assert out.shape == (0, 2, 1, 16)


@pytest.mark.parametrize(("dtype", "splits"), [(F32, 1), (F16, 3), (BF16, 2)])
def test_mla_absorbed_decode(dtype: torch.dtype, splits: int) -> None:
    """MLA's absorbed decode over the latent cache: one key head of [latent | rope] rows
    shared by all query heads (5: padded to 16), values the rows' latent part."""
    latent, rope, heads = 32, 16, 5
    lengths = [3, 70, 129]
    per_request, _ = layout(lengths, 16, seed=3)
    indptr, indices = SlotRuns.build(per_request, torch.device("cpu")).expand()
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(SLOTS, latent + rope, generator=g).to(dtype)
    q = torch.randn(len(lengths), 1, heads, latent + rope, generator=g).to(dtype)
    scale = 0.3
    got = paged_decode(q, cache[None], cache[None], indptr, indices, scale, splits, rope=rope)
    assert got.shape == (len(lengths), 1, heads, latent)
    for i, req_runs in enumerate(per_request):
        rows = cache[slots_of(req_runs)].double()  # [L, latent + rope]
        p = torch.softmax(q[i, 0].double() @ rows.T * scale, dim=-1)
        want = p @ rows[:, :latent]
        torch.testing.assert_close(got[i, 0].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(("dtype", "dv"), [(F32, 12), (F16, 40), (BF16, 12)])
def test_mla_expanded_prompt_chunks_in_one_launch(dtype: torch.dtype, dv: int) -> None:
    """MLA's expanded prompt chunks (`expanded_extend`): the queries' [nope | rope] parts
    over keys k_nope per head and k_rope shared by the heads, values of another width, all
    views into one up-projection (strided rows); chunks with and without a prefix, one of
    several blocks of query rows, one of one row; one launch."""
    from pipeserve.backends.base import ExpandedSpan
    from pipeserve.backends.triton_backend import expanded_tables
    from pipeserve.kernels import triton_attention

    heads, nope, rope = 3, 16, 8
    chunks = [(0, 9), (20, 150), (4, 1)]  # (prefix_len, q_len)
    g = torch.Generator().manual_seed(11)
    spans, rows, keys = [], 0, 0
    for prefix, n in chunks:
        spans.append(ExpandedSpan(rows + 2, n, prefix, keys))  # rows 0-1 are others'
        rows, keys = rows + n, keys + prefix + n
    up = torch.randn(keys, heads, nope + dv, generator=g).to(dtype)
    k_nope, v = up.split([nope, dv], -1)
    latents = torch.randn(keys, 32 + rope, generator=g).to(dtype)
    k_rope = latents[:, 32:]
    q = torch.randn(rows + 2, heads, nope + rope, generator=g).to(dtype)
    out = torch.full((rows + 2, heads, dv), 7.0, dtype=dtype)
    launches = Counted(triton_attention._extend_kernel)
    triton_attention._extend_kernel = launches
    try:
        block_m = triton_attention.expanded_block_m(dtype)
        tables = expanded_tables(tuple(spans), keys, torch.device("cpu"), block_m)
        triton_attention.expanded_extend(q, k_nope, k_rope, v, tables, 0.3, out)
    finally:
        triton_attention._extend_kernel = launches.kernel
    assert launches.launches == 1
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))  # others' rows untouched
    full_keys = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1)], -1)
    for span in spans:
        first, length = span.first_key, span.prefix_len + span.q_len
        k = full_keys[first : first + length].transpose(0, 1)  # [h, L, nope + rope]
        vv = v[first : first + length].transpose(0, 1)
        q_rows = q[span.q_start : span.q_start + span.q_len]
        want = reference(q_rows, k, vv, torch.arange(span.prefix_len, length), 0.3)
        got = out[span.q_start : span.q_start + span.q_len].double()
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_v32_sparse_prompt_queries_read_their_chosen_rows_only(dtype, monkeypatch) -> None:
    """DeepSeek-V3.2's prompt chunk on the Triton backend: each query over its own chosen
    latent rows (-1: none; a query with one row, one with all topk), as torch's gathered
    path computes it, in launches of at most a few queries (the partials' budget); the
    pairs read are the chosen ones, counted without a host read."""
    from pipeserve.backends.triton_backend import TritonBackend
    from pipeserve.kernels import triton_attention
    from pipeserve.layers.mla import sparse_latent_attention

    latent, rope, heads, n, topk = 32, 16, 5, 7, 24
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(SLOTS, latent + rope, generator=g).to(dtype)
    q = torch.randn(n, heads, latent + rope, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:topk] for _ in range(n)])
    slots[1, 1:] = -1
    slots[2, ::3] = -1
    slots[4, 5:] = -1
    launches: list[int] = []
    real = triton_attention.paged_decode

    def counted(qb, *args, **kwargs):
        launches.append(qb.shape[0])
        return real(qb, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_decode", counted)
    monkeypatch.setattr(triton_attention, "SPARSE_PARTIAL_BYTES", heads * latent * 4 * 3)
    kernel = TritonBackend.kernels.sparse_latent
    assert kernel is not None
    read = torch.zeros(1, dtype=torch.long)
    if dtype == F32:  # the layer's call (float16 takes its torch path: the kernel alone)
        got = sparse_latent_attention(q, cache, slots, latent, 0.3, kernel, read)
    else:
        got = kernel(q, cache, slots, latent, 0.3, read)
    want = sparse_latent_attention(q.double(), cache.double(), slots, latent, 0.3)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert launches == [3, 3, 1]
    assert int(read) == int((slots >= 0).sum()) == n * topk - (topk - 1) - 8 - (topk - 5)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hidden", [576, 1000])
def test_fused_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    """RMSNorm and its residual add in one launch, rounded as the torch ops round, at hidden
    sizes that are not powers of 2."""
    from test_triton_attention import check_norms

    check_norms(torch.device("cpu"), dtype, tokens=5, hidden=hidden)


@pytest.mark.parametrize(
    ("dtype", "shape", "qk_norm"),
    [
        (F32, (4, 2, 64), False),
        (F32, (6, 2, 128), True),
        (BF16, (8, 2, 64), True),
        (BF16, (3, 3, 128), False),
    ],
)
def test_fused_norm_rope_store(dtype: torch.dtype, shape, qk_norm: bool) -> None:
    """q/k norm, rotary and the KV write in one launch: the queries and the pool as the torch
    ops leave them (GQA groups of 4 and 3, MHA, with and without q/k norms)."""
    from test_triton_attention import check_norm_rope_store

    check_norm_rope_store(torch.device("cpu"), dtype, 7, shape, 64, qk_norm)


@pytest.mark.parametrize(
    # tiny-llama is tiny-qwen2 less the q/k/v biases, which the linears (not these kernels) add
    "preset",
    ["tiny-qwen3", "tiny-deepseek-v3", "tiny-deepseek-v32"],  # tiny-qwen2: with the graphs
)
def test_the_engine_on_the_triton_path_serves_the_same_tokens(
    model_dir, monkeypatch, preset: str
) -> None:
    """The whole engine with --attention-backend triton (its plans, int32 slot tables, one
    launch per layer for the decode steps and one for the prompt chunks; for DeepSeek's MLA
    one absorbed launch for the decode steps, V3.2's over the indexer's chosen rows, chosen for
    all steps at once over the page table, and its prompt chunks past index_topk over their
    chosen rows on the Triton kernel too, a batch's other prompt chunks in one launch; the fused
    norms, and for GQA layers the fused q/k norm (Qwen3), rotary and KV write) against the
    torch kernels: prompts of several chunks decoded together, one sharing a cached prefix."""
    from pipeserve import Engine
    from pipeserve.backends import triton_backend
    from pipeserve.kernels import triton_attention, triton_norm, triton_rope
    from pipeserve.layers import indexer

    fused = [(triton_norm, "_rms_norm_kernel"), (triton_rope, "_norm_rope_store_kernel")]
    counted = [Counted(getattr(module, name)) for module, name in fused]
    for (module, name), c in zip(fused, counted, strict=True):
        monkeypatch.setattr(module, name, c)
    at_once: list[int] = []  # V3.2: decode steps selected at once over a page table
    real_decode_top = indexer.decode_top_positions

    def decode_top(q, *args):
        at_once.append(q.shape[0])
        return real_decode_top(q, *args)

    monkeypatch.setattr(indexer, "decode_top_positions", decode_top)
    sparse_chunks: list[int] = []  # V3.2's prompt chunks over their chosen rows, on Triton
    real_sparse = triton_attention.sparse_latent

    def sparse(q, *args):
        sparse_chunks.append(q.shape[0])
        return real_sparse(q, *args)

    monkeypatch.setattr(triton_attention, "sparse_latent", sparse)
    expanded: list[int] = []  # MLA's expanded prompt chunks: the chunks of each launch
    real_expanded = triton_attention.expanded_extend

    def expanded_launch(q, k, k_rope, v, tables, *args):
        expanded.append(tables[2].shape[0])
        return real_expanded(q, k, k_rope, v, tables, *args)

    monkeypatch.setattr(triton_attention, "expanded_extend", expanded_launch)
    tables: list[int] = []  # the launch's tables, made once per batch (its first layer)
    real_tables = triton_backend.expanded_tables

    def made_tables(spans, *args):
        tables.append(len(spans))
        return real_tables(spans, *args)

    monkeypatch.setattr(triton_backend, "expanded_tables", made_tables)
    model = str(model_dir(preset, num_hidden_layers=2))  # fewer interpreted launches
    # V3.2: longer than its index_topk (64), so decode steps read only the indexer's choice
    base = [(7 * j) % 300 + 1 for j in range(90 if preset.endswith("v32") else 40)]
    short = [(5 * j) % 300 + 2 for j in range(5)]
    prompts = [base, base[:24] + [9, 8, 7], short[:2], short[2:]]
    params = {"max_new_tokens": 4, "temperature": 0}
    outs, launches = {}, {}
    for backend in ("torch", "triton"):
        flags = {"dtype": "float32", "chunked_prefill_size": 16, "attention_backend": backend}
        before = [c.launches for c in counted]
        with Engine(model, **flags) as engine:
            assert engine.backend.runner.backend.name == backend
            outs[backend] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
        launches[backend] = [c.launches > b for c, b in zip(counted, before, strict=True)]
        launches[backend] += [max(at_once, default=0), len(sparse_chunks)]
        launches[backend] += [max(expanded, default=0)]
        assert len(expanded) == 2 * len(tables)  # two layers
        tables.clear()
        at_once.clear()
        sparse_chunks.clear()
        expanded.clear()
    # all four requests' steps in one selection, on either backend's page table
    v32 = 4 if preset.endswith("v32") else 0
    # V3.2: the 90-token prompt's chunks past topk (64-80, 80-90) on 2 layers
    chunks = 4 if preset.endswith("v32") else 0
    # MLA: a batch's prompt chunks that attend on up-projected keys in one launch (the two
    # short prompts, beside chunks after a cached prefix that attend in latent space)
    together = 2 if "deepseek" in preset else 0
    assert launches == {
        "torch": [False, False, v32, 0, 0],
        "triton": [True, "deepseek" not in preset, v32, chunks, together],
    }
    same_outputs(outs["triton"], outs["torch"], atol=1e-4)


def test_auto_s_mix_of_triton_and_library_kernels_serves_the_same_tokens(
    model_dir, monkeypatch
) -> None:
    """Auto on CUDA as one engine sees it: prompt chunks within the key limit and every
    decode step on the Triton path (its fused q/k norm, rotary and KV write), chunks past it
    on the torch kernels, so each side reads KV the other wrote; the same tokens and logprobs
    as the torch kernels throughout (tiny-qwen3, a key limit of 20 at chunks of 16)."""
    from pipeserve import Engine
    from pipeserve.backends import registry
    from pipeserve.backends.split import LongPromptSplit
    from pipeserve.backends.torch_backend import TorchBackend
    from pipeserve.backends.triton_backend import TritonBackend
    from pipeserve.runner import forward_batch

    real_choice = registry.select_backend

    def choice(name, device, *args):  # auto on CUDA, with a key limit of 20
        if name != "triton":
            return real_choice(name, device, *args)
        return LongPromptSplit(TritonBackend(), TorchBackend(device), 20)

    monkeypatch.setattr(registry, "select_backend", choice)
    kinds: list[bool] = []  # per prepared batch with a prompt chunk: batched or not
    real_prepare = forward_batch.ForwardBatch.prepare.__func__  # type: ignore[attr-defined]

    def prepare(cls, batch, *args, **kwargs):
        fb = real_prepare(cls, batch, *args, **kwargs)
        if any(not s.is_decode for s in batch.slices):
            kinds.append(isinstance(fb.attn.backend, TritonBackend))
        return fb

    monkeypatch.setattr(forward_batch.ForwardBatch, "prepare", classmethod(prepare))
    model = str(model_dir("tiny-qwen3", num_hidden_layers=2))
    base = [(7 * j) % 300 + 1 for j in range(40)]
    prompts = [base, [(5 * j) % 300 + 2 for j in range(12)]]
    params = {"max_new_tokens": 5, "temperature": 0}
    outs = {}
    for backend in ("torch", "triton"):
        flags = {"dtype": "float32", "chunked_prefill_size": 16, "attention_backend": backend}
        kinds.clear()
        with Engine(model, **flags) as engine:
            outs[backend] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
    assert True in kinds and False in kinds  # the triton engine's batches took both paths
    same_outputs(outs["triton"], outs["torch"], atol=1e-4)


def same_outputs(gots: list[dict], wants: list[dict], atol: float) -> None:
    """The same tokens, and their logprobs within `atol`."""
    for got, want in zip(gots, wants, strict=True):
        assert got["output_ids"] == want["output_ids"]
        torch.testing.assert_close(
            torch.tensor(got["output_logprobs"]),
            torch.tensor(want["output_logprobs"]),
            atol=atol,
            rtol=0,
        )


class Counted:
    """A Triton kernel whose launches are counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("requests", [2, 7])
def test_one_launch_per_layer_however_many_requests(monkeypatch, requests: int) -> None:
    """A layer's forward over a batch of decode steps and prompt chunks launches the decode
    kernel once and the extend kernel once, for 2 requests of each kind as for 7."""
    from pipeserve.backends.triton_backend import TritonBackend
    from pipeserve.kernels import triton_attention as ta
    from pipeserve.layers.attention import PagedAttention, plan_attention
    from pipeserve.mem_cache.kv_pool import KVPool

    counted = {name: Counted(getattr(ta, name)) for name in ("_decode_kernel", "_extend_kernel")}
    for name, c in counted.items():
        monkeypatch.setattr(ta, name, c)
    hk, group, d = 2, 2, 16
    pool = KVPool(SLOTS, range(1), hk, d, torch.float32, torch.device("cpu"), 16)
    segments, row = [], 0
    for i in range(requests):  # a decode step at position 30 + i, then a chunk of 5 after 8
        segments.append((row, 1, 30 + i, [(64 * i, 31 + i)]))
        segments.append((row + 1, 5, 8, [(64 * (i + 8), 13)]))
        row += 6
    plan = plan_attention(segments, torch.device("cpu"), torch.float32, TritonBackend())
    layer = PagedAttention(0, hk * group, hk, d)
    q = torch.randn(row, hk * group, d)
    k, v = torch.randn(row, hk, d), torch.randn(row, hk, d)
    slots = torch.tensor(
        [
            s
            for i in range(requests)
            for s in [64 * i + 30 + i, *range(64 * (i + 8) + 8, 64 * (i + 8) + 13)]
        ]
    )
    layer(q, k, v, pool, slots, plan)
    assert [c.launches for c in counted.values()] == [1, 1]


@pytest.mark.parametrize("requests", [2, 7])
def test_a_decode_layer_launches_each_fused_kernel_once(monkeypatch, requests: int) -> None:
    """A Qwen3 decoder layer (q/k norms) over a batch of decode steps on the Triton path: the
    residual add and norm launch twice (before attention, before the MLP), the q/k norm,
    rotary and KV write once, attention once; for 2 requests as for 7."""
    from pipeserve.backends.triton_backend import TritonBackend
    from pipeserve.kernels import triton_attention, triton_norm, triton_rope
    from pipeserve.layers.attention import plan_attention
    from pipeserve.mem_cache.kv_pool import KVPool
    from pipeserve.models.arch import ArchConfig
    from pipeserve.models.presets import PRESETS
    from pipeserve.models.qwen3 import Qwen3ForCausalLM
    from pipeserve.runner.forward_batch import ForwardBatch

    kernels = [
        (triton_norm, "_rms_norm_kernel"),
        (triton_rope, "_norm_rope_store_kernel"),
        (triton_attention, "_decode_kernel"),
        (triton_attention, "_extend_kernel"),
    ]
    counted = [Counted(getattr(module, name)) for module, name in kernels]
    for (module, name), c in zip(kernels, counted, strict=True):
        monkeypatch.setattr(module, name, c)
    arch = ArchConfig.from_dict(
        {k: v for k, v in PRESETS["tiny-qwen3"].items() if k != "_init_std"}
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(arch, F32)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    cpu, batched = torch.device("cpu"), TritonBackend()
    pool = KVPool(SLOTS, range(arch.num_layers), arch.num_kv_heads, arch.head_dim, F32, cpu, 16)
    for buf in pool.k + pool.v:  # the steps' cached keys and values
        buf.normal_()
    steps = [(i, 1, 30 + i, [(64 * i, 31 + i)]) for i in range(requests)]  # row, 1, prefix, runs
    positions = torch.tensor([30 + i for i in range(requests)])
    slots = torch.tensor([64 * i + 30 + i for i in range(requests)])
    none = torch.zeros(0, dtype=torch.long)
    fb = ForwardBatch(
        input_ids=none.new_zeros(requests),
        positions=positions,
        out_slots=slots,
        attn=plan_attention(steps, cpu, F32, batched),
        kv_pool=pool,
        sample_rows=none,
        logprob_rows=none,
        logprob_targets=none,
        future_slots=none,
    )
    hidden, residual = torch.randn(2, requests, arch.hidden_size)
    model.model.layers[1](hidden, residual, model.rotary.cos_sin(positions, F32), fb)
    assert [c.launches for c in counted] == [2, 1, 1, 0]


def test_the_gpu_check_runs_on_small_shapes() -> None:
    """test_triton_attention.py's -m cuda check, on the CPU at small sizes (its own code,
    not only the kernels, is then known to run before a GPU sees it)."""
    from test_triton_attention import check_kernels

    shape = (2, 2, 16)
    check_kernels(torch.device("cpu"), torch.float32, [1, 70, 200], [(0, 20), (90, 3)], 1024, shape)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-deepseek-v3"])  # qwen2: no q/k norms
def test_decode_steps_over_the_graph_buffers_serve_the_same_tokens(
    model_dir, monkeypatch, preset: str
) -> None:
    """The CUDA-graph path with no CUDA: decode steps padded to their bucket and run over
    DecodeGraphs' persistent buffers (eagerly: nothing is captured on a CPU) give the plain
    Triton path's tokens and logprobs, the buffers reused across steps of different sizes;
    padded rows write PAD_SLOT alone. DeepSeek-V3: MLA's absorbed decode and its latent rows
    written at the write slots, with no per-request segments in the buffers' batch."""
    from pipeserve import Engine
    from pipeserve.mem_cache.kv_pool import PAD_SLOT
    from pipeserve.runner import cuda_graph, model_runner

    real_blocker = model_runner.graph_blocker

    def blocker(config, arch, device, backend):  # as if the CPU were a CUDA device
        return real_blocker(config, arch, torch.device("cuda"), backend)

    monkeypatch.setattr(model_runner, "graph_blocker", blocker)
    monkeypatch.setattr(cuda_graph.DecodeGraphs, "capture", lambda self: None)
    real_run = cuda_graph.DecodeGraphs.run
    steps: list[tuple[int, int]] = []  # (bucket, requests) of every step run over the buffers

    def run(self, fb):
        n = fb.sample_rows.shape[0]
        assert fb.out_slots[n:].tolist() == [PAD_SLOT] * (fb.num_tokens - n)
        assert PAD_SLOT not in fb.out_slots[:n].tolist()
        steps.append((fb.num_tokens, n))
        return real_run(self, fb)

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "run", run)
    model = str(model_dir(preset, num_hidden_layers=2))
    prompts = [[(7 * j) % 300 + 1 for j in range(n)] for n in (12, 5, 9)]
    # the requests end at different steps: 3, then 2, then 1 decoding
    params = [{"max_new_tokens": n, "temperature": 0} for n in (6, 2, 4)]
    outs = {}
    for max_bs in (0, 8):
        flags = {"dtype": "float32", "chunked_prefill_size": 16, "attention_backend": "triton"}
        with Engine(model, **flags, cuda_graph_max_bs=max_bs) as engine:
            assert (engine.backend.runner.graphs is not None) == (max_bs > 0)
            outs[max_bs] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
    assert {n for _, n in steps} == {1, 2, 3} and (4, 3) in steps and (2, 2) in steps
    same_outputs(outs[8], outs[0], atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_graph_step_on_a_device_is_one_copy_into_the_graph_s_buffers(
    model_dir, monkeypatch, overlap: bool
) -> None:
    """On a (fake) device, a decode step that replays a graph reaches it in one host-to-device
    copy, queued on the compute stream (the last step may still read the buffers), straight
    into the graph's input buffer: its ids, positions, write slots, rows and kv_indptr are
    read there, and its slot runs are expanded into the backend's persistent kv_indices.
    Nothing is copied from device to device into the graph's buffers, nothing is cast, and
    the tokens are those of the run without graphs; other steps keep their one copy on the
    copy stream. Under overlap a step's ids are placeholders until the compute stream
    resolves them, in the graph's buffer."""
    from fake_cuda import FakeApi
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeserve import Engine
    from pipeserve.runner import cuda_graph, model_runner
    from pipeserve.streams import DeviceStreams

    real_blocker = model_runner.graph_blocker

    def blocker(config, arch, device, backend):  # as if the CPU were a CUDA device
        return real_blocker(config, arch, torch.device("cuda"), backend)

    monkeypatch.setattr(model_runner, "graph_blocker", blocker)
    monkeypatch.setattr(cuda_graph.DecodeGraphs, "capture", lambda self: None)

    class Writes(TorchDispatchMode):
        """Copies and casts, by the storage they write into."""

        def __init__(self) -> None:
            super().__init__()
            self.into: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in ("copy_", "_to_copy", "index_put_", "index_copy_", "scatter_"):
                dst = args[0] if name != "_to_copy" else None
                self.into.append((name, dst.untyped_storage().data_ptr() if dst is not None else 0))
            return func(*args, **kwargs)

    loads: list[tuple[int, list[tuple[str, int]], list[tuple]]] = []  # (bucket, writes, log)
    real_load = cuda_graph.DecodeGraphs.load

    def load(self, fb, streams=None):
        api = streams.api if streams is not None else None
        start = len(api.log) if api is not None else 0
        with Writes() as writes:
            out = real_load(self, fb, streams)
        loads.append((fb.num_tokens, writes.into, api.log[start:] if api is not None else []))
        graph = {self.inputs.untyped_storage().data_ptr()}
        graph.add(self.attention.kv_indices.untyped_storage().data_ptr())
        assert out.input_ids.untyped_storage().data_ptr() in graph
        return out

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "load", load)
    model = str(model_dir("tiny-qwen2", num_hidden_layers=2))
    prompts = [[(7 * j) % 300 + 1 for j in range(n)] for n in (12, 5, 9)]
    params = [{"max_new_tokens": n, "temperature": 0} for n in (6, 2, 4)]
    flags = {"dtype": "float32", "chunked_prefill_size": 16, "attention_backend": "triton"}
    flags["enable_overlap_schedule" if overlap else "disable_overlap_schedule"] = True
    outs, api = {}, FakeApi()
    for max_bs in (0, 8):
        with Engine(model, **flags, cuda_graph_max_bs=max_bs) as engine:
            runner = engine.backend.runner
            runner.streams = DeviceStreams(torch.device("cpu"), api)
            outs[max_bs] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
            graphs = runner.graphs
    same_outputs(outs[8], outs[0], atol=1e-5)
    assert graphs is not None and {b for b, _, _ in loads} == {1, 2, 4}
    graph = {graphs.inputs.untyped_storage().data_ptr()}
    graph.add(graphs.attention.kv_indices.untyped_storage().data_ptr())
    for bucket, writes, log in loads:
        uploads = [e for e in log if e[0] == "upload"]
        assert len(uploads) == 1 and uploads[0][2].startswith("default"), (bucket, log)
        assert not any(e[0] == "stream_wait" for e in log)  # same stream: nothing to wait for
        into_graph = [name for name, dst in writes if dst in graph]
        assert into_graph == ["copy_"], (bucket, writes)  # the upload alone
        assert not any(name == "_to_copy" for name, _ in writes)
    # the other steps (prompt chunks) still go through the copy stream, one copy each
    copy_stream = [e for e in api.log if e[0] == "upload" and e[2] == "copy"]
    assert copy_stream and len(copy_stream) + len(loads) == len(
        [e for e in api.log if e[0] == "upload"]
    )
