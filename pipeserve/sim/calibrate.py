"""Fitting the cost model's efficiencies.

On this machine (`pipeserve simulate --calibrate`): the real engine times single prompt
chunks on a grid of (prefix, chunk) points, in three set-ups a two-core machine runs — a
one-thread worker alone, a two-thread worker alone, and two one-thread workers timing at
once (every core busy: what PP2 and TP2 stages see) — in the dtype `--dtype best` computes
in here (bfloat16 with native bf16 products, else float32), and measures that dtype's
matmul peak.
Per set-up a non-negative least-squares fit of relative errors gives 1 / efficiency for the
gemm, MoE and attention classes and a per-layer overhead: each point's seconds are
sum_class (the class's seconds at efficiency 1) / efficiency_class + layers x overhead.

On GPUs (`calibrate_published`): the two published TTFT points of spec 06, nothing else,
fit at most two scalars (see that function).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import queue
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from pipeserve.models.arch import ArchConfig
from pipeserve.scheduler.chunk_cost import non_negative_lstsq
from pipeserve.sim.cost_model import CostModel, Precision, SimLayout, SliceWork
from pipeserve.sim.hardware import Efficiency, Hardware, efficiency_key

log = logging.getLogger(__name__)

CAL_PREFIXES = (0, 2048, 4096, 8192, 12288)
CAL_CHUNKS = (256, 512, 1024, 2048, 4096)
# (threads per worker, every core busy, in a worker process): the set-ups the engine runs on
# two cores — PP1 in-process with both threads; each stage of PP2 or rank of TP2 a one-thread
# worker process beside the other; a stage of those timed alone by the dynamic-chunking
# profile (a forward in a worker process runs 9-21% slower than in-process, measured)
SETUPS = ((1, False, True), (2, False, False), (1, True, True))
FIT_CLASSES = ("gemm", "moe", "attention")
UNIT = Efficiency(gemm=1.0, moe=1.0, attention=1.0, memory=1e9)  # compute at the peak, no
# memory bound: the fit's regressors


def calibration_points(max_len: int) -> list[tuple[int, int]]:
    """The grid (every point within max_len), the first point once more in front as a
    warm-up."""
    points = [(p, x) for p in CAL_PREFIXES for x in CAL_CHUNKS if p + x <= max_len]
    return points[:1] + points


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    errors: list[float]  # relative error per point (model / measured - 1)

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.errors))) if self.errors else 0.0


TERMS = (*FIT_CLASSES, "layer_overhead_s")  # what a fit may free


def fit_efficiency(
    arch: ArchConfig,
    hw: Hardware,
    threads: int,
    points: list[tuple[int, int]],
    seconds: list[float],
    base: Efficiency,
    free: tuple[str, ...] = TERMS,
) -> Fit:
    """The `free` efficiencies (and per-layer overhead) that best explain the measured
    seconds of one stage holding every layer, the other terms held at `base`'s values and
    their seconds taken off first (relative least squares, every term >= 0). A class the
    points never exercise keeps `base`'s value. A MoE model's chunks grow its projections and
    its experts alike with the chunk, so it cannot tell the two apart: fit the gemm class on
    a dense model and free only `moe` on the MoE one."""
    unit = replace(hw, thread_efficiency={}, efficiency=UNIT)
    dtype = hw.compute_dtype or "bfloat16"
    precision = Precision(dtype, dtype)
    cm = CostModel(arch, unit, SimLayout(threads=threads), precision, [arch.num_layers])
    rows = []
    for L, x in points:
        c = cm.forward(0, [[SliceWork(L, x)]]).seconds
        rows.append([c[k] for k in FIT_CLASSES] + [float(arch.num_layers)])
    held = asdict(base)
    inverse = [1 / held[k] for k in FIT_CLASSES] + [held["layer_overhead_s"]]
    design, target = np.asarray(rows), np.asarray(seconds, dtype=float)
    cols = [i for i, k in enumerate(TERMS) if k in free and design[:, i].any()]
    fixed = [i for i in range(len(TERMS)) if i not in cols]
    rest = target - design[:, fixed] @ np.asarray(inverse)[fixed]
    w = non_negative_lstsq(design[:, cols] / target[:, None], rest / target)
    values = dict(held)
    for i, v in zip(cols, w, strict=True):
        if TERMS[i] == "layer_overhead_s":
            values[TERMS[i]] = float(v)
        elif v > 0:
            values[TERMS[i]] = 1.0 / float(v)
    eff = Efficiency(**values)
    model = CostModel(arch, replace(unit, efficiency=eff), cm.layout, precision, cm.partition)
    predicted = [model.forward(0, [[SliceWork(L, x)]]).total for L, x in points]
    errors = [p / t - 1 for p, t in zip(predicted, seconds, strict=True)]
    return Fit(eff, errors)


# -- measuring on this machine ----------------------------------------------------------------


def _time_worker(
    model: str,
    dtype: str,
    threads: int,
    spawn: bool,
    points: list[tuple[int, int]],
    barrier: Any,
    out: Any,
) -> None:
    import torch

    from pipeserve.bench.peak import matmul_peak_flops
    from pipeserve.device import DTYPES
    from pipeserve.engine.engine import Engine

    tokens = max(p + x for p, x in points) + 64
    with Engine(
        model,
        threads_per_worker=threads,
        spawn_workers=spawn,
        max_total_tokens=tokens,
        dtype=dtype,
    ) as e:
        barrier.wait()
        torch.set_num_threads(threads)  # this process's: the model may be in a worker
        peak = matmul_peak_flops(DTYPES[dtype], torch.device("cpu"))
        seconds = e.backend.profile_chunks(points, budget_s=math.inf)[0]  # every point asked
        out.put((seconds, peak))


def time_points(
    model: str,
    dtype: str,
    threads: int,
    workers: int,
    spawn: bool,
    points: list[tuple[int, int]],
) -> tuple[list[float], float]:
    """Seconds per point and the `dtype` matmul FLOP/s of an engine with `threads` threads
    (its model in a worker process when `spawn`), `workers` engines timing at once (each
    its own process, started together); per point the mean over the engines."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_time_worker, args=(model, dtype, threads, spawn, points, barrier, out))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    results: list[tuple[list[float], float]] = []
    try:
        while len(results) < workers:
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a calibration process exited with code {dead[0].exitcode}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    seconds = np.mean([r[0] for r in results], axis=0).tolist()
    return seconds, float(np.mean([r[1] for r in results]))


