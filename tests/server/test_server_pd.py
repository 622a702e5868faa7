"""Prefill/decode disaggregation served for real: `pipeserve serve --disaggregation-mode
prefill|decode` processes behind `pipeserve router`.

- The tokens (greedy) of prompts spanning many chunks are those of co-located serving, for
  prefill PP2 -> decode PP1, prefill PP1 -> decode TP2 and sharded CP2 -> decode PP1
  (DeepSeek-V3 and V3.2; there also transformers', in float32).
- Faults: a client that leaves mid-prefill, the prefill server killed (-9) mid-transfer,
  the decode server killed mid-decode: the request ends with an error or an abort (never
  hangs), every page reserved for it on both sides is free again (read from /metrics),
  the router marks a dead server unhealthy, and the servers left keep serving.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_helpers import (
    Router,
    Server,
    drained,
    kill_pids,
    wait_for,
    wait_gone,
)

pytestmark = pytest.mark.timeout(600)

CHUNK = 32
SETTLE_S = 60.0
TIMEOUT_FLAGS = ["--disaggregation-transfer-timeout", "60", "--watchdog-timeout", "60"]


@contextlib.contextmanager
def servers(
    model: Path, tmp: Path, prefill_args: list[str], decode_args: list[str]
) -> Iterator[tuple[Server, Server, Router]]:
    common = ["--chunked-prefill-size", str(CHUNK), "--served-model-name", "m", *TIMEOUT_FLAGS]
    made: list[Any] = []
    try:
        prefill = Server(
            model, [*common, "--disaggregation-mode", "prefill", *prefill_args], tmp / "p.log"
        )
        made.append(prefill)
        decode_args = ["--disaggregation-prefill-url", prefill.base_url, *decode_args]
        decode = Server(
            model, [*common, "--disaggregation-mode", "decode", *decode_args], tmp / "d.log"
        )
        made.append(decode)
        prefill.wait_for_line("ready")
        decode.wait_for_line("ready")
        router = Router([prefill.base_url], [decode.base_url], tmp / "router.log")
        made.append(router)
        yield prefill, decode, router
    finally:
        for m in reversed(made):
            m.stop()


def prompts() -> list[list[int]]:
    """Prompts of 5 to 12 chunks (at 32 tokens), none a prefix of another."""
    return [[(7 * i + 13 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((150, 247, 390))]


def body(prompt: list[int], max_tokens: int = 10, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def tokens_of(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def run_all(post: Any, reqs: list[dict[str, Any]]) -> list[httpx.Response]:
    """The requests at once (several in flight through both sides)."""
    out: list[Any] = [None] * len(reqs)

    def one(i: int) -> None:
        out[i] = post(reqs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def pd_stats(server: Server) -> dict[str, float]:
    m = server.metrics()
    totals = {
        k.split('"')[1]: v for k, v in m.items() if k.startswith("pipeserve_pd_transfers_total{")
    }
    now = {s: m[f"pipeserve_pd_transfers_{s}"] for s in ("active", "waiting")}
    return totals | now


def settled(*sides: Server) -> bool:
    """Every side drained: no pages held, nothing running or waiting, no transfer open."""
    return all(drained(s) is not None for s in sides) and all(
        pd_stats(s).get("active", 0) == 0 for s in sides
    )


def check_same_tokens(prefill: Server, decode: Server, router: Router) -> None:
    reqs = [body(p, logprobs=0) for p in prompts()]
    disaggregated = [tokens_of(r) for r in run_all(router.complete, reqs)]
    stats = pd_stats(decode)
    assert stats["done"] == len(reqs) and stats["failed"] == 0, stats
    assert decode.metrics()["pipeserve_pd_transfer_bytes_total"] > 0
    # co-located serving on each side's own layout
    for side in (decode, prefill):
        direct = [tokens_of(side.post("/v1/completions", r)) for r in reqs]
        assert direct == disaggregated
    assert wait_for(lambda: settled(prefill, decode), SETTLE_S)


@pytest.fixture(autouse=True)
def pd_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router and the servers (children: they inherit it) share the PD key."""
    monkeypatch.setenv("PIPESERVE_PD_AUTH_KEY", "3b8e1f6a9d20c47e5a1b8f3c6d92e0a7")


def test_prefill_pp2_to_decode_pp1_then_faults(model_dir, tmp_path: Path) -> None:
    model = model_dir("tiny-llama")
    # tiny chunks: the long prompts stay mid-prefill for seconds (metrics lag up to 0.5 s)
    slow = ["--pp-size", "2", "--chunked-prefill-size", "4"]
    with servers(model, tmp_path, slow, []) as (prefill, decode, router):
        check_same_tokens(prefill, decode, router)
        client_leaves_mid_prefill(prefill, decode, router)
        prefill_killed_mid_transfer(prefill, decode, router)


