"""Command line: `pipeserve generate | serve | bench | bench-serving | tune | simulate |
convert | make-model | router`.

Engine flags are generated from the config dataclasses (names, defaults and help text), so
the CLI, `Engine(**flags)` and the docs cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from typing import Any, NamedTuple

from pipeserve import envs
from pipeserve.config import AREA_TYPES, SettingsError
from pipeserve.lifetime import REFUSED_EXIT
from pipeserve.models.default_model import BENCH_PRESET
from pipeserve.scheduler.request import SamplingParams

_TYPES = {"int": int, "float": float, "str": str}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for area, kind in AREA_TYPES.items():
        group = parser.add_argument_group(f"{area} options")
        for f in dataclasses.fields(kind):
            names = ["--" + f.name.replace("_", "-")]
            if f.name == "model_path":
                names.insert(0, "--model")
            said = "default:" in f.metadata["help"]  # the help says the default in words
            help_text = f.metadata["help"] + ("" if said else f" (default: {f.default})")
            if f.type == "bool":
                group.add_argument(
                    *names, dest=f.name, action="store_true", default=None, help=help_text
                )
            elif str(f.type).startswith("tuple["):  # a list: the flag repeated
                values = f.default if isinstance(f.default, tuple) else ()
                help_text = f"{f.metadata['help']} (default: {', '.join(values) or 'none'})"
                group.add_argument(
                    *names, dest=f.name, action="append", default=None, help=help_text
                )
            else:
                base = str(f.type).split(" | ")[0]
                group.add_argument(
                    *names,
                    dest=f.name,
                    type=_TYPES[base],
                    default=None,
                    choices=f.metadata.get("choices"),
                    help=help_text,
                )


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave; the dataclass defaults fill in the rest."""
    from pipeserve.config import FLAG_AREAS

    return {k: v for k, v in vars(args).items() if k in FLAG_AREAS and v is not None}


def run_as_worker_node(args: argparse.Namespace) -> bool:
    """On nodes other than 0 every command just runs this node's workers."""
    if not args.node_rank:
        return False
    from pipeserve.config import EngineConfig
    from pipeserve.device import with_compute_dtype
    from pipeserve.distributed.launcher import run_worker_node
    from pipeserve.models.resolve import resolve_model_path

    config = with_compute_dtype(EngineConfig.from_flags(**engine_flags(args)))
    path = resolve_model_path(config.model.model_path, config.model.dtype)
    sys.exit(run_worker_node(config, str(path)))


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about pipelines.",
    "In one sentence, why are long prompts split into chunks?",
]
RAW_PROMPTS = [
    "The capital of France is",
    "Write a haiku about pipelines:",
    "Long prompts are split into chunks because",
]


def cmd_generate(args: argparse.Namespace) -> None:
    from pipeserve.engine.engine import Engine

    run_as_worker_node(args)
    sp = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    if args.skip_tokenizer_init:
        sys.exit("pipeserve generate takes text prompts: it needs the tokenizer")
    with Engine(**engine_flags(args)) as engine:
        print(f"model: {engine.model_path} ({engine.arch.architecture})")
        tok = engine.tokenizer
        assert tok is not None
        chat = not args.raw and tok.has_chat_template
        prompts = args.prompt or (CHAT_PROMPTS if chat else RAW_PROMPTS)
        ids = [
            tok.encode_chat([{"role": "user", "content": p}]) if chat else tok.encode(p)
            for p in prompts
        ]
        outputs = engine.generate(input_ids=ids, sampling_params=sp)
        assert isinstance(outputs, list)
        for prompt, out in zip(prompts, outputs, strict=True):
            meta = out["meta_info"]
            print(f"\n>>> {prompt}\n{out['text']}")
            print(
                f"[{meta['prompt_tokens']} prompt + {meta['completion_tokens']} generated tokens,"
                f" TTFT {meta['ttft_s'] * 1000:.1f} ms, finish: {meta['finish_reason']}]"
            )


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


