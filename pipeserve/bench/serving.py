"""`pipeserve bench-serving`: load a running server over HTTP and measure what clients see:
time to first token, inter-token latency, end-to-end latency (percentiles) and throughput.
Prompts are random token ids of a fixed length; `ignore_eos` keeps output lengths exact."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Outcome:
    start = time.perf_counter()
    last = None
    out = Outcome(ok=True)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return Outcome(
                    False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(False, error=event["error"]["message"])
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.itls.append(now - last)
                last = now
                out.output_tokens += 1 if event["choices"][0].get("text") is not None else 0
    except httpx.HTTPError as exc:
        return Outcome(False, error=repr(exc))
    out.latency = time.perf_counter() - start
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {
        "mean": statistics.fmean(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ordered[-1],
    }


async def _run(
    base_url: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
) -> dict[str, Any]:
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        models = (await client.get("/v1/models", headers=headers)).json()["data"]
        model = models[0]["id"]
        vocab_guess = 256  # byte tokens exist in every byte-level vocabulary
        limit = asyncio.Semaphore(max_concurrency or num_prompts)
        bar = tqdm(total=num_prompts, desc="requests")

        async def request(i: int) -> Outcome:
            body = {
                "model": model,
                "prompt": [rng.randrange(vocab_guess) for _ in range(input_len)],
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with limit:
                out = await _one(client, "/v1/completions", body, headers)
            bar.update(1)
            return out

        tasks = []
        start = time.perf_counter()
        for i in range(num_prompts):
            tasks.append(asyncio.create_task(request(i)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    good = [o for o in outcomes if o.ok]
    return {
        "base_url": base_url,
        "model": model,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "request_rate": request_rate,
        "max_concurrency": max_concurrency,
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(good) / duration,
        "input_throughput_tok_s": len(good) * input_len / duration,
        "output_throughput_tok_s": sum(o.output_tokens for o in good) / duration,
        "ttft_s": _percentiles([o.ttft for o in good]),
        "itl_s": _percentiles([x for o in good for x in o.itls]),
        "e2e_latency_s": _percentiles([o.latency for o in good]),
    }


def run_bench_serving(
    base_url: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    json_path: str | None,
    seed: int = 0,
) -> dict[str, Any]:
    report = asyncio.run(
        _run(
            base_url,
            num_prompts,
            input_len,
            output_len,
            request_rate,
            max_concurrency,
            api_key,
            seed,
        )
    )
    print(
        f"completed {report['completed']}/{num_prompts} in {report['duration_s']:.2f}s "
        f"({report['failed']} failed)"
    )
    for key in ("ttft_s", "itl_s", "e2e_latency_s"):
        p = report[key]
        if p:
            print(
                f"{key:<14} mean {p['mean']:.4f}  p50 {p['p50']:.4f}  p90 {p['p90']:.4f}  "
                f"p99 {p['p99']:.4f}"
            )
    print(
        f"throughput: {report['request_throughput']:.2f} req/s, "
        f"input {report['input_throughput_tok_s']:.1f} tok/s, "
        f"output {report['output_throughput_tok_s']:.1f} tok/s"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"saved {json_path}")
    return report
