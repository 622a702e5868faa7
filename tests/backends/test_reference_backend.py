"""The attention-backend interface is the only contact between the engine and a backend: a
backend written here from the math (float64 softmax attention over each request's cached
keys, no pipeserve kernel), registered by name in this file, serves the engine end to end
with the torch backend's tokens and logprobs, its own linear products (float64, from the
math) serving every linear layer and the LM head; and, declaring itself capturable with its own
persistent buffers, its decode steps run over DecodeGraphs' buffers (eagerly: a CPU captures
nothing) with the same outputs as without graphs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipeserve import config as config_mod
from pipeserve.backends import registry
from pipeserve.backends.base import AttentionBackend, LinearKernels, Segment
from pipeserve.layers.embedding import ParallelLMHead
from pipeserve.layers.linear import LinearBase
from pipeserve.mem_cache.kv_pool import PAD_SLOT
from pipeserve.scheduler.batch import runs_prefix

pytestmark = pytest.mark.timeout(300)


@dataclass
class Chunk:
    row: int
    rows: int
    prefix: int
    slots: torch.Tensor  # [prefix + rows]: the slot of every position


@dataclass
class Steps:
    rows: torch.Tensor  # [b] token rows of the decode steps
    table: torch.Tensor  # [b, width] each step's slots, PAD_SLOT past its length
    lengths: torch.Tensor  # [b]


@dataclass
class Meta:
    chunks: list[Chunk]
    steps: Steps | None


def slots_of(runs: list[tuple[int, int]], length: int) -> list[int]:
    return [s for start, n in runs_prefix(runs, length) for s in range(start, start + n)]


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, h, n, d] over k/v [b, h, L, d] where keep [b, 1 or h, n, L] -> [b, h, n, d]."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return (probs @ v.double()).to(q.dtype)


class ReferenceLinears(LinearKernels):
    """y = x W^T + b in float64, cast back; records the weight shapes it served."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, ...]] = set()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.shapes.add(tuple(weight.shape))
        y = x.double() @ weight.double().T
        return (y if bias is None else y + bias.double()).to(x.dtype)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    capturable = True

    def __init__(self) -> None:
        self.chunks_run = self.steps_run = 0
        self.linears = ReferenceLinears()

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> Meta:
        chunks, rows, tables = [], [], []
        for row, n, prefix, runs in segments:
            slots = slots_of(runs, prefix + n)
            if n > 1:
                chunks.append(Chunk(row, n, prefix, torch.tensor(slots, device=device)))
            else:
                rows.append(row)
                tables.append(slots)
        if not rows:
            return Meta(chunks, None)
        width = max(map(len, tables))
        table = [t + [PAD_SLOT] * (width - len(t)) for t in tables]
        lengths = [len(t) for t in tables]

        def tensor(x: Any) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        return Meta(chunks, Steps(tensor(rows), tensor(table), tensor(lengths)))

    def attend(
        self,
        layer: Any,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        fresh: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor,
    ) -> None:
        group = layer.group
        for c in meta.chunks:  # each position attends to the positions up to its own
            self.chunks_run += 1
            k = k_cache[:, c.slots].repeat_interleave(group, 0)[None]  # [1, h, L, d]
            v = v_cache[:, c.slots].repeat_interleave(group, 0)[None]
            qc = q[c.row : c.row + c.rows].transpose(0, 1)[None]  # [1, h, n, d]
            position = torch.arange(c.prefix, c.prefix + c.rows, device=q.device)
            keep = torch.arange(c.slots.shape[0], device=q.device)[None, :] <= position[:, None]
            o = softmax_attention(qc, k, v, keep[None, None], layer.scale)
            out[c.row : c.row + c.rows] = o[0].transpose(0, 1)
        if (s := meta.steps) is not None:  # no host read: the graphs' buffers serve as well
            self.steps_run += 1
            k = k_cache[:, s.table].transpose(0, 1).repeat_interleave(group, 1)  # [b, h, W, d]
            v = v_cache[:, s.table].transpose(0, 1).repeat_interleave(group, 1)
            width = torch.arange(s.table.shape[1], device=q.device)
            keep = (width[None, :] < s.lengths[:, None])[:, None, None, :]
            o = softmax_attention(q[s.rows][:, :, None], k, v, keep, layer.scale)
            out[s.rows] = o[:, :, 0]

    def graph_buffers(self, pool_slots: int, rows: int, device: torch.device) -> Buffers:
        return Buffers(pool_slots, rows, device)


