"""The native CPU prefill-attention kernels — AVX512-BF16 (bfloat16 products) and AVX2
(float32 arithmetic on float32 or bfloat16 storage) — against a float64 softmax attention,
and through `PagedAttention` against the torch kernels. Each kernel runs on every machine
that has its instructions (an AVX512 machine runs both).

In bfloat16 a kernel's error is bounded relative to PyTorch's fused attention kernel on the
same inputs (what transformers' bfloat16 runs): its mean error against float64 at most 1.1x
that kernel's, its max at most 1.25x. A fixed tolerance (2e-2 before issue 48) is 20x the
output's own rounding here and cannot see a kernel that rounds more than it should."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_threads import torch_threads

from pipeserve.backends.native_backend import NativeBackend, RunChunk
from pipeserve.backends.split import PrefillDecodeSplit
from pipeserve.backends.torch_backend import TorchBackend, blockwise_prefill
from pipeserve.device import native_prefill_kernel
from pipeserve.kernels import native as native_module
from pipeserve.layers.attention import PagedAttention, plan_attention
from pipeserve.mem_cache.kv_pool import KVPool

CPU = torch.device("cpu")
TOL = 2e-2  # bfloat16 output, where two bfloat16 paths are compared with each other
MEAN_BOUND, MAX_BOUND = 1.1, 1.25  # bfloat16 error relative to PyTorch's fused kernel's
# (kernel, storage dtype)
KERNELS = {
    "avx512-bf16": ("paged_prefill_attention", torch.bfloat16),
    "avx2-fp32": ("paged_prefill_attention_avx2", torch.float32),
    "avx2-bf16": ("paged_prefill_attention_avx2", torch.bfloat16),
}
SUPPORTED = {
    "paged_prefill_attention": "prefill_attention_supported",
    "paged_prefill_attention_avx2": "prefill_attention_avx2_supported",
}


def kernel_params() -> list:
    module = native_module()
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                module is None or not getattr(module, SUPPORTED[KERNELS[name][0]])(),
                reason=f"this CPU or build has no {name} prefill kernel",
            ),
        )
        for name in KERNELS
    ]


@pytest.fixture(params=kernel_params())
def kernel(request):
    """(the kernel, its storage dtype)."""
    name, dtype = KERNELS[request.param]
    return getattr(native_module(), name), dtype


needs_engine_kernel = pytest.mark.skipif(
    native_prefill_kernel(torch.bfloat16) is None, reason="no native prefill kernel here"
)


def reference(q, k_cache, v_cache, runs, prefix):
    """q [n, H, D]; positions 0 .. prefix + n - 1 at the runs' slots; query t sits at
    position prefix + t. -> [n, H, D] float64."""
    slots = torch.cat([torch.arange(s, s + n) for s, n in runs])
    k, v = k_cache[:, slots].double(), v_cache[:, slots].double()  # [Hk, T, D]
    n, heads, d = q.shape
    group = heads // k.shape[0]
    qh = q.double().view(n, k.shape[0], group, d).permute(1, 2, 0, 3)  # [Hk, G, n, D]
    scores = torch.einsum("hgnd,htd->hgnt", qh, k) * d**-0.5
    future = torch.arange(k.shape[1])[None, :] > prefix + torch.arange(n)[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hgnt,htd->hgnd", probs, v).permute(2, 0, 1, 3).reshape(n, heads, d)


def fused_torch(q, k_cache, v_cache, runs, prefix):
    """The same attention by PyTorch's fused CPU kernel in q's dtype (flash-style: float32
    scores and sums, bfloat16 probabilities times bfloat16 values) -> [n, H, D]."""
    slots = torch.cat([torch.arange(s, s + n) for s, n in runs])
    k, v = k_cache[:, slots], v_cache[:, slots]
    n, heads, d = q.shape
    group = heads // k.shape[0]
    visible = torch.arange(k.shape[1])[None, :] <= prefix + torch.arange(n)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(group, 0)[None],
        v.repeat_interleave(group, 0)[None],
        attn_mask=visible,
        scale=d**-0.5,
    )
    return o[0].transpose(0, 1)


def assert_as_accurate_as_torch(out, torch_out, exact) -> None:
    """bfloat16 `out` no further from float64 `exact` than PyTorch's fused kernel's
    `torch_out`: within MEAN_BOUND of its mean error, MAX_BOUND of its max."""
    ours, theirs = (out.double() - exact).abs(), (torch_out.double() - exact).abs()
    figures = {"mean": (ours.mean().item(), theirs.mean().item())}
    figures["max"] = (ours.max().item(), theirs.max().item())
    assert figures["mean"][0] <= MEAN_BOUND * figures["mean"][1], figures
    assert figures["max"][0] <= MAX_BOUND * figures["max"][1], figures


def scattered_runs(total: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """Runs of random lengths with gaps between them, covering `total` positions."""
    runs, slot, left = [], 3, total
    while left:
        n = min(left, int(torch.randint(1, 300, (), generator=gen)))
        runs.append((slot, n))
        slot += n + int(torch.randint(0, 40, (), generator=gen))
        left -= n
    return runs


CASES = {
    # n, prefix, kv heads, group, head dim, scattered runs
    "one-token-no-prefix": (1, 0, 1, 1, 16, False),
    "short-chunk-after-prefix": (5, 3, 2, 3, 64, True),
    "first-chunk": (64, 0, 4, 3, 64, False),
    "long-prefix-d128": (300, 1000, 2, 4, 128, True),
    "many-blocks": (700, 1500, 2, 3, 64, True),
    "odd-group-d80": (77, 513, 3, 5, 80, True),
    "mha-d48": (33, 257, 2, 1, 48, True),
    "decode-like-pair": (2, 700, 1, 8, 32, False),
    "long-context": (40, 16000, 1, 2, 64, True),
    "gqa-8-many-strips": (130, 260, 1, 8, 64, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_float64_attention(kernel, case) -> None:
    fn, dtype = kernel
    n, prefix, kv_heads, group, d, scattered = case
    gen = torch.Generator().manual_seed(n * 1000 + prefix)
    pool_slots = 2 * (prefix + n) + 4000
    k_cache = torch.randn(kv_heads, pool_slots, d, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, pool_slots, d, generator=gen).to(dtype)
    runs = scattered_runs(prefix + n, gen) if scattered else [(11, prefix + n)]
    q = (2 * torch.randn(n, kv_heads * group, d, generator=gen)).to(dtype)
    out = fn(q, k_cache, v_cache, torch.tensor(runs), prefix, d**-0.5)
    ref = reference(q, k_cache, v_cache, runs, prefix)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4)
        assert (out.double() - ref).abs().mean() < 1e-6  # rounding, not a wrong key
    else:
        assert_as_accurate_as_torch(out, fused_torch(q, k_cache, v_cache, runs, prefix), ref)


def test_a_row_does_not_depend_on_the_chunking(kernel) -> None:
    """Batch invariance (deterministic inference): a chunk computed whole or as two chunks,
    the second over the first as its prefix, gives bitwise the same rows."""
    fn, dtype = kernel
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(2, 2000, 64, generator=gen).to(dtype)
    v_cache = torch.randn(2, 2000, 64, generator=gen).to(dtype)
    q = torch.randn(301, 6, 64, generator=gen).to(dtype)
    runs = [(0, 500), (700, 300), (1200, 301)]  # prefix 800, chunk 301
    whole = fn(q, k_cache, v_cache, torch.tensor(runs), 800, 0.125)
    first = fn(
        q[:77], k_cache, v_cache, torch.tensor([(0, 500), (700, 300), (1200, 77)]), 800, 0.125
    )
    second = fn(q[77:], k_cache, v_cache, torch.tensor(runs), 877, 0.125)
    assert torch.equal(torch.cat([first, second]), whole)


def test_kernel_is_the_same_with_one_or_two_threads(kernel) -> None:
    fn, dtype = kernel
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(2, 3000, 64, generator=gen).to(dtype)
    v_cache = torch.randn(2, 3000, 64, generator=gen).to(dtype)
    q = torch.randn(400, 6, 64, generator=gen).to(dtype)
    runs = torch.tensor([(0, 900), (1000, 500)])
    outs = []
    for threads in (1, 2):
        with torch_threads(threads):
            outs.append(fn(q, k_cache, v_cache, runs, 1000, 0.125))
    assert torch.equal(outs[0], outs[1])  # each task's arithmetic does not depend on threads


def test_kernel_rejects_runs_that_do_not_cover_the_chunk(kernel) -> None:
    fn, dtype = kernel
    k_cache = torch.zeros(1, 100, 16).to(dtype)
    q = torch.zeros(4, 2, 16).to(dtype)
    with pytest.raises(RuntimeError, match="cover exactly"):
        fn(q, k_cache, k_cache, torch.tensor([(0, 10)]), 3, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fn(q, k_cache, k_cache, torch.tensor([(98, 7)]), 3, 0.25)
    with pytest.raises(RuntimeError, match="one dtype|takes"):
        fn(q.half(), k_cache.half(), k_cache.half(), torch.tensor([(0, 7)]), 3, 0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_native_and_torch_prefill_agree(dtype) -> None:
    """A batch of two prompt chunks (one with a scattered prefix) and a decode step, through
    `PagedAttention` with the native prefill kernel the engine picks for the dtype and with
    the torch kernels."""
    if native_prefill_kernel(dtype) is None:
        pytest.skip(f"no native prefill kernel for {dtype} here")
    tol = TOL if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator().manual_seed(3)
    kv_heads, group, d = 2, 3, 64
    pool = KVPool(6000, range(1), kv_heads, d, dtype, CPU, 1)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    chunk_a = [(10, 700), (900, 300), (1300, 150)]  # prefix 1000, chunk 150
    chunk_b = [(2000, 96)]  # no prefix
    step = [(3000, 40)]  # decode: prefix 39
    segments = [(0, 150, 1000, chunk_a), (150, 96, 0, chunk_b), (246, 1, 39, step)]
    tokens = 247
    q = torch.randn(tokens, kv_heads * group, d, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
    slots = torch.cat([torch.arange(1300, 1450), torch.arange(2000, 2096), torch.tensor([3039])])
    attn = PagedAttention(0, kv_heads * group, kv_heads, d)
    outs = {}
    for native in (False, True):
        backend = PrefillDecodeSplit(
            NativeBackend() if native else TorchBackend("cpu"), TorchBackend("cpu")
        )
        plan = plan_attention(segments, CPU, dtype, backend)
        assert all(isinstance(c, RunChunk) == native for c in plan.meta.prefill.chunks)
        outs[native] = attn(q, k, v, pool, slots, plan).float()
    assert torch.allclose(outs[True], outs[False], atol=tol, rtol=tol)
    k_cache, v_cache = pool.buffers(0)
    ref_a = reference(q[:150], k_cache, v_cache, chunk_a, 1000).float().reshape(150, -1)
    assert torch.allclose(outs[True][:150], ref_a, atol=tol, rtol=tol)


def bf16_prefill_paths() -> list:
    """Every bfloat16 prefill path this machine runs: the native kernels it has, and the torch
    backend's blockwise path (long prompt chunks on CPUs without a native kernel)."""
    module = native_module()

    def native(name: str):
        fn = getattr(module, KERNELS[name][0])
        return lambda q, k, v: fn(q, k, v, torch.tensor([(0, q.shape[0])]), 0, q.shape[2] ** -0.5)

    def blockwise(q, k, v):
        return blockwise_prefill(q, k.transpose(0, 1), v.transpose(0, 1), [], q.shape[2] ** -0.5)

    paths = [pytest.param(blockwise, id="torch-blockwise")]
    for name in ("avx512-bf16", "avx2-bf16"):
        have = module is not None and getattr(module, SUPPORTED[KERNELS[name][0]])()
        paths.append(
            pytest.param(
                native(name) if have else None,
                id=name,
                marks=pytest.mark.skipif(not have, reason=f"this CPU or build has no {name}"),
            )
        )
    return paths


