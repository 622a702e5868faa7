"""A model runner's KV below the device: its layers' and heads' pages in host memory (L2)
and in a file on disk (L3), laid out like the device pool's buffers, and the copies the
scheduler's `CacheOp`s ask for (pipeserve/mem_cache/hicache.py has the bookkeeping).

The disk tier is one file per worker in --hicache-storage-dir, read and written with
pread/pwrite (so the OS page cache serves it as it would any file, and dropping that cache
makes it read from the disk). Its space is reserved at start (`posix_fallocate`: a disk too
small fails there, not mid-serve), and it is unlinked as soon as it is open, so it is gone
when the worker exits however it exits. Nothing survives a restart: reusing KV from an
earlier run would need proof that the weights, dtype, layout and page size are the same,
and a file of another model's KV read as this one's gives wrong tokens silently.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch

from pipeserve.device import queues_on_streams
from pipeserve.mem_cache.hicache import DEVICE, DISK, HOST, CacheOp
from pipeserve.mem_cache.kv_pool import KVPool

Buffers = list[tuple[torch.Tensor, int]]  # (buffer, the dimension that indexes slots)


class TierStore:
    def __init__(
        self,
        pool: KVPool,
        page_size: int,
        host_pages: int,
        disk_pages: int,
        storage_dir: str | None,
        name: str,
    ) -> None:
        self.page_size = page_size
        device = pool.slot_buffers()
        self.tiers: dict[str, Buffers] = {DEVICE: device}
        # on a device with streams: host pages pinned, copies synchronised
        self.on_cuda = pin = queues_on_streams(device[0][0].device)
        host_slots = (host_pages + 1) * page_size
        # not written: the kernel commits its pages as copies first land in them, like the
        # device pool's on a CPU (pinned memory, for a GPU, is committed at once); its size is
        # capped by what was free at start (pipeserve/mem_cache/host_tier.py)
        self.tiers[HOST] = [
            (torch.empty(_with_slots(b, dim, host_slots), dtype=b.dtype, pin_memory=pin), dim)
            for b, dim in device
        ]
        self.disk: DiskTier | None = None
        if disk_pages:
            assert storage_dir is not None
            slots = (disk_pages + 1) * page_size
            self.disk = DiskTier(device, slots, storage_dir, name)

    def close(self) -> None:
        """Give the disk tier's space back."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def run(self, ops: list[CacheOp]) -> None:
        """Carry out a batch's copies, in order."""
        for op in ops:
            self.copy(op)

    def copy(self, op: CacheOp) -> None:
        """Page runs consecutive on both sides (the allocators hand out runs) are copied as
        slices, in one pass each."""
        known = (*self.tiers, DISK) if self.disk is not None else tuple(self.tiers)
        if op.src not in known or op.dst not in known:
            raise ValueError(f"cache op {op.src} -> {op.dst}: this worker has no such tier")
        ps = self.page_size
        runs = [(s * ps, d * ps, n * ps) for s, d, n in _paired_runs(op.src_pages, op.dst_pages)]
        if op.src == DISK:
            assert self.disk is not None
            self.disk.read(runs, self.tiers[op.dst])
        elif op.dst == DISK:
            assert self.disk is not None
            self.disk.write(runs, self.tiers[op.src])
        else:
            for (src, dim), (dst, _) in zip(self.tiers[op.src], self.tiers[op.dst], strict=True):
                for s, d, n in runs:
                    dst.narrow(dim, d, n).copy_(src.narrow(dim, s, n), non_blocking=True)
        if self.on_cuda:
            torch.cuda.current_stream().synchronize()  # pinned host pages may be reused next


class DiskTier:
    """Buffers shaped like the device ones with `slots` slots, one after another in a file:
    a buffer viewed as [outer, slots, inner] keeps each (outer index, run of slots) in one
    contiguous byte range, read or written with one call."""

    def __init__(self, device: Buffers, slots: int, storage_dir: str, name: str) -> None:
        self.slots = slots
        self.layout: list[tuple[int, int, int]] = []  # (file offset, outer, inner bytes)
        size = 0
        for buf, dim in device:
            outer = math.prod(buf.shape[:dim])
            inner = math.prod(buf.shape[dim + 1 :]) * buf.dtype.itemsize
            self.layout.append((size, outer, inner))
            size += outer * slots * inner
        directory = Path(storage_dir)
        directory.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(
            prefix=f"pipeserve-hicache-{name}-", suffix=".kv", dir=directory
        )
        os.unlink(path)  # gone with the last descriptor, however the worker exits
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            raise OSError(
                f"--hicache-storage-dir {storage_dir}: cannot reserve {size / 2**30:.2f} GiB "
                f"for the disk tier ({exc.strerror}); lower --hicache-storage-ratio or free "
                "space"
            ) from None
        self.fd = fd

    def read(self, runs: list[tuple[int, int, int]], into: Buffers) -> None:
        """Slot runs (file slot, buffer slot, count) into the buffers."""
        for (offset, outer, inner), (buf, dim) in zip(self.layout, into, strict=True):
            rows = _rows(buf, dim)
            for s, d, n in runs:
                for o in range(outer):
                    part = rows[o, d : d + n]
                    staged = part if part.is_cpu else torch.empty_like(part, device="cpu")
                    at = offset + (o * self.slots + s) * inner
                    got = os.preadv(self.fd, [_bytes(staged)], at)
                    if got != n * inner:
                        raise OSError(f"disk tier: short read ({got} of {n * inner} bytes)")
                    if staged is not part:
                        part.copy_(staged)

    def write(self, runs: list[tuple[int, int, int]], source: Buffers) -> None:
        """Slot runs (buffer slot, file slot, count) of the buffers into the file."""
        for (offset, outer, inner), (buf, dim) in zip(self.layout, source, strict=True):
            rows = _rows(buf, dim)
            for s, d, n in runs:
                for o in range(outer):
                    part = rows[o, s : s + n].cpu()
                    at = offset + (o * self.slots + d) * inner
                    os.pwritev(self.fd, [_bytes(part)], at)

    def close(self) -> None:
        os.close(self.fd)


def _rows(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """A contiguous buffer as [outer, slots, inner bytes]."""
    outer = math.prod(buf.shape[:dim])
    return buf.view(torch.uint8).view(outer, buf.shape[dim], -1)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy().data).cast("B")


def _paired_runs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, pages) of the runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _with_slots(buf: torch.Tensor, dim: int, slots: int) -> list[int]:
    shape = list(buf.shape)
    shape[dim] = slots
    return shape
