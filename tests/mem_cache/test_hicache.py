"""HiCache's bookkeeping (pipeserve/mem_cache/hicache.py) against a simulated memory: every
KV slot of every tier holds the token whose KV it would be, the ops each batch carries are
applied in order as a worker would, and each chunk checks that every prefix position it
reads on the device holds the right token. Randomized runs with small tiers (shared prefixes
cut at many depths, two requests interleaved, both write policies, with and without a disk
tier, prefetch thresholds) check that and the tiers' accounting after every batch; fixed
cases check write-back at eviction, write-through one batch late, an eviction racing a load
of the same host pages, LRU order in the host tier, the prefetch threshold and a node
leaving the tree with its subtree."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pipeserve.mem_cache.hicache import DEVICE, DISK, HOST, CacheOp, HiCache
from pipeserve.mem_cache.radix_cache import Node
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams


@dataclass
class Sim:
    """A KV manager with HiCache over a simulated memory: tier -> slot -> token."""

    page_size: int
    device_pages: int
    host_pages: int
    disk_pages: int = 0
    write_through: bool = True
    threshold: int = 0
    mem: dict[str, dict[int, int]] = field(default_factory=dict)
    ops: list[CacheOp] = field(default_factory=list)  # every op so far, in order

    def __post_init__(self) -> None:
        self.hc = HiCache(
            self.page_size, self.host_pages, self.disk_pages, self.write_through, self.threshold
        )
        self.kv = KVManager(self.device_pages, self.page_size, False, self.hc)
        self.mem = {DEVICE: {}, HOST: {}, DISK: {}}
        self._ids = 0

    def start(self, tokens: list[int]) -> Req:
        self._ids += 1
        req = Req(f"r{self._ids}", list(tokens), SamplingParams(max_new_tokens=1))
        self.kv.match_prefix(req)
        return req

    def batch(self) -> list[CacheOp]:
        """Build a batch: its ops run on the simulated memory before its forward."""
        ops = self.kv.take_cache_ops()
        for op in ops:
            src, dst = self.mem[op.src], self.mem[op.dst]
            for s, d in zip(op.src_pages, op.dst_pages, strict=True):
                for i in range(self.page_size):
                    slot = s * self.page_size + i
                    if slot in src:
                        dst[d * self.page_size + i] = src[slot]
                    else:
                        dst.pop(d * self.page_size + i, None)
        self.ops += ops
        return ops

    def chunk(self, req: Req, n: int) -> None:
        """Schedule and run the next n prompt tokens of `req`."""
        assert self.kv.allocate(req, n)
        start = req.kv_len
        req.kv_len += n
        self.kv.cache_prefix(req)
        self.batch()
        dev = self.mem[DEVICE]
        for p in range(start):  # the prefix this chunk attends to
            assert dev.get(self._slot(req, p)) == req.seq[p], f"{req.rid} position {p}"
        for p in range(start, start + n):
            dev[self._slot(req, p)] = req.seq[p]

    def run(self, tokens: list[int], chunk: int = 16) -> int:
        """A whole prompt; returns the tokens served from the cache."""
        req = self.start(tokens)
        cached = req.kv_len
        while req.kv_len < len(tokens):
            self.chunk(req, min(chunk, len(tokens) - req.kv_len))
        self.kv.release(req, cache=True)
        return cached

    def _slot(self, req: Req, p: int) -> int:
        return req.pages[p // self.page_size] * self.page_size + p % self.page_size

    def check_accounting(self, running: list[Req]) -> None:
        tree, hc = self.kv.tree, self.hc
        assert tree is not None
        nodes = tree.nodes()
        device = sum(len(n.pages) for n in nodes)
        own = sum(len(r.pages) - r.cached_pages for r in running)
        assert self.kv.allocator.num_free + device + own == self.kv.allocator.capacity
        assert device == tree.cached_pages()
        assert hc.host.capacity - hc.host.num_free == sum(len(n.host or []) for n in nodes)
        assert {n for n in nodes if n.host is not None} == hc.on_host
        if hc.disk is not None:
            assert hc.disk.capacity - hc.disk.num_free == sum(len(n.disk or []) for n in nodes)
            assert {n for n in nodes if n.disk is not None} == hc.on_disk
        for n in nodes:
            assert n.pages or n.host is not None or n.disk is not None, "a node with no copy"
            parent = n.parent
            assert parent is not None
            if n.pages and parent is not tree.root:
                assert parent.pages, "a device-resident node below one that left the device"


def _prompts(rng: random.Random, bases: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        base = rng.choice(bases)
        cut = rng.randrange(0, len(base) + 1)
        out.append(base[:cut] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 40))])
    return out


@pytest.mark.parametrize("write_through", [True, False])
@pytest.mark.parametrize("disk_pages", [0, 40])
@pytest.mark.parametrize("threshold", [0, 12])
def test_random_workloads_read_the_right_kv(write_through, disk_pages, threshold) -> None:
    rng = random.Random(hash((write_through, disk_pages, threshold)) & 0xFFFF)
    sim = Sim(4, 56, 100, disk_pages, write_through, threshold)
    bases = [[rng.randrange(1, 1000) for _ in range(rng.randrange(40, 100))] for _ in range(10)]
    loaded = 0
    for _ in range(25):
        a, b = _prompts(rng, bases, 2)  # two requests interleaved chunk by chunk
        ra, rb = sim.start(a), sim.start(b)
        while ra.kv_len < len(a) or rb.kv_len < len(b):
            for req, toks in ((ra, a), (rb, b)):
                if req.kv_len < len(toks):
                    sim.chunk(req, min(rng.choice([4, 7, 16]), len(toks) - req.kv_len))
                    sim.check_accounting([ra, rb])
        for req in (ra, rb):
            sim.kv.release(req, cache=True)
        sim.check_accounting([])
        for p in _prompts(rng, bases, 3):
            sim.run(p, chunk=rng.choice([5, 16]))
            sim.check_accounting([])
        loaded = sim.hc.counters.loaded_host_tokens + sim.hc.counters.loaded_disk_tokens
    assert loaded > 0  # the lower tiers served hits (else the run checked nothing of them)
    if disk_pages:
        assert sim.hc.counters.to_disk_pages > 0


def test_write_back_copies_at_eviction_and_the_hit_loads_back() -> None:
    sim = Sim(4, 11, 8, write_through=False)  # 10 usable device pages
    a = list(range(1, 33))  # 8 pages
    sim.run(a + [99])
    assert sim.hc.counters.backed_up_pages == 0  # write-back: nothing copied yet
    sim.run(list(range(100, 133)))  # evicts a
    assert sim.hc.counters.backed_up_pages == 8
    cached = sim.run(a + [98])
    assert cached == 32 and sim.hc.counters.loaded_host_tokens == 32


def test_write_through_copies_one_batch_after_the_compute() -> None:
    sim = Sim(4, 20, 20, write_through=True)
    req = sim.start(list(range(1, 18)))
    sim.chunk(req, 16)  # computes pages 0-3 and caches them in this batch
    assert not [op for op in sim.ops if op.dst == HOST], "copied before it was computed"
    sim.chunk(req, 1)
    copies = [op for op in sim.ops if op.src == DEVICE and op.dst == HOST]
    assert sum(len(op.src_pages) for op in copies) == 4
    assert all(sim.mem[HOST][s] == t for s, t in _host_slots(sim, req.pages[:4], copies))


def _host_slots(sim: Sim, pages: list[int], copies: list[CacheOp]) -> list[tuple[int, int]]:
    """(host slot, token that device slot held) for the given device pages' copies."""
    out = []
    for op in copies:
        for s, d in zip(op.src_pages, op.dst_pages, strict=True):
            if s in pages:
                for i in range(sim.page_size):
                    out.append((d * sim.page_size + i, sim.mem[DEVICE][s * sim.page_size + i]))
    return out


