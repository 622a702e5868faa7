"""FP8 checkpoints kept in FP8 (`--fp8-weights keep`): the start-up refusals where the kernel
cannot run, and on a GPU (-m cuda) the compiled products; fp8_interpreted.py checks them on a
CPU under Triton's interpreter (run by test_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from pipeserve.config import EngineConfig, SettingsError
from pipeserve.device import fp8_gemm_unavailable


def test_keeping_fp8_needs_a_gpu_with_fp8_units(model_dir) -> None:
    """On a CPU the engine refuses --fp8-weights keep at start-up, in one line that says why
    and what to use instead."""
    from pipeserve.engine.engine import Engine

    reason = fp8_gemm_unavailable(torch.device("cpu"))
    assert reason is not None and "CUDA GPU" in reason
    with pytest.raises(ValueError, match=r"^--fp8-weights keep needs a CUDA GPU.*dequantize$"):
        Engine(str(model_dir("tiny-qwen3")), fp8_weights="keep")


def test_keep_is_refused_beside_shard_linear_layers() -> None:
    with pytest.raises(SettingsError, match="^--shard-linear-layers .* --fp8-weights keep$"):
        EngineConfig.from_flags(fp8_weights="keep", cp_size=2, shard_linear_layers="qkv_proj")
    EngineConfig.from_flags(cp_size=2, shard_linear_layers="qkv_proj")  # the default: taken


def test_keep_is_refused_with_deterministic_inference() -> None:
    """The FP8 kernels' tiles depend on the batch's rows: no batch-invariance is claimed."""
    with pytest.raises(SettingsError, match="^--enable-deterministic-inference .*dequantize$"):
        EngineConfig.from_flags(fp8_weights="keep", enable_deterministic_inference=True)
    EngineConfig.from_flags(enable_deterministic_inference=True)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_the_fp8_product_on_a_gpu(m: int) -> None:
    """Compiled on a GPU with fp8 units: bfloat16 activations against DeepSeek-V3-sized
    weights (7168 x 2112: a partial block row), within bfloat16's rounding of the block math
    computed in float32 from the same quantised activations."""
    from pipeserve.kernels.triton_fp8 import fp8_linear, quantize_groups
    from pipeserve.models.quantization import BLOCK, dequantize_blocks, quantize_blocks

    device = torch.device("cuda")
    reason = fp8_gemm_unavailable(device)
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(m)
    values, grid = quantize_blocks(torch.randn(2112, 7168, generator=gen) * 0.02)
    x = torch.randn(m, 7168, generator=gen).to(torch.bfloat16)
    got = fp8_linear(x.to(device), values.to(device), grid.to(device)).float().cpu()
    a, scales = quantize_groups(x)
    want = (
        dequantize_blocks(a, scales, (0, 0), (1, 128))
        @ dequantize_blocks(values, grid, (0, 0), BLOCK).T
    )
    torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