class LayoutSpec(NamedTuple):
    """One --layouts item. ep/cp None: the item leaves the size out, so it runs with every
    --ep-size/--cp-size (a PPxTP pair leaves out both, a PPxTPxEP triple CP)."""

    pp: int
    tp: int
    ep: int | None = None
    cp: int | None = None
    afd: tuple[int, int] = (0, 0)  # attention-FFN disaggregation: (attention, FFN) workers


LAYOUT_FORMS = (
    "PPxTP pairs, PPxTPxEP triples, named sizes ppPtpTepEcpC (each part optional, in this "
    "order) or aAfF (attention and FFN workers)"
)


def layout_list(text: str) -> list[LayoutSpec]:
    """PPxTP pairs, PPxTPxEP triples, named sizes such as cp2, pp2cp2, pp1tp2ep1 (the parts
    pp, tp, ep, cp in this order, each optional: a left-out PP or TP is 1, a left-out EP or
    CP runs with every --ep-size/--cp-size as in a pair) or attention-FFN disaggregation's
    aAfF (A attention and F FFN workers), e.g. 1x1,2x1,1x2,1x1x2,cp2,pp2cp2,a1f1."""
    try:
        specs = [_layout_spec(item) for item in text.split(",")]
    except ValueError:
        specs = []
    if not specs:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {LAYOUT_FORMS} such as "
            "1x1,2x1,1x2,1x1x2,cp2,pp2cp2,a1f1"
        )
    written = [(s.pp, s.tp, s.ep or 1, s.cp or 1, s.afd) for s in specs]
    bad = [_size_words(*size) for size in written if not _combines(*size)]
    if bad:  # an error as written (a product with --ep-size/--cp-size skips these instead)
        raise argparse.ArgumentTypeError(
            f"{text!r}: {', '.join(bad)} do not combine: context parallelism above 1 needs "
            "tp 1 and ep 1"
        )
    return specs


_NAMED_LAYOUT = re.compile(r"(?:pp(\d+))?(?:tp(\d+))?(?:ep(\d+))?(?:cp(\d+))?")


def _layout_spec(item: str) -> LayoutSpec:
    afd = re.fullmatch(r"a(\d+)f(\d+)", item)
    named = _NAMED_LAYOUT.fullmatch(item)
    if afd:
        spec = LayoutSpec(1, 1, 1, 1, (int(afd[1]), int(afd[2])))
        sizes: tuple[int, ...] = spec.afd
    elif named and item:
        pp, tp, ep, cp = (int(g) if g else None for g in named.groups())
        spec = LayoutSpec(pp or 1, tp or 1, ep, cp)
        sizes = tuple(x for x in (pp, tp, ep, cp) if x is not None)
    else:
        sizes = tuple(int(x) for x in item.split("x"))
        if len(sizes) not in (2, 3):
            raise ValueError(item)
        spec = LayoutSpec(sizes[0], sizes[1], sizes[2] if len(sizes) == 3 else None)
    if min(sizes) < 1:
        raise ValueError(item)
    return spec


def _combines(pp: int, tp: int, ep: int, cp: int, afd: tuple[int, int]) -> bool:
    """Whether the engine builds these sizes together: a CP rank runs whole (no TP or EP
    inside it) and CP does not combine with AFD (config validation says so too)."""
    return cp == 1 or (tp == 1 and ep == 1 and not afd[0])


def _size_words(pp: int, tp: int, ep: int, cp: int, afd: tuple[int, int]) -> str:
    if afd[0]:
        return f"a{afd[0]}f{afd[1]} with CP{cp}"
    return f"PP{pp} TP{tp} EP{ep} CP{cp}"


def size_list(text: str) -> list[int]:
    """512,1024 or start:stop:step (stop included)."""
    try:
        if ":" in text:
            start, stop, step = (int(x) for x in text.split(":"))
            return list(range(start, stop + 1, step))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a list like 512,1024 nor a range like 256:2048:256"
        ) from None


