"""FP8 block-quantised checkpoints (DeepSeek-V3/V3.2's and Qwen3 FP8's format) against
transformers on the same weights dequantised block by block: random-weight checkpoints whose
attention, MLP, expert and indexer linears are stored as float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 block (partial blocks at the edges), written as the releases
are. fp32 prompt logprobs within 2e-4 and greedy tokens equal, at PP1 and across layouts (a
TP2 split through a partial block, PP2, EP2); the scales are really read; every other
quantisation is refused in one line; loading holds one tensor's worth beyond the model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import test_hf_parity
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeserve.config import SettingsError
from pipeserve.engine.engine import Engine
from pipeserve.models.presets import make_model
from pipeserve.models.quantization import (
    BLOCK,
    SCALE_SUFFIX,
    checkpoint_quantization,
    dequantize_blocks,
    quantize_blocks,
    write_fp8_checkpoint,
)

pytestmark = pytest.mark.timeout(600)
FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
LOGPROB_ATOL = 2e-4
NEW_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# widths that are not multiples of 128, so edge blocks are partial and TP2 splits cut blocks
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "tiny-llama",
        {"hidden_size": 320, "intermediate_size": 400, "head_dim": 80, "num_hidden_layers": 2},
    ),
    "qwen3": (
        "tiny-qwen3",
        {"hidden_size": 320, "intermediate_size": 400, "head_dim": 80, "num_hidden_layers": 2},
    ),
    "qwen3-moe": (
        "tiny-qwen3-moe",
        {"hidden_size": 320, "moe_intermediate_size": 200, "head_dim": 80, "num_hidden_layers": 2},
    ),
    "deepseek-v3": (
        "tiny-deepseek-v3",
        {
            "hidden_size": 256,
            "q_lora_rank": 192,
            "kv_lora_rank": 160,
            "moe_intermediate_size": 200,
            "intermediate_size": 300,
        },
    ),
    "deepseek-v32": (
        "tiny-deepseek-v32",
        {
            "hidden_size": 256,
            "q_lora_rank": 192,
            "kv_lora_rank": 160,
            "moe_intermediate_size": 200,
            "intermediate_size": 300,
        },
    ),
}
RUNS = [
    ("llama", "pp1"),
    ("qwen3", "pp1"),
    ("qwen3-moe", "pp1"),
    ("deepseek-v3", "pp1"),
    ("deepseek-v32", "pp1"),
    ("qwen3", "tp2"),
    ("qwen3", "pp2"),
    ("deepseek-v3", "tp2"),
    ("qwen3-moe", "ep2"),
]
LAYOUTS: dict[str, dict[str, Any]] = {
    "pp1": {},
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2},
    "ep2": {"ep_size": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """model -> (fp8 checkpoint, dequantised checkpoint)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(model: str) -> tuple[Path, Path]:
        if model not in made:
            preset, overrides = MODELS[model]
            root = tmp_path_factory.mktemp(model)
            src = make_model(preset, root / "src", overrides=overrides)
            assert write_fp8_checkpoint(src, root / "fp8", root / "deq", torch.float32) > 0
            made[model] = root / "fp8", root / "deq"
        return made[model]

    return get


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 170)]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """model -> transformers' (prompt logprobs, greedy tokens) per prompt on the dequantised
    weights."""
    from transformers import AutoModelForCausalLM

    done: dict[str, list[tuple[torch.Tensor, list[int]]]] = {}

    def get(model: str) -> list[tuple[torch.Tensor, list[int]]]:
        if model not in done:
            _, deq = checkpoints(model)
            hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
            done[model] = [test_hf_parity.hf_run(hf, ids, NEW_TOKENS) for ids in prompts()]
        return done[model]

    return get


def run(path: Path, **flags: Any) -> list[dict[str, Any]]:
    with Engine(
        str(path), dtype="float32", chunked_prefill_size=64, max_total_tokens=2048, **flags
    ) as engine:
        out = engine.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
    assert isinstance(out, list)
    return out


