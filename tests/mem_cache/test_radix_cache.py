"""RadixCache: match/insert/split, page alignment, lock accounting, LRU eviction, and a
randomized run against a reference model of who owns each page."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pipeserve.mem_cache.allocator import PageAllocator
from pipeserve.mem_cache.radix_cache import Node, RadixCache


def make_tree(page_size: int = 1) -> tuple[RadixCache, list[int]]:
    """A tree whose evictions are recorded, in order, in the returned list."""
    freed: list[int] = []
    return RadixCache(page_size, freed.extend), freed


def nodes(tree: RadixCache) -> list[Node]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def child_keys(node: Node) -> list[list[int]]:
    return sorted(c.key for c in node.children.values())


# -- insert and match -------------------------------------------------------------------


def test_insert_then_match_whole_and_longer() -> None:
    tree, _ = make_tree()
    assert tree.insert([1, 2, 3], [10, 11, 12]) == 0
    pages, node = tree.match_prefix([1, 2, 3])
    assert pages == [10, 11, 12]
    assert node.key == [1, 2, 3]
    assert tree.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12]
    assert tree.evictable_pages == 3


def test_match_miss_returns_root() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2], [10, 11])
    pages, node = tree.match_prefix([2, 1])
    assert pages == []
    assert node is tree.root
    assert tree.match_prefix([]) == ([], tree.root)


def test_partial_match_splits_the_node() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    pages, node = tree.match_prefix([1, 2, 9])
    assert pages == [10, 11]
    assert node.key == [1, 2] and node.pages == [10, 11]
    assert child_keys(node) == [[3, 4]]
    assert node.parent is tree.root
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    assert tree.cached_pages() == 4  # splitting neither adds nor loses pages


def test_insert_of_a_diverging_sequence_splits_and_shares_the_prefix() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert tree.insert([1, 2, 5, 6], [20, 21, 22, 23]) == 2
    (shared,) = tree.root.children.values()
    assert shared.key == [1, 2] and shared.pages == [10, 11]
    assert child_keys(shared) == [[3, 4], [5, 6]]
    assert tree.match_prefix([1, 2, 5, 6])[0] == [10, 11, 22, 23]
    assert tree.cached_pages() == 6  # the caller still owns (and must free) pages 20, 21


@pytest.mark.parametrize(
    ("tokens", "already"),
    [
        ([1, 2, 3, 4], 4),  # the same sequence again
        ([1, 2], 2),  # a prefix of a cached sequence
        ([1, 2, 3, 4, 5], 4),  # a cached sequence plus one page
        ([7, 8], 0),  # nothing in common
    ],
)
def test_insert_returns_pages_already_present(tokens: list[int], already: int) -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    before = tree.cached_pages()
    new_pages = list(range(50, 50 + len(tokens)))
    assert tree.insert(tokens, new_pages) == already
    assert tree.cached_pages() == before + len(tokens) - already
    assert tree.match_prefix(tokens)[0][already:] == new_pages[already:]


def test_page_size_alignment() -> None:
    tree, _ = make_tree(page_size=2)
    assert tree.insert([1, 2, 3, 4], [5, 6]) == 0
    assert tree.match_prefix([1, 2, 3])[0] == [5]  # an incomplete page is never matched
    assert tree.match_prefix([1, 2, 3, 9])[0] == [5]
    assert tree.match_prefix([1, 9, 3, 4])[0] == []  # the first page differs
    pages, node = tree.match_prefix([1, 2, 3, 4, 7])
    assert pages == [5, 6]
    assert node.key == [3, 4] and node.pages == [6]  # split at a page boundary above


def test_split_lands_on_a_page_boundary() -> None:
    tree, _ = make_tree(page_size=2)
    tree.insert([1, 2, 3, 4], [5, 6])
    assert tree.insert([1, 2, 3, 7], [8, 9]) == 1  # tokens 1..3 agree, but only 1 page
    (shared,) = tree.root.children.values()
    assert shared.key == [1, 2] and shared.pages == [5]
    assert child_keys(shared) == [[3, 4], [3, 7]]
    assert tree.match_prefix([1, 2, 3, 7])[0] == [5, 9]


def test_insert_rejects_unaligned_tokens() -> None:
    tree, _ = make_tree(page_size=2)
    with pytest.raises(AssertionError):
        tree.insert([1, 2, 3], [5, 6])


# -- locks ------------------------------------------------------------------------------


def test_lock_protects_the_path_and_counts_references() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, node = tree.match_prefix([1, 2])
    tree.lock(node)
    tree.lock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (2, 2)
    tree.unlock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (2, 2)
    tree.unlock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 4)
    with pytest.raises(AssertionError, match="unlocked more often than locked"):
        tree.unlock(node)


def test_lock_of_a_deep_node_protects_its_ancestors() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 5, 6], [20, 21, 22, 23])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.lock(node)
    assert node.parent is not None and node.parent.lock_ref == 1
    assert (tree.protected_pages, tree.evictable_pages) == (4, 2)


def test_split_of_a_locked_node_keeps_accounting() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, deep = tree.match_prefix([1, 2, 3, 4])
    tree.lock(deep)
    _, upper = tree.match_prefix([1, 2, 9])  # splits the locked node
    assert upper.lock_ref == 1 and deep.parent is upper
    assert tree.protected_pages == 4
    tree.unlock(deep)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 4)
    assert all(n.lock_ref == 0 for n in nodes(tree))


# -- eviction ---------------------------------------------------------------------------


def test_evict_least_recently_used_leaf_first() -> None:
    tree, freed = make_tree()
    tree.insert([1, 1], [10, 11])
    tree.insert([2, 2], [20, 21])
    tree.insert([3, 3], [30, 31])
    tree.match_prefix([1, 1])  # touch: [2, 2] is now the oldest
    assert tree.evict(1) == 2  # a whole leaf goes, even if fewer pages were asked for
    assert freed == [20, 21]
    assert tree.evict(3) == 4
    assert freed == [20, 21, 30, 31, 10, 11]
    assert tree.cached_pages() == 0 and tree.root.children == {}


def test_evict_never_touches_locked_nodes() -> None:
    tree, freed = make_tree()
    tree.insert([1, 1], [10, 11])
    tree.insert([2, 2], [20, 21])
    _, node = tree.match_prefix([1, 1])
    tree.lock(node)
    assert tree.evict(100) == 2
    assert freed == [20, 21]
    assert tree.match_prefix([1, 1])[0] == [10, 11]
    assert (tree.protected_pages, tree.evictable_pages) == (2, 0)


def test_parent_is_evicted_after_its_children() -> None:
    tree, freed = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 5, 6], [20, 21, 22, 23])
    assert tree.evict(100) == 6
    assert sorted(freed[:4]) == [12, 13, 22, 23]  # leaves first
    assert freed[4:] == [10, 11]
    assert tree.cached_pages() == 0 and tree.root.children == {}


def test_parent_of_a_locked_child_stays() -> None:
    tree, freed = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 5, 6], [20, 21, 22, 23])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.lock(node)
    assert tree.evict(100) == 2
    assert freed == [22, 23]
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]


def test_evict_stops_once_enough_is_freed() -> None:
    tree, freed = make_tree()
    for t in range(1, 6):
        tree.insert([t], [t * 10])
    assert tree.evict(2) == 2
    assert freed == [10, 20]  # inserted first = least recently used
    assert tree.evictable_pages == 3


def test_evict_does_not_walk_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction pops candidates from a heap kept up to date by insert/match/lock/unlock; a
    walk of every node per call (what it did before) would make each eviction O(tree)."""
    tree, freed = make_tree()
    held = []
    for i in range(500):  # 500 locked branches and 5 evictable ones
        tree.insert([i, 1000 + i], [2 * i, 2 * i + 1])
        _, node = tree.match_prefix([i, 1000 + i])
        if i >= 5:
            tree.lock(node)
            held.append(node)
    monkeypatch.setattr(RadixCache, "nodes", lambda self: pytest.fail("walked the tree"))
    tree.match_prefix([3, 1003])  # touched: now the most recently used of the five
    assert tree.evict(1) == 2 and freed == [0, 1]
    assert tree.evict(100) == 8 and freed[2:] == [2, 3, 4, 5, 8, 9, 6, 7]
    tree.unlock(held[0])  # branch 5 becomes evictable
    assert tree.evict(1) == 2 and freed[-2:] == [10, 11]


