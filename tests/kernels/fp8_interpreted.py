"""FP8 checkpoints kept in FP8 (`--fp8-weights keep`) on CPU tensors through Triton's
interpreter: the block-scaled product (kernels/triton_fp8.py) against the block math in
float64; the linear layers' loading of raw fp8 values and their scale grids (kept where each of
a rank's 128-blocks is one of the checkpoint's, dequantised where a TP slice or a fused part
starts inside a block or the tensor is stored unquantised); the scales really read; whole
engines (Qwen3-MoE, DeepSeek-V3.2 with MLA, its indexer, shared and routed experts) against
the dequantised path whose kept layers see the same quantised activations.

Run by test_triton_fp8.py in a process of its own with TRITON_INTERPRET=1; not collected on
its own (no test_ prefix)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_fp8.py"

from pipeserve.kernels.triton_fp8 import FP8, GROUP, fp8_linear, quantize_groups  # noqa: E402
from pipeserve.layers import linear  # noqa: E402
from pipeserve.model_loader import _lazy  # noqa: E402
from pipeserve.models.quantization import (  # noqa: E402
    BLOCK,
    SCALE_SUFFIX,
    Fp8Blocks,
    dequantize_blocks,
    quantize_blocks,
    write_fp8_checkpoint,
)


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each 1 x 128 group through fp8 and back."""
    q, s = quantize_groups(x.reshape(-1, x.shape[-1]))
    return dequantize_blocks(q, s, (0, 0), (1, GROUP)).to(x.dtype).view(x.shape)


@pytest.mark.parametrize(
    ("m", "n", "k", "row_offset", "bias"),
    [
        (1, 64, 128, 0, False),  # one decode row, whole blocks
        (5, 200, 300, 0, True),  # partial blocks in both directions
        (33, 130, 576, 37, False),  # a weight slice starting inside a block row
        (70, 320, 96, 200, True),  # K narrower than a group; the slice from a block's middle
    ],
)
def test_the_product_is_the_block_math(m, n, k, row_offset, bias) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    full = torch.randn(row_offset + n, k, generator=gen) * 0.1
    values, grid = quantize_blocks(full)
    grid = grid * torch.rand(grid.shape, generator=gen).add(0.5)  # scales apart per block
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    first = row_offset // GROUP
    got = fp8_linear(x, values[row_offset:], grid[first:], b, row_offset=row_offset)
    w = dequantize_blocks(values, grid, (0, 0), BLOCK)[row_offset:]
    want = fake_quantized(x).double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=2e-5 * want.abs().max().item(), rtol=0)
    # the activations really went through fp8: the unquantised product is further off
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert (got.double() - exact).abs().max() > 1e-3 * exact.abs().max()


def test_activation_groups() -> None:
    """One scale per 1 x 128 group (the last partial), the group's largest magnitude to 448;
    an all-zero group stays zero."""
    x = torch.zeros(2, 300)
    x[0, :128] = torch.linspace(-3, 2, 128)
    x[0, 256:] = 7.0
    x[1, 130] = -0.5
    q, s = quantize_groups(x)
    assert q.dtype == FP8 and q.shape == (2, 300) and s.shape == (2, 3)
    torch.testing.assert_close(s[0], torch.tensor([3.0, 1e-12, 7.0]) / 448)
    assert q[0, :128].float().abs().max() == 448 and (q[0, 128:256].float() == 0).all()
    assert q[1, 130].float() == -448 and s[1, 1] == pytest.approx(0.5 / 448)


def checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor], quantize: set[str]):
    """`tensors` written as an FP8 release writes them (those named in `quantize` as fp8 with
    block scales) -> (name -> LazyTensor as the loader makes them, name -> dequantised)."""
    stored, real = {}, {}
    for name, t in tensors.items():
        if name in quantize:
            values, grid = quantize_blocks(t)
            grid = grid * (1 + torch.arange(grid.numel()).view(grid.shape) % 3)  # apart
            stored[name], stored[name + SCALE_SUFFIX] = values, grid
            real[name] = dequantize_blocks(values, grid, (0, 0), BLOCK)
        else:
            stored[name] = real[name] = t
    file = tmp_path / "model.safetensors"
    save_file(stored, str(file))
    handle = safe_open(file, framework="pt")
    index = dict.fromkeys(stored, file)
    lazy = {name: _lazy(lambda _: handle, name, index, Fp8Blocks()) for name in tensors}
    return lazy, real


