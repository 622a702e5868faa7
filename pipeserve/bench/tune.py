"""`pipeserve tune`: the chunk-size tuning guide, automated.

1. Sweep fixed chunk sizes for the given layout and input length; keep the best.
2. Dynamic chunking with initial sizes 2x, 3x and 4x the best fixed size and smoothing
   factors across 0..1 (densest over 0.6..0.85), each profiled once (profiles are cached).
3. Report the fastest setting as command-line flags; save the table (JSON) and a plot of
   TTFT against the smoothing factor, one line per initial size (PNG).

One engine serves every trial (the chunk policy is scheduler state, the workers do not
change); each trial prefills a fresh random prompt, so the prefix cache never helps.
Trials run in order of expected value until --budget-s is spent. `--fixed-sizes` and
`--dynamic` name the trials instead; `--rounds R` runs the whole list R times, interleaved
(a machine whose speed drifts affects every trial alike), and reports each trial's median.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeserve.bench.offline import make_prompts
from pipeserve.engine.chunking import ChunkPolicy
from pipeserve.engine.engine import Engine
from pipeserve.scheduler.request import Req, SamplingParams

FIXED_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SMOOTH_FACTORS = (0.75, 0.6, 0.85, 0.7, 0.8, 0.65, 0.5, 0.9, 0.3, 1.0, 0.0)
INITIAL_MULTIPLES = (2, 3, 4)


@dataclass
class Trial:
    mode: str  # "fixed" | "dynamic"
    chunk_size: int
    smooth_factor: float | None
    ttft_s: float  # the median of the samples
    chunk_sizes: list[int]
    samples: list[float] = field(default_factory=list)

    def flags(self) -> str:
        out = f"--chunked-prefill-size {self.chunk_size}"
        if self.mode == "dynamic":
            out += (
                f" --enable-dynamic-chunking --dynamic-chunking-smooth-factor {self.smooth_factor}"
            )
        return out


class Tuner:
    def __init__(
        self,
        engine: Engine,
        input_len: int,
        budget_s: float,
        fixed_sizes: list[int] | None = None,
        dynamic: list[tuple[int, float]] | None = None,
        rounds: int = 1,
    ) -> None:
        self.engine, self.input_len = engine, input_len
        self.deadline = time.monotonic() + budget_s
        sizes = fixed_sizes or [s for s in FIXED_SIZES if s <= input_len] or [input_len]
        self.fixed = [ChunkPolicy(size) for size in sizes]
        self.dynamic_settings, self.rounds = dynamic, rounds
        self.trials: list[Trial] = []
        self._prompt_seed = 1000

    def run(self) -> list[Trial]:
        self._warm_up()
        self._round(self.fixed)
        fixed_trials = [t for t in self.trials if t.mode == "fixed"]
        if not fixed_trials:
            return self.trials
        dynamic = self._dynamic_trials(min(fixed_trials, key=lambda t: t.ttft_s).chunk_size)
        self._round(dynamic)
        for _ in range(self.rounds - 1):
            self._round(self.fixed + dynamic)
        return self.trials

    def _dynamic_trials(self, best_fixed: int) -> list[ChunkPolicy]:
        """The --dynamic settings, or initial sizes 2-4x the best fixed size at every
        smoothing factor."""
        if self.dynamic_settings is not None:
            return [self._dynamic(size, factor) for size, factor in self.dynamic_settings]
        initial = sorted(
            {min(m * best_fixed, self.input_len) // 64 * 64 for m in INITIAL_MULTIPLES}
        )
        return [self._dynamic(size, factor) for factor in SMOOTH_FACTORS for size in initial]

    def _round(self, policies: list[ChunkPolicy]) -> None:
        for policy in policies:
            self._try(policy)

    def _dynamic(self, size: int, factor: float) -> ChunkPolicy:
        """Dynamic chunking as the engine's flags set it (cost model, floor, profile length),
        with this trial's initial size and smoothing factor."""
        base = ChunkPolicy.from_config(self.engine.config)
        return replace(
            base, size=size, dynamic=True, auto=False, smooth_factor=factor, online=False
        )

    def _warm_up(self) -> None:
        self._measure(ChunkPolicy(min(512, self.input_len)), 256)

    def _try(self, policy: ChunkPolicy) -> None:
        expected = max((t.ttft_s for t in self.trials), default=0.0)
        if time.monotonic() + expected > self.deadline:
            return
        ttft, sizes = self._measure(policy, self.input_len)
        trial = self._trial_for(policy, ttft, sizes)
        trial.samples.append(ttft)
        trial.ttft_s = statistics.median(trial.samples)
        factor = "-" if trial.smooth_factor is None else trial.smooth_factor
        print(
            f"{trial.mode:<8} C={trial.chunk_size:<6} s={factor:<5} TTFT {ttft:8.3f}s  "
            f"chunks {len(sizes)}",
            flush=True,
        )

    def _trial_for(self, policy: ChunkPolicy, ttft: float, sizes: list[int]) -> Trial:
        """The trial of this policy (a new one in the first round)."""
        mode = "dynamic" if policy.dynamic else "fixed"
        key = (
            mode,
            policy.size or self.input_len,
            policy.smooth_factor if policy.dynamic else None,
        )
        for t in self.trials:
            if (t.mode, t.chunk_size, t.smooth_factor) == key:
                return t
        self.trials.append(Trial(*key, ttft, sizes))
        return self.trials[-1]

    def _measure(self, policy: ChunkPolicy, length: int) -> tuple[float, list[int]]:
        self.engine.backend.set_chunk_policy(policy)
        self._prompt_seed += 1
        prompt = make_prompts(self.engine.arch.vocab_size, 1, length, self._prompt_seed)[0]
        req = Req(
            f"tune-{self._prompt_seed}", prompt, SamplingParams(max_new_tokens=1, temperature=0)
        )
        out = self.engine.run([req])[0]
        return out["meta_info"]["ttft_s"], out["meta_info"]["chunk_sizes"]


