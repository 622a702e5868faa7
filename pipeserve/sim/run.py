"""`pipeserve simulate`: one layout and chunk setting on a named hardware, simulated; the
report `pipeserve bench` would give (TTFT, throughput, per-stage bubble ratio) plus what only
a model knows (seconds by operator class, memory per device), and the same trace and Gantt
chart formats, so a real and a simulated run can be put side by side."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeserve.config import EngineConfig
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config, weight_dtype
from pipeserve.sim.cost_model import CLASSES, Precision
from pipeserve.sim.executor import SimClock
from pipeserve.sim.hardware import Hardware, load_hardware
from pipeserve.sim.simulator import SimBackend, make_requests, serve, summary
from pipeserve.timeline import (
    Event,
    boundary_bytes,
    bubble_ratios,
    draw_timeline,
    makespan_idle_share,
    write_trace,
)

# --mem-fraction-static on a simulated GPU when not given: weights and KV may take 92% of the
# device's memory, the rest left to activations and the runtime (a choice, not a measurement)
GPU_MEM_FRACTION = 0.92


@dataclass(frozen=True)
class SimSpec:
    """What to simulate beyond the engine flags."""

    model: str  # checkpoint directory, config preset or built-in preset
    hardware: str = "h20"
    calibration: str | None = None  # calibration file (CPU: the saved one by default)
    devices_per_node: int | None = None  # default: the hardware's
    dtype: str | None = None  # weights: fp8 | bfloat16 | float16 | float32 (None: checkpoint's)
    input_len: int = 131072
    output_len: int = 1
    num_prompts: int = 1
    request_rate: float = float("inf")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.request_rate <= 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")


def precision_for(
    spec: SimSpec, config: dict[str, Any], hw: Hardware, fp8_weights: str = "dequantize"
) -> Precision:
    """The weights' dtype named, else what the engine would hold: the hardware's compute
    dtype on a CPU calibrated in it; for an FP8 checkpoint bfloat16, as the engine dequantises
    it at load, or fp8 with --fp8-weights keep; else the checkpoint's dtype."""
    if spec.dtype in (None, "auto") and hw.compute_dtype is not None:
        return Precision(hw.compute_dtype, hw.compute_dtype)
    weights = spec.dtype if spec.dtype not in (None, "auto") else weight_dtype(config)
    if spec.dtype in (None, "auto") and weights == "fp8" and fp8_weights != "keep":
        weights = "bfloat16"
    return Precision(weights, "float32" if weights == "float32" else "bfloat16")


def simulate(flags: dict[str, Any], spec: SimSpec) -> dict[str, Any]:
    """Build the simulated engine, serve the requests, report."""
    return simulate_with(flags, spec, load_hardware(spec.hardware, spec.calibration))


def simulate_with(flags: dict[str, Any], spec: SimSpec, hw: Hardware) -> dict[str, Any]:
    """`simulate` on a given hardware description (e.g. efficiencies being fitted)."""
    raw, source = load_config(spec.model)
    arch = ArchConfig.from_dict(raw)
    precision = precision_for(spec, raw, hw, flags.get("fp8_weights", "dequantize"))
    engine_flags = {k: v for k, v in flags.items() if k not in ("model_path", "dtype")}
    if hw.kind == "gpu":  # the engine's default share is a CPU's (of RAM, beside the OS)
        engine_flags.setdefault("mem_fraction_static", GPU_MEM_FRACTION)
    if engine_flags.get("nnodes", 1) > 1:  # no process starts: any rendezvous passes validation
        engine_flags.setdefault("dist_init_addr", "127.0.0.1:29500")
    config = EngineConfig.from_flags(**engine_flags)
    context = arch.context_length(config.model.context_length)
    notes = []
    need = spec.input_len + spec.output_len
    if need > context:  # a model's limit is no obstacle to a what-if
        if spec.input_len >= context:
            notes.append(f"context length raised from {context} to {need} for the simulation")
        context = need
    clock = SimClock()
    backend = SimBackend(config, arch, hw, precision, clock, context, spec.devices_per_node)
    reqs = make_requests(
        spec.num_prompts, spec.input_len, spec.output_len, spec.request_rate, spec.seed
    )
    outcomes = serve(backend, reqs)
    events = backend.timeline()
    return _report(spec, source, backend, precision, outcomes, events, notes)


