"""The torch backend without a model: the blockwise and fused prompt-chunk kernels, the batched
decode path and `PagedAttention.forward` over a real KVPool, all against a plain float32
softmax attention; its plan (views vs gathered slots, padding) and `merge_partials`."""

from __future__ import annotations

import pytest
import torch

from pipeserve.backends import torch_backend, torch_ops
from pipeserve.backends.torch_backend import (
    BLOCKWISE_MIN_TOKENS,
    blockwise_prefill,
    fused_prompt_chunk,
)
from pipeserve.backends.torch_ops import attention_with_lse
from pipeserve.layers.attention import PagedAttention, plan_attention
from pipeserve.layers.attention_parts import VIEW_MIN_TOKENS, merge_partials
from pipeserve.mem_cache.kv_pool import KVPool

D = 16  # head dim
KV_HEADS = 2
CPU = torch.device("cpu")
ATOL = 2e-5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """Plain softmax attention. q [n, h, d]; k/v [L, hk, d] of positions 0..L-1; query i sits
    at position q_pos[i] and sees keys 0..q_pos[i]. -> [n, h, d]."""
    group = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, L, d]
    vr = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kr.transpose(1, 2) * q.shape[-1] ** -0.5  # [h, n, L]
    keys = torch.arange(k.shape[0])[None, :]
    future = keys > torch.tensor(q_pos)[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return (scores.softmax(-1) @ vr).transpose(0, 1).float()


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def split_prefix(
    k: torch.Tensor, v: torch.Tensor, sizes: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut prefix k/v [L, hk, d] into consecutive parts in the cache layout [hk, n_i, d]."""
    parts, start = [], 0
    for n in sizes:
        parts.append((k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)))
        start += n
    assert start == k.shape[0]
    return parts


PREFIX_LAYOUTS = {
    "none": [],
    "gathered": [37],
    "view": [300],
    "views+gathered": [260, 256, 41],
}


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("layout", list(PREFIX_LAYOUTS))
@pytest.mark.parametrize("kernel", ["blockwise", "fused"])
def test_prompt_chunk_kernels_match_reference(kernel: str, layout: str, group: int) -> None:
    sizes = PREFIX_LAYOUTS[layout]
    prefix = sum(sizes)
    n = 150 if kernel == "blockwise" else 23  # blockwise: more than one 128-row query block
    h = KV_HEADS * group
    q = rand(n, h, D, seed=1)
    k, v = rand(prefix + n, KV_HEADS, D, seed=2), rand(prefix + n, KV_HEADS, D, seed=3)
    cached = split_prefix(k[:prefix], v[:prefix], sizes)
    if kernel == "blockwise":
        out = blockwise_prefill(q, k[prefix:], v[prefix:], cached, D**-0.5)
    else:
        layer = PagedAttention(0, h, KV_HEADS, D)
        out = fused_prompt_chunk(layer, q, k[prefix:], v[prefix:], cached)
    expected = reference(q, k, v, list(range(prefix, prefix + n)))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [16, 17, 40, 47])
def test_blockwise_small_query_blocks(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A tiny score budget forces 16-row query blocks: the causal mask must be right across
    block boundaries and for a ragged last block."""
    monkeypatch.setattr(torch_backend, "SCORE_BLOCK_ELEMENTS", 1)
    group, prefix = 2, 20
    q = rand(n, KV_HEADS * group, D, seed=4)
    k, v = rand(prefix + n, KV_HEADS, D, seed=5), rand(prefix + n, KV_HEADS, D, seed=6)
    cached = split_prefix(k[:prefix], v[:prefix], [prefix])
    out = blockwise_prefill(q, k[prefix:], v[prefix:], cached, D**-0.5)
    torch.testing.assert_close(
        out, reference(q, k, v, list(range(prefix, prefix + n))), atol=ATOL, rtol=0
    )


# -- plan_attention ------------------------------------------------------------------------


def chunk_plan(runs: list[tuple[int, int]], prefix: int, q_len: int) -> tuple[list, list[int]]:
    """plan_attention for one prompt chunk: (views, gathered slot ids) of its prefix."""
    plan = plan_attention([(0, q_len, prefix, runs)], CPU, torch.float32)
    assert plan.meta.decode is None
    (chunk,) = plan.meta.chunks
    assert (chunk.q_start, chunk.q_len) == (0, q_len)
    return chunk.views, [] if chunk.gather is None else chunk.gather.tolist()


def test_plan_views_vs_gathered_split_at_view_min_tokens() -> None:
    n = VIEW_MIN_TOKENS
    runs = [(10, n), (1000, n - 1), (2000, 400), (3000, 50)]  # the last run is the chunk
    views, gathered = chunk_plan(runs, 2 * n - 1 + 400, 50)
    assert views == [(10, n), (2000, 400)]
    assert gathered == list(range(1000, 1000 + n - 1))


def test_plan_chunk_reads_only_its_prefix_from_the_pool() -> None:
    # One run holds prefix and chunk: only the prefix's part of it counts (255 < a view).
    views, gathered = chunk_plan([(10, 300), (500, 300)], 555, 45)
    assert views == [(10, 300)]
    assert gathered == list(range(500, 755))
    views, gathered = chunk_plan([(10, 300)], 100, 200)
    assert (views, gathered) == ([], list(range(10, 110)))


def test_plan_chunk_without_prefix_reads_nothing_cached() -> None:
    assert chunk_plan([(100, 40)], 0, 40) == ([], [])


def test_plan_decode_steps_are_a_page_table_with_their_runs() -> None:
    """Decode steps (a prompt chunk among them) as the page table of their whole sequences,
    their own just-written slot included, longest first, and each step's runs on the host
    (what a step read in place attends over)."""
    segments = [
        (0, 1, 4, [(10, 5)]),  # 5 keys in one run
        (1, 40, 0, [(200, 40)]),  # a prompt chunk among decode steps
        (41, 1, 300, [(1000, 300), (5000, 1)]),  # a long run, its own token elsewhere
        (42, 1, 1, [(20, 1), (30, 1)]),  # 2 keys in 2 scattered pages
    ]
    plan = plan_attention(segments, CPU, torch.bfloat16)
    assert [(c.q_start, c.q_len) for c in plan.meta.chunks] == [(1, 40)]
    dec = plan.meta.decode
    assert dec is not None
    assert dec.table.rows.tolist() == [0, 41, 42]
    assert dec.runs == (((10, 5),), ((1000, 300), (5000, 1)), ((20, 1), (30, 1)))
    assert dec.order == (1, 0, 2) and dec.table.order.tolist() == [1, 0, 2]
    indptr, indices = dec.table.kv_indptr.tolist(), dec.table.kv_indices.tolist()
    assert indptr == [0, 5, 306, 308]
    assert indices[5:305] == list(range(1000, 1300)) and indices[305] == 5000
    assert indices[:5] == list(range(10, 15)) and indices[306:] == [20, 30]


def test_decode_gathers_cheap_groups_and_reads_the_rest_in_place() -> None:
    """Which groups of steps are gathered for one call: those whose padded keys and values
    take fewer bytes than `gather_max_bytes`; the rest's steps read in place, longest first."""
    segments = [(0, 1, 4, [(10, 5)]), (1, 1, 300, [(1000, 301)]), (2, 1, 1, [(20, 2)])]
    backend = torch_backend.TorchBackend(CPU)
    plan = plan_attention(segments, CPU, torch.float32, backend).meta.decode
    assert plan.table.groups == ((0, 2, 301), (2, 3, 2))  # 5 padded to 301: 2x at most
    backend.gather_max_bytes = 302 * 100
    split = backend.split(plan, 100)
    assert [s.tolist() for s, _ in split.gathered] == [[1, 0], [2]] and split.in_place == []
    assert backend.split(plan, 100) is split  # made once per batch
    backend.gather_max_bytes = 301 * 100
    split = backend.split(plan, 100)  # another limit: split again
    ((steps, slots),) = split.gathered
    assert steps.tolist() == [2] and slots.tolist() == [[20, 21]]
    assert split.in_place == [1, 0]


def test_plan_decode_runs_shorter_than_sequence() -> None:
    with pytest.raises(ValueError, match="shorter than the sequence"):
        plan_attention([(0, 1, 10, [(1, 10)])], CPU, torch.float32)


# -- merge_partials -------------------------------------------------------------------------


def test_merge_partials_equals_attention_over_all_keys() -> None:
    q, k, v = rand(1, 2, 5, D, seed=7), rand(1, 2, 90, D, seed=8), rand(1, 2, 90, D, seed=9)
    full, full_lse = attention_with_lse(q, k, v, False, D**-0.5)
    cuts = [(0, 7), (7, 60), (60, 90)]
    parts = [attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], False, D**-0.5) for a, b in cuts]
    torch.testing.assert_close(merge_partials(parts), full, atol=ATOL, rtol=0)
    torch.testing.assert_close(merge_partials(parts[::-1]), full, atol=ATOL, rtol=0)
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=0)


