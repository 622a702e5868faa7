"""Prefill/decode disaggregation measures (spec 05), with real servers and the router.

transfer  one long prompt through the router: the KV bytes the decode side received, the
          time the link spent carrying them, the part of it after the prefill side's
          last layer was computed (exposed), so the share hidden behind prefill is
          1 - exposed / wire; and TTFT disaggregated vs the same prompt co-located on the
          prefill server. `--netlab RATE` puts the prefill and decode servers on two
          emulated nodes (network namespaces joined by a veth pair limited with tc tbf:
          needs root), the router and this client beside the decode server.
tpot      decode TPOT (p50/p99 of one long generation's token gaps) alone and while N
          long prompts are prefilled at once: co-located (one server, one core) vs
          disaggregated (prefill server on core 0, decode server on core 1).

python benchmarks/pd_bench.py transfer --netlab 1gbit --input-len 16384 --json t.json
python benchmarks/pd_bench.py tpot --prefills 4 --prefill-len 8192 --json d.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
PIPESERVE = str(Path(sys.executable).parent / "pipeserve")
READY_S = 600.0
NS0, NS1 = f"pspd-{os.getpid()}-n0", f"pspd-{os.getpid()}-n1"
ADDR0, ADDR1 = "10.124.0.1", "10.124.0.2"


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]  # within every preset's vocabulary


# -- processes ------------------------------------------------------------------------------


class Proc:
    def __init__(self, cmd: list[str], log: Path, ready: str) -> None:
        self.log = log
        self._file = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._file, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + READY_S
        while ready not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self._file.close()


def serve(
    args: argparse.Namespace,
    port: int,
    log: Path,
    extra: list[str],
    core: int | None,
    netns: str | None = None,
) -> Proc:
    cmd = [PIPESERVE, "serve", "--model", args.model, "--dtype", args.dtype, "--port", str(port)]
    cmd += ["--chunked-prefill-size", str(args.chunk), "--max-total-tokens", str(args.pool)]
    cmd += ["--served-model-name", "m", "--threads-per-worker", "1", *extra]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return Proc(cmd, log, "ready: serving")


def router(prefill: str, decode: str, port: int, log: Path) -> Proc:
    cmd = [PIPESERVE, "router", "--port", str(port), "--prefill", prefill, "--decode", decode]
    return Proc(cmd, log, "router ready")


@contextlib.contextmanager
def running(*starters: Any) -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        for start in starters:
            procs.append(start())
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def transfers_done(url: str, n: int) -> dict[str, float]:
    """The decode server's metrics once they count `n` transfers done (they refresh twice a
    second)."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(url)
        done = m.get('pipeserve_pd_transfers_total{state="done"}', 0)
        if done >= n or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=3600)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
    return {"seconds": time.perf_counter() - start, "body": r.json()}


def stream_gaps(url: str, prompt: list[int], max_tokens: int, stop: threading.Event) -> list[float]:
    """Arrival times of one greedy generation's tokens (until `stop` or the end)."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
            if stop.is_set():
                break
    return times


# -- transfer -------------------------------------------------------------------------------


def transfer(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Run inside the decode node's namespace with --netlab (see `netlab`)."""
    p_host = ADDR0 if args.in_netlab else "127.0.0.1"
    d_host = ADDR1 if args.in_netlab else "127.0.0.1"
    p_url, d_url, r_url = f"http://{p_host}:8201", "http://127.0.0.1:8202", "http://127.0.0.1:8200"
    prefill_flags = ["--disaggregation-mode", "prefill", "--host", p_host, *args.prefill_flags]
    prefill_flags += ["--disaggregation-decode-host", d_host]
    decode_flags = ["--disaggregation-mode", "decode", "--disaggregation-host", d_host]
    decode_flags += ["--disaggregation-prefill-url", p_url]
    netns = args.in_netlab  # the prefill node's namespace
    with running(
        lambda: serve(args, 8201, log_dir / "prefill.log", prefill_flags, 0, netns),
        lambda: serve(args, 8202, log_dir / "decode.log", decode_flags, 1),
        lambda: router(p_url, d_url, 8200, log_dir / "router.log"),
    ):
        complete(r_url, tokens(64, 0), 1)  # warm up both sides and the link
        before = transfers_done(d_url, 1)
        pd = complete(r_url, tokens(args.input_len, 1), 1)
        after = transfers_done(d_url, 2)
        colocated = complete(p_url, tokens(args.input_len, 2), 1)
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("pipeserve_pd_")}
    wire, exposed = (
        delta["pipeserve_pd_transfer_wire_seconds_total"],
        delta["pipeserve_pd_transfer_exposed_seconds_total"],
    )
    return {
        "input_len": args.input_len,
        "chunk": args.chunk,
        "netlab_rate": args.netlab,
        "kv_bytes": delta["pipeserve_pd_transfer_bytes_total"],
        "wire_s": wire,
        "exposed_s": exposed,
        "hidden_share": 1 - exposed / wire if wire > 0 else None,
        "ttft_disaggregated_s": pd["seconds"],
        "ttft_colocated_prefill_server_s": colocated["seconds"],
        "failed_transfers": delta.get('pipeserve_pd_transfers_total{state="failed"}', 0.0),
    }


