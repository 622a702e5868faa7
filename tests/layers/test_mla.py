"""Multi-head latent attention against transformers' DeepseekV3Attention (random weights, copied
in by checkpoint name): a causal prompt through the expanded path, the same prompt in chunks over
the latent cache, absorbed decode steps, what the cache holds, and two emulated TP ranks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from host_sync import no_host_sync
from selection_oracle import masked_attention, selection_mask
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from pipeserve.backends.base import TORCH_KERNELS, DirectKernels
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.backends.torch_ops import chunked_attention_with_lse
from pipeserve.device import native_prefill_kernel
from pipeserve.distributed import parallel_state
from pipeserve.distributed.parallel_state import ParallelState
from pipeserve.layers import linear
from pipeserve.layers import mla as mla_mod
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.mla import (
    MLAttention,
    Mode,
    absorb_max_queries,
    latent_width,
)
from pipeserve.layers.rotary import RotaryEmbedding, apply_rotary
from pipeserve.models.arch import MLAConfig, RopeConfig

HIDDEN, HEADS, THETA, MAX_POSITIONS = 64, 4, 10000.0, 256
RANK, NOPE, ROPE, V = 32, 16, 8, 12  # kv_lora_rank, qk_nope/rope_head_dim, v_head_dim
PROMPT = 40
NUM_SLOTS = 128
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
CASES: dict[str, dict[str, Any]] = {
    "q-lora-interleaved-yarn": {"q_lora_rank": 24, "rope_interleave": True, "rope": YARN},
    "no-q-lora-half-split-yarn": {"q_lora_rank": None, "rope_interleave": False, "rope": YARN},
    "q-lora-half-split-bias": {
        "q_lora_rank": 24,
        "rope_interleave": False,
        "rope": None,
        "attention_bias": True,
    },
}


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hf_config(case: dict[str, Any]) -> DeepseekV3Config:
    rope = case["rope"] or {"rope_type": "default"}
    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=1,
        q_lora_rank=case["q_lora_rank"],
        kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_interleave=case["rope_interleave"],
        attention_bias=case.get("attention_bias", False),
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={**rope, "rope_theta": THETA},
    )
    config._attn_implementation = "eager"
    return config


class InMemory:
    """A checkpoint tensor as the weight loaders see one (`LazyTensor`'s interface)."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor, self.name, self.shape = tensor, name, list(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> InMemory:
        return InMemory(self.tensor.narrow(dim, start, length), self.name)

    def load(self) -> torch.Tensor:
        return self.tensor


class Setup:
    """transformers' attention with random weights, and the layer's config and rope."""

    def __init__(self, name: str) -> None:
        case = CASES[name]
        self.config = hf_config(case)
        torch.manual_seed(0)
        self.hf = hf_v3.DeepseekV3Attention(self.config, layer_idx=0).eval()
        with torch.no_grad():
            for n, p in self.hf.named_parameters():
                if "layernorm" in n or n.endswith("bias"):  # not their trivial init
                    p.copy_(1 + 0.2 * torch.randn_like(p))
        self.hf_rope = hf_v3.DeepseekV3RotaryEmbedding(self.config)
        self.mla = MLAConfig(case["q_lora_rank"] or 0, RANK, NOPE, ROPE, V, case["rope_interleave"])
        rope = RopeConfig.from_config({"rope_parameters": case["rope"]}, MAX_POSITIONS)
        self.scaling = rope.scaling
        self.bias = case.get("attention_bias", False)
        self.rotary = RotaryEmbedding(ROPE, THETA, self.scaling)

    def layer(self, dtype: torch.dtype = torch.float32) -> MLAttention:
        layer = MLAttention(HIDDEN, HEADS, self.mla, self.scaling, dtype, self.bias)
        params = dict(layer.named_parameters())
        hf_params = dict(self.hf.named_parameters())
        assert params.keys() == hf_params.keys()
        for name, tensor in hf_params.items():
            loader = getattr(params[name], "weight_loader", None)
            if loader is None:
                params[name].data.copy_(tensor)
            else:
                loader(params[name], InMemory(tensor.detach(), name))
        return layer

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' output for one causal prompt x [n, hidden] at positions 0..n-1."""
        n = x.shape[0]
        cos_sin = self.hf_rope(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            return self.hf(x[None], cos_sin, mask)[0][0]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.rotary.cos_sin(positions, dtype)


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest) -> Setup:
    return Setup(request.param)


def scattered_slots(n: int, seed: int) -> torch.Tensor:
    """A request's slots, out of order (as pages make them); slot 0 is never used."""
    return 1 + torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:n]


