"""Soak a server: start `pipeserve serve`, load it at a moderate rate for a while with
`pipeserve bench-serving`, and report each process's resident memory at the start and the end,
lost requests and the KV pages free afterwards. Prints and saves JSON.

    python benchmarks/soak.py --minutes 10 --json out/soak.json -- --pp-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_mib(pids: list[int]) -> dict[str, float]:
    out = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        name = "server" if b"serve" in cmd else "child"
        out[f"{pid} {name}"] = round(kb / 1024, 1)
    return out


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("pipeserve_") and " " in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=30177)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("serve_args", nargs="*", help="after --: flags for pipeserve serve")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    model = [] if "--model" in args.serve_args else ["--model", "bench"]  # as it always ran
    server = subprocess.Popen(
        [str(BIN / "pipeserve"), "serve", "--port", str(args.port), *model, *args.serve_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in server.stdout:  # type: ignore[union-attr]
            if "pipeserve ready" in line:
                break
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        start = rss_mib(tree(server.pid))
        prompts = int(args.minutes * 60 * args.rate)
        began = time.monotonic()
        load = subprocess.Popen(
            [
                str(BIN / "pipeserve"),
                "bench-serving",
                "--base-url",
                base,
                "--num-prompts",
                str(prompts),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--request-rate",
                str(args.rate),
                "--max-concurrency",
                "32",
                "--json",
                "/tmp/soak-load.json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        samples = []  # (minute, MiB per process): growth that levels off is warm-up
        while load.poll() is None:
            time.sleep(1)
            if time.monotonic() - began >= 60 * (len(samples) + 1):
                samples.append((len(samples) + 1, rss_mib(tree(server.pid))))
        out = load.stdout.read() if load.stdout else ""
        seconds = time.monotonic() - began
        time.sleep(2)
        end = rss_mib(tree(server.pid))
        m = metrics(base)
        report: dict[str, Any] = {
            "model": model,
            "minutes": round(seconds / 60, 2),
            "requests": prompts,
            "load_summary": out.strip().splitlines()[-6:],
            "rss_mib_start": start,
            "rss_mib_end": end,
            "rss_mib_per_minute": samples,
            "kv_pages_total": m.get("pipeserve_kv_pages_total"),
            "kv_pages_free_after": m.get("pipeserve_kv_pages_free"),
            "requests_total": {k: v for k, v in m.items() if "requests_total" in k},
            "healthy": httpx.get(base + "/health", timeout=30).status_code == 200,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
