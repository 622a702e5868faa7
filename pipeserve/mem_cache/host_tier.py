"""How much of the host's RAM a run takes where it starts, and how large HiCache's lower tiers
are: host memory (L2) bounded by what the machine has free, and disk (L3) as a multiple of
the device pool.

Where a run starts (`with_host_memory`, once: the result travels with the flags, so the
scheduler and every worker derive the same numbers) it counts the RAM the other pipeserve runs
of this host have claimed (mem_cache/host_reservations.py) as taken:
- a CPU device's pools and weights take --mem-fraction-static of RAM, lowered to what the
  other runs left (RAM less their claims, less a tenth kept for everything else); with none
  left the run is refused, naming the runs that hold it;
- the host tier holds --hicache-ratio (default 2) times the device pool's pages, at most
  --hicache-size GiB per worker. Without --hicache-size the cap is what is free
  (`host_tier_free_bytes`): the kernel's MemAvailable, or RAM less the other runs' claims
  where that is less (their pools fill lazily, so MemAvailable does not show them yet), less
  the pools and weights this run will place in the same RAM (a CPU device), less a tenth of
  RAM, split among the node's workers. A setting that cannot fit is refused at start-up with
  what fits: --hicache-size over what is free, or a --hicache-ratio whose tier exceeds the cap.
The run then claims what it will fill (`claim_bytes`): the CPU pools and weights and the host
tier.
"""

from __future__ import annotations

import dataclasses
import logging

from pipeserve.config import CacheConfig, EngineConfig, SettingsError
from pipeserve.device import available_memory, resolve_device, total_memory
from pipeserve.mem_cache.host_reservations import Claim, claimed_bytes, describe

log = logging.getLogger(__name__)

DEFAULT_HICACHE_RATIO = 2.0
KEPT_FREE_SHARE = 0.1  # of RAM, never given to pools or tiers (the OS, activations, Python)
MIN_FRACTION = 0.02  # of RAM: less left than this for a run's pools is refused
GIB = 2**30


def local_workers(config: EngineConfig) -> int:
    """Workers on one node: the layout's ranks over the nodes, or the one in-process runner."""
    p = config.parallel
    return max(p.world_size // p.nnodes, 1) if p.uses_workers else 1


def _single_host(config: EngineConfig) -> bool:
    return config.parallel.nnodes == 1


def _pools_in_ram(config: EngineConfig) -> bool:
    """Whether the device pools and weights live in this host's RAM, sized from
    --mem-fraction-static (a CPU device, no --max-total-tokens)."""
    on_cpu = resolve_device(config.model.device).type == "cpu"
    return on_cpu and config.cache.max_total_tokens is None


def host_tier_free_bytes(config: EngineConfig, others: int = 0) -> int:
    """Bytes of host memory one worker's host tier may take: MemAvailable (or RAM less `others`,
    the other runs' claims, where less), less this run's pools and weights where they live in
    RAM (a CPU device), less KEPT_FREE_SHARE of RAM, split among the node's workers (never
    below zero)."""
    ram = total_memory(resolve_device("cpu"))
    free = min(available_memory(), ram - others)
    if resolve_device(config.model.device).type == "cpu":  # the pools are allocated later
        free -= int(ram * config.cache.mem_fraction_static)
    free -= int(ram * KEPT_FREE_SHARE)
    return max(free, 0) // local_workers(config)


def with_host_memory(config: EngineConfig) -> EngineConfig:
    """`config` sized to the RAM this host has left for the run: --mem-fraction-static lowered
    to what the other runs' claims leave (pools and weights on a CPU device), and HiCache's
    host tier cap made concrete (--hicache-size in GiB per worker). Called once where a run
    starts. Raises SettingsError when nothing is left, or an explicit --hicache-size exceeds
    what is free."""
    counted = _pools_in_ram(config) or config.cache.enable_hierarchical_cache
    others, claims = claimed_bytes() if counted and _single_host(config) else (0, [])
    if _pools_in_ram(config) and others:
        config = _fraction_left(config, others, claims)
    return _with_host_tier(config, others)


def _fraction_left(config: EngineConfig, others: int, claims: list[Claim]) -> EngineConfig:
    ram = total_memory(resolve_device("cpu"))
    left = ram * (1 - KEPT_FREE_SHARE) - others
    fraction = config.cache.mem_fraction_static
    if left < ram * MIN_FRACTION:
        raise SettingsError(
            f"no RAM left for this run's weights and KV cache: other pipeserve runs on this "
            f"host claim {others / GIB:.1f} of {ram / GIB:.1f} GiB ({describe(claims)}), and a "
            "tenth is kept free; stop one, or size this run with --max-total-tokens"
        )
    if left >= ram * fraction:
        return config
    log.info(
        "other pipeserve runs on this host claim %.1f GiB of RAM (%s): this run takes %.2f "
        "of RAM for its weights and KV cache instead of --mem-fraction-static %.2f",
        others / GIB,
        describe(claims),
        left / ram,
        fraction,
    )
    cache = dataclasses.replace(config.cache, mem_fraction_static=round(left / ram, 4))
    return dataclasses.replace(config, cache=cache)


def claim_bytes(config: EngineConfig) -> int:
    """RAM of this host the run (sized by `with_host_memory`) will fill: its pools and
    weights on a CPU device, and its host tier (per worker, times the node's workers). A run
    sized by --max-total-tokens claims its host tier only."""
    if not _single_host(config):
        return 0
    ram = total_memory(resolve_device("cpu"))
    claim = int(ram * config.cache.mem_fraction_static) if _pools_in_ram(config) else 0
    if config.cache.enable_hierarchical_cache and config.cache.hicache_size is not None:
        claim += int(config.cache.hicache_size * GIB) * local_workers(config)
    return claim


def _with_host_tier(config: EngineConfig, others: int) -> EngineConfig:
    """`config` with the host tier's cap made concrete; unchanged without HiCache."""
    c = config.cache
    if not c.enable_hierarchical_cache:
        return config
    free = host_tier_free_bytes(config, others)
    if c.hicache_size is not None:
        if c.hicache_size * GIB > free:
            raise SettingsError(
                f"--hicache-size {c.hicache_size:g} GiB per worker does not fit: "
                f"{free / GIB:.1f} GiB of host memory is free for it (MemAvailable, less this "
                "run's CPU pools, other runs' claims and a tenth of RAM, per worker); use "
                f"--hicache-size {free / GIB:.1f} or less"
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
