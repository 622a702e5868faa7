"""HiCache's bookkeeping: the host-memory (L2) and disk (L3) tiers below the device KV pool.

Pure integer bookkeeping, like the allocator and the radix tree: each tier's pages come from
a `PageAllocator`, and moving KV between tiers is a `CacheOp` that the scheduler attaches to
the next batch it builds. Every model runner (each holding its own layers and KV heads of
every tier) carries out a batch's ops in order before the batch's forward, so every stage and
rank holds the same pages in every tier: the hit length the scheduler uses is one that every
stage holds, by construction.

- Eviction from the device pool (`keep`, called by the tree) copies the node's pages to the
  host tier unless a copy is there already (write-through made one), and the host tier to
  the disk tier when the host tier needs room. Each tier evicts least recently used first,
  never a node a request holds; a node whose last copy goes leaves the tree with the nodes
  below it (deeper nodes are never used more recently than their ancestors, so LRU takes
  them first anyway).
- write_through: a node's pages are copied to the host tier in the batch after the one that
  computed them (ops run before a batch's forward, so the copy waits for the next batch);
  write_back: only when the device pool evicts it.
- A lookup (`load`) takes the tree path in any tier; the part below the device, when at least
  `prefetch_threshold` tokens long, gets device pages and is copied up before the request's
  first chunk runs, so those chunks are skipped.

Ordering is what makes this safe without acknowledgements: an op that reads pages always
runs before any later op or forward that overwrites them, on every worker, because ops and
forwards run in the order the scheduler issued them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.mem_cache.allocator import PageAllocator
from pipeserve.mem_cache.radix_cache import Node, RadixCache

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class CacheOp:
    """Copy pages between tiers: src_pages[i] of tier `src` to dst_pages[i] of tier `dst`."""

    src: str
    dst: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]

    def wire_check(self) -> None:
        """ValueError unless the tiers differ and each page pairs with one (`wire`)."""
        if self.src not in TIERS or self.dst not in TIERS or self.src == self.dst:
            raise ValueError(f"a cache op between tiers {self.src!r} and {self.dst!r}")
        pages = self.src_pages + self.dst_pages
        if len(self.src_pages) != len(self.dst_pages) or any(p < 1 for p in pages):
            raise ValueError("a cache op's pages: as many of each, all positive")


@dataclass
class TierCounters:
    """Pages moved and tokens served, since start."""

    backed_up_pages: int = 0  # device -> host (write-through or eviction)
    to_disk_pages: int = 0  # host or device -> disk
    loaded_host_tokens: int = 0  # prefix tokens loaded back from the host tier
    loaded_disk_tokens: int = 0  # and from the disk tier
    skipped_loads: int = 0  # lower-tier hits under the prefetch threshold (recomputed)
    dropped_pages: int = 0  # lower-tier pages whose KV left the cache for good


@dataclass
class HiCache:
    page_size: int
    host_pages: int
    disk_pages: int  # 0: no disk tier
    write_through: bool
    prefetch_threshold: int  # tokens
    tree: RadixCache = field(init=False)
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        self.host = PageAllocator(self.host_pages + 1)  # page 0 is never handed out
        self.disk = PageAllocator(self.disk_pages + 1) if self.disk_pages else None
        self.on_host: set[Node] = set()
        self.on_disk: set[Node] = set()
        self._ops: list[CacheOp] = []
        self._written: list[tuple[int, Node]] = []  # write-through: (batch count, node)
        self._adopted: dict[Node, int] = {}  # nodes whose device pages the batch numbered
        # here computes (recomputed after leaving the device): not to be copied before it
        self._batches = 0  # batches built so far

    # -- what the tree calls -------------------------------------------------------------

    def keep(self, node: Node, copy_down: bool) -> bool:
        if node.host is not None or node.disk is not None:
            return True
        if not copy_down:
            return False
        n = len(node.pages)
        host = self._take(HOST, n, node)
        if host is not None:
            self._backup(node, host)
            return True
        disk = self._take(DISK, n, node) if self.disk is not None else None
        if disk is None:
            return False
        self._emit(DEVICE, DISK, node.pages, disk)
        node.disk = disk
        self.on_disk.add(node)
        self.counters.to_disk_pages += n
        return True

    def drop(self, node: Node) -> None:
        for tier in (HOST, DISK):
            pages = self._pages(node, tier)
            if pages is not None:
                self._free(node, tier)
                self.counters.dropped_pages += len(pages)

    def split(self, upper: Node, lower: Node) -> None:
        if upper.host is not None:
            self.on_host.add(upper)
        if upper.disk is not None:
            self.on_disk.add(upper)
        if lower in self._adopted:
            self._adopted[upper] = self._adopted[lower]

    def adopted(self, node: Node) -> None:
        """A node that had left the device got device pages the batch being built fills."""
        self._adopted[node] = self._batches
        self.written(node)

    # -- what the KV manager calls -------------------------------------------------------

    def written(self, node: Node) -> None:
        """A node (and its ancestors) now caches KV computed by the batch being built."""
        if self.write_through:
            self._written.append((self._batches, node))

    def load(self, nodes: list[Node], alloc: PageAllocator) -> int:
        """Device pages for `nodes` (the path's part below the device, locked by the caller),
        copied up from the host tier or else the disk tier, in path order; stops where the
        device pool has no room. Returns how many nodes are now device-resident."""
        tokens = sum(len(n.key) for n in nodes)
        if tokens < self.prefetch_threshold:
            self.counters.skipped_loads += 1
            return 0
        for i, node in enumerate(nodes):
            n = len(node.key) // self.page_size
            if alloc.num_free < n:
                self.tree.evict(n - alloc.num_free)
            pages = alloc.alloc(n)
            if pages is None:
                return i
            if node.host is not None:
                self._emit(HOST, DEVICE, node.host, pages)
                self.counters.loaded_host_tokens += len(node.key)
            else:
                assert node.disk is not None
                self._emit(DISK, DEVICE, node.disk, pages)
                self.counters.loaded_disk_tokens += len(node.key)
            self.tree.attach_pages(node, pages)
        return len(nodes)

    def take_ops(self) -> list[CacheOp]:
        """The ops for the batch being built (write-through copies of what earlier batches
        computed included); the next batch's start here."""
        pending, self._written = self._written, []
        self._adopted = {n: b for n, b in self._adopted.items() if b >= self._batches}
        for stamp, node in pending:
            if stamp < self._batches:
                self._write_through(node)
            else:
                self._written.append((stamp, node))
        self._batches += 1
        ops, self._ops = self._ops, []
        return ops

    def tokens(self, tier: str) -> tuple[int, int]:
        """(used, capacity) of a lower tier, in tokens."""
        if tier == DISK and self.disk is None:
            return 0, 0
        alloc, _ = self._tier(tier)
        return (alloc.capacity - alloc.num_free) * self.page_size, alloc.capacity * self.page_size

    # -- inside ----------------------------------------------------------------------------

    def _write_through(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:  # still in the tree
            fresh = self._adopted.get(node, -1) >= self._batches  # computed by this batch
            if node.pages and node.host is None and not fresh:
                host = self._take(HOST, len(node.pages), node)
                if host is None:
                    return
                self._backup(node, host)
            node = node.parent

    def _backup(self, node: Node, host: list[int]) -> None:
        self._emit(DEVICE, HOST, node.pages, host)
        node.host = host
        self.on_host.add(node)
        self.counters.backed_up_pages += len(host)

    def _emit(self, src: str, dst: str, src_pages: list[int], dst_pages: list[int]) -> None:
        self._ops.append(CacheOp(src, dst, tuple(src_pages), tuple(dst_pages)))

    def _take(self, tier: str, n: int, exclude: Node) -> list[int] | None:
        """n pages of a lower tier, evicting its least recently used nodes for room."""
        alloc, _ = self._tier(tier)
        if n > alloc.capacity:
            return None
        if alloc.num_free < n:
            self._make_room(tier, n - alloc.num_free, exclude)
        return alloc.alloc(n)

    def _make_room(self, tier: str, short: int, exclude: Node) -> None:
        alloc, members = self._tier(tier)
        target = alloc.num_free + short
        while alloc.num_free < target:
            free = [n for n in members if n.lock_ref == 0 and n is not exclude]
            if not free:
                return
            for node in sorted(free, key=lambda n: n.last_access):
                if alloc.num_free >= target:
                    return
                if node in members and node.parent is not None:  # not gone meanwhile
                    self._leave(node, tier, exclude)

    def _leave(self, node: Node, tier: str, exclude: Node) -> None:
        """A node's pages leave a lower tier: the host tier's go down to the disk tier when
        the node has no copy elsewhere; a node left with no copy leaves the tree."""
        if tier == HOST and not node.pages and node.disk is None and self.disk is not None:
            disk = self._take(DISK, len(node.key) // self.page_size, exclude)
            if node.host is None:  # left with an ancestor while the disk tier made room
                if disk is not None:
                    self.disk.free(disk)
                return
            if disk is not None:
                self._emit(HOST, DISK, node.host, disk)
                node.disk = disk
                self.on_disk.add(node)
                self.counters.to_disk_pages += len(disk)
        pages = self._pages(node, tier)
        assert pages is not None
        self._free(node, tier)
        if not node.pages and node.host is None and node.disk is None:
            self.counters.dropped_pages += len(pages)
            self.tree.remove(node)

    def _tier(self, tier: str) -> tuple[PageAllocator, set[Node]]:
        """A lower tier's page allocator and the nodes holding pages in it."""
        if tier == HOST:
            return self.host, self.on_host
        assert self.disk is not None
        return self.disk, self.on_disk

    def _pages(self, node: Node, tier: str) -> list[int] | None:
        return node.host if tier == HOST else node.disk

    def _free(self, node: Node, tier: str) -> None:
        alloc, members = self._tier(tier)
        pages = self._pages(node, tier)
        assert pages is not None
        alloc.free(pages)
        if tier == HOST:
            node.host = None
        else:
            node.disk = None
        members.discard(node)
