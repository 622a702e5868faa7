"""Radix tree over token ids whose values are KV pages: requests that share a prompt prefix
share its KV. Pure Python, no tensors.

Invariants: every node's key is a whole number of pages; a node with `lock_ref > 0` (a
running request depends on it, or an ancestor of such a node) is never evicted; only
unlocked leaves are evicted, least recently used first.

With a lower tier (`LowerTiers`, pipeserve/mem_cache/hicache.py), a node evicted from the
device pool may keep its KV in host memory or on disk: it stays in the tree with no device
pages (`pages == []`) and its `host`/`disk` pages set. The device-resident nodes always form
a subtree holding the root (only a node none of whose children is device-resident leaves
the device), so along any path the device pages come first. Without a lower tier every
node is device-resident and the tree is exactly as before.

Eviction candidates sit in a lazy heap of (last access, seq, node): an entry is pushed
whenever a node may have become an unlocked leaf or was touched while being one, and is
checked when popped, so eviction costs O(log n) per freed node instead of a walk of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Protocol


class Node:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access", "host", "disk")

    def __init__(self, key: list[int], pages: list[int], parent: Node | None) -> None:
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = 0
        self.host: list[int] | None = None  # the lower tiers' pages of this node's KV
        self.disk: list[int] | None = None

    def __lt__(self, other: Node) -> bool:
        return self.last_access < other.last_access


class LowerTiers(Protocol):
    """Where nodes leaving the device pool go (pipeserve/mem_cache/hicache.py)."""

    def keep(self, node: Node, copy_down: bool) -> bool:
        """Whether the node's KV is held below the device, copying it down first if needed
        and `copy_down`; False: the node is then dropped."""
        ...

    def drop(self, node: Node) -> None:
        """Free the node's lower-tier pages (it leaves the tree)."""
        ...

    def split(self, upper: Node, lower: Node) -> None:
        """A node was cut in two: `upper` is new (it takes its share of lower-tier pages)."""
        ...

    def adopted(self, node: Node) -> None:
        """`insert` gave a node that had left the device the caller's pages (recomputed)."""
        ...


class RadixCache:
    def __init__(
        self,
        page_size: int,
        free_pages: Callable[[list[int]], None],
        lower: LowerTiers | None = None,
    ) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self.lower = lower
        self._clock = itertools.count(1)
        self.root = Node([], [], None)
        self.root.lock_ref = 1
        self.evictable_pages = 0  # pages in nodes nobody holds
        self.protected_pages = 0  # pages in nodes some request holds
        self.num_nodes = 0
        self._heap: list[tuple[int, int, Node]] = []  # eviction candidates (some stale)
        self._seq = itertools.count()

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Longest device-resident page-aligned prefix of `tokens`: its pages and the node
        where it ends (split so that the node ends exactly there)."""
        node, pages = self.root, []
        for child in self.match_path(tokens, device_only=True):
            pages.extend(child.pages)
            node = child
        return pages, node

    def match_path(self, tokens: list[int], device_only: bool = False) -> list[Node]:
        """The nodes of the longest cached page-aligned prefix of `tokens` in any tier (the
        device-resident ones first), the last split to end where the match does."""
        path = []
        for child, n in self._matches(tokens):
            if device_only and not child.pages:
                break
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            path.append(child)
        return path

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
        the tree already had on the device: those of the caller's pages are duplicates it
        must free; the rest now belong to the tree (also where a node on the path had left
        the device: it takes the caller's pages back)."""
        assert len(tokens) == len(pages) * self.page_size
        node, i, held = self.root, 0, None
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                self._add_leaf(node, tokens[i:], pages[i // self.page_size :])
                return i // self.page_size if held is None else held
            n = self._match_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            if not child.pages:
                held = i // self.page_size if held is None else held
                first = i // self.page_size
                self.attach_pages(child, pages[first : first + n // self.page_size])
                if self.lower is not None:
                    self.lower.adopted(child)
            self._touch(child)
            node, i = child, i + n
        return len(pages) if held is None else held

    def attach_pages(self, node: Node, pages: list[int]) -> None:
        """Device pages for a node that had left the device (loaded back or recomputed)."""
        assert not node.pages and len(pages) * self.page_size == len(node.key)
        node.pages = list(pages)
        if node.lock_ref:
            self.protected_pages += len(pages)
        else:
            self.evictable_pages += len(pages)
        self._push_if_candidate(node)

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

    def evict(self, num_pages: int, copy_down: bool = True) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first
        (fewer if not enough are evictable). Returns the number freed. `copy_down` False: a
        node whose KV no lower tier holds yet is dropped, not copied down (for pages about
        to be written before the copy would run)."""
        freed = 0
        while freed < num_pages and self._heap:
            access, _, leaf = heapq.heappop(self._heap)
            if not self._is_candidate(leaf) or leaf.last_access != access:
                continue  # stale: touched, locked, grown or evicted since it was pushed
            freed += self._leave_device(leaf, copy_down)
        return freed

    def _leave_device(self, leaf: Node, copy_down: bool) -> int:
        """Free a device-leaf's pages: it stays in the tree if a lower tier keeps its KV,
        else it goes with everything below it (held only in lower tiers)."""
        n = len(leaf.pages)
        kept = self.lower is not None and self.lower.keep(leaf, copy_down)
        self._free_pages(leaf.pages)
        leaf.pages = []
        self.evictable_pages -= n
        if kept:
            assert leaf.parent is not None
            self._push_if_candidate(leaf.parent)
        else:
            self.remove(leaf)
        return n

    def remove(self, node: Node) -> None:
        """Take a node that has left the device out of the tree, with its descendants (all
        off the device) and their lower-tier pages."""
        assert not node.pages and node.lock_ref == 0
        for child in list(node.children.values()):
            self.remove(child)
        if self.lower is not None:
            self.lower.drop(node)
        self.num_nodes -= 1
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None  # out of the tree: any heap entry for it is stale
        self._push_if_candidate(parent)

    def _touch(self, node: Node) -> None:
        node.last_access = next(self._clock)
        self._push_if_candidate(node)

    def _is_candidate(self, node: Node) -> bool:
        """An unlocked device-resident node none of whose children is device-resident."""
        return (
            node.parent is not None
            and bool(node.pages)
            and node.lock_ref == 0
            and not any(c.pages for c in node.children.values())
        )

    def _push_if_candidate(self, node: Node) -> None:
        if not self._is_candidate(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 4 * self.num_nodes + 64:  # mostly stale: rebuild
            self._heap = [
                (n.last_access, next(self._seq), n) for n in self.nodes() if self._is_candidate(n)
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
        cut = n // self.page_size
        upper = Node(child.key[:n], child.pages[:cut], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        self.num_nodes += 1
        child.key, child.pages = child.key[n:], child.pages[cut:]
        if child.host is not None:
            upper.host, child.host = child.host[:cut], child.host[cut:]
        if child.disk is not None:
            upper.disk, child.disk = child.disk[:cut], child.disk[cut:]
        if self.lower is not None:
            self.lower.split(upper, child)
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

    def nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                out.append(node)
        return out
