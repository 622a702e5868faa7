"""Measured per-layer costs, for `--pp-layer-partition auto`.

Times one decoder layer of each kind (dense MLP, routed experts), the embedding and the
output head (final norm, LM head, sampling row) on a prompt chunk after a cached prefix of
the same length, with random weights of the model's shapes (cost does not depend on values).
A pilot measurement at PILOT_CHUNK tokens comes first: the chunk asked for is halved until
its measurement is predicted to fit BUDGET_S, so a slow device or dtype starts in bounded
time (the partition needs the layers' relative costs, which a shorter chunk gives too).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from pipeserve.device import synchronize
from pipeserve.distributed.parallel_state import standalone
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.models.arch import ArchConfig
from pipeserve.models.llama import LlamaForCausalLM
from pipeserve.models.registry import build_model
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.runner.kv_layout import build_kv_pool
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch

REPEATS = 3
PILOT_CHUNK = 128
BUDGET_S = 20.0


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    per_layer: list[float]  # seconds per decoder layer, by layer index
    embed: float
    head: float


@torch.inference_mode()
def measure_layer_costs(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, chunk: int
) -> LayerCosts:
    kinds = sorted({arch.is_moe_layer(i) for i in range(arch.num_layers)})
    probe = dataclasses.replace(
        arch,
        num_layers=len(kinds),
        mlp_only_layers=tuple(i for i, moe in enumerate(kinds) if not moe),
        decoder_sparse_step=1,
    )
    with standalone():
        model = build_model(probe, dtype, device)
    for p in model.parameters():
        p.normal_(0.0, 0.02)
    pool = build_kv_pool(probe, 2 * chunk + 1, range(probe.num_layers), 1, dtype, device, 1)
    start = time.perf_counter()
    timed = _measure(model, pool, kinds, min(chunk, PILOT_CHUNK), arch.vocab_size, device)
    chunk = affordable_chunk(time.perf_counter() - start, chunk)
    if chunk > PILOT_CHUNK:
        timed = _measure(model, pool, kinds, chunk, arch.vocab_size, device)
    per_kind = {moe: timed[f"layer{i}"] for i, moe in enumerate(kinds)}
    return LayerCosts(
        [per_kind[arch.is_moe_layer(i)] for i in range(arch.num_layers)],
        timed["embed"],
        timed["head"],
    )


def affordable_chunk(pilot_s: float, chunk: int, budget_s: float = BUDGET_S) -> int:
    """The chunk to measure at: `chunk` halved until a measurement, predicted from the
    pilot's seconds at PILOT_CHUNK tokens (twice linear: attention grows faster), fits the
    budget; at most `chunk`; the pilot's size or less means the pilot's measurement stands."""
    while chunk > PILOT_CHUNK and 2 * pilot_s * chunk / PILOT_CHUNK > budget_s:
        chunk //= 2
    return chunk


def _measure(
    model: LlamaForCausalLM,
    pool: KVPool,
    kinds: list[bool],
    chunk: int,
    vocab: int,
    device: torch.device,
) -> dict[str, float]:
    ids = [i % vocab for i in range(chunk)]
    timed: dict[str, float] = {}
    for prefix in (0, chunk):  # the first pass fills the prefix; the second is timed
        probe = ReqSlice("probe", ids, prefix, [(1, prefix + chunk)], sample=False, chunk_index=0)
        fb = ForwardBatch.prepare(ScheduledBatch(0, [probe]), pool, device)
        timed = _time_parts(model, fb, kinds)
    return timed


def _time_parts(model: LlamaForCausalLM, fb: ForwardBatch, kinds: list[bool]) -> dict[str, float]:
    out: dict[str, float] = {}
    embed, norm = model.model.embed_tokens, model.model.norm
    assert embed is not None and norm is not None
    hidden = embed(fb.input_ids)
    out["embed"] = _median_time(lambda: embed(fb.input_ids), fb)
    rope = model.rotary.cos_sin(fb.positions, hidden.dtype)
    residual = None
    for i in range(len(kinds)):
        layer, args = model.model.layers[i], (hidden, residual, rope, fb)
        out[f"layer{i}"] = _median_time(lambda layer=layer, args=args: layer(*args), fb)
        hidden, residual = layer(*args)

    def head() -> None:
        normed = norm(hidden + residual)
        model.compute_logits(normed[-1:]).argmax(-1)

    out["head"] = _median_time(head, fb)
    return out


def _median_time(fn: object, fb: ForwardBatch) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        synchronize(fb.input_ids.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