def test_evict_on_empty_tree() -> None:
    tree, freed = make_tree()
    assert tree.evict(5) == 0 and freed == []


# -- prefix_length: a lookup that changes nothing -----------------------------------------


def shape(tree: RadixCache) -> tuple[object, ...]:
    """All that a lookup could change: every node (key, pages, parent, locks, recency), the
    page counters and the eviction heap."""
    described = sorted(
        (n.key, n.pages, n.parent.key if n.parent else [], n.lock_ref, n.last_access)
        for n in nodes(tree)
    )
    counts = (tree.num_nodes, tree.evictable_pages, tree.protected_pages, len(tree._heap))
    return described, counts


def four_token_pages() -> RadixCache:
    """Page size 4: [0..7] with children [8..11] (locked) and [50..53]; and [100..107]."""
    tree, _ = make_tree(page_size=4)
    tree.insert(list(range(12)), [10, 11, 12])
    tree.insert(list(range(8)) + [50, 51, 52, 53], [10, 11, 20])
    tree.insert(list(range(100, 108)), [30, 31])
    tree.lock(tree.match_prefix(list(range(12)))[1])
    return tree


LOOKUPS = [  # tokens, the page-aligned length of their cached prefix
    (list(range(12)), 12),
    (list(range(14)), 12),  # the tail is shorter than a page
    (list(range(10)), 8),  # ends inside a page
    (list(range(4)) + [9] * 8, 4),  # leaves [0..7] after one page (match_prefix splits it)
    (list(range(6)) + [9] * 6, 4),  # leaves [0..7] inside its second page
    (list(range(8)) + [50, 51, 52, 53, 54], 12),
    (list(range(100, 106)), 4),  # ends inside a leaf
    ([100, 101, 102], 0),  # less than a page
    ([5, 6, 7, 8], 0),
    ([], 0),
]