def run_chunks(
    layer: MLAttention,
    setup: Setup,
    x: torch.Tensor,
    slots: torch.Tensor,
    chunks: list[int],
    cache: torch.Tensor,
    mode: Mode = "auto",
    kernels: DirectKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """One request's prompt fed in chunks of the given sizes, each over the cached prefix."""
    outs, start = [], 0
    for n in chunks:
        seg = LatentSegment(0, n, slots[: start + n])
        rope = setup.rope(torch.arange(start, start + n), x.dtype)
        with torch.no_grad():
            outs.append(layer(x[start : start + n], rope, cache, [seg], mode, kernels=kernels))
        start += n
    return torch.cat(outs)


def new_cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(NUM_SLOTS, RANK + ROPE, dtype=dtype)


def test_expanded_prompt_matches_transformers(setup: Setup) -> None:
    x = rand(PROMPT, HIDDEN, seed=1)
    got = run_chunks(
        setup.layer(), setup, x, scattered_slots(PROMPT, 2), [PROMPT], new_cache(), "expanded"
    )
    torch.testing.assert_close(got, setup.reference(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["expanded", "absorbed", "auto"])
def test_chunks_over_cached_prefix_match_one_shot(setup: Setup, mode: Mode) -> None:
    layer, x, slots = setup.layer(), rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    one_shot = run_chunks(layer, setup, x, slots, [PROMPT], new_cache(), "expanded")
    chunked = run_chunks(layer, setup, x, slots, [13, 1, 15, 11], new_cache(), mode)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=0)


def test_absorbed_decode_matches_expanded_and_transformers(setup: Setup) -> None:
    """Two requests prefilled, then one batch with a decode step of each (absorbed)."""
    layer, cache = setup.layer(), new_cache()
    lens, xs = [PROMPT, 25], [rand(PROMPT, HIDDEN, seed=1), rand(25, HIDDEN, seed=3)]
    all_slots = scattered_slots(PROMPT + 25, 2)
    slots = [all_slots[:PROMPT], all_slots[PROMPT:]]
    expanded = [
        run_chunks(layer, setup, x, s, [n], cache, "expanded")
        for x, s, n in zip(xs, slots, lens, strict=True)
    ]
    # decode the last token again, as a step over the other n - 1 cached positions
    segments = [LatentSegment(i, 1, s) for i, s in enumerate(slots)]
    x_step = torch.stack([x[-1] for x in xs])
    rope = setup.rope(torch.tensor([n - 1 for n in lens]), torch.float32)
    with torch.no_grad():
        step = layer(x_step, rope, cache, segments)
    for i, x in enumerate(xs):
        torch.testing.assert_close(step[i], expanded[i][-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(step[i], setup.reference(x)[-1], atol=1e-5, rtol=0)


def test_decode_steps_attend_in_one_call_of_the_compiled_kernel(setup: Setup) -> None:
    """With the native kernels, a batch's decode steps (no indexer) attend to all their
    positions in one call of the sparse latent kernel (each step's slots, padded with -1 to
    the longest: scattered, one run, and a step of two positions; no slot shared), as each
    step does alone on the torch ops."""
    native = NativeBackend().kernels
    if native.sparse_latent is None:
        pytest.skip("no native sparse latent kernel on this CPU")
    calls: list[tuple[int, ...]] = []

    def counted(q, rows, slots, *args):  # noqa: ANN001, ANN202
        calls.append(tuple(slots.shape))
        return native.sparse_latent(q, rows, slots, *args)

    kernels = dataclasses.replace(native, sparse_latent=counted)
    layer, cache = setup.layer(), rand(NUM_SLOTS, RANK + ROPE, seed=21)
    steps = [
        LatentSegment(
            0, 1, 4 + torch.randperm(60, generator=torch.Generator().manual_seed(5))[:40]
        ),
        LatentSegment(1, 1, runs=((64, 17),)),
        LatentSegment(2, 1, torch.tensor([3, 90])),
    ]
    rope = setup.rope(torch.tensor([39, 16, 1]), torch.float32)
    x = rand(3, HIDDEN, seed=22)
    with torch.no_grad():
        got = layer(x, rope, cache.clone(), steps, kernels=kernels)
        assert calls == [(3, 40)]
        for i, seg in enumerate(steps):
            alone = LatentSegment(0, 1, seg.slots)
            want = layer(
                x[i : i + 1], (rope[0][i : i + 1], rope[1][i : i + 1]), cache.clone(), [alone]
            )
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)


def runs_of(slots: torch.Tensor) -> list[tuple[int, int]]:
    """A request's slots as their runs of consecutive slots."""
    runs: list[tuple[int, int]] = []
    for s in slots.tolist():
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def test_torch_backend_s_decode_steps_gather_a_group_of_lengths_at_once(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the torch backend a batch's decode steps (no indexer) attend through its page
    table of the steps: one gathered call per group of similar lengths (35, 17 and 2
    positions: scattered, one run, two runs); a group whose longest step is over the
    backend's `gather_max_bytes` (here 100 rows) is read in place a step at a time (300 positions
    in a long run and a short one, and the 40 grouped with it). Each step's output is what
    it computes alone."""
    from pipeserve.backends import torch_backend, torch_ops
    from pipeserve.backends.base import AttentionPlan

    gathered: list[tuple[int, ...]] = []
    real = torch_backend.gathered_latent_attention

    def counted(q, rows, slots, *args):  # noqa: ANN001, ANN202
        gathered.append(tuple(slots.shape))
        return real(q, rows, slots, *args)

    monkeypatch.setattr(torch_backend, "gathered_latent_attention", counted)
    layer, cache = setup.layer(), rand(1024, RANK + ROPE, seed=23)
    gen = torch.Generator().manual_seed(24)
    slots = [
        600 + torch.randperm(300, generator=gen)[:35],  # scattered
        torch.arange(40, 80),
        torch.arange(100, 117),
        torch.tensor([5, 999]),
        torch.cat([torch.arange(200, 490), torch.arange(10, 20)]),  # a long run, a short one
    ]
    steps = [LatentSegment(i, 1, s) for i, s in enumerate(slots)]
    plan_segments = [(i, 1, len(s) - 1, runs_of(s)) for i, s in enumerate(slots)]
    backend = torch_backend.TorchBackend("cpu")
    row_bytes = (RANK + ROPE) * cache.element_size()
    backend.gather_max_bytes = 100 * row_bytes
    plan = AttentionPlan(backend, backend.latent_plan(plan_segments, torch.device("cpu")))
    plan = plan.expanded()
    assert backend.split(plan.meta.decode, row_bytes).in_place == [4, 1]  # longest first
    positions = torch.tensor([len(s) - 1 for s in slots])
    rope, x = setup.rope(positions, torch.float32), rand(len(slots), HIDDEN, seed=25)
    # as on a GPU, where the gathers' masks are made without reading them on the host
    monkeypatch.setattr(torch_ops, "queues_on_streams", lambda device: True)
    with torch.no_grad(), no_host_sync():
        got = layer(x, rope, cache.clone(), steps, batched=plan)
    assert gathered == [(3, 35)]
    with torch.no_grad():
        for i, seg in enumerate(steps):
            alone = LatentSegment(0, 1, seg.slots)
            one_rope = (rope[0][i : i + 1], rope[1][i : i + 1])
            want = layer(x[i : i + 1], one_rope, cache.clone(), [alone])
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)


class RunsOnly(LatentSegment):
    """A segment whose slot tensor must not be made: the test fails if anything reads it."""

    @property
    def slots(self) -> torch.Tensor:
        raise AssertionError("a decode step made the slot tensor of its whole context")


def test_a_decode_step_over_runs_reads_them_in_place(setup: Setup) -> None:
    """A decode step whose segment gives only its runs (as the engine's CPU path does)
    attends without making the slot tensor of its context, and gives what the same step over
    the explicit slots gives."""
    layer, cache = setup.layer(), new_cache()
    x = rand(PROMPT, HIDDEN, seed=1)
    runs = ((70, 25), (3, 9), (110, 6))  # PROMPT positions in three runs
    slots = torch.tensor([start + i for start, n in runs for i in range(n)])
    run_chunks(layer, setup, x, slots, [PROMPT], cache, "expanded")
    rope = setup.rope(torch.tensor([PROMPT - 1]), torch.float32)
    with torch.no_grad():
        expected = layer(x[-1:], rope, cache.clone(), [LatentSegment(0, 1, slots)])
        got = layer(x[-1:], rope, cache, [RunsOnly(0, 1, runs=runs)], new_slots=slots[-1:])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_cache_holds_normed_latent_and_roped_key_per_token(setup: Setup) -> None:
    layer, cache = setup.layer(), new_cache()
    x, slots = rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    run_chunks(layer, setup, x, slots, [PROMPT], cache)
    assert latent_width(setup.mla) == RANK + ROPE == cache.shape[1]
    with torch.no_grad():
        c, k_rope = setup.hf.kv_a_proj_with_mqa(x).split([RANK, ROPE], -1)
        cos, sin = setup.rope(torch.arange(PROMPT), torch.float32)
        k_rope = apply_rotary(k_rope[:, None], cos, sin, setup.mla.rope_interleave)[:, 0]
        expected = torch.cat([setup.hf.kv_a_layernorm(c), k_rope], -1)
    torch.testing.assert_close(cache[slots], expected, atol=1e-6, rtol=0)
    unused = torch.ones(NUM_SLOTS, dtype=torch.bool)
    unused[slots] = False
    assert not cache[unused].any()  # nothing else was written


def test_bfloat16_paths_agree_with_float32(setup: Setup) -> None:
    x, slots = rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    reference = setup.reference(x)
    layer = setup.layer(torch.bfloat16)
    xb = x.bfloat16()
    for mode, chunks in (("expanded", [PROMPT]), ("absorbed", [30, 10]), ("auto", [PROMPT - 1, 1])):
        got = run_chunks(layer, setup, xb, slots, chunks, new_cache(torch.bfloat16), mode)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=0)  # max err ~1e-2


def test_two_tp_ranks_sum_to_one_rank(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each emulated rank holds half the heads; o_proj's all-reduce is the sum of their outputs.
    Prefill expanded, then an absorbed decode step, each rank over its own (equal) cache."""
    x, slots = rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    chunks = [PROMPT - 1, 1]
    full = run_chunks(setup.layer(), setup, x, slots, chunks, new_cache())
    monkeypatch.setattr(linear, "tp_all_reduce", lambda t: t)
    partials, caches = [], []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_state", ParallelState(tp_rank=rank, tp_size=2))
        layer = setup.layer()
        assert layer.num_heads == HEADS // 2
        assert layer.kv_b_proj.weight.shape == (HEADS // 2 * (NOPE + V), RANK)
        caches.append(new_cache())
        partials.append(run_chunks(layer, setup, x, slots, chunks, caches[-1]))
    bias = setup.hf.o_proj.bias if setup.bias else torch.zeros(HIDDEN)
    torch.testing.assert_close(partials[0] + partials[1] - bias.detach(), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)


def test_auto_mode_takes_the_cheaper_form() -> None:
    """Absorbed up to the multiply-add crossover, and only after a prefix (none to re-expand)."""
    bench = MLAConfig(384, 256, 64, 32, 64, True)  # bench-deepseek
    assert absorb_max_queries(bench) == 256 * 128 // (512 - 128) == 85
    assert absorb_max_queries(MLAConfig(1536, 512, 128, 64, 128, True)) == 170  # DeepSeek-V3
    layer = MLAttention(64, 4, bench, None, torch.float32)
    slots = torch.arange(1, 201)
    assert layer.absorbs("auto", LatentSegment(0, 1, slots))
    assert layer.absorbs("auto", LatentSegment(0, 85, slots))
    assert not layer.absorbs("auto", LatentSegment(0, 86, slots))
    assert not layer.absorbs("auto", LatentSegment(0, 200, slots))  # no prefix
    assert layer.absorbs("absorbed", LatentSegment(0, 200, slots))

    def compiled(*args: object) -> torch.Tensor:  # a compiled dense kernel (never called)
        raise AssertionError("absorbs only asks whether expanded chunks have one")

    assert layer.absorbs("auto", LatentSegment(0, 42, slots), compiled)  # 85 // 2
    assert not layer.absorbs("auto", LatentSegment(0, 43, slots), compiled)
    assert not layer.absorbs("expanded", LatentSegment(0, 1, slots))


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_native_prefill_kernel_matches_transformers(setup: Setup, dtype, atol) -> None:
    """Expanded chunks on pipeserve's compiled prefill kernel for the dtype (keys of
    qk_head_dim, values zero-padded to it) agree with transformers as the torch path does."""
    if native_prefill_kernel(dtype) is None:
        pytest.skip(f"no native prefill kernel for {dtype} on this CPU")
    x, slots = rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    calls: list[int] = []
    kernel = mla_mod._native_prefill
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_mod, "_native_prefill", lambda *a: calls.append(1) or kernel(*a))
        got = run_chunks(
            setup.layer(dtype),
            setup,
            x.to(dtype),
            slots,
            [30, 10],
            new_cache(dtype),
            "expanded",
            NativeBackend().kernels,
        )
    assert len(calls) == 2
    torch.testing.assert_close(got.float(), setup.reference(x), atol=atol, rtol=0)


@pytest.mark.parametrize("native", [False, True])
def test_expanded_keys_serve_blocks_as_causal_attention_does(setup: Setup, native: bool) -> None:
    """Context parallelism's ExpandedKeys: a request's positions up-projected once (for the
    compiled kernel padded and laid out once) serve each block of queries [first, end) as
    causal attention over the expansion of positions [0, end) does, bitwise."""
    if native and native_prefill_kernel(torch.float32) is None:
        pytest.skip("no native float32 prefill kernel on this CPU (it needs AVX2 and FMA)")
    dtype = torch.float32
    layer = setup.layer(dtype)
    kv = rand(96, RANK + ROPE, seed=8).to(dtype)
    q = rand(96, HEADS * (NOPE + ROPE), seed=9).to(dtype).view(96, HEADS, NOPE + ROPE)
    prefill = native_prefill_kernel(dtype) if native else None
    keys = mla_mod.ExpandedKeys(*layer.expand(kv), prefill)
    assert (keys.pools is not None) == native
    with torch.no_grad():
        for first, end in [(0, 24), (72, 96), (24, 25)]:
            k, v = layer.expand(kv[:end])
            want = mla_mod.causal_attention(q[first:end], k, v, first, layer.scale, prefill)
            got = keys.attend(q[first:end], first, end, layer.scale)
            assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("native", "budget_rows", "products_made"),
    [(False, None, [63]), (True, None, [63]), (False, 0, [7, 35, 21]), (True, 42, [42, 21])],
)
def test_a_batch_s_expanded_chunks_up_project_once_as_each_alone(
    setup: Setup, monkeypatch, native: bool, budget_rows: int | None, products_made: list[int]
) -> None:
    """Three requests' prompt chunks in one forward (no prefix over scattered slots; a prefix
    of 30 in one run of slots; a prefix of 12 over two runs; no slot shared): their cached
    rows gathered and up-projected by one product, each chunk's attention as when it runs
    alone (the torch ops, or the compiled prefill kernel). Under a smaller budget of
    up-projected rows, in groups of chunks that fit it, a longer chunk alone."""
    if budget_rows is not None:
        per_row = HEADS * (NOPE + ROPE + V) * 4
        monkeypatch.setattr(mla_mod, "EXPANDED_GROUP_BYTES", budget_rows * per_row)
    if native and native_prefill_kernel(torch.float32) is None:
        pytest.skip("no native float32 prefill kernel on this CPU (it needs AVX2 and FMA)")
    kernels = NativeBackend().kernels if native else TORCH_KERNELS
    layer, cache = setup.layer(), rand(NUM_SLOTS, RANK + ROPE, seed=12)
    run_c = ((90, 10), (60, 11))
    requests = [  # (segment at row 0, its positions)
        (LatentSegment(0, 7, 100 + torch.randperm(28)[:7]), torch.arange(7)),
        (LatentSegment(0, 5, runs=((10, 35),)), torch.arange(30, 35)),
        (LatentSegment(0, 9, torch.cat([torch.arange(s, s + n) for s, n in run_c]), run_c),
         torch.arange(12, 21)),
    ]  # fmt: skip
    x = rand(21, HIDDEN, seed=13)
    products: list[int] = []
    layer.kv_b_proj.register_forward_hook(lambda m, args, out: products.append(out.shape[0]))
    alone, row = [], 0
    with torch.no_grad():
        for seg, positions in requests:
            rows = x[row : row + seg.q_len]
            rope = setup.rope(positions, torch.float32)
            alone.append(layer(rows, rope, cache.clone(), [seg], "expanded", kernels=kernels))
            row += seg.q_len
        assert products == [7, 35, 21]  # each request's positions, one product each
        products.clear()
        batch, row = [], 0
        for seg, _ in requests:
            slots = seg.slots
            batch.append(LatentSegment(row, seg.q_len, slots, seg.runs))
            row += seg.q_len
        rope = setup.rope(torch.cat([p for _, p in requests]), torch.float32)
        got = layer(x, rope, cache.clone(), batch, "expanded", kernels=kernels)
    assert products == products_made
    torch.testing.assert_close(got, torch.cat(alone), atol=1e-5, rtol=1e-5)


def reference_varlen(calls: list[int], refuse: bool = False):  # noqa: ANN201
    """`_flash_attention_forward` as PyTorch documents it for packed sequences, written from
    the math: each sequence's queries over its keys, the causal mask aligned bottom-right
    (query i of nq sees keys up to i + nk - nq); float32 inside. `refuse`: raise as a kernel
    that does not take the inputs does."""

    def op(q, k, v, cum_q, cum_k, max_q, max_k, dropout, causal, debug, *, scale):  # noqa: ANN001, ANN202
        calls.append(len(cum_q) - 1)
        if refuse:
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        assert causal and dropout == 0.0 and not debug
        assert q.dtype == k.dtype == v.dtype and q.shape[-1] == k.shape[-1] == v.shape[-1]
        assert cum_q.dtype == cum_k.dtype == torch.int32
        out = torch.empty_like(q)
        for i in range(len(cum_q) - 1):
            qs = slice(int(cum_q[i]), int(cum_q[i + 1]))
            ks = slice(int(cum_k[i]), int(cum_k[i + 1]))
            nq, nk = qs.stop - qs.start, ks.stop - ks.start
            assert nq <= max_q and nk <= max_k
            s = torch.einsum("qhd,khd->hqk", q[qs].float(), k[ks].float()) * scale
            keep = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            p = s.masked_fill(~keep, float("-inf")).softmax(-1)
            out[qs] = torch.einsum("hqk,khd->qhd", p, v[ks].float()).to(q.dtype)
        return out, None, None, None, None

    return op


def test_torch_backend_s_varlen_kernel_takes_a_batch_s_expanded_chunks_at_once(
    setup: Setup, caplog
) -> None:
    """On a GPU the torch backend attends all of a batch's expanded prompt chunks in one call
    of PyTorch's packed varlen flash kernel (here a reference of its documented semantics on
    the CPU): the chunks' rows packed and put back, values padded to the keys' width, the
    cumulative lengths made once per batch; the same output as chunk by chunk. A kernel that
    refuses is logged, not asked again, and the chunks run one by one."""
    from pipeserve.backends.base import AttentionPlan
    from pipeserve.backends.torch_backend import TorchBackend

    dtype = torch.bfloat16
    layer, cache = setup.layer(dtype), rand(NUM_SLOTS, RANK + ROPE, seed=12).to(dtype)
    segments = [  # their rows not in the order of the segments
        LatentSegment(14, 7, 100 + torch.randperm(28)[:7]),
        LatentSegment(0, 5, runs=((10, 35),)),
        LatentSegment(5, 9, torch.arange(60, 81)),
    ]
    positions = torch.cat([torch.arange(30, 35), torch.arange(12, 21), torch.arange(7)])
    x, rope = rand(21, HIDDEN, seed=13).to(dtype), setup.rope(positions, dtype)
    with torch.no_grad():
        each = layer(x, rope, cache.clone(), segments, "expanded")
        for refuse in (False, True):
            calls: list[int] = []
            backend = TorchBackend("cpu", varlen=reference_varlen(calls, refuse))
            plan = AttentionPlan(backend, backend.latent_plan([], torch.device("cpu")))
            for _ in range(2):  # two layers of one batch
                got = layer(x, rope, cache.clone(), segments, "expanded", batched=plan)
                torch.testing.assert_close(got.float(), each.float(), atol=3e-2, rtol=3e-2)
            assert calls == ([3, 3] if not refuse else [3])  # refused: not asked again
            assert len(plan.meta.tables) == 1  # made by the first layer, read by the next
    assert "refused MLA's prompt chunks" in caplog.text


def test_decode_over_runs_reads_views_and_matches_one_gather(setup: Setup) -> None:
    """A decode step whose positions lie in runs of slots attends to long runs in place (as
    views) and to the gathered short rest, merged by log-sum-exp: the same as one gather."""
    layer, cache = setup.layer(), rand(1024, RANK + ROPE, seed=5)
    runs = ((1, 300), (700, 7), (400, 260))  # long, short, long
    slots = torch.cat([torch.arange(s, s + n) for s, n in runs])
    in_runs = LatentSegment(0, 1, slots, runs=runs)
    parts = in_runs.parts(cache)
    assert [p.shape[0] for p in parts] == [300, 260, 7]
    assert parts[0].data_ptr() == cache[1].data_ptr()  # a view, not a copy
    q = layer.query(rand(1, HIDDEN, seed=6), setup.rope(torch.tensor([566]), torch.float32))
    with torch.no_grad():
        got = layer.absorbed(q, in_runs, cache)
        expected = layer.absorbed(q, LatentSegment(0, 1, slots), cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("q_len", [1, 5])
def test_sparse_absorbed_reads_only_chosen_rows_like_masked_expanded(
    setup: Setup, q_len: int, native: bool
) -> None:
    """With an indexer's choice (some queries padded with -1, in no order), absorbed attention
    over the chosen cache rows (the compiled kernel reading them in place, or torch's over the
    rows gathered) equals plain attention over all the expanded keys under the selection
    mask, and reads the chosen rows only."""
    layer, cache = setup.layer(), rand(NUM_SLOTS, RANK + ROPE, seed=5)
    length = 90
    slots = scattered_slots(length, 7)
    seg = LatentSegment(0, q_len, slots)
    gen = torch.Generator().manual_seed(8)
    chosen = torch.stack(
        [torch.randperm(length - q_len + i + 1, generator=gen)[:12] for i in range(q_len)]
    )
    chosen[0, 9:] = -1  # fewer than topk for the first query
    positions = torch.arange(length - q_len, length)
    q = layer.query(rand(q_len, HIDDEN, seed=6), setup.rope(positions, torch.float32))
    read = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        kernels = NativeBackend().kernels if native else TORCH_KERNELS
        got = layer.absorbed(q, seg, cache, chosen, kernels, read)
        k, v = layer.expand(cache[slots])
        expected = masked_attention(q, k, v, selection_mask(chosen, length), layer.scale)
    assert read.item() == int((chosen >= 0).sum())  # the chosen rows only
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [False, True])
def test_several_requests_attend_in_latent_space_in_one_call(setup: Setup, native: bool) -> None:
    """A batch's latent requests (three decode steps of 60, 30 and 15 positions, and a chunk
    of 3 queries) in one call: each row what the request computes alone (`absorbed` over its
    chosen rows), and the pairs read are the chosen ones."""
    if native and NativeBackend().kernels.sparse_latent is None:
        pytest.skip("the native CPU kernels do not build")
    layer, cache = setup.layer(), rand(NUM_SLOTS, RANK + ROPE, seed=15)
    kernels = NativeBackend().kernels if native else TORCH_KERNELS
    slots = scattered_slots(60 + 30 + 20 + 15, 16)
    gen = torch.Generator().manual_seed(17)
    parts, first, start = [], 0, 0
    for q_len, length in ((1, 60), (1, 30), (3, 20), (1, 15)):
        seg = LatentSegment(start, q_len, slots[first : first + length])
        chosen = torch.stack(
            [torch.randperm(length - q_len + i + 1, generator=gen)[:12] for i in range(q_len)]
        )
        parts.append((seg, chosen))
        first, start = first + length, start + q_len
    parts[1][1][0, 7:] = -1  # fewer than topk
    parts = [parts[3], parts[0], parts[2], parts[1]]  # not in row order
    q = layer.query(
        rand(start, HIDDEN, seed=18), setup.rope(torch.arange(start) + 60, torch.float32)
    )
    read = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        rows, got = layer.sparse_latent_rows(q, parts, cache, kernels, read)
        for seg, chosen in parts:
            at = (rows >= seg.q_start) & (rows < seg.q_start + seg.q_len)
            assert rows[at].tolist() == list(range(seg.q_start, seg.q_start + seg.q_len))
            alone = layer.absorbed(q[seg.rows], seg, cache, chosen, kernels)
            torch.testing.assert_close(got[at], alone, atol=1e-5, rtol=0)
    assert read.item() == sum(int((chosen >= 0).sum()) for _, chosen in parts)


@pytest.mark.parametrize("mode", ["expanded", "absorbed", "auto"])
def test_chunks_on_accelerator_kernels_match_cpu_kernels(
    setup: Setup, mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels off the CPU (PyTorch's chunked fallback, small blocks, forced on CPU
    tensors) give what the CPU kernel gives; an absorbed chunk's causal mask covers only its
    own keys (heads x chunk x chunk), never the prefix."""
    layer, x, slots = setup.layer(), rand(PROMPT, HIDDEN, seed=1), scattered_slots(PROMPT, 2)
    chunks = [13, 1, 15, 11]
    want = run_chunks(layer, setup, x, slots, chunks, new_cache(), mode)
    mask_widths: list[int] = []

    def accelerator(q, k, v, causal, scale, mask=None):  # type: ignore[no-untyped-def]
        if mask is not None:
            mask_widths.append(mask.shape[-1])
        return chunked_attention_with_lse(q, k, v, causal, scale, mask, block_q=7, block_k=5)

    monkeypatch.setattr(mla_mod, "attention_with_lse", accelerator)
    got = run_chunks(layer, setup, x, slots, chunks, new_cache(), mode)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if mode == "absorbed":
        assert sorted(mask_widths) == [11, 13, 15]
