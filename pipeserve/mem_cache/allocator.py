"""KV page allocator: pure integer bookkeeping, no tensors.

A page holds `page_size` consecutive KV slots. Page 0 is never handed out: it is the
padding target of batched gathers. Free pages live in a bitmap (a bytearray), so a run of
free pages is found by C-speed substring search. Requests grow by extending their last run
in place when the next pages are free, which keeps most of a request's KV contiguous and
lets attention read it as a view instead of gathering it. A run that cannot grow in place
is started `headroom` pages past the previous tenant when there is room, so decoding
requests that take a page each per step do not end up interleaved page by page.
"""

from __future__ import annotations

FREE, USED = 1, 0


class PageAllocator:
    def __init__(self, num_pages: int, headroom: int = 0) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.headroom = headroom
        self._map = bytearray([FREE]) * num_pages
        self._map[0] = USED
        self.num_free = num_pages - 1

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    def alloc(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` pages, the ones right after page `after` when they are free, else a fresh run
        (with headroom on both sides if possible), else any free pages. None (nothing taken)
        if too few are free."""
        if n <= 0:
            return []
        if n > self.num_free:
            return None
        start = self._in_place(n, after)
        if start is None:
            start = self._fresh_run(n)
        pages = list(range(start, start + n)) if start is not None else self._scattered(n)
        for p in pages:
            self._map[p] = USED
        self.num_free -= n
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; a bad list (foreign, already free, repeated) changes nothing."""
        bad = next((p for p in pages if not 0 < p < self.num_pages or self._map[p] == FREE), None)
        if bad is None and len(set(pages)) != len(pages):
            bad = next(p for p in pages if pages.count(p) > 1)
        if bad is not None:
            raise ValueError(f"page {bad} is not allocated (double free or foreign page)")
        for p in pages:
            self._map[p] = FREE
        self.num_free += len(pages)

    def is_free(self, page: int) -> bool:
        return self._map[page] == FREE

    def _in_place(self, n: int, after: int | None) -> int | None:
        if after is None or after + 1 + n > self.num_pages:
            return None
        window = self._map[after + 1 : after + 1 + n]
        return after + 1 if window.count(FREE) == n else None

    def _fresh_run(self, n: int) -> int | None:
        """Start of the first free run of n pages; of the first one with `headroom` free pages
        before and after it, when there is one."""
        if self.headroom:
            found = self._map.find(bytes([FREE]) * (n + 2 * self.headroom))
            if found >= 0:
                return found + self.headroom
        found = self._map.find(bytes([FREE]) * n)
        return found if found >= 0 else None

    def _scattered(self, n: int) -> list[int]:
        pages: list[int] = []
        pos = self._map.find(FREE)
        while len(pages) < n:
            pages.append(pos)
            pos = self._map.find(FREE, pos + 1)
        return pages
