"""V3.2's lightning indexer against transformers' DeepseekV32Indexer (random weights, copied in by
checkpoint name): index scores of a causal prompt, the selected sets where the top-k boundary is
not a near tie, chunks over the key cache, queries seeing fewer tokens than index_topk, and the
tie-break (earlier position wins) on constructed ties."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
from selection_oracle import selection_mask
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

from pipeserve.backends.base import StepTable, length_groups
from pipeserve.backends.native_backend import NativeBackend
from pipeserve.device import native_index_scores, native_index_topk
from pipeserve.layers import indexer as indexer_mod
from pipeserve.layers.indexer import Indexer, top_positions
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.rotary import RotaryEmbedding, apply_rotary_part
from pipeserve.models.arch import IndexerConfig, RopeConfig

HIDDEN, Q_RANK, ROPE, THETA, MAX_POSITIONS = 64, 24, 8, 10000.0, 256
INDEX_HEADS, INDEX_DIM, TOPK = 4, 32, 16
PROMPT, NUM_SLOTS = 40, 128
GAP = 1e-4  # the selections are compared only where the top-k boundary is wider than this
YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # cos/sin carry an attention factor != 1
}


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Setup:
    """transformers' indexer with random weights, and our layer's config and rope."""

    def __init__(self, topk: int = TOPK) -> None:
        self.config = DeepseekV32Config(
            hidden_size=HIDDEN,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=1,
            q_lora_rank=Q_RANK,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=ROPE,
            v_head_dim=12,
            index_n_heads=INDEX_HEADS,
            index_head_dim=INDEX_DIM,
            index_topk=topk,
            max_position_embeddings=MAX_POSITIONS,
            rope_parameters={**YARN, "rope_theta": THETA},
        )
        torch.manual_seed(0)
        self.hf = hf_v32.DeepseekV32Indexer(self.config, layer_idx=0).eval()
        with torch.no_grad():
            self.hf.k_norm.weight.copy_(1 + 0.2 * torch.randn(INDEX_DIM))  # not the trivial init
            self.hf.k_norm.bias.copy_(0.2 * torch.randn(INDEX_DIM))
        self.hf_rope = hf_v32.DeepseekV32RotaryEmbedding(self.config)
        scaling = RopeConfig.from_config({"rope_parameters": YARN}, MAX_POSITIONS).scaling
        self.rotary = RotaryEmbedding(ROPE, THETA, scaling)
        self.index = IndexerConfig(INDEX_HEADS, INDEX_DIM, topk)

    def layer(self) -> Indexer:
        layer = Indexer(HIDDEN, Q_RANK, self.index, torch.float32)
        params, hf_params = dict(layer.named_parameters()), dict(self.hf.named_parameters())
        assert params.keys() == hf_params.keys()
        for name, tensor in hf_params.items():
            params[name].data.copy_(tensor.detach())
        return layer

    def reference(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """transformers' index scores [n, n] (-inf where masked) and top-k indices [n, topk] for
        one causal prompt at positions 0..n-1."""
        n = x.shape[0]
        cos_sin = self.hf_rope(x, torch.arange(n)[None])
        visible = torch.ones(n, n, dtype=torch.bool).tril()[None]
        with torch.no_grad(), recorded_topk_input() as seen:
            indices = self.hf(x[None], q_latent[None], cos_sin, visible, torch.arange(n)[None])
        return seen[0][0], indices[0].long()


@contextmanager
def recorded_topk_input() -> Iterator[list[torch.Tensor]]:
    """transformers returns only the indices; its scores are what it calls `.topk` on."""
    seen: list[torch.Tensor] = []
    original = torch.Tensor.topk

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(self.clone())
        return original(self, *args, **kwargs)

    torch.Tensor.topk = recording  # type: ignore[method-assign, assignment]
    try:
        yield seen
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def scattered_slots(n: int, seed: int) -> torch.Tensor:
    """A request's slots, out of order (as pages make them); slot 0 is never used."""
    return 1 + torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:n]


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return rand(PROMPT, HIDDEN, seed=1), rand(PROMPT, Q_RANK, seed=2)


