"""Radix tree over token ids whose values are KV pages: requests that share a prompt prefix
share its KV. Pure Python, no tensors.

Invariants: every node's key is a whole number of pages; a node with `lock_ref > 0` (a
running request depends on it, or an ancestor of such a node) is never evicted; only
unlocked leaves are evicted, least recently used first.

Eviction candidates sit in a lazy heap of (last access, seq, node): an entry is pushed
whenever a node may have become an unlocked leaf or was touched while being one, and is
checked when popped, so eviction costs O(log n) per freed node instead of a walk of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator


class Node:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: Node | None) -> None:
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: Node) -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self._clock = itertools.count(1)
        self.root = Node([], [], None)
        self.root.lock_ref = 1
        self.evictable_pages = 0  # pages in nodes nobody holds
        self.protected_pages = 0  # pages in nodes some request holds
        self.num_nodes = 0
        self._heap: list[tuple[int, int, Node]] = []  # eviction candidates (some stale)
        self._seq = itertools.count()

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Longest cached page-aligned prefix of `tokens`: its pages and the node where it
        ends (split so that the node ends exactly there)."""
        node, pages = self.root, []
        for child, n in self._matches(tokens):
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            pages.extend(child.pages)
            node = child
        return pages, node

    def prefix_length(self, tokens: list[int]) -> int:
        """Tokens of the longest cached page-aligned prefix of `tokens`; unlike
        `match_prefix` it changes nothing (no split, no recency update)."""
        return sum(n for _, n in self._matches(tokens))

    def _matches(self, tokens: list[int]) -> Iterator[tuple[Node, int]]:
        """The nodes along the longest cached page-aligned prefix of `tokens`, each with how
        many of its leading tokens match (all of them but perhaps in the last node). The
        caller may split a yielded node: the walk has finished with it."""
        node, i = self.root, 0
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                return
            n = self._match_len(child.key, tokens, i)
            whole = n == len(child.key)
            yield child, n
            if not whole:
                return
            node, i = child, i + n

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Cache `pages` as the KV of `tokens` (page-aligned). Returns how many leading pages
        the tree already had: those of the caller's pages are duplicates it must free; the
        rest now belong to the tree."""
        assert len(tokens) == len(pages) * self.page_size
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                self._add_leaf(node, tokens[i:], pages[i // self.page_size :])
                return i // self.page_size
            n = self._match_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            node, i = child, i + n
        return len(pages)

    def lock(self, node: Node) -> None:
        """A request now depends on the path root..node."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix node unlocked more often than locked"
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                self._push_if_candidate(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first
        (fewer if not enough are evictable). Returns the number freed."""
        freed = 0
        while freed < num_pages and self._heap:
            access, _, leaf = heapq.heappop(self._heap)
            if not self._is_candidate(leaf) or leaf.last_access != access:
                continue  # stale: touched, locked, grown or evicted since it was pushed
            freed += self._remove_leaf(leaf)
        return freed

    def _remove_leaf(self, leaf: Node) -> int:
        self._free_pages(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        self.num_nodes -= 1
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        leaf.parent = None  # out of the tree: any heap entry for it is stale
        self._push_if_candidate(parent)
        return len(leaf.pages)

    def _touch(self, node: Node) -> None:
        node.last_access = next(self._clock)
        self._push_if_candidate(node)

    def _is_candidate(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_candidate(self, node: Node) -> None:
        if not self._is_candidate(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 4 * self.num_nodes + 64:  # mostly stale: rebuild
            self._heap = [
                (n.last_access, next(self._seq), n) for n in self._nodes() if self._is_candidate(n)
            ]
            heapq.heapify(self._heap)

    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def _child_key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.page_size])

    def _match_len(self, key: list[int], tokens: list[int], start: int) -> int:
        n = min(len(key), len(tokens) - start)
        if key[:n] != tokens[start : start + n]:
            n = next(j for j in range(n) if key[j] != tokens[start + j])
        return n - n % self.page_size

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after its first n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:n], child.pages[: n // self.page_size], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        self.num_nodes += 1
        child.key, child.pages = child.key[n:], child.pages[n // self.page_size :]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        return upper

    def _add_leaf(self, parent: Node, key: list[int], pages: list[int]) -> None:
        leaf = Node(list(key), list(pages), parent)
        parent.children[self._child_key(key, 0)] = leaf
        self.evictable_pages += len(pages)
        self.num_nodes += 1
        self._touch(leaf)

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                out.append(node)
        return out