@pytest.fixture(scope="module")
def built_in_model_attention() -> list[tuple[torch.Tensor, ...]]:
    """Per layer of the built-in model over the first 256 tokens of README.md (transformers,
    float32 forward: fast on every CPU; q, k, v then rounded to bfloat16): q [n, H, D], k and
    v [Hk, n, D], PyTorch's fused kernel's output on them and the float64 attention. Real
    activations, with the sharp copy heads and large scores that random inputs lack."""
    from tokenizers import Tokenizer
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pipeserve.models.resolve import resolve_model_path

    path = resolve_model_path(None, "float32")
    text = (Path(__file__).parents[2] / "README.md").read_text()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids[:256]
    assert len(ids) == 256
    layers = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q = query[0].transpose(0, 1).bfloat16().contiguous()
        k, v = key[0].bfloat16().contiguous(), value[0].bfloat16().contiguous()
        runs = [(0, q.shape[0])]
        layers.append((q, k, v, fused_torch(q, k, v, runs, 0), reference(q, k, v, runs, 0)))
        # the model's own float32 attention, so that every layer sees real inputs
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)

    AttentionInterface.register("pipeserve_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pipeserve_capture")
    with torch.inference_mode():
        model.eval()(torch.tensor([ids]))
    return layers


@pytest.mark.parametrize("path", bf16_prefill_paths())
def test_bf16_prefill_on_the_built_in_models_activations(path, built_in_model_attention):
    """Each bfloat16 prefill path on real activations, layer by layer, as accurate as
    PyTorch's fused kernel. Issue 48 blamed the AVX512-BF16 kernel for a whole-model max
    error 1.65x transformers' bfloat16; on these activations its error equals the fused
    kernel's in every layer. The torch backend's blockwise path scored in bfloat16 then and
    measured 2-3x the fused kernel's mean error; it computes in float32 now."""
    for q, k, v, torch_out, exact in built_in_model_attention:
        assert_as_accurate_as_torch(path(q, k, v), torch_out, exact)