def test_an_eviction_racing_a_load_of_the_same_host_pages() -> None:
    """The host tier is full of prefix `a`. Loading `a` back needs device room, which evicts
    `b`, whose copy would take host pages `a` is being read from: `a` is locked, so the host
    tier gives none of it up and `b` goes to disk. Were the pages taken, the op order (the
    read before any overwrite) would still keep the load right; the memory check in `chunk`
    catches either mistake."""
    sim = Sim(4, 11, 8, disk_pages=8, write_through=False)
    a, b = list(range(1, 33)), list(range(100, 132))
    sim.run(a + [7])
    sim.run(b + [7])  # a: device -> host (8 pages)
    assert sim.hc.counters.backed_up_pages == 8
    req = sim.start(a + [8])  # loads a; b must leave the device
    assert req.kv_len == 32
    ops = sim.batch()
    load = [op for op in ops if op.dst == DEVICE]
    assert load and load[0].src == HOST
    evict_b = [op for op in ops if op.src == DEVICE]
    assert evict_b and all(op.dst == DISK for op in evict_b)
    host_reads = {p for op in load for p in op.src_pages}
    for i, op in enumerate(ops):  # any write to host pages a is read from comes after the read
        if op.dst == HOST and host_reads & set(op.dst_pages):
            assert i > ops.index(load[0])
    sim.chunk(req, 1)  # checks every position of a on the device
    sim.kv.release(req, cache=True)
    assert sim.run(b + [9]) == 32 and sim.hc.counters.loaded_disk_tokens == 32