@contextlib.contextmanager
def netlab(rate: str) -> Iterator[None]:
    """Two namespaces joined by a rate-limited veth pair (as benchmarks/netlab.sh builds)."""

    def ip(*a: str) -> None:
        subprocess.run(["ip", *a], check=True)

    try:
        for ns in (NS0, NS1):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip(
            "link",
            "add",
            "veth0",
            "netns",
            NS0,
            "type",
            "veth",
            "peer",
            "name",
            "veth1",
            "netns",
            NS1,
        )
        for i, (ns, addr) in enumerate(((NS0, ADDR0), (NS1, ADDR1))):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"veth{i}")
            ip("-n", ns, "link", "set", f"veth{i}", "up")
            subprocess.run(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    f"veth{i}",
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "50ms",
                ],
                check=True,
            )
        yield
    finally:
        for ns in (NS0, NS1):
            for pid in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- tpot ---------------------------------------------------------------------------------


def gaps_stats(times: list[float], window: tuple[float, float] | None) -> dict[str, Any]:
    gaps = [
        b - a
        for a, b in zip(times, times[1:], strict=False)
        if window is None or (a < window[1] and b > window[0])  # overlapping it: a stall
    ]
    if not gaps:
        return {"tokens": 0}
    # inclusive: within the data (few gaps when a stall fills the window)
    q = statistics.quantiles(gaps, n=100, method="inclusive") if len(gaps) > 1 else [gaps[0]] * 99
    return {
        "tokens": len(gaps),
        "p50_ms": 1e3 * q[49],
        "p99_ms": 1e3 * q[98],
        "mean_ms": 1e3 * statistics.fmean(gaps),
        "max_ms": 1e3 * max(gaps),
    }


def decode_under_prefills(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """One long generation; after a quiet stretch, N long prompts at once; the generation's
    token gaps alone and during the prefills."""
    stop = threading.Event()
    times: list[float] = []
    gen = threading.Thread(
        target=lambda: times.extend(stream_gaps(url, tokens(256, 7), args.generate, stop))
    )
    gen.start()
    time.sleep(args.quiet_s)
    quiet_end = time.perf_counter()
    start = time.perf_counter()
    workers = [
        threading.Thread(target=complete, args=(url, tokens(args.prefill_len, 100 + i), 1))
        for i in range(args.prefills)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    end = time.perf_counter()
    stop.set()
    gen.join(timeout=60)
    return {
        "alone": gaps_stats(times, (0.0, quiet_end - 0.5)),  # well before the prefills
        "during_prefills": gaps_stats(times, (start, end)),
        "prefills_s": end - start,
    }


def tpot(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    with running(lambda: serve(args, 8211, log_dir / "colocated.log", [], 0)):
        colocated = decode_under_prefills(args, "http://127.0.0.1:8211")
    mixed = ["--enable-mixed-chunk"]  # decode steps ride along each prefill chunk
    with running(lambda: serve(args, 8212, log_dir / "colocated-mixed.log", mixed, 0)):
        colocated_mixed = decode_under_prefills(args, "http://127.0.0.1:8212")
    prefill_flags = ["--disaggregation-mode", "prefill"]
    decode_flags = ["--disaggregation-mode", "decode"]
    decode_flags += ["--disaggregation-prefill-url", "http://127.0.0.1:8201"]
    with running(
        lambda: serve(args, 8201, log_dir / "prefill.log", prefill_flags, 0),
        lambda: serve(args, 8202, log_dir / "decode.log", decode_flags, 1),
        lambda: router(
            "http://127.0.0.1:8201", "http://127.0.0.1:8202", 8200, log_dir / "router.log"
        ),
    ):
        disaggregated = decode_under_prefills(args, "http://127.0.0.1:8200")
    return {
        "prefills": args.prefills,
        "prefill_len": args.prefill_len,
        "colocated_one_core": colocated,
        "colocated_one_core_mixed_chunk": colocated_mixed,
        "disaggregated_core_each": disaggregated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measure", choices=("transfer", "tpot"))
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="best")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=65536, help="KV tokens of each server")
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--netlab", default=None, help="tc rate between the two nodes, e.g. 1gbit")
    ap.add_argument("--prefill-flags", nargs="*", default=[], help="extra prefill server flags")
    ap.add_argument("--prefills", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument("--quiet-s", type=float, default=5.0)
    ap.add_argument("--generate", type=int, default=16384, help="tokens of the long generation")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--in-netlab", default=None, help=argparse.SUPPRESS)  # the prefill ns
    args = ap.parse_args()
    # every server and the router share the disaggregation's secret (a fresh one per run
    # unless given); children inherit it through the environment, never the command line
    os.environ.setdefault("PIPESERVE_PD_AUTH_KEY", secrets.token_hex(32))
    if args.measure == "transfer" and args.netlab and not args.in_netlab:
        with netlab(args.netlab):  # the rest runs beside the decode server, in its node
            cmd = ["ip", "netns", "exec", NS1, sys.executable, *sys.argv, "--in-netlab", NS0]
            sys.exit(subprocess.run(cmd).returncode)
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        try:
            out = (transfer if args.measure == "transfer" else tpot)(args, Path(tmp))
        except BaseException:
            for log in Path(tmp).glob("*.log"):
                print(f"== {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
