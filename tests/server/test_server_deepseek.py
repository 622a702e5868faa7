"""`pipeserve serve` on DeepSeek-V3.2 (MLA, latent KV cache, sparse attention, grouped-routing
MoE) at TP2: /v1/completions with a prompt longer than index_topk gives the offline engine's
greedy tokens, streamed and not, and leaves no KV behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_helpers import drained, running_server, wait_for

from pipeserve import Engine

pytestmark = pytest.mark.timeout(240)
NEW = 16


def test_deepseek_v32_served_at_tp2_matches_offline(model_dir, tmp_path: Path) -> None:
    model = model_dir("tiny-deepseek-v32")
    prompt = [(i * 37 + 5) % 500 for i in range(300)]  # > index_topk (64): sparse attention
    with Engine(str(model), dtype="float32") as engine:
        offline = engine.generate(
            input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": NEW}
        )
    body = {"model": model.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    with running_server(
        model, ["--tp-size", "2", "--chunked-prefill-size", "128"], tmp_path / "server.log"
    ) as srv:
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline["text"]
        streamed = srv.post("/v1/completions", {**body, "stream": True})
        chunks = [
            json.loads(line[6:])
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(c["choices"][0]["text"] for c in chunks) == offline["text"]
        assert wait_for(lambda: drained(srv), 30) is not None
