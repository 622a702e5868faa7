"""How large HiCache's lower tiers are: host memory (L2) bounded by what the machine has free,
and disk (L3) as a multiple of the device pool.

The host tier holds --hicache-ratio (default 2) times the device pool's pages, at most
--hicache-size GiB per worker. Without --hicache-size the cap is what is free where the run
starts (`host_tier_free_bytes`): the kernel's MemAvailable, less the device pools and weights
this run will place in the same RAM (a CPU device: --mem-fraction-static of it), less a tenth
of RAM kept for everything else, split among the node's workers. It is decided once, where
the run starts (`with_host_tier`), and travels with the flags, so the scheduler and every
worker derive the same page counts (`tier_pages`). A setting that cannot fit is refused at
start-up with what fits: --hicache-size over what is free, or a --hicache-ratio whose tier
exceeds the cap.
"""

from __future__ import annotations

import dataclasses
import logging

from pipeserve.config import CacheConfig, EngineConfig, SettingsError
from pipeserve.device import available_memory, resolve_device, total_memory

log = logging.getLogger(__name__)

DEFAULT_HICACHE_RATIO = 2.0
KEPT_FREE_SHARE = 0.1  # of RAM, never given to the host tier (the OS, activations, Python)
GIB = 2**30


def local_workers(config: EngineConfig) -> int:
    """Workers on one node: the layout's ranks over the nodes, or the one in-process runner."""
    p = config.parallel
    return max(p.world_size // p.nnodes, 1) if p.uses_workers else 1


def host_tier_free_bytes(config: EngineConfig) -> int:
    """Bytes of host memory one worker's host tier may take: MemAvailable, less this run's
    device pools and weights where they live in RAM (a CPU device), less KEPT_FREE_SHARE of
    RAM, split among the node's workers (never below zero)."""
    ram = total_memory(resolve_device("cpu"))
    free = available_memory()
    if resolve_device(config.model.device).type == "cpu":  # the pools are allocated later
        free -= int(ram * config.cache.mem_fraction_static)
    free -= int(ram * KEPT_FREE_SHARE)
    return max(free, 0) // local_workers(config)


def with_host_tier(config: EngineConfig) -> EngineConfig:
    """`config` with the host tier's cap made concrete (--hicache-size in GiB per worker);
    unchanged without HiCache. Called once where a run starts. Raises SettingsError (via
    validation's type) when an explicit --hicache-size exceeds what is free."""
    c = config.cache
    if not c.enable_hierarchical_cache:
        return config
    free = host_tier_free_bytes(config)
    if c.hicache_size is not None:
        if c.hicache_size * GIB > free:
            raise SettingsError(
                f"--hicache-size {c.hicache_size:g} GiB per worker does not fit: "
                f"{free / GIB:.1f} GiB of host memory is free for it (MemAvailable, less this "
                "run's CPU pools and a tenth of RAM, per worker); use --hicache-size "
                f"{free / GIB:.1f} or less"
            )
        return config
    cache = dataclasses.replace(c, hicache_size=round(free / GIB, 3))
    log.info(
        "HiCache host tier: at most %.1f GiB per worker (free at start-up; --hicache-size sets it)",
        cache.hicache_size,
    )
    return dataclasses.replace(config, cache=cache)


def tier_pages(cache: CacheConfig, device_pages: int, token_bytes: int | None) -> tuple[int, int]:
    """(host, disk) pages of the lower tiers for a device pool of `device_pages` pages (page 0
    of which is padding), a token's cache taking `token_bytes` on a worker (the largest
    stage's: `stage_kv_bytes_per_token`; None: no cap, as in the simulator). The scheduler
    and every worker derive the same numbers. ValueError where an explicit --hicache-ratio
    exceeds the cap, or no page fits."""
    usable = device_pages - 1
    disk = int(cache.hicache_storage_ratio * usable) if cache.hicache_storage_dir else 0
    ratio = cache.hicache_ratio if cache.hicache_ratio is not None else DEFAULT_HICACHE_RATIO
    host = int(ratio * usable)
    if cache.hicache_size is None or token_bytes is None:
        return host, disk
    page_bytes = token_bytes * cache.page_size
    cap = int(cache.hicache_size * GIB) // page_bytes
    if cache.hicache_ratio is not None and host > cap:
        raise ValueError(
            f"--hicache-ratio {ratio:g} asks for {host * page_bytes / GIB:.1f} GiB of host "
            f"memory per worker; {cache.hicache_size:g} GiB is its cap (--hicache-size, or "
            f"what was free at start-up): use --hicache-ratio {cap / usable:.2f} or less"
        )
    host = min(host, cap)
    if host < 1:
        raise ValueError(
            f"no host memory for HiCache's tier: {cache.hicache_size:g} GiB per worker holds "
            f"no page of {page_bytes / 2**20:.1f} MiB; free memory or drop "
            "--enable-hierarchical-cache"
        )
    return host, disk