def build(cls: type, *args: Any, tp: tuple[int, int] = (0, 1), monkeypatch) -> Any:
    monkeypatch.setattr(linear, "get_tp_rank", lambda: tp[0])
    monkeypatch.setattr(linear, "get_tp_size", lambda: tp[1])
    with linear.keeping_fp8_weights(True):
        return cls(*args)


def rows_of(real: torch.Tensor, tp: tuple[int, int], dim: int = 0) -> torch.Tensor:
    size = real.shape[dim] // tp[1]
    return real.narrow(dim, tp[0] * size, size)


@pytest.mark.parametrize(
    ("out", "tp", "kept"),
    [
        (512, (1, 2), True),  # rank 1's rows start at block 2
        (576, (0, 1), True),  # a partial last block (DeepSeek's kv_a_proj_with_mqa)
        (320, (1, 2), False),  # rank 1's rows start at 160, inside block 1
    ],
)
def test_a_column_split_keeps_whole_blocks_only(tmp_path, monkeypatch, out, tp, kept) -> None:
    gen = torch.Generator().manual_seed(out)
    lazy, real = checkpoint(tmp_path, {"w": torch.randn(out, 200, generator=gen)}, {"w"})
    layer = build(
        linear.ColumnParallelLinear, 200, out, False, torch.float32, tp=tp, monkeypatch=monkeypatch
    )
    assert layer.weight.dtype == FP8  # built for fp8, before the checkpoint is read
    layer.weight.weight_loader(layer.weight, lazy["w"])
    want = rows_of(real["w"], tp)
    assert (layer.scale_inv is not None) == kept
    if kept:
        assert layer.weight.dtype == FP8
        got = dequantize_blocks(layer.weight.data, layer.scale_inv, (0, 0), BLOCK)
        assert torch.equal(got, want)  # the raw values and the grid rows that cover them
    else:
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight.data, want)
    x = torch.randn(3, 200, generator=gen)
    expected = (fake_quantized(x) if kept else x).double() @ want.double().T
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("cols", "kept"), [(512, True), (320, False)])
def test_a_row_split_keeps_whole_blocks_only(tmp_path, monkeypatch, cols, kept) -> None:
    """RowParallelLinear's rank 1 of 2 (its all-reduce is a no-op without a group)."""
    monkeypatch.setattr(linear, "tp_all_reduce", lambda y: y)
    gen = torch.Generator().manual_seed(cols)
    lazy, real = checkpoint(
        tmp_path, {"w": torch.randn(96, cols, generator=gen), "b": torch.randn(96)}, {"w"}
    )
    layer = build(
        linear.RowParallelLinear, cols, 96, True, torch.float32, tp=(1, 2), monkeypatch=monkeypatch
    )
    layer.weight.weight_loader(layer.weight, lazy["w"])
    layer.bias.weight_loader(layer.bias, lazy["b"])
    want = rows_of(real["w"], (1, 2), dim=1)
    assert (layer.scale_inv is not None) == kept
    x = torch.randn(4, cols // 2, generator=gen)
    expected = (fake_quantized(x) if kept else x).double() @ want.double().T + real["b"].double()
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


def test_fused_parts_keep_fp8_only_when_each_starts_on_a_block(tmp_path, monkeypatch) -> None:
    """gate/up of 384 rows each: kept; q/k/v of 4 x 64, 2 x 64, 2 x 64 rows: k starts at row
    256, v at 384: kept; of 4 x 80 ...: k starts at 320, inside a block: dequantised, with
    what was loaded as fp8 before (q) turned into its real values."""
    gen = torch.Generator().manual_seed(3)
    tensors = {n: torch.randn(384, 256, generator=gen) for n in ("gate", "up")}
    for d in (64, 80):
        tensors |= {f"q{d}": torch.randn(4 * d, 256, generator=gen)}
        tensors |= {f"{n}{d}": torch.randn(2 * d, 256, generator=gen) for n in "kv"}
    lazy, real = checkpoint(tmp_path, tensors, set(tensors))
    merged = build(
        linear.MergedColumnParallelLinear,
        256,
        [384, 384],
        False,
        torch.float32,
        monkeypatch=monkeypatch,
    )
    for i, n in enumerate(("gate", "up")):
        merged.weight.weight_loader(merged.weight, lazy[n], i)
    assert merged.scale_inv is not None
    x = torch.randn(5, 256, generator=gen)
    want = torch.cat([real["gate"], real["up"]])
    torch.testing.assert_close(merged(x), fake_quantized(x) @ want.T, atol=1e-4, rtol=1e-5)
    for d, kept in ((64, True), (80, False)):
        qkv = build(
            linear.QKVParallelLinear, 256, d, 4, 2, False, torch.float32, monkeypatch=monkeypatch
        )
        for n in "qkv":
            qkv.weight.weight_loader(qkv.weight, lazy[f"{n}{d}"], n)
        assert (qkv.scale_inv is not None) == kept
        want = torch.cat([real[f"{n}{d}"] for n in "qkv"])
        xin = fake_quantized(x) if kept else x
        torch.testing.assert_close(qkv(x), xin @ want.T, atol=1e-4, rtol=1e-5)
        # K and V alone (context parallelism's order): a slice from inside the grid's blocks
        kv = qkv.project(x, qkv.q_size, None)
        torch.testing.assert_close(kv, xin @ want[qkv.q_size :].T, atol=1e-4, rtol=1e-5)


def test_an_unquantised_tensor_turns_the_layer_back(tmp_path, monkeypatch) -> None:
    """A checkpoint that stores this linear unquantised: the layer holds the compute dtype."""
    gen = torch.Generator().manual_seed(4)
    lazy, real = checkpoint(tmp_path, {"w": torch.randn(256, 128, generator=gen)}, set())
    layer = build(linear.ReplicatedLinear, 128, 256, False, torch.float32, monkeypatch=monkeypatch)
    layer.weight.weight_loader(layer.weight, lazy["w"])
    assert layer.scale_inv is None and layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight.data, real["w"])


