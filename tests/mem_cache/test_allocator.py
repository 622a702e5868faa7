"""PageAllocator: page 0 reserved, in-place growth, first-fit runs, scattered fallback."""

from __future__ import annotations

import random

import pytest

from pipeserve.mem_cache.allocator import PageAllocator


def allocator_with_free(num_pages: int, free: list[int]) -> PageAllocator:
    """An allocator whose only free pages are `free`."""
    a = PageAllocator(num_pages)
    a.alloc(a.capacity)
    a.free(free)
    return a


def test_page_zero_is_reserved() -> None:
    a = PageAllocator(5)
    assert a.capacity == 4
    assert a.num_free == 4
    assert not a.is_free(0)
    assert a.alloc(4) == [1, 2, 3, 4]
    assert a.num_free == 0


def test_pool_needs_two_pages() -> None:
    with pytest.raises(ValueError, match="at least 2 pages, got 1"):
        PageAllocator(1)


@pytest.mark.parametrize("n", [0, -3])
def test_alloc_nothing(n: int) -> None:
    a = PageAllocator(4)
    assert a.alloc(n) == []
    assert a.num_free == 3


def test_alloc_grows_in_place_after_a_page() -> None:
    a = PageAllocator(11)
    first = a.alloc(3)
    assert a.alloc(2) == [4, 5]
    a.free(first)  # a first-fit run now starts at page 1
    assert a.alloc(2, after=5) == [6, 7]


def test_alloc_in_place_after_page_zero() -> None:
    assert PageAllocator(4).alloc(2, after=0) == [1, 2]


@pytest.mark.parametrize(
    ("after", "n", "expected"),
    [
        (4, 2, [2, 3]),  # page 5 is taken: first free run of 2
        (1, 3, [7, 8, 9]),  # pages 2, 3 are free but 4 is not: first free run of 3
        (10, 1, [2]),  # nothing after the last page
    ],
)
def test_in_place_falls_back_to_first_fit(after: int, n: int, expected: list[int]) -> None:
    a = allocator_with_free(11, [2, 3, 7, 8, 9, 10])
    assert a.alloc(n, after=after) == expected


def test_first_fit_skips_holes_too_small() -> None:
    a = allocator_with_free(10, [2, 5, 6, 7, 9])
    assert a.alloc(3) == [5, 6, 7]
    assert a.alloc(1) == [2]


def test_scattered_when_no_run_is_long_enough() -> None:
    a = allocator_with_free(10, [2, 4, 5, 8, 9])
    assert a.alloc(4) == [2, 4, 5, 8]
    assert a.num_free == 1
    assert a.is_free(9)


def test_alloc_returns_none_and_takes_nothing_when_short() -> None:
    a = allocator_with_free(10, [2, 4, 5])
    assert a.alloc(4) is None
    assert a.alloc(4, after=1) is None
    assert a.num_free == 3
    assert [p for p in range(10) if a.is_free(p)] == [2, 4, 5]


def test_free_returns_pages() -> None:
    a = PageAllocator(6)
    pages = a.alloc(5)
    a.free(pages[1:3])
    assert a.num_free == 2
    assert a.is_free(2) and a.is_free(3) and not a.is_free(4)
    assert a.alloc(2) == [2, 3]


@pytest.mark.parametrize("page", [0, 6, -1, 3])
def test_free_rejects_pages_not_allocated(page: int) -> None:
    a = PageAllocator(6)
    a.alloc(2)  # pages 1, 2 in use; 3 is free
    with pytest.raises(ValueError, match=f"page {page} is not allocated"):
        a.free([page])
    assert a.num_free == 3


def test_double_free_raises() -> None:
    a = PageAllocator(6)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="double free"):
        a.free(pages)
    assert a.num_free == 5


def test_rejected_free_changes_nothing() -> None:
    a = PageAllocator(6)
    pages = a.alloc(2)
    with pytest.raises(ValueError):
        a.free([pages[0], pages[0]])  # the same page twice in one call
    assert not a.is_free(pages[0])
    assert a.num_free == 3


def test_random_alloc_free_keeps_counts_consistent() -> None:
    rng = random.Random(0)
    a = PageAllocator(40)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            last = held[-1][-1] if held and held[-1] else None
            pages = a.alloc(rng.randint(1, 6), after=last)
            if pages is not None:
                held.append(pages)
        owned = [p for pages in held for p in pages]
        assert len(owned) == len(set(owned)), "a page was handed out twice"
        assert 0 not in owned
        assert a.num_free == a.capacity - len(owned)
        assert all(not a.is_free(p) for p in owned)
        assert sum(a.is_free(p) for p in range(a.num_pages)) == a.num_free


def test_headroom_leaves_room_for_neighbours_to_grow() -> None:
    a = PageAllocator(40, headroom=4)
    first = a.alloc(3)  # pages 5-7: four free pages before and after
    assert first == [5, 6, 7]
    second = a.alloc(2)  # first fit with headroom, past first's four pages of room
    assert second == [12, 13]
    assert a.alloc(4, after=first[-1]) == [8, 9, 10, 11]  # first grows in place
    assert a.alloc(1, after=first[-1] + 4) == [18]  # no room left: a fresh run, with headroom


def test_headroom_falls_back_to_first_fit_when_space_is_tight() -> None:
    a = allocator_with_free(12, [2, 3, 4, 8, 9])
    a.headroom = 2
    assert a.alloc(2) == [2, 3]  # no free run of 2 + 2 * 2 pages
    assert a.alloc(3) == [4, 8, 9]  # no run of 3 at all: scattered


def test_decoding_requests_stay_in_few_runs_with_headroom() -> None:
    """Eight requests taking one page each per step: without headroom every page is its own
    run; with it, a request's pages form about one run per headroom pages."""

    def runs_per_request(headroom: int) -> float:
        a = PageAllocator(2000, headroom=headroom)
        pages = [a.alloc(10) or [] for _ in range(8)]
        for _ in range(64):
            for p in pages:
                p.extend(a.alloc(1, after=p[-1]) or [])
        breaks = [sum(1 for x, y in zip(p, p[1:], strict=False) if y != x + 1) for p in pages]
        return 1 + sum(breaks) / len(pages)

    assert runs_per_request(0) > 60
    assert runs_per_request(16) <= 6
