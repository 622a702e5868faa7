"""HiCache measures on an in-process engine (the 8-layer `bench` preset by default).

tiers: TTFT of a prompt whose long prefix is cold, then held in the device pool (L1), in
host memory (L2), on disk (L3, the OS page cache dropped first when this runs as root),
each prompt = the prefix + a short new question. The prefix is pushed down by filler
prompts of the same length; a small host tier sends it on to disk.

multiturn: conversations that each append a user turn to their history, round-robin, with a
working set of 4x a deliberately small device pool: prefix-cache hit rate and mean TTFT with
the radix cache alone and with the host + disk tiers.

    python benchmarks/hicache_bench.py --prefix-len 16384 --json out/hicache.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeserve.engine.engine import Engine, resolve_model_path
from pipeserve.models.arch import ArchConfig

VOCAB = [512]  # set from the model's config in main()


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB[0], (n,), generator=gen).tolist()


def drop_page_cache() -> bool:
    """Drop the OS page cache so the disk tier is read from the disk (root only)."""
    if os.geteuid() != 0:
        return False
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def first_token(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    assert isinstance(out, dict)
    meta = out["meta_info"]
    return {"ttft_s": meta["ttft_s"], "cached_tokens": meta["cached_tokens"]}


def tiers(args: argparse.Namespace, storage: str) -> dict[str, Any]:
    n = args.prefix_len
    prefix = tokens(n, 1)
    fillers = [tokens(n, 100 + i) for i in range(6)]
    base = {
        "model_path": args.model,
        "dtype": args.dtype,
        "max_total_tokens": n + n // 4,  # one long prompt at a time
        "chunked_prefill_size": args.chunk,
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": storage,
    }
    out: dict[str, Any] = {}
    # host tier big enough for the prefix and a filler: the prefix waits there
    with Engine(**base, hicache_ratio=2.5) as engine:
        out["cold"] = first_token(engine, prefix + tokens(16, 2))
        out["l1"] = first_token(engine, prefix + tokens(16, 3))
        first_token(engine, fillers[0] + [1])  # the prefix moves to host memory
        out["l2"] = first_token(engine, prefix + tokens(16, 4))
        out["l2_loaded_tokens"] = engine.backend.stats()["hicache_loaded_host_tokens"]
    # host tier for one prompt: fillers push the prefix on to disk
    with Engine(**base, hicache_ratio=1.0, hicache_storage_ratio=6.0) as engine:
        first_token(engine, prefix + [1])
        for f in fillers[:3]:
            first_token(engine, f + [1])
        out["page_cache_dropped"] = drop_page_cache()
        out["l3"] = first_token(engine, prefix + tokens(16, 5))
        out["l3_loaded_tokens"] = engine.backend.stats()["hicache_loaded_disk_tokens"]
    return out


def multiturn(args: argparse.Namespace, storage: str, hicache: bool) -> dict[str, Any]:
    """`conversations` histories of `turn_len`-token turns, round-robin; the device pool
    holds a quarter of their final total."""
    convs, turns, turn = args.conversations, args.turns, args.turn_len
    working_set = convs * turns * turn
    flags: dict[str, Any] = {
        "model_path": args.model,
        "dtype": args.dtype,
        "max_total_tokens": max(working_set // 4, turns * turn + 256),
        "chunked_prefill_size": args.chunk,
    }
    if hicache:
        flags |= {
            "enable_hierarchical_cache": True,
            "hicache_ratio": 2.0,
            "hicache_storage_dir": storage,
            "hicache_storage_ratio": 4.0,
        }
    histories = [tokens(64, 1000 + c) for c in range(convs)]
    ttfts, hit, looked = [], 0, 0
    with Engine(**flags) as engine:
        for t in range(turns):
            for c in range(convs):
                histories[c] = histories[c] + tokens(turn, 2000 + 100 * c + t)
                r = first_token(engine, histories[c])
                if t > 0:  # the first turn has nothing to hit
                    ttfts.append(r["ttft_s"])
                    hit += r["cached_tokens"]
                    looked += len(histories[c])
        stats = engine.backend.stats()
    return {
        "working_set_tokens": working_set,
        "device_pool_tokens": flags["max_total_tokens"],
        "mean_ttft_s": statistics.mean(ttfts),
        "hit_rate": hit / looked,
        "loaded_host_tokens": stats.get("hicache_loaded_host_tokens", 0),
        "loaded_disk_tokens": stats.get("hicache_loaded_disk_tokens", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="best")
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=1024)
    ap.add_argument("--only", choices=("tiers", "multiturn"), default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    VOCAB[0] = ArchConfig.load(resolve_model_path(args.model)).vocab_size
    result: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as storage:
        if args.only in (None, "tiers"):
            result["tiers"] = tiers(args, storage)
            t = result["tiers"]
            print(
                f"{args.prefix_len}-token prefix, TTFT: cold {t['cold']['ttft_s']:.3f} s, "
                f"L1 {t['l1']['ttft_s']:.3f} s, L2 {t['l2']['ttft_s']:.3f} s, "
                f"L3 {t['l3']['ttft_s']:.3f} s (page cache dropped: {t['page_cache_dropped']})"
            )
        if args.only in (None, "multiturn"):
            without = multiturn(args, storage, hicache=False)
            with_tiers = multiturn(args, storage, hicache=True)
            result["multiturn"] = {"radix_only": without, "hicache": with_tiers}
            print(
                f"multi-turn, working set {without['working_set_tokens']} tokens, device pool "
                f"{without['device_pool_tokens']}: mean TTFT {without['mean_ttft_s']:.3f} s "
                f"(hit rate {without['hit_rate']:.2f}) without tiers, "
                f"{with_tiers['mean_ttft_s']:.3f} s ({with_tiers['hit_rate']:.2f}) with; "
                f"ratio {without['mean_ttft_s'] / with_tiers['mean_ttft_s']:.2f}x"
            )
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
