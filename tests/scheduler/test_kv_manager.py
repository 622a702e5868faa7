"""KVManager: pages and slot runs per request, prefix reuse, release into the cache."""

from __future__ import annotations

import random

import pytest

from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams


def make_req(rid: str, prompt: list[int], return_logprob: bool = False) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=4), return_logprob=return_logprob)


def prefill(kv: KVManager, req: Req) -> None:
    """Admit `req` and give it pages for its whole sequence, as one prefill chunk would."""
    kv.match_prefix(req)
    assert kv.allocate(req, req.seq_len - req.kv_len)
    req.kv_len = req.seq_len


def slots(runs: list[tuple[int, int]]) -> list[int]:
    return [s for start, n in runs for s in range(start, start + n)]


def assert_all_pages_accounted(kv: KVManager) -> None:
    assert kv.tree is not None
    assert kv.allocator.num_free + kv.tree.cached_pages() == kv.allocator.capacity


def test_capacity_and_pages_for() -> None:
    kv = KVManager(num_pages=9, page_size=4, disable_radix_cache=False)
    assert kv.capacity_tokens == 32
    assert [kv.pages_for(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert kv.available_tokens() == 32


def test_allocate_grows_one_contiguous_run() -> None:
    kv = KVManager(num_pages=16, page_size=2, disable_radix_cache=False)
    req = make_req("a", [1, 2, 3, 4, 5])
    kv.match_prefix(req)
    assert kv.allocate(req, 5)
    assert req.pages == [1, 2, 3]
    req.kv_len = 5
    assert kv.allocate(req, 1)  # position 5 still fits in page 3
    assert req.pages == [1, 2, 3]
    req.kv_len = 6
    assert kv.allocate(req, 3)
    assert req.pages == [1, 2, 3, 4, 5]
    assert kv.kv_runs(req, 9) == [(2, 9)]  # slot = page * page_size
    assert kv.kv_runs(req, 3) == [(2, 3)]


def test_kv_runs_split_where_pages_are_not_consecutive() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=True)
    req = make_req("a", [1, 2, 3, 4])
    prefill(kv, req)  # pages 1, 2
    neighbour = make_req("b", [5, 6])
    prefill(kv, neighbour)  # page 3
    req.input_ids += [9, 9, 9]
    assert kv.allocate(req, 3)
    assert req.pages == [1, 2, 4, 5]
    assert kv.kv_runs(req, 7) == [(2, 4), (8, 3)]
    assert slots(kv.kv_runs(req, 5)) == [2, 3, 4, 5, 8]


def test_kv_runs_beyond_allocated_pages_fail_loudly() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=True)
    req = make_req("a", [1, 2, 3])
    prefill(kv, req)
    with pytest.raises(AssertionError, match="fewer than 5 tokens"):
        kv.kv_runs(req, 5)


def test_allocate_short_takes_nothing() -> None:
    kv = KVManager(num_pages=4, page_size=2, disable_radix_cache=True)
    req = make_req("a", [1] * 5)
    kv.match_prefix(req)
    assert not kv.allocate(req, 7)  # 4 pages needed, 3 exist
    assert req.pages == [] and kv.allocator.num_free == 3


def test_release_caches_full_pages_and_frees_the_rest() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=False)
    req = make_req("a", [1, 2, 3, 4, 5])
    prefill(kv, req)
    kv.release(req)
    assert kv.tree is not None and kv.tree.evictable_pages == 2  # tokens 1..4
    assert kv.allocator.num_free == 7
    assert (req.pages, req.kv_len, req.cached_pages, req.last_node) == ([], 0, 0, None)


def test_second_request_reuses_the_cached_prefix() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=False)
    first = make_req("a", [1, 2, 3, 4, 5, 6])
    prefill(kv, first)
    first_slots = slots(kv.kv_runs(first, 6))
    kv.release(first)
    second = make_req("b", [1, 2, 3, 4, 9, 9])
    kv.match_prefix(second)
    kv.record_admission(second)
    assert second.cached_pages == 2 and second.kv_len == 4 == second.cached_tokens
    assert kv.tree is not None and kv.tree.protected_pages == 2
    assert kv.allocate(second, 2)
    assert slots(kv.kv_runs(second, 6))[:4] == first_slots[:4]
    assert (kv.hit_tokens, kv.lookup_tokens) == (4, 6)  # only the admitted request counts


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=False)
    prompt = [1, 2, 3, 4]
    first = make_req("a", prompt)
    prefill(kv, first)
    kv.release(first)
    again = make_req("b", prompt)
    kv.match_prefix(again)
    assert again.kv_len == 2  # matched on tokens[:-1], page aligned


