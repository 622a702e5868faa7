"""`pipeserve tune --simulate`: which layout and chunk settings to run on a cluster one does
not have. Every layout of the cluster's devices the engine builds (TP x PP x CP x EP) whose
weights and the prompt's KV fit in memory, each with fixed chunk sizes and, under PP,
dynamic chunking around the best fixed size, is simulated with the engine's own scheduler
(sim/simulator.py); the report ranks them by TTFT for one prompt and gives each one's input
throughput with several prompts in flight."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeserve.config import SchedulerConfig
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config
from pipeserve.sim.run import SimSpec, simulate

FIXED_SIZES = (2048, 4096, 6144, 8192, 12288, 16384)
DEFAULT_PREFILL_BUDGET = SchedulerConfig().max_prefill_tokens
DYNAMIC_MULTIPLES = (2, 3)
SMOOTH_FACTORS = (0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1

    @property
    def name(self) -> str:
        parts = [f"PP{self.pp}", f"TP{self.tp}"]
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        return " ".join(parts)

    def flags(self) -> dict[str, int]:
        return {"tp_size": self.tp, "pp_size": self.pp, "ep_size": self.ep, "cp_size": self.cp}


@dataclass
class Plan:
    layout: str
    flags: dict[str, Any]
    chunking: str  # "fixed 4096" | "dynamic C=8192 s=0.8"
    ttft_s: float
    input_throughput_tok_s: float | None = None
    bubble_ratio: list[float] | None = None
    chunks: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(arch: ArchConfig, devices: int) -> list[Candidate]:
    """Layouts of exactly `devices` the engine builds: TP dividing the attention heads, PP
    at most the layers, EP (MoE models; needs TP 1) dividing the experts, CP (needs TP 1
    and EP 1)."""
    out = []
    for pp in _divisors(devices):
        if pp > arch.num_layers:
            continue
        rest = devices // pp
        if arch.num_heads % rest == 0:
            out.append(Candidate(rest, pp))
        if arch.num_experts and rest > 1 and arch.num_experts % rest == 0:
            out.append(Candidate(1, pp, ep=rest))
        if rest > 1:
            out.append(Candidate(1, pp, cp=rest))
    return out


def plan(
    flags: dict[str, Any],
    spec: SimSpec,
    devices: int,
    fixed_sizes: list[int] | None = None,
    dynamic: list[tuple[int, float]] | None = None,
    throughput_prompts: int = 4,
) -> dict[str, Any]:
    arch = ArchConfig.from_dict(load_config(spec.model)[0])
    plans: list[Plan] = []
    skipped: dict[str, str] = {}
    for cand in candidates(arch, devices):
        found = _plan_layout(flags, spec, cand, fixed_sizes, dynamic)
        if isinstance(found, str):
            skipped[cand.name] = found
            continue
        plans.extend(found)
    if not plans:
        raise ValueError(
            "no layout of these devices fits the model and the prompt: "
            + "; ".join(f"{k}: {v}" for k, v in skipped.items())
        )
    plans.sort(key=lambda p: p.ttft_s)
    best = _best_per_layout(plans)
    for p in best:
        p.input_throughput_tok_s = _throughput(flags, spec, p, throughput_prompts)
    return {
        "model": spec.model,
        "hardware": spec.hardware,
        "devices": devices,
        "devices_per_node": spec.devices_per_node,
        "input_len": spec.input_len,
        "throughput_prompts": throughput_prompts,
        "best": [asdict(p) for p in best],
        "trials": [asdict(p) for p in plans],
        "skipped": skipped,
    }


def _plan_layout(
    flags: dict[str, Any],
    spec: SimSpec,
    cand: Candidate,
    fixed_sizes: list[int] | None,
    dynamic: list[tuple[int, float]] | None,
) -> list[Plan] | str:
    base = {**flags, **cand.flags()}
    sizes = [s for s in (fixed_sizes or FIXED_SIZES) if s <= spec.input_len] or [spec.input_len]
    out: list[Plan] = []
    refusals: list[str] = []
    for size in sizes:
        fixed = base | _chunk_flags(size, flags)
        found = _trial(fixed, spec, cand, f"fixed {size}")
        if isinstance(found, Plan):
            out.append(found)
        else:
            refusals.append(found)
    if not out:  # e.g. the weights do not fit; the same reason for every size
        return refusals[0]
    if cand.pp == 1:  # dynamic chunking balances pipeline stages: nothing to balance
        return out
    best = min(out, key=lambda p: p.ttft_s)
    size = best.flags["chunked_prefill_size"]
    settings = dynamic or [(m * size, s) for m in DYNAMIC_MULTIPLES for s in SMOOTH_FACTORS]
    for c, s in settings:
        if c > spec.input_len:
            continue
        dyn = (
            base
            | _chunk_flags(c, flags)
            | {
                "enable_dynamic_chunking": True,
                "dynamic_chunking_smooth_factor": s,
                "dynamic_chunking_profile_max_len": spec.input_len,
            }
        )
        found = _trial(dyn, spec, cand, f"dynamic C={c} s={s}")
        if isinstance(found, Plan):
            out.append(found)
    return out


def _chunk_flags(size: int, flags: dict[str, Any]) -> dict[str, Any]:
    """A chunk size and a prefill budget that lets a chunk be that large (unless the user
    set the budget)."""
    budget = flags.get("max_prefill_tokens") or max(size, DEFAULT_PREFILL_BUDGET)
    return {"chunked_prefill_size": size, "max_prefill_tokens": budget}


def _trial(flags: dict[str, Any], spec: SimSpec, cand: Candidate, chunking: str) -> Plan | str:
    """The simulated plan, or why the engine refuses it (memory, a flag combination)."""
    try:
        r = simulate(flags, spec)
    except ValueError as exc:
        return str(exc)
    return Plan(
        cand.name,
        {k: v for k, v in flags.items() if k in _PLAN_FLAGS},
        chunking,
        r["ttft_mean_s"],
        bubble_ratio=r["bubble_ratio"],
        chunks=len(r["chunk_sizes"][0]),
    )


_PLAN_FLAGS = (
    "tp_size",
    "pp_size",
    "ep_size",
    "cp_size",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "enable_dynamic_chunking",
    "dynamic_chunking_smooth_factor",
    "dynamic_chunking_profile_max_len",
)


def _best_per_layout(plans: list[Plan]) -> list[Plan]:
    seen: dict[str, Plan] = {}
    for p in plans:  # sorted: the first of a layout is its best
        seen.setdefault(p.layout, p)
    return list(seen.values())


def _throughput(flags: dict[str, Any], spec: SimSpec, p: Plan, prompts: int) -> float:
    many = SimSpec(**{**asdict(spec), "num_prompts": prompts})
    return float(simulate({**flags, **p.flags}, many)["input_throughput_tok_s"])


def command_line(p: dict[str, Any]) -> str:
    f = p["flags"]
    out = f"--tp-size {f['tp_size']} --pp-size {f['pp_size']}"
    out += f" --ep-size {f['ep_size']}" if f.get("ep_size", 1) > 1 else ""
    out += f" --cp-size {f['cp_size']}" if f.get("cp_size", 1) > 1 else ""
    out += f" --chunked-prefill-size {f['chunked_prefill_size']}"
    if f.get("max_prefill_tokens", DEFAULT_PREFILL_BUDGET) != DEFAULT_PREFILL_BUDGET:
        out += f" --max-prefill-tokens {f['max_prefill_tokens']}"
    if f.get("enable_dynamic_chunking"):
        out += (
            " --enable-dynamic-chunking --dynamic-chunking-smooth-factor "
            f"{f['dynamic_chunking_smooth_factor']} --dynamic-chunking-profile-max-len "
            f"{f['dynamic_chunking_profile_max_len']}"
        )
    return out


def print_plan(report: dict[str, Any], top: int) -> None:
    print(
        f"simulated plans: {report['model']} on {report['devices']} x {report['hardware']}, "
        f"{report['input_len']} input tokens (throughput: {report['throughput_prompts']} prompts)"
    )
    print(f"{'layout':<16} {'chunking':<24} {'TTFT s':>9} {'in tok/s':>10}  bubble per stage")
    for p in report["best"][:top]:
        bubbles = ", ".join(f"{b:.2f}" for b in p["bubble_ratio"] or [])
        print(
            f"{p['layout']:<16} {p['chunking']:<24} {p['ttft_s']:9.2f} "
            f"{p['input_throughput_tok_s']:10.1f}  {bubbles}"
        )
    best = report["best"][0]
    print(f"recommended: {command_line(best)}")
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def plot_plan(report: dict[str, Any], path: str) -> None:
    """Best TTFT per layout (bars) and its input throughput (dots, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = report["best"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(best)), 4.5))
    names = [f"{p['layout']}\n{p['chunking']}" for p in best]
    ax.bar(range(len(best)), [p["ttft_s"] for p in best], color="tab:blue")
    ax.set_xticks(range(len(best)), names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("simulated TTFT (s)")
    right = ax.twinx()
    right.plot(range(len(best)), [p["input_throughput_tok_s"] for p in best], "o", color="tab:red")
    right.set_ylabel("input throughput (tok/s)", color="tab:red")
    ax.set_title(
        f"{report['model']}: {report['devices']} x {report['hardware']}, "
        f"{report['input_len']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_plan(
    flags: dict[str, Any],
    spec: SimSpec,
    devices: int,
    json_path: str | None,
    png_path: str | None,
    fixed_sizes: list[int] | None = None,
    dynamic: list[tuple[int, float]] | None = None,
    throughput_prompts: int = 4,
    top: int = 5,
) -> dict[str, Any]:
    chunking_log = logging.getLogger("pipeserve.engine.chunking")
    level = chunking_log.level
    chunking_log.setLevel(logging.WARNING)  # not a fit line per trial
    try:
        report = plan(flags, spec, devices, fixed_sizes, dynamic, throughput_prompts)
    finally:
        chunking_log.setLevel(level)
    print_plan(report, top)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"saved {json_path}")
    if png_path:
        plot_plan(report, png_path)
        print(f"saved {png_path}")
    return report