def test_the_scales_are_read(tmp_path, monkeypatch) -> None:
    """Doubling one block's scale in the layer doubles that block's share of the output and
    nothing else."""
    gen = torch.Generator().manual_seed(5)
    lazy, _ = checkpoint(tmp_path, {"w": torch.randn(256, 256, generator=gen)}, {"w"})
    layer = build(linear.ReplicatedLinear, 256, 256, False, torch.float32, monkeypatch=monkeypatch)
    layer.weight.weight_loader(layer.weight, lazy["w"])
    x = torch.zeros(2, 256)
    x[:, 128:] = torch.randn(2, 128, generator=gen)  # only column block 1 contributes
    before = layer(x)
    layer.scale_inv[1, 1] *= 2
    after = layer(x)
    torch.testing.assert_close(after[:, 128:], 2 * before[:, 128:])
    torch.testing.assert_close(after[:, :128], before[:, :128])


def test_grouped_experts_are_each_experts_block_math() -> None:
    """Rows sorted by expert through their experts' fp8 weights in one launch: groups of 3, 0,
    70 (two row tiles), 1 and 20 rows, partial blocks; rows past the last group untouched."""
    from pipeserve.kernels.triton_fp8 import fp8_grouped_linear

    gen = torch.Generator().manual_seed(6)
    stored = [quantize_blocks(torch.randn(200, 300, generator=gen) * 0.1) for _ in range(5)]
    weight = torch.stack([w for w, _ in stored])
    grids = torch.stack([g * (1 + i) for i, (_, g) in enumerate(stored)])  # experts apart
    ends = torch.tensor([3, 0, 70, 1, 20]).cumsum(0).to(torch.int32)
    x = torch.randn(int(ends[-1]) + 4, 300, generator=gen)
    got = fp8_grouped_linear(x, weight, grids, ends)
    start = 0
    for e, end in enumerate(ends.tolist()):
        w = dequantize_blocks(weight[e], grids[e], (0, 0), BLOCK).double()
        want = fake_quantized(x[start:end]).double() @ w.T
        torch.testing.assert_close(got[start:end].double(), want, atol=1e-5, rtol=1e-5)
        start = end