def _report(
    spec: SimSpec,
    source: str,
    backend: SimBackend,
    precision: Precision,
    outcomes: list[Any],
    events: list[Event],
    notes: list[str],
) -> dict[str, Any]:
    lay, hw, mem = backend.layout, backend.hw, backend.memory
    busy = backend.workers.breakdown.seconds
    return {
        "simulated": True,
        "model": source,
        "hardware": hw.name,
        "calibration": hw.calibration or None,
        "efficiency": asdict(backend.cost.eff),
        "precision": asdict(precision),
        "layout": {
            "tp_size": lay.tp,
            "pp_size": lay.pp,
            "ep_size": lay.ep,
            "cp_size": lay.cp,
            "devices": lay.world,
            "nnodes": lay.nnodes,
            "devices_per_node": lay.devices_per_node,
            "threads_per_device": lay.threads if hw.kind == "cpu" else None,
        },
        "partition": backend.partition,
        "loop_depth": backend.loop.depth,
        "forwards": backend.workers.forwards,
        "two_batch_forwards": backend.workers.split_forwards,
        "chunking": backend.chunking,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "num_prompts": spec.num_prompts,
        **summary(outcomes),
        "ttft_s": [o.ttft_s for o in outcomes],
        "chunk_sizes": [o.chunk_sizes for o in outcomes],
        "bubble_ratio": bubble_ratios(events),
        "makespan_idle_share": makespan_idle_share(events),
        "stage_busy_s": backend.scheduler.ranks[0].stage_busy,
        "boundary_bytes": boundary_bytes(events),
        "seconds_by_class": {k: busy[k] for k in CLASSES},
        "memory": {
            "weight_gb_per_device": mem.weight_bytes / 1e9,
            "kv_bytes_per_token_per_device": mem.kv_bytes_per_token,
            "kv_pool_tokens": mem.kv_tokens,
            "budget_gb": mem.budget_bytes / 1e9,
        },
        "notes": notes,
        "events": events,
    }


def save(report: dict[str, Any], json_path: str | None, trace: str | None, png: str | None) -> None:
    events = report["events"]
    if json_path:
        Path(json_path).write_text(
            json.dumps({k: v for k, v in report.items() if k != "events"}, indent=2)
        )
    if trace:
        write_trace(events, trace)
    if png:
        lay = report["layout"]
        name = f"simulated {report['hardware']} PP{lay['pp_size']} TP{lay['tp_size']}"
        draw_timeline([(name, events)], png)


def print_report(r: dict[str, Any]) -> None:
    lay = r["layout"]
    chunking = r["chunking"]
    mode = chunking.get("mode")
    size = chunking.get("chunk_size") or chunking.get("initial_size")
    print(
        f"simulated: {r['model']} on {lay['devices']} x {r['hardware']} "
        f"(PP{lay['pp_size']} TP{lay['tp_size']} EP{lay['ep_size']} CP{lay['cp_size']}, "
        f"{lay['nnodes']} node(s)), weights {r['precision']['weights']}"
    )
    print(
        f"  {r['num_prompts']} x {r['input_len']} in / {r['output_len']} out, chunking {mode} "
        f"({size}), partition {','.join(map(str, r['partition']))}"
    )
    print(
        f"  TTFT mean {r['ttft_mean_s']:.3f} s, input throughput {r['input_throughput_tok_s']:.1f} "
        f"tok/s, bubble ratio per stage {', '.join(f'{b:.3f}' for b in r['bubble_ratio'])}, "
        f"makespan idle share {r['makespan_idle_share']:.3f}"
    )
    busy = r["seconds_by_class"]
    total = sum(busy.values()) or 1.0
    print("  stage seconds by class: " + ", ".join(f"{k} {v / total:.0%}" for k, v in busy.items()))
    m = r["memory"]
    print(
        f"  per device: weights {m['weight_gb_per_device']:.1f} GB, KV pool "
        f"{m['kv_pool_tokens']} tokens (budget {m['budget_gb']:.1f} GB)"
    )
    for note in r["notes"]:
        print(f"  note: {note}")
