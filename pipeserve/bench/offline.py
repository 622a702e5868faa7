"""`pipeserve bench`: prefill/decode timing on identical random prompts, the achieved prefill
FLOP/s against this machine's matmul peak, per-stage bubble ratios and communication (bytes
per forward, seconds waited) from the timeline, and ratios taken in the same run: between
parallel layouts (`--pp-size 1,2 --ep-size 1,2 --cp-size 1,2`) and against Hugging Face
transformers (`--baseline hf`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.flops import attention_flops, prefill_flops
from pipeserve.bench.llamacpp_baseline import LLAMACPP_MISSING
from pipeserve.bench.peak import matmul_peak_flops
from pipeserve.bench.summary import summarize
from pipeserve.config import EngineConfig, ParallelConfig, SettingsError
from pipeserve.device import (
    DTYPES,
    peak_memory,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    set_threads,
)
from pipeserve.distributed.launcher import threads_per_worker
from pipeserve.engine.engine import Engine
from pipeserve.models.resolve import gguf_file
from pipeserve.runner.kv_layout import stage_kv_bytes_per_token
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.timeline import (
    COMM_BYTES,
    Event,
    afd_bytes_per_step,
    afd_idle_shares,
    afd_in_node_bytes_per_step,
    boundary_bytes,
    bubble_ratios,
    comm_bytes_per_forward,
    cp_kv_per_layer,
    draw_overlap,
    draw_timeline,
    exposed_comm_s,
    exposed_comm_share,
    forward_events,
    hidden_cpu_time,
    micro_batch_seconds,
    split_forward_share,
    stage_overlap,
    weight_bytes_per_device,
    write_trace,
)

TIMING_KEYS = (
    "ttft_mean_s",
    "ttft_p50_s",
    "prefill_s",
    "decode_s",
    "total_s",
    "input_throughput_tok_s",
    "output_throughput_tok_s",
)


def make_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(num)]


def run_pipeserve(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Warm up on other prompts, then time all prompts submitted at once."""
    warm = make_prompts(engine.arch.vocab_size, 2, 64, seed=12345)
    engine.run(
        [
            Req(f"warmup-{i}", p, SamplingParams(max_new_tokens=2, temperature=0.0))
            for i, p in enumerate(warm)
        ]
    )
    engine.backend.timeline()  # drop the warm-up events
    sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"bench-{i}", p, sp) for i, p in enumerate(prompts)]
    device = resolve_device(engine.config.model.device)
    reset_peak_memory(device)  # one in-process engine: its GPU memory is this process's
    graphs = getattr(getattr(engine.backend, "runner", None), "graphs", None)  # in-process
    replays = 0 if graphs is None else graphs.replays
    start = time.perf_counter()
    outputs = engine.run(reqs)
    total = time.perf_counter() - start
    ttfts = [o["meta_info"]["ttft_s"] for o in outputs]
    out_tokens = sum(len(o["output_ids"]) for o in outputs)
    stats: dict[str, Any] = summarize(
        ttfts, total, sum(map(len, prompts)), out_tokens, len(prompts)
    )
    stats["chunk_sizes"] = [o["meta_info"]["chunk_sizes"] for o in outputs]
    stats["output_ids"] = [o["output_ids"] for o in outputs]
    stats["events"] = events = engine.backend.timeline()
    cpu, hidden = hidden_cpu_time(events)
    stats["scheduler_cpu_s"], stats["scheduler_cpu_hidden_s"] = cpu, hidden
    stats["overlap_schedule"] = engine.backend.stats()["overlap_schedule"]
    stats["chunking"] = dict(engine.backend.chunking)  # with dynamic chunking: profile and fit
    stats["loop"] = engine.backend.stats()["loop"]
    stats["expert_weight_bytes_per_rank"] = engine.backend.expert_bytes_per_rank()
    stats["kv_bytes_per_device"] = kv_bytes_per_device(
        engine, [len(p) for p in prompts], output_len
    )
    in_process = not engine.config.parallel.uses_workers
    stats["peak_device_bytes"] = peak_memory(device) if in_process else None
    stats["cuda_graph_replays"] = None if graphs is None else graphs.replays - replays
    return stats