def test_prefix_length_is_page_aligned_and_changes_nothing() -> None:
    tree = four_token_pages()
    before = shape(tree)
    assert [tree.prefix_length(tokens) for tokens, _ in LOOKUPS] == [n for _, n in LOOKUPS]
    assert shape(tree) == before


def test_prefix_length_agrees_with_match_prefix_which_it_leaves_as_it_was() -> None:
    looked, untouched = four_token_pages(), four_token_pages()
    lengths = [looked.prefix_length(tokens) for tokens, _ in LOOKUPS]
    for (tokens, _), n in zip(LOOKUPS, lengths, strict=True):
        pages = looked.match_prefix(tokens)[0]
        assert pages == untouched.match_prefix(tokens)[0]
        assert len(pages) * 4 == n
    assert shape(looked) == shape(untouched)  # same splits, same recency, same heap


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_length_matches_the_reference_model(page_size: int) -> None:
    model = Model(random.Random(99 + page_size), page_size, num_pages=24)
    for _ in range(300):
        model.step()
        tokens = model.random_tokens()
        if model.live and model.rng.random() < 0.5:  # often a prefix the tree may hold
            tokens = model.rng.choice(model.live).tokens + tokens
        before = shape(model.tree)
        expected = len(model.expected_match(tokens)) * page_size
        assert model.tree.prefix_length(tokens) == expected, f"lookup of {tokens}"
        assert shape(model.tree) == before


# -- randomized run against a reference model -------------------------------------------


@dataclass
class LiveRequest:
    tokens: list[int]
    node: Node
    cached: list[int]  # pages shared with the tree
    own: list[int] = field(default_factory=list)  # pages only this request holds