def test_merge_partials_single_part_and_dtype() -> None:
    o, lse = rand(1, 2, 3, D, seed=10), rand(1, 2, 3, seed=11)
    assert merge_partials([(o, lse)]) is o
    merged = merge_partials([(o.bfloat16(), lse), (o.bfloat16(), lse)])
    assert merged.dtype == torch.bfloat16
    # Two equal partials weigh one half each: the result is the partial itself.
    torch.testing.assert_close(merged, o.bfloat16())


# -- PagedAttention.forward over a KVPool ---------------------------------------------------


class Seq:
    """One request of a mixed batch: its KV slots, prefix length and new tokens' k/v."""

    def __init__(
        self, runs: list[tuple[int, int]], prefix: int, q_len: int, seed: int, heads: int
    ) -> None:
        self.runs, self.prefix, self.q_len = runs, prefix, q_len
        self.slots = [s for start, n in runs for s in range(start, start + n)]
        assert len(self.slots) == prefix + q_len
        total = prefix + q_len
        self.k = rand(total, KV_HEADS, D, seed=seed)
        self.v = rand(total, KV_HEADS, D, seed=seed + 1)
        self.q = rand(q_len, heads, D, seed=seed + 2)


@pytest.mark.parametrize("gather", ["gathered", "in place"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_mixed_batch_matches_reference(group: int, gather: str) -> None:
    """Decode steps (short, scattered, and long runs: gathered for one call, or read in
    place a step at a time), a short chunk (fused kernel) and a long chunk (blockwise) with
    cached prefixes, in one forward."""
    heads = KV_HEADS * group
    seqs = [
        Seq([(16, 9)], 8, 1, seed=10, heads=heads),  # short decode
        Seq([(40, 300), (700, 3), (900, 1)], 303, 1, seed=20, heads=heads),  # view + gathered
        Seq([(1100, 20), (1200, 7)], 0, 27, seed=30, heads=heads),  # fused, no prefix
        Seq([(1300, 280), (1600, 12)], 280, 12, seed=40, heads=heads),  # fused, view prefix
        Seq([(2000, 270), (2300, 5), (2400, 100)], 275, 100, seed=50, heads=heads),  # blockwise
        Seq(
            [(2600, 2), (2700, 3), (2800, BLOCKWISE_MIN_TOKENS)],
            5,
            BLOCKWISE_MIN_TOKENS,
            seed=60,
            heads=heads,
        ),  # blockwise over a gathered prefix
    ]
    pool = KVPool(3000, range(0, 1), KV_HEADS, D, torch.float32, CPU, page_size=1)
    k_cache, v_cache = pool.buffers(0)
    segments, row = [], 0
    for s in seqs:  # the prefix KV is already in the pool
        k_cache[:, s.slots[: s.prefix]] = s.k[: s.prefix].transpose(0, 1)
        v_cache[:, s.slots[: s.prefix]] = s.v[: s.prefix].transpose(0, 1)
        segments.append((row, s.q_len, s.prefix, s.runs))
        row += s.q_len
    backend = torch_backend.TorchBackend(CPU)
    backend.gather_max_bytes = 2**30 if gather == "gathered" else 0
    plan = plan_attention(segments, CPU, torch.float32, backend)
    decode = plan.meta.decode
    assert decode is not None
    in_place = backend.split(decode, 2 * KV_HEADS * D * 4).in_place
    assert in_place == ([] if gather == "gathered" else [1, 0])  # longest first
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.prefix :] for s in seqs])
    v = torch.cat([s.v[s.prefix :] for s in seqs])
    out_slots = torch.tensor([slot for s in seqs for slot in s.slots[s.prefix :]])
    out = PagedAttention(0, heads, KV_HEADS, D)(q, k, v, pool, out_slots, plan)
    assert out.shape == (row, heads * D)
    errors, row = [], 0
    for s in seqs:
        expected = reference(s.q, s.k, s.v, list(range(s.prefix, s.prefix + s.q_len)))
        got = out[row : row + s.q_len].view(s.q_len, heads, D)
        errors.append((got - expected).abs().max().item())
        row += s.q_len
    assert max(errors) < ATOL, f"max error per sequence: {errors}"
    # The new tokens' KV was written to their slots.
    torch.testing.assert_close(k_cache[:, out_slots], k.transpose(0, 1))


