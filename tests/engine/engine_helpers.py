"""What the offline-engine tests share: the tiny model, random prompts, generate calls."""

from __future__ import annotations

from typing import Any

import torch

from pipeserve.engine.engine import Engine

PRESET = "tiny-qwen3"
VOCAB = 512

Outputs = list[dict[str, Any]]


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def generate(
    engine: Engine, ids: list[list[int]], sp: dict[str, Any] | list[dict[str, Any]], **kwargs: Any
) -> Outputs:
    out = engine.generate(input_ids=ids, sampling_params=sp, **kwargs)
    assert isinstance(out, list) and len(out) == len(ids)
    return out


def tokens(outputs: Outputs) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]