MOE_MAX_LEN = 8192  # the MoE model's grid: one efficiency to fit, shorter prompts do


def _measure(
    model: str, dtype: str, points: list[tuple[int, int]], rounds: int
) -> dict[str, tuple[int, list[float], float]]:
    """Per set-up: threads, seconds per point (median over the rounds, the set-ups
    interleaved so a machine whose speed drifts affects all alike), matmul FLOP/s."""
    runs: dict[str, list[tuple[list[float], float]]] = {}
    for r in range(rounds):
        for threads, busy, spawn in SETUPS:
            key = efficiency_key(threads, busy)
            log.info("calibrating %s on %s (round %d of %d)", key, model, r + 1, rounds)
            runs.setdefault(key, []).append(
                time_points(model, dtype, threads, 2 if busy else 1, spawn, points)
            )
    threads_of = {efficiency_key(t, b): t for t, b, _ in SETUPS}
    return {
        key: (
            threads_of[key],
            np.median([s for s, _ in got], axis=0).tolist(),
            float(np.median([f for _, f in got])),
        )
        for key, got in runs.items()
    }


def calibrate_cpu(
    hw: Hardware,
    model: str,
    max_len: int,
    moe_model: str | None = "bench-moe",
    rounds: int = 1,
) -> dict[str, Any]:
    """Time the grid in every set-up and fit each: the gemm and attention classes and the
    per-layer overhead on a dense `model`, then the routed experts' class on `moe_model`
    with those held. Returns the calibration (for hardware.apply_calibration) with the
    measurements and each fit's errors."""
    import torch

    from pipeserve.device import best_dtype
    from pipeserve.models.config_presets import load_config

    arch = ArchConfig.from_dict(load_config(model)[0])
    if arch.num_experts:
        raise ValueError(f"calibrate on a dense model ({model} has experts); MoE goes second")
    points = calibration_points(max_len)
    dtype = best_dtype(torch.device("cpu"))  # what the engine computes in here by default
    measured = _measure(model, dtype, points, rounds)
    # efficiencies are shares of the matmul peak of one core in that dtype, measured alone
    peak = measured[efficiency_key(1, False)][2]
    hw = replace(hw, peak_flops=hw.peak_flops | {dtype: peak}, compute_dtype=dtype)
    report: dict[str, Any] = {"model": model, "points": points, "rounds": rounds, "setups": {}}
    fits = {}
    for key, (threads, seconds, flops) in measured.items():
        fit = fit_efficiency(arch, hw, threads, points[1:], seconds[1:], hw.efficiency)
        fits[key] = fit.efficiency
        report["setups"][key] = _setup_report(seconds, flops, fit)
    if moe_model:
        report["moe"] = _calibrate_moe(hw, moe_model, min(max_len, MOE_MAX_LEN), rounds, fits)
    return report | {
        "hardware": hw.name,
        "peak_flops": hw.peak_flops,
        "compute_dtype": dtype,
        "thread_efficiency": {k: asdict(v) for k, v in fits.items()},
    }


