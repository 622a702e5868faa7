"""Per-request KV bookkeeping: the page allocator and the radix prefix cache together.

A request's pages are [shared prefix from the tree | its own pages]. `_runs` keeps the same
pages as runs of consecutive KV slots, maintained incrementally, so describing where a
request's KV lives is a list copy plus a trim of the last run, not a walk over its tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeserve.mem_cache.allocator import PageAllocator
from pipeserve.mem_cache.hicache import CacheOp, HiCache
from pipeserve.mem_cache.radix_cache import Node, RadixCache
from pipeserve.scheduler.batch import Run
from pipeserve.scheduler.request import Req, SamplingParams

GROWTH_ROOM_SLOTS = 64  # a request's run starts this far past its neighbour when space allows


def _append_runs(runs: list[Run], pages: list[int], page_size: int) -> None:
    """Extend slot runs by whole pages, merging a page that continues the last run."""
    for p in pages:
        start = p * page_size
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + page_size)
        else:
            runs.append((start, page_size))


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        disable_radix_cache: bool,
        hicache: HiCache | None = None,
    ) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, headroom=max(1, GROWTH_ROOM_SLOTS // page_size))
        self.hicache = hicache
        self.tree = (
            None if disable_radix_cache else RadixCache(page_size, self.allocator.free, hicache)
        )
        if hicache is not None:
            assert self.tree is not None, "the hierarchical cache needs the radix cache"
            hicache.tree = self.tree
        self._runs: dict[str, list[Run]] = {}  # slot runs of each request's pages
        self.hit_tokens = 0  # prompt tokens served from the prefix cache
        self.lookup_tokens = 0  # prompt tokens looked up

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    def available_tokens(self) -> int:
        """Tokens that could be allocated now (free pages plus evictable cached pages)."""
        evictable = self.tree.evictable_pages if self.tree else 0
        return (self.allocator.num_free + evictable) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, req: Req) -> None:
        """Reuse cached KV for the longest known prefix (keeping at least one token to
        compute). Requests that still need prompt logprobs compute everything."""
        assert not req.pages
        self._runs[req.rid] = []
        if self.tree is None or req.wants_prompt_logprobs:
            return
        pages, node = self._match(req.seq[: req.seq_len - 1])
        self.tree.lock(node)
        req.last_node = node
        req.pages, req.cached_pages = list(pages), len(pages)
        req.kv_len = req.cached_tokens = len(pages) * self.page_size
        _append_runs(self._runs[req.rid], pages, self.page_size)

    def _match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """The device pages of the longest cached prefix and the node where it ends, after
        loading the part held only in lower tiers (HiCache) back to the device."""
        assert self.tree is not None
        if self.hicache is None:
            return self.tree.match_prefix(tokens)
        path = self.tree.match_path(tokens)
        resident = next((i for i, n in enumerate(path) if not n.pages), len(path))
        if resident < len(path):
            self.tree.lock(path[-1])  # nothing on the path may leave while others make room
            resident += self.hicache.load(path[resident:], self.allocator)
            self.tree.unlock(path[-1])
        path = path[:resident]
        return [p for n in path for p in n.pages], path[-1] if path else self.tree.root

    def take_cache_ops(self) -> list[CacheOp]:
        """Copies between cache tiers for the batch being built (none without HiCache)."""
        return self.hicache.take_ops() if self.hicache is not None else []

    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of a prompt the prefix cache holds now (a lookup only:
        nothing is locked, a later match may find less)."""
        return self.tree.prefix_length(tokens[:-1]) if self.tree is not None else 0

    def record_admission(self, req: Req) -> None:
        """Prefix-cache statistics, counted once per admitted request."""
        self.lookup_tokens += len(req.input_ids)
        self.hit_tokens += min(req.cached_tokens, len(req.input_ids))

    def cache_prefix(self, req: Req) -> None:
        """Put the request's full pages into the tree as soon as they are scheduled, so a
        request admitted later shares them even while this one is still running. (Safe
        before the KV is computed: every executor runs batches in the order they were
        scheduled.) Where another request cached the same tokens first, adopt its pages
        and free ours."""
        if self.tree is None:
            return
        full = min(req.kv_len, req.seq_len) // self.page_size
        if full <= req.cached_pages:
            return
        tokens = req.seq[: full * self.page_size]
        existing = self.tree.insert(tokens, req.pages[:full])
        pages, node = self.tree.match_prefix(tokens)
        if existing > req.cached_pages:
            self.allocator.free(req.pages[req.cached_pages : existing])
            req.pages[req.cached_pages : existing] = pages[req.cached_pages : existing]
            self._runs[req.rid] = []
            _append_runs(self._runs[req.rid], req.pages, self.page_size)
        self.tree.lock(node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node, req.cached_pages = node, full
        if self.hicache is not None:
            self.hicache.written(node)

    def allocate(self, req: Req, num_tokens: int, copy_down: bool = True) -> bool:
        """Pages for `num_tokens` more tokens after req.kv_len (evicting cached prefixes if
        needed; see RadixCache.evict for `copy_down`). False, with nothing taken, when memory
        is short."""
        need = self.pages_for(req.kv_len + num_tokens) - len(req.pages)
        if need <= 0:
            return True
        short = need - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short, copy_down)
        pages = self.allocator.alloc(need, after=req.pages[-1] if req.pages else None)
        if pages is None:
            return False
        req.pages.extend(pages)
        _append_runs(self._runs.setdefault(req.rid, []), pages, self.page_size)
        return True

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back a request's KV; with `cache`, its full pages go into the prefix cache."""
        own_from = req.cached_pages
        if self.tree is not None and cache:
            full = min(req.kv_len, req.seq_len) // self.page_size
            tokens = req.seq[: full * self.page_size]
            existing = self.tree.insert(tokens, req.pages[:full])
            self.allocator.free(req.pages[own_from:existing])  # duplicates of cached pages
            own_from = full
            if self.hicache is not None and full:
                self.hicache.written(self.tree.match_prefix(tokens)[1])
        self.allocator.free(req.pages[own_from:])
        if req.last_node is not None:
            assert self.tree is not None
            self.tree.unlock(req.last_node)
        req.pages, req.cached_pages, req.kv_len, req.last_node = [], 0, 0, None
        self._runs.pop(req.rid, None)

    def lend(self, num_tokens: int) -> tuple[list[Run], Callable[[], None]]:
        """Slots for work outside any request (e.g. a start-up profile), and the function
        that gives them back."""
        holder = Req("__lent__", [0], SamplingParams(max_new_tokens=0))
        self._runs[holder.rid] = []
        # lent slots are written before the next batch's tier copies would run: nothing is
        # copied down from them
        if not self.allocate(holder, num_tokens, copy_down=False):
            self._runs.pop(holder.rid)
            raise ValueError(
                f"{num_tokens} KV tokens are needed (e.g. for the dynamic chunking profile) but "
                f"only {self.available_tokens()} are free; raise --max-total-tokens"
            )
        holder.kv_len = num_tokens
        return self.kv_runs(holder, num_tokens), lambda: self.release(holder, cache=False)

    def kv_runs(self, req: Req, num_tokens: int) -> list[Run]:
        """Slot runs holding the KV of positions [0, num_tokens)."""
        runs = self._runs[req.rid]
        excess = len(req.pages) * self.page_size - num_tokens
        assert excess >= 0, f"request {req.rid} has KV pages for fewer than {num_tokens} tokens"
        keep = len(runs)
        while excess and runs[keep - 1][1] <= excess:  # whole runs past num_tokens go, then
            keep -= 1
            excess -= runs[keep][1]
        out = runs[:keep]  # the last one is trimmed
        if excess:
            out[-1] = (out[-1][0], out[-1][1] - excess)
        return out