def test_host_tier_evicts_least_recently_used_first() -> None:
    sim = Sim(4, 6, 12, write_through=False)  # 5 usable device pages, 3 prompts' worth of host
    x, y, w, z, v = (list(range(k, k + 16)) for k in (1, 100, 200, 300, 400))
    for p in (x, y, w):
        sim.run(p + [1])  # each evicts the one before: host holds x, y
    assert sim.run(x + [2]) == 16  # x loaded back (w goes to the host): x is the newest use
    sim.run(z + [1])  # x leaves the device (its host copy stays)
    sim.run(v + [1])  # z needs host room: y, the least recently used, goes
    tree = sim.kv.tree
    assert tree is not None
    assert tree.prefix_length(x + [0]) == 16
    assert tree.prefix_length(w + [0]) == 16
    assert tree.prefix_length(y + [0]) == 0
    sim.check_accounting([])


def test_short_lower_tier_hits_are_recomputed() -> None:
    sim = Sim(4, 6, 8, write_through=False, threshold=17)
    a = list(range(1, 17))  # 16 tokens < threshold
    sim.run(a + [1])
    sim.run(list(range(100, 116)) + [1])  # a: device -> host
    assert sim.run(a + [2]) == 0
    assert sim.hc.counters.skipped_loads == 1 and sim.hc.counters.loaded_host_tokens == 0
    tree = sim.kv.tree
    assert tree is not None
    assert [bool(n.pages) for n in tree.match_path(a)] == [True]  # recomputed pages adopted
    sim.check_accounting([])


def test_without_room_below_a_node_leaves_with_its_subtree() -> None:
    sim = Sim(4, 6, 4, write_through=False)  # host holds 4 pages
    base = list(range(1, 9))
    tail1, tail2 = list(range(10, 18)), list(range(20, 28))
    sim.run(base + tail1 + [1])
    sim.run(base + tail2 + [1])  # splits base off; tail1 goes to the host
    sim.run(list(range(100, 116)) + [1])  # tail2, then base to the host; tail1 dropped
    tree = sim.kv.tree
    assert tree is not None
    assert tree.prefix_length(base + tail1 + [0]) == 8
    assert tree.prefix_length(base + tail2 + [0]) == 16
    dropped = sim.hc.counters.dropped_pages
    sim.run(list(range(200, 216)) + [1])  # base (older than tail2) goes, and tail2 with it
    assert tree.prefix_length(base + tail2 + [0]) == 0
    assert sim.hc.counters.dropped_pages == dropped + 4
    sim.check_accounting([])