def _calibrate_moe(
    hw: Hardware, model: str, max_len: int, rounds: int, fits: dict[str, Efficiency]
) -> dict[str, Any]:
    """The experts' efficiency per set-up (updating `fits`), the dense classes held."""
    from pipeserve.models.config_presets import load_config

    arch = ArchConfig.from_dict(load_config(model)[0])
    points = calibration_points(max_len)
    report: dict[str, Any] = {"model": model, "points": points, "setups": {}}
    measured = _measure(model, hw.compute_dtype or "bfloat16", points, rounds)
    for key, (threads, seconds, flops) in measured.items():
        fit = fit_efficiency(arch, hw, threads, points[1:], seconds[1:], fits[key], free=("moe",))
        fits[key] = fit.efficiency
        report["setups"][key] = _setup_report(seconds, flops, fit)
    return report


def _setup_report(seconds: list[float], flops: float, fit: Fit) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "matmul_flops": flops,
        "efficiency": asdict(fit.efficiency),
        "errors": fit.errors,
        "median_abs_error": fit.median_abs_error,
    }


# -- the published GPU points -------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedPoint:
    """A TTFT someone measured: one prompt, PP1, a TP size, fixed chunks (spec 06)."""

    name: str
    model: str  # a config preset
    hardware: str
    tp: int
    chunk: int  # unpublished; the model's best fixed size under PP
    input_len: int
    ttft_s: float


PUBLISHED = (
    PublishedPoint("DeepSeek-V3.1 FP8, H20 PP1 TP8", "deepseek-v3.1", "h20", 8, 4096, 131072, 48.5),
    PublishedPoint(
        "Qwen3-235B-A22B-FP8, H20 PP1 TP4", "qwen3-235b-a22b", "h20", 4, 6144, 131072, 55.5
    ),
)
FIT_ITERATIONS = 8


def _point_classes(point: PublishedPoint, hw: Hardware) -> dict[str, float]:
    """Seconds by class (summed over the chunks) of the point's prefill, simulated."""
    from pipeserve.sim.run import SimSpec, simulate_with

    flags = {"tp_size": point.tp, "chunked_prefill_size": point.chunk}
    # the published runs multiplied the FP8 releases' weights in fp8, experts included
    spec = SimSpec(point.model, point.hardware, dtype="fp8", input_len=point.input_len)
    report = simulate_with(flags, spec, hw)
    return report["seconds_by_class"] | {"ttft_s": report["ttft_mean_s"]}


def _split(classes: dict[str, float], eff: Efficiency) -> tuple[float, float, float]:
    """(compute seconds at efficiency 1 of the gemm and MoE classes, of attention, the rest)."""
    gemm = classes["gemm"] * eff.gemm + classes["moe"] * eff.moe
    attention = classes["attention"] * eff.attention
    rest = classes["ttft_s"] - classes["gemm"] - classes["moe"] - classes["attention"]
    return gemm, attention, rest


def fit_published(
    hw: Hardware, points: tuple[PublishedPoint, ...] = PUBLISHED
) -> tuple[Efficiency, list[float]]:
    """Two scalars from two points: one efficiency for the matmul classes (projections and
    experts alike: gemm = moe), one for attention, such that each point's simulated TTFT is
    its published one. A point's TTFT is gemm_s / e_gemm + attention_s / e_attention + rest
    where compute binds; the 2 x 2 system is solved, the points re-simulated at the new
    efficiencies (where memory binds the split moves), until it settles. Returns the
    efficiency and each point's simulated TTFT at it."""
    eff = hw.efficiency
    for _ in range(FIT_ITERATIONS):
        rows, rhs = [], []
        for p in points:
            g, a, rest = _split(_point_classes(p, hw.with_efficiency(eff)), eff)
            rows.append([g, a])
            rhs.append(p.ttft_s - rest)
        inv = np.linalg.solve(np.asarray(rows), np.asarray(rhs))
        if (inv <= 0).any():
            raise ValueError(f"the published points give no positive efficiencies: {inv}")
        eff = replace(eff, gemm=1 / inv[0], moe=1 / inv[0], attention=1 / inv[1])
    final = [_point_classes(p, hw.with_efficiency(eff))["ttft_s"] for p in points]
    return eff, final