@needs_engine_kernel
def test_engine_in_bfloat16_is_as_close_to_float32_as_the_torch_kernels(model_dir) -> None:
    """The default dtype end to end: prompt logprobs of chunked prompts (later chunks read a
    long cached prefix) with the native prefill kernel are as close to a float32 run as
    those of the torch kernels in bfloat16 (a wrong key or a lost block would be far off)."""
    from pipeserve.engine.engine import Engine

    path = model_dir("tiny-qwen3")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (300, 150, 37)]
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    logprobs = {}
    for backend, dtype in (("torch", "float32"), ("torch", "bfloat16"), ("auto", "bfloat16")):
        flags = {"dtype": dtype, "chunked_prefill_size": 64, "max_total_tokens": 4096}
        with Engine(str(path), attention_backend=backend, **flags) as engine:
            runner = engine.backend.runner
            native = runner.backend.kernels.prefill(runner.dtype) is not None
            assert native == (backend == "auto" and dtype == "bfloat16")
            out = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        logprobs[backend, dtype] = torch.tensor([lp for o in out for lp in o["prompt_logprobs"]])
    exact = logprobs["torch", "float32"]
    assert exact.shape == (300 + 150 + 37 - 3,)
    native_err = (logprobs["auto", "bfloat16"] - exact).abs()
    torch_err = (logprobs["torch", "bfloat16"] - exact).abs()
    assert native_err.mean() <= 1.25 * torch_err.mean()
    assert native_err.max() <= 2 * torch_err.max()