def test_prefill_pp1_to_decode_tp2_then_decode_killed(model_dir, tmp_path: Path) -> None:
    model = model_dir("tiny-llama")
    with servers(model, tmp_path, [], ["--tp-size", "2"]) as (prefill, decode, router):
        check_same_tokens(prefill, decode, router)
        decode_killed_mid_decode(prefill, decode, router)


def long_prompt(seed: int) -> list[int]:
    """~875 chunks of 4 tokens: long enough to be caught mid-prefill (a new one each time:
    the prefill side caches what it computed)."""
    return [(11 * j + seed) % 500 + 1 for j in range(3500)]


def busy(server: Server) -> bool:
    m = server.metrics()
    return m.get("pipeserve_requests_running", 0) > 0


def client_leaves_mid_prefill(prefill: Server, decode: Server, router: Router) -> None:
    data = json.dumps(body(long_prompt(1), stream=True)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.sendall(head + data)
        caught = wait_for(lambda: busy(prefill) and pd_stats(decode).get("active") == 1, 60, 0.02)
    assert caught, "the long prompt was never seen mid-prefill"
    assert wait_for(lambda: settled(prefill, decode), SETTLE_S), (
        decode.metrics(),
        prefill.metrics(),
    )
    assert tokens_of(router.complete(body(prompts()[0], logprobs=0)))  # still serving


def prefill_killed_mid_transfer(prefill: Server, decode: Server, router: Router) -> None:
    result: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: result.append(router.complete(body(long_prompt(2)), timeout=90))
    )
    t.start()
    caught = wait_for(lambda: busy(prefill) and pd_stats(decode).get("active", 0) == 1, 60, 0.02)
    assert caught, "the long prompt was never seen mid-prefill"
    tree = prefill.tree()
    kill_pids(tree)
    assert not wait_gone(tree, 20)
    t.join(timeout=90)
    assert result and result[0].status_code == 503, result and result[0].text
    assert "prefill server" in result[0].json()["error"]["message"]
    assert wait_for(lambda: settled(decode), SETTLE_S), decode.metrics()
    assert pd_stats(decode)["failed"] == 0  # ended by the failed call, not a timeout
    assert wait_for(lambda: router.health()["prefill"]["healthy"] == 0, 20)
    r = router.complete(body(prompts()[0]))
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    # the decode server itself keeps serving
    assert decode.post("/v1/completions", body(prompts()[1])).status_code == 200


def decode_killed_mid_decode(prefill: Server, decode: Server, router: Router) -> None:
    events: list[str] = []
    first = threading.Event()

    def client() -> None:
        req = body(prompts()[0], max_tokens=3000, stream=True, ignore_eos=True)
        with httpx.stream("POST", router.base_url + "/v1/completions", json=req, timeout=90) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    t = threading.Thread(target=client)
    t.start()
    assert first.wait(60), "no token streamed"
    tree = decode.tree()
    kill_pids(tree)
    assert not wait_gone(tree, 20)
    t.join(timeout=90)
    assert not t.is_alive(), "the client hangs after the decode server died"
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert wait_for(lambda: router.health()["decode"]["healthy"] == 0, 20)
    assert wait_for(lambda: settled(prefill), SETTLE_S), prefill.metrics()
    assert prefill.post("/v1/completions", body(prompts()[1])).status_code == 200


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v32"])
def test_prefill_sharded_cp2_mla_to_decode_pp1_as_transformers(
    model_dir, tmp_path: Path, preset: str
) -> None:
    """DeepSeek's latent cache, computed by two context-parallel ranks that each hold a
    stripe of the pages and, under shard linear, only every other layer's o_proj (its layer
    hooks broadcast them; the KV sender's hooks run beside them), to one decode rank that
    holds them all: float32 greedy tokens equal transformers' on the same weights. V3.2: its
    indexer keys go with the latent rows, and prompts of 150-390 tokens past its index_topk
    (64) attend sparsely on both sides."""
    from transformers import AutoModelForCausalLM

    from pipeserve.tokenizer import Tokenizer

    model = model_dir(preset)
    f32 = ["--dtype", "float32"]
    sharded = ["--cp-size", "2", "--shard-linear-layers", "kv_b_proj,o_proj", *f32]
    with servers(model, tmp_path, sharded, f32) as (prefill, decode, router):
        check_same_tokens(prefill, decode, router)
        reqs = [body(p, logprobs=0, ignore_eos=True) for p in prompts()]
        disaggregated = [tokens_of(r) for r in run_all(router.complete, reqs)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    text = Tokenizer(model).token_text
    for prompt, got in zip(prompts(), disaggregated, strict=True):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = [text(t) for t in out.sequences[0, len(prompt) :].tolist()]
        if got != want:  # only where transformers' two best were a float32 near-tie
            step = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            best, second = out.scores[step][0].float().topk(2).values.tolist()
            assert best - second < 1e-4 * max(1.0, abs(best)), (step, got, want)