def test_loads_and_backups_travel_as_ops_in_batch_order() -> None:
    sim = Sim(4, 12, 16, write_through=True)
    sim.run(list(range(1, 33)) + [5])
    first = sim.batch()
    assert first == [] or all(isinstance(op, CacheOp) for op in first)
    assert all(len(op.src_pages) == len(op.dst_pages) for op in sim.ops)
    assert all(0 not in op.src_pages + op.dst_pages for op in sim.ops)  # page 0 is padding


def test_the_tree_keeps_nodes_below_the_device() -> None:
    sim = Sim(4, 6, 8)
    a = list(range(1, 17))
    sim.run(a + [1])
    sim.run(list(range(100, 116)) + [1])
    tree = sim.kv.tree
    assert tree is not None
    path = tree.match_path(a)
    assert [len(n.key) for n in path] == [16]
    node: Node = path[0]
    assert not node.pages and node.host is not None
    assert tree.match_prefix(a) == ([], tree.root)  # the device part only


def test_slots_lent_outside_requests_never_get_copied_down() -> None:
    """A start-up profile writes lent slots at once, before the next batch's copies would
    run: a node evicted for them is dropped (or kept where a lower tier already holds it),
    never copied from pages the profile overwrites."""
    sim = Sim(4, 11, 16, write_through=False)
    a, b = list(range(1, 17)), list(range(100, 116))
    sim.run(a + [1])
    sim.run(b + [1])  # cached: a, b (4 pages each) on the device only
    runs, give_back = sim.kv.lend(32)  # 8 pages: both must go
    assert sum(n for _, n in runs) == 32
    assert sim.kv.take_cache_ops() == []
    give_back()
    tree = sim.kv.tree
    assert tree is not None and tree.prefix_length(a + [0]) == tree.prefix_length(b + [0]) == 0
    sim.check_accounting([])


def test_write_through_never_copies_a_recomputed_node_before_it_is_computed() -> None:
    """A node held only on disk is recomputed (its hit under the prefetch threshold) and takes
    the new pages in the batch being built; a write-through entry of its child, queued a
    batch earlier, walks up to it in that same batch's copies. Copied then, the host would
    hold pages not yet computed, and a later hit load them: the node must wait."""
    sim = Sim(4, 12, 8, disk_pages=16, write_through=True, threshold=10**6)
    tree, hc = sim.kv.tree, sim.hc
    assert tree is not None
    p, d = list(range(1, 17)), list(range(20, 28))
    sim.run(p + d + [1])
    sim.batch()  # write-through copies made
    tree.evict(100)  # off the device (the host has them)
    hc._make_room(HOST, hc.host.capacity, tree.root)  # host -> disk
    path = tree.match_path(p + d)
    assert [len(n.key) for n in path] == [16, 8]  # the chunks' inserts
    assert all(not n.pages and n.host is None and n.disk is not None for n in path)
    req = sim.start(p + [2])  # no load (threshold): p is recomputed
    assert req.kv_len == 0
    assert sim.kv.allocate(req, 16)
    req.kv_len = 16
    sim.kv.cache_prefix(req)  # p's node takes the request's pages, filled by this batch
    p_node, d_node = tree.match_path(p + d)
    assert p_node.pages and not d_node.pages
    hc._written.append((hc._batches - 1, d_node))  # d's entry, from the batch before
    sim.batch()
    assert p_node.host is None  # not copied before its forward
    for i in range(16):
        sim.mem[DEVICE][sim._slot(req, i)] = p[i]  # the forward
    sim.chunk(req, 1)  # the next batch copies it (and checks p's positions)
    assert p_node.host is not None
    sim.kv.release(req, cache=True)
    hc.prefetch_threshold = 0
    tree.evict(100)
    assert sim.run(p + [3]) == 16 and hc.counters.loaded_host_tokens == 16