def test_prompt_logprob_requests_skip_the_cache() -> None:
    kv = KVManager(num_pages=10, page_size=1, disable_radix_cache=False)
    first = make_req("a", [1, 2, 3])
    prefill(kv, first)
    kv.release(first)
    wants = make_req("b", [1, 2, 3, 4], return_logprob=True)
    kv.match_prefix(wants)
    assert wants.kv_len == 0 and wants.last_node is None


def test_release_frees_duplicates_of_pages_already_cached() -> None:
    kv = KVManager(num_pages=12, page_size=1, disable_radix_cache=False)
    a, b = make_req("a", [1, 2, 3, 4]), make_req("b", [1, 2, 3, 4])
    prefill(kv, a)
    prefill(kv, b)  # computed side by side: no sharing yet
    kv.release(a)
    kv.release(b)
    assert kv.tree is not None and kv.tree.cached_pages() == 4
    assert_all_pages_accounted(kv)


def test_release_without_cache_unlocks_and_frees_own_pages() -> None:
    kv = KVManager(num_pages=12, page_size=1, disable_radix_cache=False)
    a = make_req("a", [1, 2, 3, 4])
    prefill(kv, a)
    kv.release(a)
    b = make_req("b", [1, 2, 3, 7, 8])
    prefill(kv, b)
    kv.release(b, cache=False)
    assert kv.tree is not None
    assert (kv.tree.protected_pages, kv.tree.cached_pages()) == (0, 4)
    assert_all_pages_accounted(kv)


def test_allocate_evicts_cached_prefixes_when_short() -> None:
    kv = KVManager(num_pages=5, page_size=1, disable_radix_cache=False)
    a = make_req("a", [1, 2, 3])
    prefill(kv, a)
    kv.release(a)
    assert kv.allocator.num_free == 1 and kv.available_tokens() == 4
    b = make_req("b", [9, 9, 9, 9])
    prefill(kv, b)
    assert kv.tree is not None and kv.tree.cached_pages() == 0


def test_locked_prefix_is_not_evicted_for_a_neighbour() -> None:
    kv = KVManager(num_pages=5, page_size=1, disable_radix_cache=False)
    a = make_req("a", [1, 2, 3])
    prefill(kv, a)
    kv.release(a)
    user = make_req("b", [1, 2, 3, 4])
    kv.match_prefix(user)  # locks [1, 2, 3]
    assert kv.available_tokens() == 1
    stranger = make_req("c", [9, 9])
    kv.match_prefix(stranger)
    assert not kv.allocate(stranger, 2)
    assert kv.tree is not None and kv.tree.protected_pages == 3


def test_disabled_radix_cache_frees_everything() -> None:
    kv = KVManager(num_pages=10, page_size=2, disable_radix_cache=True)
    assert kv.tree is None
    a = make_req("a", [1, 2, 3, 4, 5])
    prefill(kv, a)
    kv.release(a)
    b = make_req("b", [1, 2, 3, 4, 5])
    kv.match_prefix(b)
    assert b.kv_len == 0 and b.pages == []
    assert kv.allocator.num_free == kv.allocator.capacity


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_kv_runs_match_the_pages_under_random_growth(page_size: int) -> None:
    """Requests growing side by side by random amounts (headroom placement, in-place growth,
    fresh runs): kv_runs always lists exactly the slots of the request's pages, in order,
    cut at the asked length."""
    rng = random.Random(page_size)
    kv = KVManager(num_pages=4096 // page_size, page_size=page_size, disable_radix_cache=True)
    reqs = [make_req(f"r{i}", [1] * rng.randint(1, 40)) for i in range(6)]
    for req in reqs:
        prefill(kv, req)
    for _ in range(200):
        req = rng.choice(reqs)
        grow = rng.randint(1, 9)
        req.input_ids += [2] * grow
        assert kv.allocate(req, grow)
        req.kv_len += grow
        want = [p * page_size + i for p in req.pages for i in range(page_size)]
        for n in (req.kv_len, max(req.kv_len - 1, 0), rng.randint(0, req.kv_len)):
            runs = kv.kv_runs(req, n)
            assert slots(runs) == want[:n]
            assert all(length > 0 for _, length in runs)
    assert max(len(kv.kv_runs(r, r.kv_len)) for r in reqs) < 20  # headroom keeps runs few
