"""`pipeserve bench --baseline llamacpp`: llama.cpp (llama-cpp-python) on the GGUF file the run's
--model names, refused before any run where that is not a GGUF or the binding is missing.
llama-cpp-python is not a test dependency (it compiles llama.cpp for minutes), so a stand-in
module with its interface records what the baseline asks of it; the real figures are in
benchmarks/results (issue 43)."""

from __future__ import annotations

import importlib.machinery
import json
import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from gguf_files import write_gguf

from pipeserve.bench.llamacpp_baseline import run_llamacpp
from pipeserve.bench.offline import TIMING_KEYS, llamacpp_gguf
from pipeserve.cli import main
from pipeserve.config import EngineConfig, SettingsError

PROMPT_S, STEP_S = 0.02, 0.005  # the stand-in's prompt and step times


class FakeLlama:
    """llama_cpp.Llama's surface the baseline uses: reset() and a generate() that yields
    tokens forever (first token + i), after PROMPT_S for the prompt and STEP_S per step."""

    made: list[FakeLlama] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.resets = 0
        self.calls: list[tuple[list[int], dict[str, Any], int]] = []
        FakeLlama.made.append(self)

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **kwargs: Any):
        self.calls.append((list(tokens), kwargs, self.resets))
        time.sleep(PROMPT_S)
        i = 0
        while True:
            yield tokens[0] + i
            i += 1
            time.sleep(STEP_S)


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> type[FakeLlama]:
    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.Llama = FakeLlama  # type: ignore[attr-defined]
    module.__version__ = "0.0-test"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    FakeLlama.made.clear()
    return FakeLlama


def test_each_prompt_runs_greedy_from_an_empty_cache_and_is_timed(
    fake_llama_cpp: type[FakeLlama], tmp_path: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    prompts = [[5] * 10, [7] * 12]
    stats = run_llamacpp(gguf, prompts, 4, threads=3)
    (llm,) = fake_llama_cpp.made
    assert llm.kwargs["model_path"] == str(gguf) and llm.kwargs["flash_attn"] is True
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == 3
    assert llm.kwargs["n_ctx"] >= 12 + 4
    assert [c[0] for c in llm.calls[1:]] == prompts  # after one warm-up call
    assert all(c[1]["top_k"] == 1 and c[1]["temp"] == 0.0 for c in llm.calls)
    assert [c[2] for c in llm.calls] == [1, 2, 3]  # each call after a reset of its own
    assert stats["output_ids"] == [[5, 6, 7, 8], [7, 8, 9, 10]]
    # spans are each prompt's own, summed; a later prompt's TTFT includes the wait
    assert stats["prefill_s"] >= 2 * PROMPT_S and stats["decode_s"] >= 2 * 3 * STEP_S
    assert stats["prefill_s"] + stats["decode_s"] <= stats["total_s"]
    assert stats["output_throughput_tok_s"] == pytest.approx(6 / stats["decode_s"])
    assert stats["input_throughput_tok_s"] == pytest.approx(22 / stats["prefill_s"])
    assert stats["ttft_mean_s"] >= (PROMPT_S + 2 * PROMPT_S + 3 * STEP_S) / 2


def test_bench_reports_llamacpp_beside_pipeserve_on_a_gguf(
    fake_llama_cpp: type[FakeLlama], model_dir, tmp_path: Path
) -> None:
    gguf = write_gguf(model_dir("tiny-llama"), tmp_path / "tiny.gguf")
    path = tmp_path / "bench.json"
    main(["bench", "--model", str(gguf), "--input-len", "16", "--output-len", "4",
          "--num-prompts", "2", "--threads-per-worker", "1", "--baseline", "llamacpp",
          "--json", str(path)])  # fmt: skip
    report = json.loads(path.read_text())
    base = report["baseline"]
    assert base["name"].startswith("llama.cpp (llama-cpp-python 0.0-test, tiny.gguf")
    assert base["gguf"] == str(gguf)
    for key in TIMING_KEYS:
        assert math.isfinite(base[key]) and base[key] > 0, (key, base[key])
    ratio = report["ratio_to_baseline"]
    assert ratio["decode_throughput"] == pytest.approx(
        base["output_throughput_tok_s"] / report["output_throughput_tok_s"]
    )
    (llm,) = fake_llama_cpp.made
    assert llm.kwargs["n_threads"] == report["threads_per_worker"] == 1
    prompts = [c[0] for c in llm.calls[1:]]
    assert len(prompts) == 2 and all(len(p) == 16 for p in prompts)


def test_a_model_that_is_not_a_gguf_or_no_output_is_refused_before_any_run(
    fake_llama_cpp: type[FakeLlama], model_dir, capsys
) -> None:
    config = EngineConfig.from_flags(model_path=str(model_dir("tiny-llama")))
    with pytest.raises(SettingsError, match="reads GGUF files"):
        llamacpp_gguf(config, 4)
    with pytest.raises(SettingsError, match="--output-len 1 or more"):
        llamacpp_gguf(EngineConfig.from_flags(), 0)
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(model_dir("tiny-llama")), "--baseline", "llamacpp"])
    assert "reads GGUF files" in capsys.readouterr().err
    assert not fake_llama_cpp.made  # nothing ran


def test_without_llama_cpp_python_it_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    config = EngineConfig.from_flags()  # the built-in model: a GGUF
    with pytest.raises(SettingsError, match="pip install llama-cpp-python"):
        llamacpp_gguf(config, 4)
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        run_llamacpp(tmp_path / "m.gguf", [[1, 2]], 2, threads=1)