@pytest.mark.parametrize(("model", "layout"), RUNS)
def test_matches_transformers_on_dequantised_weights(
    checkpoints, reference, model: str, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    fp8, _ = checkpoints(model)
    with caplog.at_level("INFO", logger="pipeserve.engine.engine"):
        outputs = run(fp8, **LAYOUTS[layout])
    assert "FP8 block-quantised weights (128x128 blocks), dequantised to float32" in caplog.text
    for out, (logprobs, tokens) in zip(outputs, reference(model), strict=True):
        got = torch.tensor(out["prompt_logprobs"])
        torch.testing.assert_close(got, logprobs, atol=LOGPROB_ATOL, rtol=0)
        assert out["output_ids"] == tokens


def test_the_scales_are_read(checkpoints, tmp_path: Path) -> None:
    """Doubling one block's scale of one weight changes the output; the untouched
    checkpoint's output is the dequantised one's."""
    fp8, deq = checkpoints("qwen3")
    changed = tmp_path / "changed"
    shutil.copytree(fp8, changed)
    with safe_open(changed / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    name = "model.layers.0.mlp.down_proj.weight" + SCALE_SUFFIX
    tensors[name][1, 2] *= 2  # an edge block (columns 256..399 of 400)
    save_file(tensors, str(changed / "model.safetensors"))
    base, plain, doubled = run(fp8), run(deq), run(changed)
    assert base[1]["prompt_logprobs"] == pytest.approx(plain[1]["prompt_logprobs"], abs=1e-5)
    diff = max(
        abs(a - b)
        for a, b in zip(base[1]["prompt_logprobs"], doubled[1]["prompt_logprobs"], strict=True)
    )
    assert diff > 1e-3


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        ({**FP8, "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
        ({**FP8, "activation_scheme": "static"}, "'static'"),
        ({**FP8, "fmt": "e5m2"}, "'e5m2'"),
    ],
)
def test_other_quantisations_are_refused_in_one_line(
    model_dir, tmp_path: Path, quant: dict[str, Any], named: str
) -> None:
    src = model_dir("tiny-qwen3")
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({**config, "quantization_config": quant})
    )
    with pytest.raises(SettingsError) as err:
        Engine(str(tmp_path / "m"))
    message = str(err.value)
    assert "\n" not in message and named in message and "128x128 block scales" in message
    with pytest.raises(ValueError, match="is not supported"):
        checkpoint_quantization({"quantization_config": quant})
    if quant["quant_method"] != "awq":
        return  # the command line's exit is the same for every refusal: one start is enough
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeserve.cli",
            "generate",
            "--model",
            str(tmp_path / "m"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines()[-1].startswith("pipeserve: error: quantization_config")


def test_fp8_tensors_without_scales_or_config_are_refused(checkpoints, tmp_path: Path) -> None:
    fp8, _ = checkpoints("qwen3")
    no_config = tmp_path / "no-config"
    shutil.copytree(fp8, no_config)
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError, match="declares no fp8 quantization_config"):
        Engine(str(no_config))
    no_scale = tmp_path / "no-scale"
    shutil.copytree(fp8, no_scale)
    with safe_open(no_scale / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    del tensors["model.layers.1.self_attn.o_proj.weight" + SCALE_SUFFIX]
    save_file(tensors, str(no_scale / "model.safetensors"))
    with pytest.raises(SettingsError, match="o_proj.weight is fp8 .* with no"):
        Engine(str(no_scale))


LOAD_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from pipeserve.model_loader import load_weights
    from pipeserve.models.arch import ArchConfig
    from pipeserve.models.registry import build_model

    def rss(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    path = Path(sys.argv[1])
    model = build_model(ArchConfig.load(path), torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.data.zero_()  # the model's own pages are resident before the load starts
    before = rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
    load_weights(model, path)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_extra": rss("VmHWM") - before, "model": model_bytes}))
    """
)


def test_loading_holds_one_tensor_beyond_the_model(tmp_path: Path) -> None:
    """Peak memory while loading an FP8 checkpoint into a float32 model: the checkpoint's
    pages as they are read, plus one tensor dequantised at a time, never a second copy of
    the model."""
    src = make_model(
        "tiny-llama",
        tmp_path / "src",
        overrides={
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "head_dim": 64,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "num_hidden_layers": 8,
        },
    )
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", torch.float32)
    probe = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE, str(tmp_path / "fp8")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    file_bytes = (tmp_path / "fp8" / "model.safetensors").stat().st_size
    largest = 2048 * 1024 * 4  # one float32 tensor, dequantised
    assert got["model"] > 250e6  # a model big enough that a second copy would show
    assert got["peak_extra"] < file_bytes + 4 * largest + 64 * 2**20, got


@pytest.mark.parametrize(
    ("first", "shape"),
    [((0, 0), (300, 200)), ((130, 7), (97, 250)), ((127, 128), (1, 1)), ((256, 0), (44, 129))],
)
def test_a_slice_is_dequantised_by_the_blocks_that_cover_it(
    first: tuple[int, int], shape: tuple[int, int]
) -> None:
    """Any slice of a weight (a TP rank's rows or columns, starting and ending inside blocks)
    equals the same slice of the whole weight's element-by-element dequantisation."""
    gen = torch.Generator().manual_seed(3)
    whole, scales = quantize_blocks(torch.randn(300, 400, generator=gen))
    rows = torch.arange(300)[:, None] // 128
    cols = torch.arange(400)[None, :] // 128
    reference = whole.float() * scales[rows, cols]
    (r0, c0), (r, c) = first, shape
    cover = scales[r0 // 128 :, c0 // 128 :]
    got = dequantize_blocks(whole[r0 : r0 + r, c0 : c0 + c], cover, first, BLOCK)
    assert torch.equal(got, reference[r0 : r0 + r, c0 : c0 + c])