def run_chunks(
    layer: Indexer, setup: Setup, x: torch.Tensor, q_latent: torch.Tensor, chunks: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One request fed in chunks over its cached prefix -> per chunk scores, the selected
    positions [n, topk], and the cache."""
    cache = torch.zeros(NUM_SLOTS, INDEX_DIM)
    slots = scattered_slots(x.shape[0], seed=3)
    scores, picked, start = [], [], 0
    for n in chunks:
        seg, rows = LatentSegment(0, n, slots[: start + n]), slice(start, start + n)
        rope = setup.rotary.cos_sin(torch.arange(start, start + n), x.dtype)
        with torch.no_grad():
            scores += layer.scores(x[rows], q_latent[rows], rope, cache.clone(), [seg])
            picked.append(layer(x[rows], q_latent[rows], rope, cache, [seg]))
        start += n
    return scores, torch.cat(picked), cache


def boundary_gaps(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[n]: k-th best minus (k+1)-th best score; inf where a row sees topk tokens or fewer."""
    values = scores.sort(dim=-1, descending=True).values
    gaps = values[:, topk - 1] - values[:, topk]
    return torch.where(values[:, topk] == float("-inf"), float("inf"), gaps)


def test_index_scores_match_transformers(setup: Setup) -> None:
    x, q_latent = inputs()
    expected, _ = setup.reference(x, q_latent)
    scores, _, _ = run_chunks(setup.layer(), setup, x, q_latent, [PROMPT])
    assert (expected.tril() != 0).any()
    torch.testing.assert_close(scores[0], expected, atol=1e-5, rtol=0)


def test_selected_sets_match_transformers_away_from_near_ties(setup: Setup) -> None:
    x, q_latent = inputs()
    expected_scores, hf_indices = setup.reference(x, q_latent)
    _, picked, _ = run_chunks(setup.layer(), setup, x, q_latent, [PROMPT])
    gaps = boundary_gaps(expected_scores, TOPK)
    decided = gaps > GAP
    assert decided[TOPK:].sum() >= (PROMPT - TOPK) // 2  # enough rows to be a real comparison
    visible = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    hf_mask = torch.zeros(PROMPT, PROMPT, dtype=torch.bool).scatter(1, hf_indices, True) & visible
    ours = selection_mask(picked, PROMPT)
    assert torch.equal(ours[decided], hf_mask[decided])
    assert (ours.sum(1) == torch.arange(1, PROMPT + 1).clamp(max=TOPK)).all()


def test_chunks_over_cached_prefix_match_one_shot(setup: Setup) -> None:
    layer, (x, q_latent) = setup.layer(), inputs()
    (one_shot,), picked, cache = run_chunks(layer, setup, x, q_latent, [PROMPT])
    chunk_scores, chunk_picked, chunk_cache = run_chunks(layer, setup, x, q_latent, [13, 1, 15, 11])
    start = 0
    for scores in chunk_scores:
        n, length = scores.shape
        torch.testing.assert_close(scores, one_shot[start : start + n, :length], atol=1e-5, rtol=0)
        start += n
    torch.testing.assert_close(chunk_cache, cache, atol=1e-6, rtol=0)
    decided = boundary_gaps(one_shot, TOPK) > GAP
    assert torch.equal(
        selection_mask(chunk_picked, PROMPT)[decided], selection_mask(picked, PROMPT)[decided]
    )


def test_cache_holds_normed_roped_keys_and_nothing_else(setup: Setup) -> None:
    x, q_latent = inputs()
    _, _, cache = run_chunks(setup.layer(), setup, x, q_latent, [PROMPT])
    cos, sin = setup.rotary.cos_sin(torch.arange(PROMPT), torch.float32)
    with torch.no_grad():
        k = setup.hf.k_norm(setup.hf.wk(x))[:, None]
        expected = apply_rotary_part(k, cos, sin, start=0, interleaved=False)[:, 0]
    slots = scattered_slots(PROMPT, seed=3)
    torch.testing.assert_close(cache[slots], expected, atol=1e-6, rtol=0)
    unused = torch.ones(NUM_SLOTS, dtype=torch.bool)
    unused[slots] = False
    assert not cache[unused].any()


def test_every_visible_token_selected_when_fewer_than_topk() -> None:
    setup = Setup(topk=64)  # > PROMPT: no query sees 64 tokens
    x, q_latent = inputs()
    _, picked, _ = run_chunks(setup.layer(), setup, x, q_latent, [PROMPT - 3, 3])
    assert picked.shape == (PROMPT, 64)
    for i in range(PROMPT):
        assert sorted(picked[i, : i + 1].tolist()) == list(range(i + 1))
        assert (picked[i, i + 1 :] == -1).all()
    visible = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    assert torch.equal(selection_mask(picked, PROMPT), visible)
    _, hf_indices = setup.reference(x, q_latent)  # transformers: every visible one, too
    hf_mask = torch.zeros(PROMPT, PROMPT, dtype=torch.bool).scatter(1, hf_indices, True)
    assert torch.equal(hf_mask & visible, visible)


def test_tie_break_earlier_position_wins() -> None:
    inf = float("inf")
    scores = torch.tensor(
        [
            [1.0, 0.0, 2.0, 0.0, -0.0, 1.0, -inf],
            [-0.0, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0],  # -0.0 ties with 0.0
            [0.0, -1.0, -inf, -inf, -inf, -inf, -inf],  # fewer visible than topk
        ]
    )
    # the sets: 2.0, both 1.0s, then the earliest of the 0.0s
    assert canonical(top_positions(scores, 4)).tolist() == [
        [0, 1, 2, 5],
        [0, 1, 2, 3],
        [0, 1, -1, -1],
    ]
    assert canonical(top_positions(scores[:, :2], 4)).tolist() == [[0, 1, -1, -1]] * 3


@pytest.mark.skipif(native_index_scores() is None, reason="the native CPU kernels do not build")
@pytest.mark.parametrize(
    ("n", "prefix", "heads", "dim"),
    [
        (1, 0, 1, 8),
        (5, 3, 4, 32),
        (37, 100, 16, 64),
        (130, 0, 3, 24),
        (64, 300, 2, 128),
        (26, 50, 2, 8),
        (27, 50, 2, 8),
        (9, 40, 3, 9),  # an odd width: bfloat16 widened even where it is multiplied natively
    ],
)
def test_the_native_kernel_gives_the_torch_path_s_scores(
    n: int, prefix: int, heads: int, dim: int
) -> None:
    """The compiled kernel (ReLU and head sum fused, future blocks skipped) against the
    blocked torch ops: the same finite scores within float32 rounding, -inf at exactly the
    future keys; queries not a multiple of its 6-query tiles or 24-query tasks (leftover
    tiles of 1 to 5 rows), keys not of its 16-key blocks. bfloat16 inputs: multiplied by
    vdpbf16ps where the CPU has AVX512-BF16 (4-query tiles, 32-key blocks; exact products
    summed in float32, as the torch path's widened ones), widened first elsewhere."""
    q, w, k = rand(n, heads, dim, seed=1), rand(n, heads, seed=2), rand(prefix + n, dim, seed=3)
    kernel = NativeBackend().kernels.index_scores
    got = indexer_mod.causal_index_scores(q, w, k, prefix, 0.2, kernel)
    want = indexer_mod.causal_index_scores(q, w, k, prefix, 0.2)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(want).sum() == n * (n - 1) // 2
    torch.testing.assert_close(got, want, atol=1e-5 * dim, rtol=1e-5)
    half = [t.to(torch.bfloat16) for t in (q, k)]
    got16 = indexer_mod.causal_index_scores(half[0], w, half[1], prefix, 0.2, kernel)
    want16 = indexer_mod.causal_index_scores(half[0], w, half[1], prefix, 0.2)
    torch.testing.assert_close(got16, want16, atol=1e-5 * dim, rtol=1e-5)


def canonical(picked: torch.Tensor) -> torch.Tensor:
    """Selections as sets: each row's positions in increasing order, -1s last."""
    big = torch.iinfo(picked.dtype).max
    ordered = torch.where(picked < 0, big, picked).sort(dim=-1).values
    return ordered.masked_fill(ordered == big, -1)


def reference_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The rule by its definition: a full stable sort by score (best first, -0.0 as 0.0),
    the first topk finite ones kept, in increasing position order, -1 last."""
    values, order = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True)
    rows = []
    for v, o in zip(values[:, :topk].tolist(), order[:, :topk].tolist(), strict=True):
        kept = sorted(p for p, x in zip(o, v, strict=True) if x != float("-inf"))
        rows.append(kept + [-1] * (topk - len(kept)))
    return torch.tensor(rows, dtype=torch.long).view(scores.shape[0], topk)


def test_the_selection_is_the_sort_s_on_ties_signed_zeros_and_short_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n, length, topk = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (12, 160, 70))
        scores = torch.relu(torch.randn(n, length, generator=gen)).round(decimals=1)
        scores[torch.rand(n, length, generator=gen) < 0.2] = -0.0  # ties with 0.0
        prefix = int(torch.randint(0, max(1, length - n + 1), (1,), generator=gen))
        future = torch.ones(n, length, dtype=torch.bool).triu(prefix + 1)
        scores = scores.masked_fill(future, float("-inf"))
        assert torch.equal(
            canonical(top_positions(scores, topk)), reference_positions(scores, topk)
        )


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
@pytest.mark.parametrize(
    ("n", "prefix", "heads", "dim", "topk"),
    [
        (1, 0, 1, 8, 4),
        (5, 3, 4, 32, 2),
        (37, 100, 16, 64, 50),
        (130, 0, 3, 24, 64),
        (64, 300, 2, 128, 300),
        (20, 300_000, 1, 8, 2048),  # scratch rows for fewer queries per task
    ],
)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_selection_is_the_rule_s_on_the_kernel_s_scores(
    n: int, prefix: int, heads: int, dim: int, topk: int, ties: bool, dtype: torch.dtype
) -> None:
    """The fused kernel (scores kept in its scratch rows, a histogram, nth_element over one
    bin, one pass in position order) picks what the rule picks on the same scores (the scores
    kernel's: the same arithmetic). ties: small integer queries and keys, some head weights
    zero or negative, so many scores are equal (0 above all) and the boundary falls among
    them."""
    q, w, k = rand(n, heads, dim, seed=4), rand(n, heads, seed=5), rand(prefix + n, dim, seed=6)
    if ties:
        q, k = (q * 2).round(), (k * 2).round()
        w = w.round()  # -1, 0 or 1 mostly: zero-weight heads and -0.0 sums
    q, k = q.to(dtype), k.to(dtype)  # bfloat16: the AVX512-BF16 form where the CPU has it
    native = NativeBackend().kernels
    picked = indexer_mod.causal_top_positions(q, w, k, prefix, 0.25, topk, native)
    scores = indexer_mod.causal_index_scores(q, w, k, prefix, 0.25, native.index_scores)
    assert torch.equal(canonical(picked), reference_positions(scores, topk))
    if ties and topk >= 50 and prefix + n > topk:  # the boundary fell among equal scores
        kth = scores.sort(dim=-1, descending=True).values[:, topk - 1 : topk + 1]
        assert ((kth[:, 0] == kth[:, 1]) & torch.isfinite(kth[:, 1])).any()


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float32, INDEX_DIM), (torch.bfloat16, INDEX_DIM), (torch.bfloat16, 17)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_s_segments_in_one_call_pick_what_each_does_alone(
    dtype: torch.dtype, dim: int, threads: int
) -> None:
    """The native backend's one call for all of a batch's segments (a prompt chunk after a
    cached prefix, decode steps of several lengths, a request shorter than topk, a padded row
    no segment holds), each over its own slots of the key cache in scattered runs: per
    segment the choice the kernel makes for it alone, and -1 in the padded row. Ties at the
    boundary: integer queries and keys. bfloat16 at an odd dim: the float32 form, each key
    widened as it is packed (a CPU without AVX512-BF16 takes it for every bfloat16 call)."""
    from torch_threads import torch_threads

    topk, heads = 48, 4
    gen = torch.Generator().manual_seed(31)
    cache = (torch.randn(4096, dim, generator=gen) * 2).round().to(dtype)
    order = torch.randperm(4096, generator=gen)
    # (q_start, q_len, length): the chunk's 20 queries after 180, steps of 300, 49 and 120
    # positions, a request of 30 (<= topk), row 25 padding
    shapes = [(0, 20, 200), (20, 1, 300), (21, 1, 49), (22, 1, 120), (23, 2, 30)]
    segments, used = [], 0
    for q_start, q_len, length in shapes:
        slots = order[used : used + length]
        used += length
        segments.append(LatentSegment(q_start, q_len, slots))
    # the step of 300 as a batch builds it: runs of slots (two, then a lone slot)
    segments[1] = LatentSegment(20, 1, runs=((3000, 200), (3500, 99), (17, 1)))
    tokens = 26
    q = (torch.randn(tokens, heads, dim, generator=gen) * 2).round().to(dtype)
    w = torch.randn(tokens, heads, generator=gen).round()
    native = NativeBackend().kernels
    calls = []

    def counted(*args):
        calls.append(args[4].shape[0])
        return native.index_topk_segments(*args)

    once = replace(native, index_topk_segments=counted)
    with torch_threads(threads):
        got = indexer_mod.select_segments(q, w, cache, segments, 0.25, topk, once)
        for seg in segments:
            alone = indexer_mod.causal_top_positions(
                q[seg.rows], w[seg.rows], cache[seg.slots], seg.prefix_len, 0.25, topk, native
            )
            assert torch.equal(canonical(got[seg.rows]), canonical(alone)), seg
    assert calls == [len(segments)]
    assert (got[25] == -1).all()
    every = torch.arange(topk)
    assert torch.equal(got[23], torch.where(every < 29, every, -1))  # keeps all it sees


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
@pytest.mark.parametrize("spread", ["tiny", "denormal", "infinite", "one-value"])
def test_the_selection_holds_on_every_spread_of_scores(spread: str) -> None:
    """The kernel's histogram over each row's range of finite scores: a range a few ulps wide,
    one too narrow for its reciprocal (denormal scores), rows with +inf scores (infinite keys),
    and rows of one value; each picks what the rule picks on the same scores."""
    n, prefix, topk = 12, 200, 64
    q, w = torch.ones(n, 1, 1), torch.ones(n, 1)
    k = 1.0 + torch.arange(prefix + n, dtype=torch.float32)[:, None].remainder(7) * 2**-20
    if spread == "denormal":
        k = torch.arange(prefix + n, dtype=torch.float32)[:, None].remainder(5) * 1e-42
    elif spread == "infinite":
        k[::9] = float("inf")
    elif spread == "one-value":
        k = torch.full((prefix + n, 1), 0.5)
    native = NativeBackend().kernels
    picked = indexer_mod.causal_top_positions(q, w, k, prefix, 1.0, topk, native)
    scores = indexer_mod.causal_index_scores(q, w, k, prefix, 1.0, native.index_scores)
    assert torch.equal(canonical(picked), reference_positions(scores, topk))


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
def test_nan_scores_still_give_topk_distinct_visible_positions() -> None:
    """A NaN head weight (broken inputs) makes a row's scores NaN: the kernel ranks NaN below
    every number and still returns min(visible, topk) distinct visible positions, never
    uninitialised ones that would address other requests' cache rows."""
    n, prefix, topk = 30, 90, 64
    q, w, k = rand(n, 4, 16, seed=10), rand(n, 4, seed=11), rand(prefix + n, 16, seed=12)
    w[::3, 0] = float("nan")  # every third row: all NaN
    w[1::3, 1] = float("inf")  # every third row: inf x 0 where a head's ReLU is 0
    picked = indexer_mod.causal_top_positions(q, w, k, prefix, 0.25, topk, NativeBackend().kernels)
    for i, row in enumerate(picked.tolist()):
        kept = [p for p in row if p >= 0]
        visible = prefix + i + 1
        assert len(kept) == min(visible, topk) == len(set(kept))
        assert all(0 <= p < visible for p in kept)


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
@pytest.mark.parametrize("inference", [True, False])
def test_a_held_choice_is_never_overwritten_and_a_dropped_one_s_memory_is_reused(
    inference: bool,
) -> None:
    """The kernel answers a prompt chunk in the memory of its latest answer once nothing
    refers to that (so a chunk's tens of MB are not mapped and faulted in afresh each layer):
    an answer still held, or a view of it alone, keeps its values through later calls, which
    are answered apart; once dropped, the latest one's memory serves the next call, also one
    with fewer rows (a new answer is allocated before the kept one is let go, so the same
    address is the same memory); answers under 1 MiB never take it. In inference mode too
    (as the engine runs), where views keep no base tensor alive."""
    kernel = native_index_topk()
    assert kernel is not None
    q, w, k = rand(300, 4, 16, seed=13), rand(300, 4, seed=14), rand(1000, 16, seed=15)
    q2 = rand(300, 4, 16, seed=16)

    def pick(queries: torch.Tensor, rows: int = 300) -> torch.Tensor:  # 1.2 MB at 300 rows
        return kernel(queries[:rows], w[:rows], k[: 700 + rows], 700, 0.25, 512)

    with torch.inference_mode(inference):
        first = pick(q)
        want = first.clone()
        other = pick(q2)  # `first` held: answered apart
        want2 = other.clone()
        assert other.data_ptr() != first.data_ptr() and torch.equal(first, want)
        assert not torch.equal(want, want2)

        view = other[5:]  # a view alone holds the memory too
        del other
        third = pick(q2)
        address = third.data_ptr()
        assert address not in (first.data_ptr(), view.data_ptr() - 5 * view.stride(0) * 8)
        assert torch.equal(third, want2) and torch.equal(view, want2[5:])

        del first, view, third  # nothing refers to the latest answer any more
        small = pick(q, rows=10)  # under 1 MiB: from the heap, the kept memory left free
        again = pick(q)
        assert again.data_ptr() == address and torch.equal(again, want)
        assert torch.equal(small, want[:10])
        del again
        fewer = pick(q2, rows=260)
        assert fewer.data_ptr() == address and torch.equal(fewer, want2[:260])


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
def test_without_the_kernel_the_selection_is_the_same() -> None:
    q, w, k = rand(40, 4, 16, seed=7), rand(40, 4, seed=8), rand(240, 16, seed=9)
    q, k, w = (q * 2).round(), (k * 2).round(), w.round()
    got = indexer_mod.causal_top_positions(q, w, k, 200, 0.25, 64, NativeBackend().kernels)
    want = indexer_mod.causal_top_positions(q, w, k, 200, 0.25, 64)
    assert torch.equal(canonical(got), canonical(want))


class Sizes(TorchDispatchMode):
    """The element count and dtype of every tensor an op makes inside (not a view of its
    inputs' memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {
            a.untyped_storage().data_ptr()
            for a in [*args, *(kwargs or {}).values()]
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.made.append((t.numel(), t.dtype))
        return out


@pytest.mark.parametrize("ties", [False, True])
def test_the_torch_selection_forms_no_queries_by_keys_tensor(
    monkeypatch: pytest.MonkeyPatch, ties: bool
) -> None:
    """The path a GPU (and --attention-backend torch) takes: a block of queries at a time,
    each scored over the keys up to its last query, so no [n, L] tensor exists, of scores or
    of booleans (a causal mask, the tie rule's), and the choice is the rule's on the whole
    scores. 64 queries after 536 cached positions, blocks of 8 queries."""
    n, prefix, topk = 64, 536, 48
    q, w, k = rand(n, 4, 16, seed=21), rand(n, 4, seed=22), rand(prefix + n, 16, seed=23)
    if ties:  # exact sums, many of them 0: the boundary resolved by position
        q, k, w = (q * 2).round(), (k * 2).round(), w.round()
    whole = indexer_mod.causal_index_scores(q, w, k, prefix, 0.25)
    monkeypatch.setattr(indexer_mod, "SCORE_BLOCK_ELEMENTS", 8 * (prefix + n))
    with Sizes() as sizes:
        picked = indexer_mod.causal_top_positions(q, w, k, prefix, 0.25, topk)
    assert torch.equal(canonical(picked), reference_positions(whole, topk))
    # the largest: a block's per-head logits [4 heads, 8, L], half of [n, L] (which the
    # one-block path makes, and [heads, n, L] beside it)
    assert max(numel for numel, _ in sizes.made) <= 4 * 8 * (prefix + n) < n * (prefix + n)
    assert max(numel for numel, dtype in sizes.made if dtype == torch.bool) <= 8 * (prefix + n)


class Sorts(torch.overrides.TorchFunctionMode):
    """The sizes of the last dimension of every tensor sorted inside."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("sort", "argsort", "msort"):
            self.widths.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ties", [False, True])
def test_the_selection_sorts_no_row_of_scores(ties: bool) -> None:
    """Linear in the row's length: what is sorted is at most topk wide (the kept positions),
    never a row of L scores, with or without ties at the boundary."""
    topk, length = 64, 4096
    scores = torch.relu(rand(32, length, seed=3) - (1.5 if ties else 0.0)).round(decimals=1)
    with Sorts() as sorts:
        picked = top_positions(scores, topk)
    assert all(width <= topk for width in sorts.widths)  # the full sort sorted 4096
    assert torch.equal(canonical(picked), reference_positions(scores, topk))


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_layer_ties_pick_the_earliest_positions(setup: Setup, weight: float) -> None:
    """All scores 0: head weights zero, or queries zero under negative weights (-0.0 sums)."""
    layer, (x, q_latent) = setup.layer(), inputs()
    with torch.no_grad():
        layer.weights_proj.weight.fill_(weight)
        if weight:
            layer.wq_b.weight.zero_()
    scores, picked, _ = run_chunks(layer, setup, x, q_latent, [PROMPT - 8, 8])
    assert all((s[s > -float("inf")] == 0).all() for s in scores)
    for i in range(PROMPT):
        k = min(i + 1, TOPK)
        assert canonical(picked[i : i + 1])[0, :k].tolist() == list(range(k))


def test_selection_mask_of_two_segments_in_one_batch(setup: Setup) -> None:
    """Two requests in one batch select exactly what each selects alone."""
    layer, (x, q_latent) = setup.layer(), inputs()
    alone = [run_chunks(layer, setup, x[:n], q_latent[:n], [n])[1] for n in (PROMPT, 25)]
    slots = scattered_slots(PROMPT + 25, seed=5)
    segs = [LatentSegment(0, PROMPT, slots[:PROMPT]), LatentSegment(PROMPT, 25, slots[PROMPT:])]
    xb, qb = torch.cat([x, x[:25]]), torch.cat([q_latent, q_latent[:25]])
    positions = torch.cat([torch.arange(PROMPT), torch.arange(25)])
    with torch.no_grad():
        picked = layer(
            xb,
            qb,
            setup.rotary.cos_sin(positions, torch.float32),
            torch.zeros(NUM_SLOTS, INDEX_DIM),
            segs,
        )
    assert torch.equal(picked[:PROMPT], alone[0])
    assert torch.equal(picked[PROMPT:], alone[1])


@pytest.mark.skipif(native_index_topk() is None, reason="the native CPU kernels do not build")
def test_the_layer_selects_a_batch_in_one_native_call(setup: Setup) -> None:
    """On the native backend the layer selects every segment of a batch (a prompt chunk, a
    request no longer than topk, decode steps) in one kernel call, as segment by segment."""
    layer, (x, q_latent) = setup.layer(), inputs()
    slots = scattered_slots(PROMPT + 5 + 30 + 20, seed=8)
    step_a, step_b = slots[PROMPT + 5 : PROMPT + 35], slots[PROMPT + 35 :]
    # rows 0-39: a prompt; 40-44: a request of 5; 45, 46: steps of 30 and 20 positions
    segs = [
        LatentSegment(0, PROMPT, slots[:PROMPT]),
        LatentSegment(PROMPT, 5, slots[PROMPT : PROMPT + 5]),
        LatentSegment(PROMPT + 5, 1, step_a),
        LatentSegment(PROMPT + 6, 1, step_b),
    ]
    xb, qb = torch.cat([x, x[:7]]), torch.cat([q_latent, q_latent[:7]])
    positions = torch.cat([torch.arange(PROMPT), torch.arange(5), torch.tensor([29, 19])])
    rope = setup.rotary.cos_sin(positions, torch.float32)
    native = NativeBackend().kernels
    calls: list[int] = []

    def counted(*args):
        calls.append(args[4].shape[0])
        return native.index_topk_segments(*args)

    picks = []
    for kernels in (
        replace(native, index_topk_segments=counted),
        replace(native, index_topk_segments=None),
    ):
        cache = torch.zeros(NUM_SLOTS, INDEX_DIM)
        cache[step_a[:-1]] = rand(29, INDEX_DIM, seed=9)  # the steps' cached positions
        cache[step_b[:-1]] = rand(19, INDEX_DIM, seed=10)
        with torch.no_grad():
            picks.append(layer(xb, qb, rope, cache, segs, kernels=kernels))
    assert calls == [4]
    assert torch.equal(canonical(picks[0]), canonical(picks[1]))


def test_segments_out_of_order_or_not_covering_the_batch(setup: Setup) -> None:
    """The choice is laid out by the segments' rows whatever their order in the list; a row of
    no segment (a padded batch's) chooses nothing (-1s) rather than another request's keys."""
    layer, (x, q_latent) = setup.layer(), inputs()
    alone = [run_chunks(layer, setup, x[:n], q_latent[:n], [n])[1] for n in (PROMPT, 25)]
    slots = scattered_slots(PROMPT + 25, seed=5)
    positions = torch.cat(
        [torch.arange(PROMPT), torch.arange(25), torch.zeros(3, dtype=torch.long)]
    )
    xb = torch.cat([x, x[:25], x[:3]])
    qb = torch.cat([q_latent, q_latent[:25], q_latent[:3]])
    rope = setup.rotary.cos_sin(positions, torch.float32)
    long_seg = LatentSegment(0, PROMPT, slots[:PROMPT])
    short_seg = LatentSegment(PROMPT, 25, slots[PROMPT:])
    with torch.no_grad():
        reversed_order = layer(
            xb[:-3],
            qb[:-3],
            (rope[0][:-3], rope[1][:-3]),
            torch.zeros(NUM_SLOTS, INDEX_DIM),
            [short_seg, long_seg],
        )
        padded = layer(xb, qb, rope, torch.zeros(NUM_SLOTS, INDEX_DIM), [long_seg, short_seg])
    for picked in (reversed_order, padded):
        assert torch.equal(picked[:PROMPT], alone[0])
        assert torch.equal(picked[PROMPT : PROMPT + 25], alone[1])
    assert padded.shape == (PROMPT + 28, TOPK) and (padded[PROMPT + 25 :] == -1).all()


def test_index_scores_in_query_blocks_equal_one_block(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a small logit budget the per-head logits are formed a few queries at a time
    (never [heads, queries, keys] at once, as on a GPU at long contexts): the same scores.
    (The torch path, which the layer takes without a backend's compiled kernels.)"""
    layer, (x, q_latent) = setup.layer(), inputs()
    (whole,), picked, _ = run_chunks(layer, setup, x, q_latent, [PROMPT])
    rows: list[int] = []
    head_sum = indexer_mod._head_sum
    monkeypatch.setattr(indexer_mod, "LOGIT_BLOCK_ELEMENTS", INDEX_HEADS * PROMPT * 3)
    monkeypatch.setattr(
        indexer_mod, "_head_sum", lambda q, *a: rows.append(q.shape[0]) or head_sum(q, *a)
    )
    (blocked,), blocked_picked, _ = run_chunks(layer, setup, x, q_latent, [PROMPT])
    assert max(rows) == 3
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=0)
    assert torch.equal(blocked_picked, picked)


def test_the_keyed_selection_is_the_sort_s_on_ties_signed_zeros_and_short_rows() -> None:
    """The selection without a host sync (one topk over int64 keys of score and position)
    picks what the rule picks, on rows full of ties (0.0 and -0.0 above all), with -inf
    tails, rows shorter than topk, and NaNs of either sign, which rank as +inf (torch.topk
    ranks a NaN first)."""
    gen = torch.Generator().manual_seed(1)
    for case in range(300):
        n, length, topk = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (12, 160, 70))
        scores = torch.randn(n, length, generator=gen).round(decimals=1)
        scores[torch.rand(n, length, generator=gen) < 0.3] = 0.0
        scores[torch.rand(n, length, generator=gen) < 0.2] = -0.0
        scores[torch.rand(n, length, generator=gen) < 0.1] = float("-inf")
        if case % 3 == 0:
            nan = torch.rand(n, length, generator=gen) < 0.05
            signed = torch.tensor([0x7FC00000, -0x00400000], dtype=torch.int32).view(torch.float32)
            scores[nan] = signed[torch.randint(0, 2, (n, length), generator=gen)][
                nan
            ]  # + and - NaN
        want = reference_positions(
            scores.nan_to_num(float("inf"), float("inf"), -float("inf")), topk
        )
        assert torch.equal(canonical(indexer_mod.keyed_top_positions(scores, topk)), want)


def decode_table(lengths: list[int], seed: int, dim: int = INDEX_DIM) -> tuple[Any, ...]:
    """A cache of NUM_SLOTS * 8 rows and decode steps of `lengths` on scattered slots:
    (cache, their StepTable, each step's slots)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_SLOTS * 8, dim, generator=gen)
    order = 1 + torch.randperm(NUM_SLOTS * 8 - 1, generator=gen)
    per_step, first = [], 0
    for n in lengths:
        per_step.append(order[first : first + n])
        first += n
    indptr = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    by_length, groups = length_groups(lengths)
    rows = torch.arange(len(lengths))
    indices = torch.cat(per_step).to(torch.int32)
    return cache, StepTable(rows, indptr, indices, torch.tensor(by_length), groups), per_step


def test_length_groups_bound_the_padded_work() -> None:
    """Steps longest first, cut so that each group padded to its first step costs at most
    twice its steps' lengths; a skewed batch (one long step among short ones) is not padded
    to the long one."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        b = int(torch.randint(1, 40, (1,), generator=gen))
        lengths = torch.randint(1, 5000, (b,), generator=gen).tolist()
        order, groups = length_groups(lengths)
        assert sorted(order) == list(range(b))
        assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
        assert groups[0][0] == 0 and groups[-1][1] == b
        assert all(a[1] == b_[0] for a, b_ in zip(groups, groups[1:], strict=False))
        for first, end, width in groups:
            own = [lengths[i] for i in order[first:end]]
            assert width == own[0] and (end - first) * width <= 2 * sum(own)
    _, groups = length_groups([131072, *([2048] * 63)])
    assert sum((end - first) * width for first, end, width in groups) < 2 * (131072 + 63 * 2048)


@pytest.mark.parametrize("block", [None, 4 * 5])  # one block of positions, or blocks of five
def test_decode_steps_at_once_score_and_pick_what_each_step_does_alone(monkeypatch, block) -> None:
    """Decode steps of ragged lengths (some no longer than topk, one far longer) over
    scattered slots: their scores, made a group at a time, are each step's
    `causal_index_scores` (a block of positions at a time or all of them), -inf past its
    length; with small integer inputs, whose sums are exact in any order, the choice is each
    step's own to the position, ties included."""
    if block is not None:
        monkeypatch.setattr(indexer_mod, "LOGIT_BLOCK_ELEMENTS", block * INDEX_DIM)
    lengths, heads, topk = [40, 7, 93, 16, 700, 5, 60], 3, 16
    cache, table, per_step = decode_table(lengths, seed=7)
    assert len(table.groups) >= 3  # (700, 93), (60, 40, 16, 7), (5) without scores
    b = len(lengths)
    q, w = rand(b, heads, INDEX_DIM, seed=8), rand(b, heads, seed=9)
    starts, seen = table.indptr[:-1].long(), torch.tensor(lengths)
    scores = indexer_mod.decode_index_scores(q, w, cache, starts, seen, table.indices, 700, 0.3)
    for i, (n, slots) in enumerate(zip(lengths, per_step, strict=True)):
        alone = indexer_mod.causal_index_scores(
            q[i : i + 1], w[i : i + 1], cache[slots], n - 1, 0.3
        )
        torch.testing.assert_close(scores[i, :n], alone[0], rtol=1e-5, atol=1e-5)
        assert torch.isinf(scores[i, n:]).all() and (scores[i, n:] < 0).all()
    qi, wi, ci = (q * 2).round(), w.round(), (cache * 2).round()  # exact sums: many ties
    picked = indexer_mod.decode_top_positions(qi, wi, ci, table, 0.25, topk)
    for i, (n, slots) in enumerate(zip(lengths, per_step, strict=True)):
        alone = indexer_mod.causal_top_positions(
            qi[i : i + 1], wi[i : i + 1], ci[slots], n - 1, 0.25, topk
        )
        assert torch.equal(canonical(picked[i : i + 1]), canonical(alone)), i


def test_decode_steps_at_once_read_nothing_on_the_host_and_launch_as_much_for_any_count() -> None:
    """What makes the batched selection a GPU's: no value read on the host (no sync), no
    `nonzero` (sized from the data), and the same ops for 2 steps as for 7 of like lengths
    (one group, one block); steps all no longer than topk keep every position."""
    from host_sync import no_host_sync
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    counts = []
    for lengths in ([90, 70], [90, 70, 88, 60, 64, 83, 71]):
        cache, table, _ = decode_table(lengths, seed=3)
        assert len(table.groups) == 1
        b = len(lengths)
        q, w = rand(b, 4, INDEX_DIM, seed=1), rand(b, 4, seed=2)
        with no_host_sync(), Ops() as ops:
            indexer_mod.decode_top_positions(q, w, cache, table, 0.3, 16)
        assert "nonzero" not in ops.names
        counts.append(len(ops.names))
    assert counts[0] == counts[1]
    cache, table, _ = decode_table([9, 3, 16], seed=4)
    with no_host_sync():
        every = indexer_mod.decode_top_positions(q[:3], w[:3], cache, table, 0.3, 16)
    assert every.tolist() == [[*range(n), *([-1] * (16 - n))] for n in (9, 3, 16)]


def test_a_batch_of_steps_and_a_prompt_chunk_selects_as_segment_by_segment(setup: Setup) -> None:
    """The layer given the batch's decode steps as a table selects them at once and the
    prompt chunk beside them as before: the same choice as segment by segment (rows whose
    top-k boundary is narrower than GAP aside: the sums' order differs)."""
    layer = setup.layer()
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(NUM_SLOTS, INDEX_DIM, generator=gen)
    slots = 1 + torch.randperm(NUM_SLOTS - 1, generator=gen)
    # row 11: a decode step of 12 positions; row 0: one of 30 (the longer: first in the
    # table's length order, second in its rows); rows 1-10: a chunk of 10 after 20
    chunk = LatentSegment(1, 10, slots[:30])
    steps = [LatentSegment(11, 1, slots[30:42]), LatentSegment(0, 1, slots[42:72])]
    x, q_latent = rand(12, HIDDEN, seed=12), rand(12, Q_RANK, seed=13)
    positions = torch.tensor([29, *range(20, 30), 11])
    rope = setup.rotary.cos_sin(positions, x.dtype)
    lengths = [12, 30]
    by_length, groups = length_groups(lengths)
    assert by_length == [1, 0]
    indptr = torch.tensor([0, 12, 42], dtype=torch.int32)
    indices = torch.cat([s.slots for s in steps]).to(torch.int32)
    table = StepTable(torch.tensor([11, 0]), indptr, indices, torch.tensor(by_length), groups)
    segments = [steps[0], chunk, steps[1]]
    with torch.no_grad():
        alone = layer(x, q_latent, rope, cache.clone(), segments)
        at_once = layer(x, q_latent, rope, cache.clone(), segments, steps=table)
        scores = layer.scores(x, q_latent, rope, cache.clone(), segments)

    def gaps_of(sc: torch.Tensor) -> torch.Tensor:  # a row of topk or fewer keeps them all
        return boundary_gaps(sc, TOPK) if sc.shape[1] > TOPK else torch.full_like(sc[:, 0], 1.0)

    gaps = torch.cat([gaps_of(sc) for sc in (scores[2], scores[1], scores[0])])  # row order
    wide = gaps > GAP
    assert wide[0] and wide[11] and wide.sum() >= 8  # both steps compared
    assert torch.equal(canonical(at_once)[wide], canonical(alone)[wide])
    assert (at_once[0] >= 0).sum() == TOPK and (at_once[11] >= 0).sum() == 12
