"""The server's side of the tokenizer options (fake engine, in-process): under
--skip-tokenizer-init a text prompt or a chat request gets HTTP 400 and a token-id prompt is
answered with its tokens as ids; a chat request to a model without a chat template gets 400
naming --chat-template."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from fake_engine import NAME, FakeEngine, serving

from pipeserve.config import EngineConfig
from pipeserve.server.state import ServerState
from pipeserve.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)


def state(tokenizer: Tokenizer | None) -> ServerState:
    config = EngineConfig.from_flags(served_model_name=NAME)
    return ServerState(config, FakeEngine(), tokenizer, NAME)  # type: ignore[arg-type]


def test_skip_tokenizer_init_refuses_text_and_returns_ids() -> None:
    asyncio.run(_skip_tokenizer_init())


async def _skip_tokenizer_init() -> None:
    async with serving(state(None)) as http:
        r = await http.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.text
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "token ids" in r.text
        r = await http.post(
            "/v1/completions", json={"model": NAME, "prompt": [1, 2], "logprobs": 1}
        )
        assert r.status_code == 400 and "logprobs" in r.text
        r = await http.post("/v1/completions", json={"model": NAME, "prompt": [1, 2, 3]})
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == [97, 97, 97]
        r = await http.post(
            "/v1/completions", json={"model": NAME, "prompt": [1, 2, 3], "stream": True}
        )
        chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
        assert len(chunks) == 3 and all('"token_ids": [97]' in c for c in chunks)


def test_chat_without_a_template_is_a_400(model_dir: Any, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dir("tiny-qwen3"), bare)
    (bare / "chat_template.jinja").unlink()
    asyncio.run(_no_template(Tokenizer(bare)))


async def _no_template(tokenizer: Tokenizer) -> None:
    async with serving(state(tokenizer)) as http:
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "--chat-template FILE" in r.text
        r = await http.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert r.status_code == 200