def test_the_gather_limit_is_the_device_s_unless_the_environment_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert torch_backend.TorchBackend(CPU).gather_max_bytes == torch_backend.GATHER_MAX_BYTES["cpu"]
    cuda = torch_backend.TorchBackend("cuda").gather_max_bytes
    assert cuda == torch_backend.GATHER_MAX_BYTES_ELSEWHERE
    monkeypatch.setenv("PIPESERVE_DECODE_GATHER_MAX_BYTES", "0")  # every step in place
    assert torch_backend.TorchBackend(CPU).gather_max_bytes == 0
    monkeypatch.setenv("PIPESERVE_DECODE_GATHER_MAX_BYTES", "64MiB")
    with pytest.raises(ValueError, match="expected a whole number of bytes"):
        torch_backend.TorchBackend(CPU)


@pytest.mark.parametrize("limit", [2**30, 0], ids=["gathered", "in place"])
def test_decode_steps_read_no_tensor_on_the_host(
    limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a GPU, where the gathers' masks are made without reading them on the host: once
    planned and expanded, a batch of decode steps (scattered, short, a long run beside a
    short one) attends without reading a tensor's value on the host, gathered or in place,
    in every layer (the first makes the groups' slots and the steps' parts, later ones reuse
    them); and gives the reference's output."""
    from host_sync import no_host_sync

    monkeypatch.setattr(torch_ops, "queues_on_streams", lambda device: True)
    heads = KV_HEADS * 2
    seqs = [
        Seq([(16, 9)], 8, 1, seed=10, heads=heads),
        Seq([(40, 300), (700, 3), (900, 1)], 303, 1, seed=20, heads=heads),
        Seq([(1000, 1), (1010, 1), (1020, 5)], 6, 1, seed=30, heads=heads),
    ]
    pool = KVPool(2000, range(0, 1), KV_HEADS, D, torch.float32, CPU, page_size=1)
    k_cache, v_cache = pool.buffers(0)
    for s in seqs:
        k_cache[:, s.slots] = s.k.transpose(0, 1)
        v_cache[:, s.slots] = s.v.transpose(0, 1)
    backend = torch_backend.TorchBackend(CPU)
    backend.gather_max_bytes = limit
    segments = [(i, 1, s.prefix, s.runs) for i, s in enumerate(seqs)]
    plan = plan_attention(segments, CPU, torch.float32, backend)
    q, layer = torch.cat([s.q for s in seqs]), PagedAttention(0, heads, KV_HEADS, D)
    out = torch.empty(len(seqs), heads, D)
    with no_host_sync():
        for _ in range(2):  # two layers of one batch
            backend.attend(layer, q, k_cache, v_cache, plan.meta, None, out)
    for i, s in enumerate(seqs):
        want = reference(s.q, s.k, s.v, [s.prefix])
        torch.testing.assert_close(out[i : i + 1], want, atol=ATOL, rtol=0)