def dynamic_list(text: str) -> list[tuple[int, float]]:
    try:
        return [(int(c), float(f)) for c, f in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of C:s pairs such as 1024:1.0,1536:0.9"
        ) from None


def bench_model(args: argparse.Namespace) -> None:
    """Benchmarks, tuning and the simulator run the random-weight `bench` preset unless a
    model is named."""
    args.model_path = args.model_path or BENCH_PRESET


def cmd_bench(args: argparse.Namespace) -> None:
    from pipeserve.bench.offline import OVERLAPS, Layout, run_bench

    bench_model(args)
    pp_sizes, tp_sizes = args.pp_size or [1], args.tp_size or [1]
    ep_sizes, cp_sizes = args.ep_size or [1], args.cp_size or [1]
    flags_afd = (args.afd_attention_size or 0, args.afd_ffn_size or 0)
    given = args.layouts or [
        LayoutSpec(pp, tp, afd=flags_afd) for pp in pp_sizes for tp in tp_sizes
    ]
    # an item runs with every --ep-size and --cp-size it leaves out; of these products only
    # the combinations the engine builds (CP above 1 only with TP 1, EP 1 and no AFD)
    product = [
        (s.pp, s.tp, ep, cp, s.afd)
        for s in given
        for ep in ([s.ep] if s.ep else ep_sizes)
        for cp in ([s.cp] if s.cp else cp_sizes)
    ]
    sizes = [size for size in product if _combines(*size)]
    if not sizes:
        sys.exit(
            f"no layout to run: {', '.join(_size_words(*size) for size in product)} do not "
            "combine (context parallelism above 1 needs TP 1, EP 1 and no AFD)"
        )
    threads = args.threads_per_worker or [None]
    loops = ["plain", "overlap"] if args.compare_loops else [None]
    overlaps = list(OVERLAPS) if args.compare_overlap else [None]
    runs = len(sizes) * len(threads) * len(loops) * len(overlaps) * args.repeat
    runs *= 2 if args.compare_worker_process else 1
    if (args.nnodes or 1) > 1 and runs > 1:  # node 1 would start workers for the first only
        sys.exit(
            f"--nnodes {args.nnodes} runs one layout per command, once, but these flags ask for "
            f"{runs} runs: run bench once per layout (benchmarks/netlab.sh --layouts does)"
        )
    args.pp_size, args.tp_size, args.ep_size, args.cp_size, (a, f) = sizes[0]
    if a and (args.nnodes or 1) > 1:  # a worker node starts the (only) layout's workers
        args.afd_attention_size, args.afd_ffn_size = a, f
    args.threads_per_worker = threads[0]
    run_as_worker_node(args)
    layouts = [
        Layout(
            pp,
            tp,
            ep,
            cp=cp,
            spawn_workers=spawn,
            threads=t if len(threads) > 1 else None,
            loop=loop if pp == 1 else None,
            overlap=overlap if ep > 1 else None,
            afd=afd,
        )
        for pp, tp, ep, cp, afd in sizes
        for t in threads
        for spawn in (False, True)
        for loop in loops
        for overlap in overlaps
        if (not spawn or (args.compare_worker_process and pp * tp * ep * cp == 1 and not afd[0]))
        and (loop is None or pp == 1 or loop == loops[0])
        and (overlap is None or ep > 1 or overlap == overlaps[0])
    ]
    run_bench(
        engine_flags(args),
        layouts,
        args.input_len,
        args.output_len,
        args.num_prompts,
        args.seed or 0,
        args.baseline,
        args.json,
        args.trace,
        args.timeline,
        args.repeat,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    from pipeserve.server.launch import serve

    run_as_worker_node(args)
    sys.exit(serve(engine_flags(args)))


def cmd_bench_serving(args: argparse.Namespace) -> None:
    from pipeserve.bench.serving import run_bench_serving

    report = run_bench_serving(
        args.base_url,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.request_rate,
        args.max_concurrency,
        args.api_key,
        args.json,
        args.seed,
    )
    if report["failed"]:
        sys.exit(1)


def cmd_tune(args: argparse.Namespace) -> None:
    if args.simulate:
        _tune_simulated(args)
        return
    if args.dtype == "fp8":
        sys.exit("pipeserve tune: --dtype fp8 is for --simulate (the engine runs bf16/fp16/fp32)")
    bench_model(args)
    from pipeserve.bench.tune import run_tune

    run_as_worker_node(args)
    run_tune(
        engine_flags(args),
        args.input_len,
        args.budget_s,
        args.json,
        args.png,
        args.fixed_sizes,
        args.dynamic,
        args.rounds,
    )


def cmd_simulate(args: argparse.Namespace) -> None:
    bench_model(args)
    if args.calibrate:
        from pipeserve.sim.calibrate import run_calibration

        try:
            run_calibration(
                args.hardware,
                args.model_path,
                args.calibration_max_len,
                args.calibration,
                args.calibration_rounds,
            )
        except ValueError as exc:
            sys.exit(f"pipeserve simulate --calibrate: {exc}")
        return
    from pipeserve.sim.run import SimSpec, print_report, save, simulate

    spec = SimSpec(
        model=args.model_path,
        hardware=args.hardware,
        calibration=args.calibration,
        devices_per_node=args.gpus_per_node,
        dtype=args.dtype,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        seed=args.seed or 0,
    )
    try:
        report = simulate(engine_flags(args), spec)
    except ValueError as exc:
        sys.exit(f"pipeserve simulate: {exc}")
    print_report(report)
    save(report, args.json, args.trace, args.timeline)


def _tune_simulated(args: argparse.Namespace) -> None:
    from pipeserve.sim.hardware import HARDWARE
    from pipeserve.sim.planner import run_plan
    from pipeserve.sim.run import SimSpec

    bench_model(args)
    per_node = args.gpus_per_node or HARDWARE[args.hardware].devices_per_node
    spec = SimSpec(
        model=args.model_path,
        hardware=args.hardware,
        calibration=args.calibration,
        devices_per_node=per_node,
        dtype=args.dtype,
        input_len=args.input_len,
        output_len=1,
    )
    try:
        run_plan(
            engine_flags(args),  # the model and weight dtype travel in `spec`
            spec,
            args.nodes * per_node,
            args.json,
            args.png,
            args.fixed_sizes,
            args.dynamic,
            args.num_prompts,
            args.top,
        )
    except ValueError as exc:
        sys.exit(f"pipeserve tune --simulate: {exc}")


def cmd_convert(args: argparse.Namespace) -> None:
    from pipeserve.models.gguf import convert
    from pipeserve.models.gguf.convert import TOKENIZER_FILES

    try:
        path = convert(args.gguf, args.out)
    except (OSError, ValueError) as exc:
        sys.exit(f"pipeserve convert: {exc}")
    names = ("config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES)
    written = ", ".join(n for n in names if (path / n).is_file())  # convert clears stale ones
    print(f"wrote {path} ({written})")


def cmd_make_model(args: argparse.Namespace) -> None:
    from pipeserve.models.config_presets import CONFIG_PRESETS, write_config
    from pipeserve.models.presets import PRESETS, make_model

    if args.list:
        every = {**PRESETS, **CONFIG_PRESETS}
        print(
            json.dumps({name: spec["architectures"][0] for name, spec in every.items()}, indent=2)
        )
        return
    if not args.preset or not args.out:
        sys.exit("make-model needs --preset NAME and --out DIR (see --list)")
    if args.preset in CONFIG_PRESETS:
        path = write_config(args.preset, args.out)
        print(f"wrote {args.preset}'s config.json to {path} (no weights: for pipeserve simulate)")
        return
    path = make_model(args.preset, args.out, seed=args.seed, shard_size_mb=args.shard_size_mb)
    print(f"wrote {args.preset} to {path}")


def cmd_router(args: argparse.Namespace) -> None:
    from pipeserve.disaggregation.pd.router import run_router
    from pipeserve.server.connection_guard import ConnectionLimits

    try:
        run_router(
            args.prefill,
            args.decode,
            args.host,
            args.port,
            health_interval_s=args.health_interval,
            request_timeout_s=args.request_timeout,
            api_key=args.api_key,
            max_request_bytes=args.max_request_bytes,
            pd_auth_key=args.disaggregation_auth_key,
            limits=ConnectionLimits.of(args),
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            ssl_ca_certs=args.ssl_ca_certs,
        )
    except ValueError as exc:
        sys.exit(f"pipeserve router: {exc}")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP connection limits and TLS files, as `pipeserve serve` has them
    (config.ServerConfig)."""
    from pipeserve.config import ServerConfig

    for name in (
        "http_head_timeout",
        "http_body_timeout",
        "http_max_connections",
        "http_max_pending_per_peer",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_ca_certs",
    ):
        f = ServerConfig.__dataclass_fields__[name]
        help_text = f.metadata["help"]
        if name == "ssl_ca_certs":
            help_text = "CA certificates (PEM) that https:// servers must chain to"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_TYPES[str(f.type).split(" | ")[0]],
            default=f.default,
            help=f"{help_text} (default: {f.default})",
        )


def add_sim_flags(parser: argparse.ArgumentParser) -> None:
    from pipeserve.sim.hardware import HARDWARE

    parser.add_argument(
        "--hardware",
        default="h20",
        choices=list(HARDWARE),
        help="the device simulated (see pipeserve/sim/hardware.py)",
    )
    parser.add_argument(
        "--calibration",
        help="a calibration file of efficiencies (default for cpu: the one --calibrate saved)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, help="devices per node (default: the hardware's)"
    )


def _allow_fp8(parser: argparse.ArgumentParser) -> None:
    """The simulator's --dtype is the weights' and also knows fp8 (default: what the engine
    holds; for an FP8 checkpoint bf16, or fp8 under --fp8-weights keep)."""
    for action in parser._actions:
        if action.dest == "dtype":
            action.choices = ["auto", "fp8", "bfloat16", "float16", "float32"]
            action.help = (
                "simulated weight dtype (default: what the engine holds: the checkpoint's "
                "dtype; an FP8 checkpoint's in bfloat16, or in fp8 with --fp8-weights keep)"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeserve",
        description="pipeserve: LLM inference for very long prompts (chunked pipeline "
        "parallelism); `pipeserve COMMAND --help` for a command's flags",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a few prompts")
    gen.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for several); sent as a user message through the model's chat "
        "template when it has one",
    )
    gen.add_argument(
        "--raw", action="store_true", help="send the prompts as they are (no chat template)"
    )
    # the sampling defaults are Engine.generate's (SamplingParams): one set (docs/python-api.md)
    sampling = SamplingParams()
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=sampling.max_new_tokens,
        help="tokens to generate per prompt at most (default: %(default)s)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=sampling.temperature,
        help="0: greedy (default: %(default)s)",
    )
    gen.add_argument(
        "--top-p", type=float, default=sampling.top_p, help="nucleus cut (default: %(default)s)"
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=sampling.top_k,
        help="keep the k most likely tokens; -1: all (default: %(default)s)",
    )
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="offline prefill/decode benchmark")
    bench.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    bench.add_argument("--output-len", type=int, default=16, help="new tokens per request")
    bench.add_argument("--num-prompts", type=int, default=1, help="requests, sent at once")
    bench.add_argument(
        "--baseline",
        choices=["hf", "llamacpp"],
        help="also run Hugging Face transformers (hf), or llama.cpp on the same GGUF file "
        "(llamacpp: needs llama-cpp-python and a GGUF --model, e.g. the built-in model)",
    )
    bench.add_argument("--json", help="save the results here")
    bench.add_argument("--trace", help="write a Chrome/Perfetto trace of every stage here")
    bench.add_argument("--timeline", help="draw the per-stage Gantt chart into this PNG")
    bench.add_argument(
        "--repeat", type=int, default=1, help="interleaved rounds of all layouts; medians reported"
    )
    bench.add_argument(
        "--layouts",
        type=layout_list,
        help="layouts to compare instead of the product of --pp-size and --tp-size: PPxTP "
        "pairs (each runs with every --ep-size and --cp-size), PPxTPxEP triples (with every "
        "--cp-size), named sizes ppPtpTepEcpC, each part optional but in this order (a left-out "
        "pp or tp is 1, a left-out ep or cp runs with every --ep-size or --cp-size: pp2tp1 is "
        "2x1, cp2 is PP1 TP1 CP2) or aAfF (A attention and F FFN workers), e.g. "
        "1x1,1x2,1x1x2,cp2,pp2cp2,a1f1",
    )
    bench.add_argument(
        "--compare-loops",
        action="store_true",
        help="run each one-stage layout with the plain and with the overlap loop",
    )
    bench.add_argument(
        "--compare-overlap",
        action="store_true",
        help="run each expert-parallel layout without MoE overlap, with two-batch overlap, "
        "single-batch overlap and both",
    )
    bench.add_argument(
        "--compare-worker-process",
        action="store_true",
        help="run each one-device layout also in a worker process (the per-worker overhead)",
    )
    add_engine_flags(bench)
    for action in bench._actions:  # to compare: --pp-size 1,2 --ep-size 1,2 --threads... 1,2
        if action.dest in ("pp_size", "tp_size", "ep_size", "cp_size", "threads_per_worker"):
            action.type = int_list
        if action.dest == "cp_size":
            action.help = (
                f"{action.help}; bench: a list such as 1,2 runs every layout with each size, "
                "skipping the combinations the engine does not build (CP above 1 with TP or EP "
                "above 1, or with AFD)"
            )
    bench.set_defaults(func=cmd_bench)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)

    bs = sub.add_parser("bench-serving", help="load a running server over HTTP")
    bs.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server to load")
    bs.add_argument("--num-prompts", type=int, default=32, help="requests in all")
    bs.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    bs.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    bs.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (inf: all at once)",
    )
    bs.add_argument(
        "--max-concurrency", type=int, help="requests in flight at most (default: all of them)"
    )
    bs.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (serve --api-key)")
    bs.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    bs.add_argument("--json", help="save the results here")
    bs.set_defaults(func=cmd_bench_serving)

    tune = sub.add_parser("tune", help="find the chunk settings with the lowest TTFT")
    tune.add_argument("--input-len", type=int, default=16384, help="prompt tokens to tune for")
    tune.add_argument(
        "--budget-s", type=float, default=900.0, help="stop starting trials after this"
    )
    tune.add_argument(
        "--fixed-sizes",
        type=size_list,
        help="fixed chunk sizes to try, e.g. 512,1024 or 256:2048:256 (default: powers of two)",
    )
    tune.add_argument(
        "--dynamic",
        type=dynamic_list,
        help="dynamic settings to try as C:s pairs, e.g. 1024:1.0,1536:0.9 (default: 2-4x the "
        "best fixed size at every smoothing factor)",
    )
    tune.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians reported")
    tune.add_argument("--json", default="tune.json", help="save the table here")
    tune.add_argument("--png", default="tune.png", help="plot TTFT against the smoothing factor")
    tune.add_argument(
        "--simulate",
        action="store_true",
        help="plan for a cluster instead of timing this machine: simulate every layout of "
        "--nodes x --gpus-per-node devices of --hardware that fits, with fixed and dynamic "
        "chunk settings (--budget-s and --rounds do not apply)",
    )
    tune.add_argument("--nodes", type=int, default=1, help="--simulate: nodes in the cluster")
    tune.add_argument(
        "--num-prompts",
        type=int,
        default=4,
        help="--simulate: prompts in flight for each best setting's input throughput",
    )
    tune.add_argument("--top", type=int, default=5, help="--simulate: plans to print")
    add_sim_flags(tune)
    add_engine_flags(tune)
    _allow_fp8(tune)
    tune.set_defaults(func=cmd_tune)

    sim = sub.add_parser(
        "simulate",
        help="run the engine's scheduler on a cost model of a named cluster (simulated time)",
    )
    add_sim_flags(sim)
    sim.add_argument("--input-len", type=int, default=131072, help="prompt tokens per request")
    sim.add_argument("--output-len", type=int, default=1, help="new tokens per request")
    sim.add_argument("--num-prompts", type=int, default=1, help="requests")
    sim.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per simulated second (inf: all at once)",
    )
    sim.add_argument("--json", help="save the report here")
    sim.add_argument("--trace", help="write the simulated Chrome/Perfetto trace here")
    sim.add_argument("--timeline", help="draw the simulated per-stage Gantt chart into this PNG")
    sim.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the CPU efficiencies on this machine (times the real engine on --model; "
        "saves them where --hardware cpu finds them, or to --calibration FILE)",
    )
    sim.add_argument(
        "--calibration-max-len",
        type=int,
        default=16384,
        help="--calibrate: the longest prefix + chunk timed",
    )
    sim.add_argument(
        "--calibration-rounds",
        type=int,
        default=1,
        help="--calibrate: time every set-up this many times, interleaved; medians fitted",
    )
    add_engine_flags(sim)
    _allow_fp8(sim)
    sim.set_defaults(func=cmd_simulate)

    conv = sub.add_parser(
        "convert", help="write a GGUF file as a Hugging Face checkpoint (dequantised safetensors)"
    )
    conv.add_argument("gguf", help="the .gguf file")
    conv.add_argument("out", help="output directory")
    conv.set_defaults(func=cmd_convert)

    make = sub.add_parser("make-model", help="write a built-in model as an HF checkpoint")
    make.add_argument("--preset", help="preset name (see --list)")
    make.add_argument("--out", help="output directory")
    make.add_argument(
        "--shard-size-mb", type=int, default=2048, help="safetensors files of at most this size"
    )
    make.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    make.add_argument("--list", action="store_true", help="list the presets")
    make.set_defaults(func=cmd_make_model)

    router = sub.add_parser(
        "router",
        help="prefill/decode disaggregation: one OpenAI API in front of prefill and decode servers",
    )
    router.add_argument(
        "--prefill", nargs="+", required=True, metavar="URL", help="prefill servers' base URLs"
    )
    router.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode servers' base URLs"
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=int, default=30000, help="port to listen on")
    router.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (forwarded to the decode servers as is)",
    )
    router.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between /health probes of every server; a probe may take as long (at "
        "least 0.5 s)",
    )
    router.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a decode server may stay silent, before its answer starts or between two "
        "parts of it (then HTTP 504), on top of the wait for a prompt's prefill that the "
        "decode server reports on /health (its --disaggregation-prefill-timeout plus its KV "
        "transfer's); a streamed answer's keep-alive comments count as parts",
    )
    router.add_argument(
        "--max-request-bytes",
        type=int,
        default=64 * 2**20,
        help="largest request body in bytes (64 MiB); larger ones get HTTP 413",
    )
    router.add_argument(
        "--disaggregation-auth-key",
        default=None,
        metavar="KEY",
        help="shared secret of disaggregation, the same on the router and every prefill and "
        "decode server, at least 32 hex digits (`openssl rand -hex 32`); prefer env "
        "PIPESERVE_PD_AUTH_KEY, which the process list does not show",
    )
    add_connection_flags(router)
    router.set_defaults(func=cmd_router)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[pipeserve] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per HTTP request
    try:
        args.func(args)
    except SettingsError as exc:  # says what to change: one line, as argparse's errors
        if envs.show_tracebacks():
            raise
        print(f"pipeserve: error: {exc}", file=sys.stderr)
        sys.exit(REFUSED_EXIT)


if __name__ == "__main__":
    main()