class Buffers:
    """Every step's slots padded to the pool's size: a padded row reads PAD_SLOT alone. A
    step's table is as wide as its longest context, so it is copied into these buffers
    (nothing of it is read where the step's copy put it)."""

    def __init__(self, pool_slots: int, rows: int, device: torch.device) -> None:
        self.rows = torch.arange(rows, device=device)
        self.table = torch.full((rows, pool_slots), PAD_SLOT, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)

    def meta(self, rows: int, staged: Meta) -> Meta:
        return Meta([], Steps(self.rows[:rows], self.table[:rows], self.lengths[:rows]))

    def holds(self, keys: int, rows: int) -> bool:
        return True  # no request reads more than the pool's slots

    def load(self, staged: Meta, rows: int) -> None:
        assert staged.steps is not None and not staged.chunks
        width = staged.steps.table.shape[1]
        self.table[:rows, :width].copy_(staged.steps.table)
        self.lengths[:rows].copy_(staged.steps.lengths)


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> ReferenceBackend:
    """The backend registered as --attention-backend reference for this test only."""
    names = list(config_mod.ATTENTION_BACKENDS)
    monkeypatch.setattr(config_mod, "ATTENTION_BACKENDS", names)
    monkeypatch.setattr(registry, "ATTENTION_BACKENDS", names)
    monkeypatch.setattr(registry, "REGISTERED", {})
    backend = ReferenceBackend()
    registry.register_backend("reference", lambda device, dtype, head_dim: backend)
    return backend


PROMPTS = [[(7 * j) % 300 + 1 for j in range(40)], [(5 * j) % 300 + 2 for j in range(12)]]
PARAMS = [{"max_new_tokens": n, "temperature": 0} for n in (6, 3)]
FLAGS = {"dtype": "float32", "chunked_prefill_size": 16, "max_total_tokens": 512}


def generate(
    model: str, backend: str, inspect: Callable[[Any], None] | None = None, **flags: Any
) -> list[dict]:
    from pipeserve import Engine

    with Engine(model, attention_backend=backend, **FLAGS, **flags) as engine:
        assert engine.backend.runner.backend.name == backend
        if inspect is not None:
            inspect(engine.backend.runner.model)
        out = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True)
    assert isinstance(out, list)
    return out


def same_outputs(gots: list[dict], wants: list[dict], atol: float) -> None:
    for got, want in zip(gots, wants, strict=True):
        assert got["output_ids"] == want["output_ids"]
        for key in ("prompt_logprobs", "output_logprobs"):
            a, b = (torch.tensor(x[key], dtype=torch.float64) for x in (got, want))
            torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_a_backend_registered_here_serves_the_engine(model_dir, reference) -> None:
    model = str(model_dir("tiny-qwen3", num_hidden_layers=2))
    weights: set[tuple[int, ...]] = set()

    def linear_weights(model: torch.nn.Module) -> None:
        kinds = (LinearBase, ParallelLMHead)
        weights.update(tuple(m.weight.shape) for m in model.modules() if isinstance(m, kinds))

    got = generate(model, "reference", linear_weights)
    assert reference.chunks_run > 0 and reference.steps_run > 0  # it served both kinds
    assert len(weights) >= 4 and reference.linears.shapes == weights  # every product
    same_outputs(got, generate(model, "torch"), atol=1e-4)


def test_its_decode_steps_run_over_the_graph_buffers(model_dir, reference, monkeypatch) -> None:
    from pipeserve.runner import cuda_graph, model_runner

    real_blocker = model_runner.graph_blocker

    def blocker(config, arch, device, backend):  # as if the CPU were a CUDA device
        return real_blocker(config, arch, torch.device("cuda"), backend)

    monkeypatch.setattr(model_runner, "graph_blocker", blocker)
    monkeypatch.setattr(cuda_graph.DecodeGraphs, "capture", lambda self: None)
    replayed: list[int] = []
    real_run = cuda_graph.DecodeGraphs.run
    monkeypatch.setattr(
        cuda_graph.DecodeGraphs,
        "run",
        lambda self, fb: replayed.append(fb.num_tokens) or real_run(self, fb),
    )
    model = str(model_dir("tiny-qwen3", num_hidden_layers=2))
    eager = generate(model, "reference", cuda_graph_max_bs=0)
    assert replayed == []
    graphed = generate(model, "reference", cuda_graph_max_bs=8)
    assert 2 in replayed and 1 in replayed  # both requests decoding, then one
    same_outputs(graphed, eager, atol=1e-6)
