"""The HTTP server's state: its engine client, tokenizer, metrics and admission count,
shared by the routes (app.py) and the parts they call (checks, request_run, the
disaggregation routes)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeserve.config import EngineConfig
from pipeserve.disaggregation.pd import auth
from pipeserve.server.admission import Admission
from pipeserve.server.engine_client import EngineClient
from pipeserve.server.metrics import Metrics
from pipeserve.tokenizer import Tokenizer, load_tokenizer

TOKENIZE_CONCURRENCY = 2 * (os.cpu_count() or 1)  # prompts tokenized at once


class ServerState:
    def __init__(
        self,
        config: EngineConfig,
        client: EngineClient,
        tokenizer: Tokenizer | None,
        model_name: str,
    ) -> None:
        """`tokenizer` None: --skip-tokenizer-init (token-id prompts only)."""
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = Metrics()
        capacity = config.scheduler.max_running_requests + config.server.max_queued_requests
        self.admission = Admission(capacity)
        self.tokenize_slots = asyncio.Semaphore(TOKENIZE_CONCURRENCY)
        self.context_len = 0
        self.vocab_size = 0
        self.on_failure: Callable[[], None] | None = None  # set by the launcher: asks to exit
        # disaggregation's internal credential (None when this server serves whole requests)
        d = config.disaggregation
        self.pd_credential = (
            auth.InternalCredential(auth.pd_key(d.pd_auth_key))
            if d.disaggregation_mode != "null"
            else None
        )

    @classmethod
    def for_model(
        cls, config: EngineConfig, flags: dict[str, Any], model_path: Path
    ) -> ServerState:
        name = config.server.served_model_name or model_path.name
        return cls(config, EngineClient(flags), load_tokenizer(config.model, model_path), name)
