"""`pipeserve tune --simulate`: the planner tries every layout of the cluster the engine
builds, skips those that do not fit (saying why), ranks by simulated TTFT and recommends the
best; its JSON and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from pipeserve.cli import main
from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import load_config
from pipeserve.sim.planner import Candidate, candidates


def test_candidates_are_the_layouts_the_engine_builds() -> None:
    qwen = ArchConfig.from_dict(load_config("qwen3-235b-a22b")[0])
    got = set(candidates(qwen, 8))
    assert Candidate(8, 1) in got and Candidate(1, 8) in got and Candidate(4, 2) in got
    assert Candidate(1, 1, ep=8) in got and Candidate(1, 2, ep=4) in got
    assert Candidate(1, 1, cp=8) in got
    assert all(c.tp * c.pp * c.ep * c.cp == 8 for c in got)
    assert all(c.tp == 1 for c in got if c.ep > 1 or c.cp > 1)
    dense = ArchConfig.from_dict(load_config("bench")[0])  # 12 heads: no TP 8, no EP
    assert all(c.tp != 8 and c.ep == 1 for c in candidates(dense, 8))


def test_tune_simulate_ranks_layouts_and_skips_what_does_not_fit(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    main(
        [
            "tune",
            "--simulate",
            "--hardware",
            "h20",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--model",
            "deepseek-v3.1",
            "--input-len",
            "32768",
            "--fixed-sizes",
            "4096,8192",
            "--dynamic",
            "8192:0.8",
            "--num-prompts",
            "2",
            "--json",
            str(out),
            "--png",
            str(png),
        ]
    )
    r = json.loads(out.read_text())
    assert r["devices"] == 16
    best = r["best"]
    assert [p["ttft_s"] for p in best] == sorted(p["ttft_s"] for p in best)
    assert min(t["ttft_s"] for t in r["trials"]) == best[0]["ttft_s"]
    assert all(p["input_throughput_tok_s"] > 0 for p in best)
    layouts = {p["layout"] for p in best}
    assert "PP2 TP8" in layouts
    # CP ranks hold every weight: 671B parameters on one H20 do not fit
    assert "memory" in r["skipped"]["PP1 TP1 CP16"]
    assert "PP16 TP1" in {t["layout"] for t in r["trials"]}  # 4 layers a GPU do
    dyn = [t for t in r["trials"] if t["layout"] == "PP2 TP8" and t["chunking"].startswith("dyn")]
    assert dyn and dyn[0]["flags"]["dynamic_chunking_profile_max_len"] == 32768
    text = capsys.readouterr().out
    assert "recommended: --tp-size" in text
    assert png.stat().st_size > 0