ENGINE_MODELS = {  # every block whole: 64-wide heads, 128-multiple widths
    "tiny-qwen3-moe": {
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
    },
    "tiny-deepseek-v32": {
        "hidden_size": 256,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "moe_intermediate_size": 256,
        "intermediate_size": 384,
        "num_hidden_layers": 2,  # a dense MLP layer, then a MoE one
    },
}


@pytest.mark.parametrize("preset", list(ENGINE_MODELS))
def test_an_engine_keeping_fp8_serves_its_block_math(tmp_path, monkeypatch, preset) -> None:
    """A whole engine with --fp8-weights keep (its fp8 check passed as on a GPU) against the
    dequantised path whose same layers see the same quantised activations: prompt logprobs
    within a mean of 0.01 (a tiny difference upstream can flip one activation's fp8 rounding
    downstream, so not bitwise), where the plain dequantised path is 10x further off; the
    layers kept are the linears whose blocks are whole (not MLA's kv_b_proj) and the routed
    experts, and the weights held are fewer bytes."""
    from pipeserve.engine import engine as engine_module
    from pipeserve.engine.engine import Engine
    from pipeserve.layers import moe
    from pipeserve.models.presets import make_model

    def experts_seeing_fp8_inputs(self, x, weights, local_ids):
        """FusedMoE._run_looped with each expert product's input fake-quantised."""
        top_k = local_ids.shape[1]
        flat = local_ids.flatten() + 1
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts) + 1).tolist()
        out, start = torch.zeros_like(x), counts[0]
        for expert, count in enumerate(counts[1:]):
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            h = moe.silu_and_mul(fake_quantized(x[tokens]) @ self.w13[expert].T)
            h = fake_quantized(h) @ self.w2[expert].T
            out.index_add_(0, tokens, h * weights.flatten()[picks, None].to(x.dtype))
        return out

    monkeypatch.setattr(engine_module, "fp8_gemm_unavailable", lambda device: None)
    src = make_model(preset, tmp_path / "src", overrides=ENGINE_MODELS[preset])
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", torch.float32)
    prompts = [[(7 * j + 3 * n) % 300 + 1 for j in range(n)] for n in (30, 70)]
    params = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
    flags = {"dtype": "float32", "chunked_prefill_size": 64, "max_total_tokens": 1024}

    def run(mode: str, fake: set[str] | None = None):
        with Engine(str(tmp_path / "fp8"), fp8_weights=mode, **flags) as engine:
            runner = engine.backend.runner
            kept = {
                n.removesuffix(".scale_inv")
                for n, _ in runner.model.named_buffers()
                if n.endswith("scale_inv")
            }
            for name, module in runner.model.named_modules():
                if fake and name in fake:  # what the kept layer's kernel sees
                    for attr in ("forward", "matmul"):
                        f = getattr(module, attr)
                        setattr(module, attr, lambda x, *a, f=f: f(fake_quantized(x), *a))
            out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            return kept, runner.param_bytes, [torch.tensor(o["prompt_logprobs"]) for o in out]

    kept, kept_bytes, got = run("keep")
    with monkeypatch.context() as patched:
        patched.setattr(moe.FusedMoE, "_run_looped", experts_seeing_fp8_inputs)
        _, plain_bytes, same_inputs = run("dequantize", fake=kept)
    _, _, plain = run("dequantize")
    kinds = {name.rsplit(".", 1)[-1] for name in kept}
    if preset == "tiny-qwen3-moe":  # layer 1 is a dense MLP (mlp_only_layers)
        assert kinds == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} | {
            "w13_scale_inv",
            "w2_scale_inv",
        }
    else:  # MLA less kv_b_proj, the indexer's projections, the MLPs and the experts
        assert "kv_b_proj" not in kinds and {"w13_scale_inv", "w2_scale_inv"} <= kinds
        assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "wq_b", "wk"} <= kinds
        assert any("shared_experts" in n for n in kept)
    assert len(kept) >= 8 and kept_bytes < plain_bytes
    near = torch.cat([g - w for g, w in zip(got, same_inputs, strict=True)]).abs().mean()
    far = torch.cat([g - w for g, w in zip(got, plain, strict=True)]).abs().mean()
    assert near < 0.01 and far > 10 * near, (near, far)