def kv_bytes_per_device(engine: Engine, prompt_lens: list[int], output_len: int) -> int:
    """KV bytes the run's requests occupy on the busiest device at their longest: a stage's
    layers (the largest stage), its TP share of the heads, and under context parallelism
    the pages it holds of each request (every N-th, rounded up)."""
    p, page = engine.config.parallel, engine.config.cache.page_size
    partition = getattr(engine.backend, "partition", None) or [engine.arch.num_layers]
    per_token = stage_kv_bytes_per_token(engine.config, engine.arch, partition)
    pages = sum(_ceil(_ceil(n + output_len, page), p.cp_size) for n in prompt_lens)
    return pages * page * per_token


OVERLAPS = ("none", "tbo", "sbo", "tbo+sbo")  # --compare-overlap: MoE overlap settings


@dataclass(frozen=True)
class Layout:
    """One engine configuration a benchmark compares."""

    pp: int
    tp: int
    ep: int = 1
    cp: int = 1  # context-parallel ranks per stage
    spawn_workers: bool = False  # one device in a worker process instead of in-process
    threads: int | None = None  # torch threads per worker (None: the flags' or the default)
    loop: str | None = None  # "overlap" | "plain" forced (None: the device's default)
    overlap: str | None = None  # MoE overlap forced: one of OVERLAPS (None: the flags')
    afd: tuple[int, int] = (0, 0)  # attention-FFN disaggregation: (attention, FFN) workers

    @property
    def name(self) -> str:
        if self.afd[0]:
            return f"AFD {self.afd[0]}A+{self.afd[1]}F"
        worker = " worker" if self.spawn_workers else ""
        threads = f" {self.threads}thr" if self.threads else ""
        loop = f" {self.loop}" if self.loop else ""
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        overlap = f" {self.overlap}" if self.overlap else ""
        return f"PP{self.pp} TP{self.tp}{ep}{cp}{worker}{threads}{loop}{overlap}"

    def flags(self, base: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {"spawn_workers": True} if self.spawn_workers else {}
        if self.threads:
            extra["threads_per_worker"] = self.threads
        if self.loop:
            extra[f"{'enable' if self.loop == 'overlap' else 'disable'}_overlap_schedule"] = True
        if self.overlap:
            extra["enable_two_batch_overlap"] = self.overlap in ("tbo", "tbo+sbo")
            extra["enable_single_batch_overlap"] = self.overlap in ("sbo", "tbo+sbo")
        sizes = {"pp_size": self.pp, "tp_size": self.tp, "ep_size": self.ep, "cp_size": self.cp}
        if self.afd[0]:
            extra["afd_attention_size"], extra["afd_ffn_size"] = self.afd
        return {**base, **sizes, **extra}

    @property
    def devices(self) -> int:
        return sum(self.afd) if self.afd[0] else self.pp * self.tp * self.ep * self.cp


def run_bench(
    flags: dict[str, Any],
    layouts: list[Layout],
    input_len: int,
    output_len: int,
    num_prompts: int,
    seed: int = 0,
    baseline: str | None = None,
    json_path: str | None = None,
    trace_path: str | None = None,
    timeline_path: str | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """Run every layout on the same prompts, `repeat` rounds interleaved (layout A, B, A, B:
    a machine whose speed drifts affects all alike); each layout reports its median run."""
    config = EngineConfig.from_flags(**flags)
    for layout in layouts:  # a layout the engine refuses fails before any runs
        EngineConfig.from_flags(**layout.flags(flags))
    gguf = llamacpp_gguf(config, output_len) if baseline == "llamacpp" else None  # and so on
    samples: dict[Layout, list[dict[str, Any]]] = {lay: [] for lay in layouts}
    for _ in range(repeat):
        for layout in layouts:
            with Engine(**layout.flags(flags)) as engine:
                if not any(samples.values()):
                    report = _describe(engine, config, input_len, output_len, num_prompts)
                    prompts = make_prompts(engine.arch.vocab_size, num_prompts, input_len, seed)
                    flops = sum(prefill_flops(engine.arch, len(p)) for p in prompts)
                    attn = sum(attention_flops(engine.arch, 0, len(p)) for p in prompts)
                samples[layout].append(run_pipeserve(engine, prompts, output_len))
    runs: list[dict[str, Any]] = []
    panels: list[tuple[str, list[Event]]] = []
    for layout in layouts:
        stats = _median_run(samples[layout])
        events = stats.pop("events")
        panels.append((layout.name, events))
        row = _layout_row(layout, stats, flops, report["matmul_peak_flops"], runs)
        # attention's FLOPs over the whole prefill span: a lower bound on the attention
        # kernels' own rate, close to it where attention dominates (long prompts)
        row["attention_flops"] = attn
        row["attention_flops_per_s"] = attn / stats["prefill_s"]
        parallel = EngineConfig.from_flags(**layout.flags(flags)).parallel
        row["two_batch_overlap"] = parallel.enable_two_batch_overlap
        row["two_batch_overlap_min_tokens"] = parallel.two_batch_overlap_min_tokens
        row["split_forward_share"] = split_forward_share(events)
        row["single_batch_overlap"] = parallel.enable_single_batch_overlap
        row["single_batch_overlap_min_tokens"] = parallel.single_batch_overlap_min_tokens
        row["bubble_ratio"] = bubble_ratios(events)
        row["boundary_bytes"] = boundary_bytes(events)
        row["stage_overlap"] = stage_overlap(events)
        row["forward_s_mean"] = _mean_forward(events)
        row["comm_bytes_per_forward"] = comm_bytes_per_forward(events)
        row["exposed_comm_s"] = exposed_comm_s(events)
        row["exposed_comm_share_of_forward"] = exposed_comm_share(events)
        row["afd"] = _afd_row(parallel, events, row, num_prompts)
        row["weight_bytes_per_device"], expected = weight_bytes_per_device(events)
        row["kv_bytes_per_device"] = stats["kv_bytes_per_device"]
        row["cp"] = _cp_row(parallel, events, expected)
        runs.append(row)
    report["repeat"] = repeat
    report.update({k: v for k, v in runs[0].items() if k not in ("output_ids", "events")})
    # report["chunking"] is the first layout's (each row has its own): with dynamic chunking
    # the cost model, its fitted coefficients, the profile points and seconds
    report["layouts"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in runs]
    report["same_tokens_across_layouts"] = all(
        r["output_ids"] == runs[0]["output_ids"] for r in runs
    )
    if baseline == "hf":
        _add_hf_baseline(report, runs[0], prompts, output_len, flags)
    elif gguf is not None:
        _add_llamacpp_baseline(report, runs[0], prompts, output_len, gguf)
    print_report(report)
    _save(report, panels, json_path, trace_path, timeline_path)
    return report


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median prefill time (its events and chunk sizes go with it), plus
    every run's TTFT and prefill time."""
    ordered = sorted(runs, key=lambda r: r["prefill_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["ttft_mean_s_samples"] = [r["ttft_mean_s"] for r in runs]
    chosen["prefill_s_samples"] = [r["prefill_s"] for r in runs]
    return chosen


def _mean_forward(events: list[Event]) -> float:
    """Mean seconds of a first-stage forward (rank 0): compare in-process with worker runs."""
    fwd = [e.end - e.start for e in forward_events(events) if e.stage == 0]
    return statistics.fmean(fwd) if fwd else 0.0


def _describe(
    engine: Engine, config: EngineConfig, input_len: int, output_len: int, num_prompts: int
) -> dict[str, Any]:
    m = engine.config.model  # --dtype best made concrete for this model and device
    dtype = resolve_dtype(m.dtype, engine.arch.torch_dtype, m.device)
    threads = threads_per_worker(config)
    set_threads(threads)
    peak = matmul_peak_flops(dtype, resolve_device(config.model.device))
    return {
        "model": str(engine.model_path),
        "dtype": str(dtype).removeprefix("torch."),
        "threads_per_worker": threads,
        "input_len": input_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "chunked_prefill_size": config.scheduler.chunked_prefill_size,
        "enable_dynamic_chunking": config.scheduler.enable_dynamic_chunking,
        "two_batch_overlap": config.parallel.enable_two_batch_overlap,
        "single_batch_overlap": config.parallel.enable_single_batch_overlap,
        "matmul_peak_flops": peak,
    }


def _layout_row(
    layout: Layout,
    stats: dict[str, Any],
    flops: float,
    peak: float,
    earlier: list[dict[str, Any]],
) -> dict[str, Any]:
    devices = layout.devices
    base = earlier[0] if earlier else None
    speedup = base["prefill_s"] / stats["prefill_s"] if base else 1.0
    base_devices = base["devices"] if base else devices
    return {
        "layout": layout.name,
        "pp_size": layout.pp,
        "tp_size": layout.tp,
        "ep_size": layout.ep,
        "cp_size": layout.cp,
        "devices": devices,
        "spawn_workers": layout.spawn_workers,
        **stats,
        "prefill_flops": flops,
        "prefill_flops_per_s": flops / stats["prefill_s"],
        "prefill_flops_share_of_peak": flops / stats["prefill_s"] / (peak * devices),
        "speedup": speedup,
        "efficiency": speedup / (devices / base_devices),
    }


def _afd_row(
    p: ParallelConfig, events: list[Event], row: dict[str, Any], num_prompts: int
) -> dict[str, Any] | None:
    """Attention-FFN disaggregation's settings and what the run measured (None: off). TPOT:
    every request decodes in every decode step here, so it is requests over tokens/s."""
    if not p.afd_enabled:
        return None
    out_rate = row["output_throughput_tok_s"]
    return {
        "decode_tok_s_per_worker": out_rate / row["devices"],
        "tpot_s": num_prompts / out_rate if out_rate else 0.0,
        "micro_batch_s": micro_batch_seconds(events, p.afd_micro_batches),
        "attention_size": p.afd_attention_size,
        "ffn_size": p.afd_ffn_size,
        "ffn_nodes": p.afd_ffn_nodes,
        "dispatch_mode": p.afd_dispatch_mode,
        "micro_batches": p.afd_micro_batches,
        "bytes_between_nodes_per_step": afd_bytes_per_step(events, p.afd_attention_size),
        "bytes_inside_node_per_step": afd_in_node_bytes_per_step(events),
        "idle_share": afd_idle_shares(events, p.afd_attention_size),
    }


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _cp_row(p: ParallelConfig, events: list[Event], expected_weights: int) -> dict[str, Any] | None:
    """Context parallelism's settings and what the run measured (None: off): per layer the
    K/V exchange's span, its exposed part and hidden share (per forward of a rank), and with
    shard linear the weight bytes its plan expects of the busiest rank."""
    if p.cp_size == 1:
        return None
    layers = cp_kv_per_layer(events)
    span = sum(v["span_s"] for v in layers.values())
    exposed = sum(v["exposed_s"] for v in layers.values())
    return {
        "prefix_mode": p.cp_prefix_mode,
        "kv_overlap": not p.disable_cp_kv_overlap,
        "kv_exchange_per_layer": layers,
        "kv_exposed_s_per_layer": exposed / len(layers) if layers else 0.0,
        "kv_hidden_share": 1 - exposed / span if span else 0.0,
        "shard_linear_layers": p.shard_linear_layers,
        "shard_linear_warm_layers": p.shard_linear_warm_layers,
        "shard_linear_expected_weight_bytes": expected_weights if p.shard_linear_layers else None,
    }


def _add_hf_baseline(
    report: dict[str, Any],
    run: dict[str, Any],
    prompts: list[list[int]],
    output_len: int,
    flags: dict[str, Any],
) -> None:
    from pipeserve.bench.hf_baseline import run_hf

    config = EngineConfig.from_flags(**flags)
    dtype = DTYPES[report["dtype"]]  # what pipeserve computed in
    device = resolve_device(config.model.device)
    name = "hf-transformers" + ("+sdpa" if device.type == "cuda" else "")
    try:
        base = run_hf(Path(report["model"]), prompts, output_len, dtype, device)
    except torch.OutOfMemoryError as e:  # a length transformers cannot hold: say so, keep ours
        report["baseline"] = {"name": name, "error": f"out of memory: {str(e).splitlines()[0]}"}
        print(f"hf: out of memory at {len(prompts[0])} tokens; no baseline")
        return
    extra = {k: base[k] for k in ("sdpa_kernels", "peak_device_bytes")}
    _compare_with_baseline(report, run, base, name, extra)


def llamacpp_gguf(config: EngineConfig, output_len: int) -> Path:
    """The GGUF file llama.cpp runs for `config`'s --model, checked before any run: llama.cpp
    reads nothing else, llama-cpp-python must be installed, and its TTFT needs a token."""
    if output_len < 1:
        raise SettingsError("--baseline llamacpp needs --output-len 1 or more")
    gguf = gguf_file(config.model.model_path)
    if gguf is None:
        raise SettingsError(
            f"--baseline llamacpp reads GGUF files; --model {config.model.model_path} is not one "
            "(the built-in model is)"
        )
    if importlib.util.find_spec("llama_cpp") is None:
        raise SettingsError(LLAMACPP_MISSING)
    return gguf


def _add_llamacpp_baseline(
    report: dict[str, Any],
    run: dict[str, Any],
    prompts: list[list[int]],
    output_len: int,
    gguf: Path,
) -> None:
    from pipeserve.bench.llamacpp_baseline import run_llamacpp

    base = run_llamacpp(gguf, prompts, output_len, report["threads_per_worker"])
    name = f"llama.cpp (llama-cpp-python {base['version']}, {gguf.name})"
    _compare_with_baseline(report, run, base, name, {"gguf": str(gguf)})


def _compare_with_baseline(
    report: dict[str, Any],
    run: dict[str, Any],
    base: dict[str, Any],
    name: str,
    extra: dict[str, Any],
) -> None:
    report["baseline"] = {
        "name": name,
        **{k: base[k] for k in TIMING_KEYS},
        **extra,
        "attention_flops_per_s": run["attention_flops"] / base["prefill_s"],
    }
    report["ratio_to_baseline"] = {
        "prefill_time": run["prefill_s"] / base["prefill_s"],
        "ttft_mean": run["ttft_mean_s"] / base["ttft_mean_s"],
        "decode_throughput": (
            base["output_throughput_tok_s"] / run["output_throughput_tok_s"]
            if run["output_throughput_tok_s"]
            else None
        ),
    }
    report["same_greedy_tokens_as_baseline"] = base["output_ids"] == run["output_ids"]


def _save(
    report: dict[str, Any],
    panels: list[tuple[str, list[Event]]],
    json_path: str | None,
    trace_path: str | None,
    timeline_path: str | None,
) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"saved {json_path}")
    if trace_path:
        events = [e for i, (_, ev) in enumerate(panels) for e in _offset_stage(ev, i)]
        write_trace(events, trace_path)
        print(f"saved {trace_path}")
    if timeline_path:
        draw_timeline(panels, timeline_path)
        print(f"saved {timeline_path}")
        overlap = Path(timeline_path).with_suffix(".overlap.png")
        if draw_overlap(panels, overlap):  # micro-batches of two-batch overlap, inside a forward
            print(f"saved {overlap}")


def _offset_stage(events: list[Event], layout: int) -> list[Event]:
    """Layouts one after another in a trace: stage ids of layout i start at 100 * i (its
    scheduler's row is 100 * i - 1)."""
    return [dataclasses.replace(e, stage=e.stage + 100 * layout) for e in events]


def describe_chunking(info: dict[str, Any]) -> str:
    """One line: the chunking mode and, with dynamic chunking, the fitted cost model."""
    picked = " picked at start-up" if "auto" in info else ""
    if "coefficients" not in info:
        extra = info.get("chunk_size") or info.get("reason")
        return info["mode"] + (f" ({extra}{picked})" if extra else "")
    terms = " ".join(f"{k}={v:.3g}" for k, v in info["coefficients"].items())
    return (
        f"{info['mode']} {info['model']}: {terms}; C {info['initial_size']}{picked}, "
        f"s {info['smooth_factor']}, floor {info['min_size']}, "
        f"{len(info['profile_points']) - 1} profile points"
    )


def describe_comm(row: dict[str, Any]) -> str:
    """One line: per kind, KiB a rank sends per forward (the busiest rank) / seconds a rank
    waited for it over the run (the mean rank), and their share of its forward time."""
    sent, waited = row["comm_bytes_per_forward"], row["exposed_comm_s"]
    share = row["exposed_comm_share_of_forward"]
    parts = [
        f"{kind} {sent[kind] / 2**10:.1f}/{waited[kind]:.3f} ({share[kind]:.0%})"
        for kind in COMM_BYTES
    ]
    return "comm KiB per forward / s waited (share of forward): " + ", ".join(parts)


def describe_cp(cp: dict[str, Any] | None) -> str:
    if cp is None:
        return ""
    words = (
        f"; CP prefix {cp['prefix_mode']}, K/V exchange per layer "
        f"{cp['kv_exposed_s_per_layer'] * 1e3:.2f} ms exposed per forward "
        f"({cp['kv_hidden_share']:.0%} hidden{'' if cp['kv_overlap'] else ', overlap off'})"
    )
    if cp["shard_linear_layers"] and cp["shard_linear_expected_weight_bytes"]:
        expected = cp["shard_linear_expected_weight_bytes"] / 2**20
        words += (
            f"; shard linear {cp['shard_linear_layers']} K={cp['shard_linear_warm_layers']}: "
            f"plan {expected:.1f} MiB"
        )
    return words


def print_report(r: dict[str, Any]) -> None:
    print(
        f"model {r['model']}  dtype {r['dtype']}  {r['threads_per_worker']} thread(s)/worker  "
        f"{r['num_prompts']} x {r['input_len']} in / {r['output_len']} out  "
        f"chunk {r['chunked_prefill_size'] or 'default'}"
    )
    print(f"matmul peak {r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s per worker")
    if r["repeat"] > 1:
        print(f"median of {r['repeat']} interleaved rounds per layout")
    for row in r["layouts"]:
        print(f"{row['layout']} chunking: {describe_chunking(row['chunking'])}")
    print(
        f"{'layout':<17}{'TTFT mean':>11}{'prefill s':>11}{'in tok/s':>11}{'out tok/s':>11}"
        f"{'speedup':>9}{'effic.':>8}{'FLOP share':>12}{'fwd s':>8}  bubble ratio per stage"
    )
    for row in r["layouts"]:
        print(
            f"{row['layout']:<17}{row['ttft_mean_s']:>11.3f}"
            f"{row['prefill_s']:>11.3f}{row['input_throughput_tok_s']:>11.1f}"
            f"{row['output_throughput_tok_s']:>11.1f}{row['speedup']:>9.3f}"
            f"{row['efficiency']:>9.3f}{row['prefill_flops_share_of_peak']:>11.2f}"
            f"{row['forward_s_mean']:>9.3f}  " + ", ".join(f"{b:.3f}" for b in row["bubble_ratio"])
        )
    for row in r["layouts"]:
        if row["boundary_bytes"]:
            per = ", ".join(f"{b['per_micro_batch'] / 2**20:.2f}" for b in row["boundary_bytes"])
            print(f"{row['layout']}: MiB per micro-batch per stage boundary: {per}")
    for row in r["layouts"]:
        print(f"{row['layout']}: {describe_comm(row)}")
    for row in r["layouts"]:
        peak = row.get("peak_device_bytes")
        print(
            f"{row['layout']}: MiB per device: weights {row['weight_bytes_per_device'] / 2**20:.1f}"
            f", KV of the run's requests {row['kv_bytes_per_device'] / 2**20:.1f}"
            + ("" if peak is None else f", peak allocated {peak / 2**20:.1f}")
            + describe_cp(row["cp"])
        )
        print(
            f"{row['layout']}: attention {row['attention_flops'] / 1e12:.3f} TFLOP, "
            f"{row['attention_flops_per_s'] / 1e12:.2f} TFLOP/s over the prefill span"
        )
    if len(r["layouts"]) > 1:
        print(f"same tokens across layouts: {r['same_tokens_across_layouts']}")
    base = r.get("baseline")
    if base and "error" not in base:
        short = "llama.cpp" if base["name"].startswith("llama.cpp") else "hf"
        print(
            f"{short:<17}{base['ttft_mean_s']:>11.3f}{base['prefill_s']:>11.3f}"
            f"{base['input_throughput_tok_s']:>11.1f}{base['output_throughput_tok_s']:>11.1f}"
        )
        kernels = base.get("sdpa_kernels")
        peak = base.get("peak_device_bytes")
        print(
            f"{base['name']}: attention {base['attention_flops_per_s'] / 1e12:.2f} TFLOP/s over "
            "the prefill span"
            + ("" if kernels is None else f"; SDPA ran {', '.join(kernels) or 'no fused kernel'}")
            + ("" if peak is None else f"; peak allocated {peak / 2**20:.1f} MiB")
        )
        ratio = r["ratio_to_baseline"]
        dec = ratio["decode_throughput"]
        print(
            f"ratio to {short}: prefill time {ratio['prefill_time']:.3f} (pipeserve/{short}), "
            f"decode throughput {'n/a' if dec is None else f'{dec:.3f}'} ({short}/pipeserve); "
            f"below 1 = pipeserve faster; same greedy tokens: "
            f"{r['same_greedy_tokens_as_baseline']}"
        )