def run_tune(
    flags: dict[str, Any],
    input_len: int,
    budget_s: float,
    json_path: str | None,
    png_path: str | None,
    fixed_sizes: list[int] | None = None,
    dynamic: list[tuple[int, float]] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    # the trials set their own chunk sizes: no start-up pick of one
    with Engine(**{"chunked_prefill_size": FIXED_SIZES[0], **flags}) as engine:
        trials = Tuner(engine, input_len, budget_s, fixed_sizes, dynamic, rounds).run()
        p = engine.config.parallel
        model = str(engine.model_path)
    if not trials:
        raise RuntimeError("the budget allowed no trial; raise --budget-s")
    best = min(trials, key=lambda t: t.ttft_s)
    best_fixed = min((t for t in trials if t.mode == "fixed"), key=lambda t: t.ttft_s)
    report: dict[str, Any] = {
        "model": model,
        "pp_size": p.pp_size,
        "tp_size": p.tp_size,
        "input_len": input_len,
        "budget_s": budget_s,
        "trials": [asdict(t) for t in trials],
        "best": asdict(best),
        "best_fixed": asdict(best_fixed),
        "recommended_flags": best.flags(),
        "gain_over_best_fixed": 1.0 - best.ttft_s / best_fixed.ttft_s,
        "rounds": rounds,
        "dynamic_vs_fixed": _dynamic_ratios(trials, best_fixed),
    }
    print(f"\nbest fixed: {best_fixed.flags()}  TTFT {best_fixed.ttft_s:.3f}s")
    print(
        f"recommended: {best.flags()}  TTFT {best.ttft_s:.3f}s "
        f"({100 * report['gain_over_best_fixed']:.1f}% below the best fixed size)"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"saved {json_path}")
    if png_path:
        plot_tune(trials, best_fixed, png_path)
        print(f"saved {png_path}")
    return report


def _dynamic_ratios(trials: list[Trial], best_fixed: Trial) -> list[dict[str, Any]]:
    """Each dynamic trial's TTFT over the best fixed size's, and over fixed chunks of its own
    initial size (when that size was a trial)."""
    fixed = {t.chunk_size: t.ttft_s for t in trials if t.mode == "fixed"}
    return [
        {
            "chunk_size": t.chunk_size,
            "smooth_factor": t.smooth_factor,
            "to_best_fixed": t.ttft_s / best_fixed.ttft_s,
            "to_same_fixed": t.ttft_s / fixed[t.chunk_size] if t.chunk_size in fixed else None,
        }
        for t in trials
        if t.mode == "dynamic"
    ]


def plot_tune(trials: list[Trial], best_fixed: Trial, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for size in sorted({t.chunk_size for t in trials if t.mode == "dynamic"}):
        pts = sorted(
            (t.smooth_factor or 0.0, t.ttft_s)
            for t in trials
            if t.mode == "dynamic" and t.chunk_size == size
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"dynamic, C={size}")
    ax.axhline(
        best_fixed.ttft_s,
        linestyle="--",
        color="grey",
        label=f"best fixed, {best_fixed.chunk_size}",
    )
    ax.set_xlabel("smoothing factor s")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT against the smoothing factor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
