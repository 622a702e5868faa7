"""Prometheus metrics of the server (names, types and labels: docs/deployment.md#metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "pipeserve_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pipeserve_inter_token_latency_seconds",
            "time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pipeserve_prompt_tokens", "prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "pipeserve_generation_tokens", "tokens generated", registry=r
        )
        self.requests = Counter(
            "pipeserve_requests",
            "requests that reached the engine, once each, by how they ended (stop, length; "
            "abort: the client went away; error)",
            ["finish_reason"],
            registry=r,
        )
        self.running = Gauge("pipeserve_requests_running", "requests holding KV", registry=r)
        self.waiting = Gauge("pipeserve_requests_waiting", "requests queued", registry=r)
        self.kv_total = Gauge("pipeserve_kv_pages_total", "KV pages in the pool", registry=r)
        self.kv_free = Gauge(
            "pipeserve_kv_pages_free",
            "KV pages a new request can get now (unallocated or evictable cache)",
            registry=r,
        )
        self.kv_used = Gauge(
            "pipeserve_kv_pages_used", "KV pages held by requests (total - free)", registry=r
        )
        self.kv_cached = Gauge(
            "pipeserve_kv_pages_cached",
            "KV pages in the prefix cache (evictable or shared)",
            registry=r,
        )
        self.hit_rate = Gauge(
            "pipeserve_prefix_cache_hit_rate",
            "share of prompt tokens served from the prefix cache",
            registry=r,
        )
        self.stage_busy = Gauge(
            "pipeserve_stage_busy_seconds",
            "cumulative forward time of each pipeline stage",
            ["stage"],
            registry=r,
        )
        self.healthy = Gauge("pipeserve_healthy", "1 while every worker is alive", registry=r)
        self.tier_tokens = Gauge(
            "pipeserve_hicache_tokens",
            "KV tokens held in a HiCache tier below the device (host, disk)",
            ["tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            "pipeserve_hicache_capacity_tokens",
            "KV tokens a HiCache tier can hold (0: the tier is off)",
            ["tier"],
            registry=r,
        )
        self.tier_loaded = Gauge(
            "pipeserve_hicache_loaded_tokens",
            "prefix tokens loaded back to the device from a HiCache tier, since start",
            ["tier"],
            registry=r,
        )

        self._init_disaggregation(r)

    def _init_disaggregation(self, r: CollectorRegistry) -> None:
        """A decode server's KV transfers (prefill/decode disaggregation): totals since start
        are counters (`*_total`), what holds now gauges."""
        self.pd_transfers = Totals(
            "pipeserve_pd_transfers",
            "requests' KV transfers since start, by outcome (done, failed)",
            r,
            "state",
            ("done", "failed"),
        )
        self.pd_active = Gauge(
            "pipeserve_pd_transfers_active",
            "KV transfers now under way (pages reserved, KV arriving)",
            registry=r,
        )
        self.pd_waiting = Gauge(
            "pipeserve_pd_transfers_waiting", "KV transfers now waiting for pages", registry=r
        )
        self.pd_bytes = Totals("pipeserve_pd_transfer_bytes", "KV bytes received", r)
        self.pd_wire = Totals(
            "pipeserve_pd_transfer_wire_seconds",
            "time the links spent carrying received KV (per request its slowest rank)",
            r,
        )
        self.pd_exposed = Totals(
            "pipeserve_pd_transfer_exposed_seconds",
            "KV transfer time after the prefill side's last layer was computed (not hidden "
            "behind prefill)",
            r,
        )
        self.pd_dropped = Totals(
            "pipeserve_pd_kv_messages_dropped",
            "KV messages the receivers refused (no such room, another stage's layer or rank's "
            "heads, positions outside the room, a wrong size, malformed): late ones of aborted "
            "requests, or forged",
            r,
        )

    def update(self, stats: dict[str, Any], healthy: bool) -> None:
        self.healthy.set(1 if healthy else 0)
        if not stats:
            return
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_total.set(stats["kv_pages_total"])
        free = stats["kv_pages_free"] + stats["kv_pages_evictable"]
        self.kv_free.set(free)
        self.kv_used.set(stats["kv_pages_total"] - free)
        self.kv_cached.set(stats["kv_pages_cached"])
        lookups = stats["prefix_lookup_tokens"]
        self.hit_rate.set(stats["prefix_hit_tokens"] / lookups if lookups else 0.0)
        for stage, seconds in enumerate(stats.get("stage_busy_s", [])):
            self.stage_busy.labels(stage=str(stage)).set(seconds)
        for tier in ("host", "disk"):
            self.tier_tokens.labels(tier=tier).set(stats.get(f"hicache_{tier}_tokens", 0))
            capacity = stats.get(f"hicache_{tier}_capacity_tokens", 0)
            self.tier_capacity.labels(tier=tier).set(capacity)
            self.tier_loaded.labels(tier=tier).set(stats.get(f"hicache_loaded_{tier}_tokens", 0))
        if "pd_transfers_done" in stats:
            for state in ("done", "failed"):
                self.pd_transfers.reach(stats[f"pd_transfers_{state}"], state)
            self.pd_active.set(stats["pd_transfers_active"])
            self.pd_waiting.set(stats["pd_transfers_waiting"])
            self.pd_bytes.reach(stats["pd_transfer_bytes"])
            self.pd_wire.reach(stats["pd_transfer_wire_s"])
            self.pd_exposed.reach(stats["pd_transfer_exposed_s"])
            self.pd_dropped.reach(stats["pd_kv_messages_dropped"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Totals:
    """A Prometheus counter (exposed as `<name>_total`) fed with the engine's running totals:
    each update adds what the total grew by since the last one."""

    def __init__(
        self,
        name: str,
        help: str,
        registry: CollectorRegistry,
        label: str | None = None,
        values: tuple[str, ...] = (),
    ) -> None:
        self.counter = Counter(name, help, [label] if label else [], registry=registry)
        for value in values:  # exported at 0 from the start, not from the first event
            self.counter.labels(value)
        self.seen: dict[str, float] = {}

    def reach(self, total: float, label: str | None = None) -> None:
        key = label or ""
        grown = total - self.seen.get(key, 0.0)
        if grown > 0:
            (self.counter.labels(label) if label is not None else self.counter).inc(grown)
            self.seen[key] = total