class Model:
    """Drives a RadixCache like the KV manager does and checks it against plain dicts:
    `page_of[prefix]` is the page holding the last page of `prefix`, for every cached prefix."""

    def __init__(self, rng: random.Random, page_size: int, num_pages: int) -> None:
        self.rng, self.ps = rng, page_size
        self.alloc = PageAllocator(num_pages)
        self.tree = RadixCache(page_size, self._tree_frees)
        self.page_of: dict[tuple[int, ...], int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.live: list[LiveRequest] = []

    def _tree_frees(self, pages: list[int]) -> None:
        """Called with the victim still in the tree: it must be the least recently used
        unlocked leaf."""
        leaves = [n for n in nodes(self.tree) if not n.children and n.lock_ref == 0]
        victim = next(n for n in leaves if n.pages == pages)
        assert victim.last_access == min(n.last_access for n in leaves), "not LRU"
        for p in pages:
            del self.page_of[self.prefix_of.pop(p)]
        self.alloc.free(pages)

    def random_tokens(self) -> list[int]:
        return [self.rng.randint(1, 3) for _ in range(self.rng.randint(1, 4 * self.ps))]

    def expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for end in range(self.ps, len(tokens) + 1, self.ps):
            page = self.page_of.get(tuple(tokens[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def start(self) -> None:
        tokens = self.random_tokens()
        expected = self.expected_match(tokens)
        cached, node = self.tree.match_prefix(tokens)
        assert cached == expected, f"match of {tokens}"
        self.tree.lock(node)
        req = LiveRequest(tokens, node, cached)
        need = -(-len(tokens) // self.ps) - len(cached)
        if need > self.alloc.num_free:
            self.tree.evict(need - self.alloc.num_free)
        own = self.alloc.alloc(need)
        if own is None:
            self.tree.unlock(node)
            return
        req.own = own
        self.live.append(req)

    def finish(self) -> None:
        req = self.live.pop(self.rng.randrange(len(self.live)))
        full = len(req.tokens) // self.ps
        pages = req.cached + req.own
        expected = len(self.expected_match(req.tokens[: full * self.ps]))
        existing = self.tree.insert(req.tokens[: full * self.ps], pages[:full])
        assert existing == expected
        for i in range(existing, full):
            prefix = tuple(req.tokens[: (i + 1) * self.ps])
            self.page_of[prefix], self.prefix_of[pages[i]] = pages[i], prefix
        self.alloc.free(pages[len(req.cached) : existing] + pages[full:])
        self.tree.unlock(req.node)

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.5:
            self.start()
        elif r < 0.9 and self.live:
            self.finish()
        else:
            self.tree.evict(self.rng.randint(1, 4))
        self.check()

    def check(self) -> None:
        tree_nodes = nodes(self.tree)
        in_tree = [p for n in tree_nodes for p in n.pages]
        held = [p for r in self.live for p in r.own]
        free = [p for p in range(1, self.alloc.num_pages) if self.alloc.is_free(p)]
        everything = in_tree + held + free
        assert sorted(everything) == list(range(1, self.alloc.num_pages)), "page owned twice"
        assert len(free) == self.alloc.num_free
        assert sorted(in_tree) == sorted(self.prefix_of)
        for n in tree_nodes:
            holders = sum(self._on_path(n, r.node) for r in self.live)
            assert n.lock_ref == holders
            assert len(n.key) == len(n.pages) * self.ps
        protected = sum(len(n.pages) for n in tree_nodes if n.lock_ref)
        assert self.tree.protected_pages == protected
        assert self.tree.evictable_pages == len(in_tree) - protected

    @staticmethod
    def _on_path(node: Node, leaf: Node | None) -> bool:
        while leaf is not None:
            if leaf is node:
                return True
            leaf = leaf.parent
        return False


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_operations_keep_every_page_owned_once(page_size: int) -> None:
    model = Model(random.Random(1234 + page_size), page_size, num_pages=24)
    for _ in range(400):
        model.step()
    while model.live:
        model.finish()
    model.tree.evict(model.alloc.capacity)
    model.check()
    assert model.alloc.num_free == model.alloc.capacity
    assert model.page_of == {}