def fit_scale(hw: Hardware, point: PublishedPoint) -> Efficiency:
    """One scalar from one point: every compute efficiency times the same factor (the
    defaults' ratios kept), so that the point's simulated TTFT is the published one."""
    eff = hw.efficiency
    for _ in range(FIT_ITERATIONS):
        g, a, rest = _split(_point_classes(point, hw.with_efficiency(eff)), eff)
        # g / (k e_g) + a / (k e_a) + rest = ttft  ->  1 / k
        inv_k = (point.ttft_s - rest) / (g / eff.gemm + a / eff.attention)
        k = 1 / inv_k
        eff = replace(eff, gemm=eff.gemm * k, moe=eff.moe * k, attention=eff.attention * k)
    return eff


def leave_one_out(
    hw: Hardware, points: tuple[PublishedPoint, ...] = PUBLISHED
) -> list[dict[str, Any]]:
    """Each point predicted from a one-scalar fit on the other."""
    out = []
    for held in points:
        other = next(p for p in points if p is not held)
        eff = fit_scale(hw, other)
        predicted = _point_classes(held, hw.with_efficiency(eff))["ttft_s"]
        out.append(
            {
                "held_out": held.name,
                "fitted_on": other.name,
                "predicted_s": predicted,
                "published_s": held.ttft_s,
                "error": predicted / held.ttft_s - 1,
            }
        )
    return out


def run_calibration(
    hardware: str, model: str, max_len: int, out: str | None, rounds: int = 1
) -> dict[str, Any]:
    """`pipeserve simulate --calibrate`: CPU: measure and fit on this machine; a GPU with
    published points: fit them, with the leave-one-out errors. Saves and prints."""
    import json
    from pathlib import Path

    from pipeserve.sim.hardware import HARDWARE, calibration_json, calibration_path

    hw = HARDWARE[hardware]
    if hw.kind == "cpu":
        report = calibrate_cpu(hw, model, max_len, rounds=rounds)
        _print_cpu(report)
    else:
        points = tuple(p for p in PUBLISHED if p.hardware == hardware)
        if len(points) < 2:
            raise ValueError(
                f"no published points for {hardware} (only for "
                f"{', '.join(sorted({p.hardware for p in PUBLISHED}))}); pass a calibration "
                "file with --calibration"
            )
        base = replace(hw, efficiency=Efficiency())  # fit from neutral values, not the table's
        eff, final = fit_published(base, points)
        loo = leave_one_out(base, points)
        report = calibration_json(base.with_efficiency(eff)) | {
            "points": [asdict(p) | {"simulated_s": t} for p, t in zip(points, final, strict=True)],
            "leave_one_out": loo,
        }
        _print_gpu(report)
    path = Path(out) if out else calibration_path(hardware)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=float))
    print(f"saved {path}")
    return report


def _print_cpu(report: dict[str, Any]) -> None:
    for key, setup in report["setups"].items():
        eff = report["thread_efficiency"][key]
        print(
            f"{key:<10} gemm {eff['gemm']:.3f}  attention {eff['attention']:.3f}  "
            f"moe {eff['moe']:.3f}  per layer {1e3 * eff['layer_overhead_s']:.3f} ms  "
            f"median |error| {100 * setup['median_abs_error']:.1f}%"
            + (
                f" (MoE model {100 * report['moe']['setups'][key]['median_abs_error']:.1f}%)"
                if "moe" in report
                else ""
            )
        )
    dtype = report["compute_dtype"]
    print(f"{dtype} matmul peak {report['peak_flops'][dtype] / 1e9:.0f} GFLOP/s per core")


def _print_gpu(report: dict[str, Any]) -> None:
    eff = report["efficiency"]
    print(
        f"fitted on {len(report['points'])} published points: gemm = moe {eff['gemm']:.3f}, "
        f"attention {eff['attention']:.3f}"
    )
    for p in report["points"]:
        print(f"  {p['name']}: published {p['ttft_s']:.1f} s, simulated {p['simulated_s']:.2f} s")
    for r in report["leave_one_out"]:
        print(
            f"  leave-one-out: {r['held_out']} from {r['fitted_on']}: predicted "
            f"{r['predicted_s']:.2f} s vs {r['published_s']:.1f} s ({100 * r['error']:+.1f}%)"
        )