@pytest.mark.skipif(
    native_prefill_kernel(torch.float32) is None, reason="no float32 prefill kernel here"
)
def test_engine_in_float32_matches_the_torch_kernels(model_dir) -> None:
    """The float32 rule's path end to end (what `--dtype best` runs on CPUs without native
    bf16): chunked prompts over cached prefixes give the prompt logprobs of the torch
    kernels to float32 rounding."""
    from pipeserve.engine.engine import Engine

    path = model_dir("tiny-qwen3")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (300, 150, 37)]
    sp = {"max_new_tokens": 4, "temperature": 0.0}
    runs = {}
    for backend in ("torch", "auto"):
        flags = {"dtype": "float32", "chunked_prefill_size": 64, "max_total_tokens": 4096}
        with Engine(str(path), attention_backend=backend, **flags) as engine:
            runner = engine.backend.runner
            assert (runner.backend.kernels.prefill(runner.dtype) is not None) == (backend == "auto")
            runs[backend] = engine.generate(
                input_ids=prompts, sampling_params=sp, return_logprob=True
            )
    for native, torch_run in zip(runs["auto"], runs["torch"], strict=True):
        got, want = (torch.tensor(o["prompt_logprobs"]) for o in (native, torch_run))
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
        assert native["output_ids"] == torch_run["output_ids"]
