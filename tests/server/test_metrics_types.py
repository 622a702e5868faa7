"""Totals since start are Prometheus counters (`*_total`, TYPE counter) fed from the engine's
running totals; what holds now is a gauge. A decode server's PD metrics as an example."""

from __future__ import annotations

from typing import Any

from server_helpers import parse_metrics

from pipeserve.server.metrics import Metrics

BASE = {
    "num_running": 0,
    "num_waiting": 0,
    "kv_pages_total": 10,
    "kv_pages_free": 10,
    "kv_pages_evictable": 0,
    "kv_pages_cached": 0,
    "prefix_lookup_tokens": 0,
    "prefix_hit_tokens": 0,
}


def pd(done: int, failed: int, active: int, sent: int, dropped: int) -> dict[str, Any]:
    return {
        **BASE,
        "pd_transfers_done": done,
        "pd_transfers_failed": failed,
        "pd_transfers_active": active,
        "pd_transfers_waiting": 0,
        "pd_transfer_bytes": sent,
        "pd_transfer_wire_s": 0.5 * done,
        "pd_transfer_exposed_s": 0.1 * done,
        "pd_kv_messages_dropped": dropped,
    }


def test_pd_totals_are_counters_and_the_present_a_gauge() -> None:
    metrics = Metrics()
    text = metrics.render().decode()
    assert "# TYPE pipeserve_pd_transfers_total counter" in text
    assert "# TYPE pipeserve_pd_transfers_active gauge" in text
    # both outcomes exported at 0 before any transfer
    values = parse_metrics(text)
    assert values['pipeserve_pd_transfers_total{state="failed"}'] == 0
    for update in (pd(1, 0, 2, 100, 0), pd(3, 1, 1, 400, 5), pd(3, 1, 0, 400, 5)):
        metrics.update(update, healthy=True)
    values = parse_metrics(metrics.render().decode())
    assert values['pipeserve_pd_transfers_total{state="done"}'] == 3
    assert values['pipeserve_pd_transfers_total{state="failed"}'] == 1
    assert values["pipeserve_pd_transfer_bytes_total"] == 400  # the total, not a sum of totals
    assert values["pipeserve_pd_kv_messages_dropped_total"] == 5
    assert values["pipeserve_pd_transfer_wire_seconds_total"] == 1.5
    assert values["pipeserve_pd_transfers_active"] == 0  # the present: the last value
