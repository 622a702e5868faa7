"""The compiled skinny linear kernel (kernels/skinny_linear.cpp: a few rows of x against a
weight read once) against float64 products: float32 and bfloat16 activations and weights in
every pairing, K not a multiple of the 8 lanes, N not a multiple of the 4-row blocks and
spanning several threads' tasks, a bias; each row's result independent of the other rows
and of the thread count; bad input refused. And the native backend's linears: which
products go to the kernel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch_threads import torch_threads

from pipeserve.backends import native_backend
from pipeserve.backends.native_backend import (
    SKINNY_MAX_ROWS,
    SKINNY_MAX_ROWS_BF16_NATIVE,
    SKINNY_MAX_ROWS_NARROW,
    NativeLinears,
)
from pipeserve.device import native_skinny_linear
from pipeserve.kernels import native
from pipeserve.layers import batch_invariant

KERNEL = native_skinny_linear()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the native CPU kernels do not build")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def data(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype)
    b = torch.randn(n, generator=gen).to(x_dtype)
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, F32), (F32, F16)]
)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 1, 1), (1, 7, 13), (3, 130, 67), (6, 130, 67), (5, 50, 100), (16, 301, 576), (2, 1000, 8)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_products(x_dtype, w_dtype, m: int, n: int, k: int, bias: bool) -> None:
    x, w, b = data(m, n, k, x_dtype, w_dtype)
    got = KERNEL(x, w, b if bias else None)
    assert got.dtype == x_dtype and got.shape == (m, n)
    want = reference(x, w, b if bias else None)
    # float32 sums of k products; a bfloat16 output is one rounding of it
    atol = 2e-6 * k**0.5 * 4 if x_dtype == F32 else 0.0
    rtol = 1e-5 if x_dtype == F32 else 2**-8
    torch.testing.assert_close(got.double(), want, atol=atol + 1e-6, rtol=rtol)


@pytest.mark.parametrize(  # bfloat16 x and weight: vdpbf16ps where the CPU has it
    ("x_dtype", "w_dtype"), [(F32, BF16), (BF16, BF16), (F32, F16)]
)
def test_a_row_does_not_depend_on_the_others_or_the_threads(
    x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    """Each output is one float32 sum in a fixed order: a row computed alone, among up to 4
    rows (the weight rows streamed) or among 5 to 16 (the register tiles, or vdpbf16ps), on
    one thread or two, comes out bitwise the same within each form."""
    x, w, b = data(16, 777, 1000, x_dtype, w_dtype, seed=3)
    with torch_threads(1):
        alone = torch.cat([KERNEL(x[i : i + 1], w, b) for i in range(16)])
        fours = torch.cat([KERNEL(x[i : i + 4], w, b) for i in range(0, 16, 4)])
        tiled = torch.cat([KERNEL(x[:5], w, b), KERNEL(x[5:], w, b)])
    with torch_threads(2):
        streamed = torch.cat([KERNEL(x[i : i + 3], w, b) for i in range(0, 15, 3)])
        together = KERNEL(x, w, b)
    assert torch.equal(alone, fours) and torch.equal(alone[:15], streamed)
    assert torch.equal(tiled, together)
    if x_dtype == BF16 and native().bf16_pairs_supported():
        assert torch.equal(alone, together)  # vdpbf16ps: one form for every row count


def test_bad_input_is_refused() -> None:
    x, w, _ = data(2, 8, 16, F32, F32)
    with pytest.raises(RuntimeError, match="at most"):
        KERNEL(torch.zeros(native().skinny_linear_max_rows() + 1, 16), w)
    with pytest.raises(RuntimeError, match="disagree on K"):
        KERNEL(x, w[:, :15].contiguous())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        KERNEL(x.half(), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        KERNEL(x, w.T.contiguous().T)
    with pytest.raises(RuntimeError, match="bias"):
        KERNEL(x, w, torch.zeros(7))


def test_native_linears_send_decode_sized_products_to_the_kernel() -> None:
    """Up to SKINNY_MAX_ROWS rows (any leading shape), SKINNY_MAX_ROWS_NARROW for a weight
    kept in bfloat16, go to the kernel; more rows, a weight that is a strided view, a dtype it
    does not take, and every product inside a deterministic forward go to torch's GEMM."""
    calls: list[tuple[int, ...]] = []

    def kernel(x, w, b=None):
        calls.append(tuple(x.shape))
        return KERNEL(x, w, b)

    linears = NativeLinears(kernel)
    most = SKINNY_MAX_ROWS
    x, w, b = data(SKINNY_MAX_ROWS_NARROW + 1, 40, 24, F32, F32)
    y = linears.linear(x[:most].view(2, -1, 24), w, b)
    assert y.shape == (2, most // 2, 40) and calls == [(most, 24)]
    torch.testing.assert_close(
        y.reshape(-1, 40).double(), reference(x[:most], w, b), atol=1e-5, rtol=0
    )
    linears.linear(x[: most + 1], w, b)  # one row too many for a float32 weight
    linears.linear(x[:1], w.T.contiguous().T)  # strided weight
    linears.linear(x[:1].half(), w.half())
    with batch_invariant.enabled_in(True):
        linears.linear(x[:1], w)
    assert len(calls) == 1
    narrow = w.bfloat16()
    linears.linear(x[:SKINNY_MAX_ROWS_NARROW], narrow, b)
    assert calls[1:] == [(SKINNY_MAX_ROWS_NARROW, 24)]
    backend = native_backend.NativeBackend()
    assert isinstance(backend.linears, NativeLinears) and backend.linears.narrow
    assert not native_backend.NativeBackend(deterministic=True).linears.narrow


@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-cpu", "avx2-cpu"])
def test_bfloat16_products_leave_the_kernel_early_where_torch_has_bf16_instructions(
    native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 x with a bfloat16 weight: on a CPU with native bf16 products torch's GEMM
    (bf16 dot products) takes them from SKINNY_MAX_ROWS_BF16_NATIVE + 1 rows on; on other
    CPUs (where torch emulates bf16) the kernel keeps them up to SKINNY_MAX_ROWS."""
    monkeypatch.setenv("PIPESERVE_CPU_BF16", "1" if native_bf16 else "0")
    linears = native_backend.NativeBackend().linears
    assert isinstance(linears, NativeLinears)
    calls: list[int] = []
    kernel = linears.kernel
    linears.kernel = lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b)
    most = SKINNY_MAX_ROWS_BF16_NATIVE if native_bf16 else SKINNY_MAX_ROWS
    x, w, _ = data(SKINNY_MAX_ROWS + 1, 40, 24, BF16, BF16)
    for rows in range(1, SKINNY_MAX_ROWS + 2):
        linears.linear(x[:rows], w)
    assert calls == list(range(1, most + 1))
    calls.clear()
    linears.linear(x[:SKINNY_MAX_ROWS].float(), w.float())  # float32 keeps its own bound
    assert calls == [SKINNY_MAX_ROWS]


def test_a_weight_of_bfloat16_or_float16_values_is_kept_so() -> None:
    """store: a float32 weight whose values are all bfloat16 numbers (a bfloat16 checkpoint's)
    is kept in bfloat16, else one whose values are all float16 numbers (a float16
    checkpoint's) in float16; one with a value that is neither, a weight of another dtype,
    and every weight when narrowing is off, are kept as they are."""
    linears = NativeLinears(KERNEL)
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(30, 20, generator=gen).bfloat16().float()
    assert linears.store(exact).dtype == BF16 and torch.equal(linears.store(exact).float(), exact)
    half = torch.randn(30, 20, generator=gen).half().float()
    assert not torch.equal(half.bfloat16().float(), half)
    assert linears.store(half).dtype == F16 and torch.equal(linears.store(half).float(), half)
    inexact = exact.clone()
    inexact[3, 7] += 2**-20
    assert linears.store(inexact) is inexact
    assert linears.store(exact.half()).dtype == torch.float16
    assert NativeLinears(KERNEL, narrow=False).store(exact) is exact


@pytest.mark.parametrize("rows", [SKINNY_MAX_ROWS_NARROW + 1, native_backend.WIDEN_WHOLE_MIN_ROWS])
def test_a_narrow_weight_widened_for_torch_s_gemm_gives_the_wide_product(rows: int) -> None:
    """Past the kernel's rows a bfloat16-kept weight is widened for torch's GEMM, in blocks
    of rows (several and a partial one here) or, for prompt-sized products, whole: the
    float32 weight's product, with a bias, under any leading shape."""
    linears = NativeLinears(KERNEL)
    block = native_backend.WIDEN_BLOCK_BYTES // (48 * 4)
    n = 2 * block + 37
    x, w, b = data(rows, n, 48, F32, BF16, seed=5)
    got = linears.linear(x.view(1, rows, 48), w, b)
    assert got.shape == (1, rows, n) and got.dtype == F32
    want = torch.nn.functional.linear(x, w.float(), b)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def float16_copy(src: Path, out: Path) -> Path:
    """The checkpoint with each value moved a little and stored in float16: float16 numbers
    that are not bfloat16 ones (a float16 checkpoint's, as older Llama and Mistral ship)."""
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(src / "model.safetensors")
    save_file(
        {k: (t.float() * (1 + 2**-9)).half() for k, t in tensors.items()}, out / "model.safetensors"
    )
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    return out


@pytest.mark.parametrize("stored", [BF16, F16])
def test_a_narrow_checkpoint_run_in_float32_keeps_its_linears_narrow(
    model_dir, tmp_path: Path, stored: torch.dtype
) -> None:
    """End to end (tied embeddings): on the native backend a float32 run of a bfloat16 (or
    float16) checkpoint keeps every linear weight and the shared embedding/LM head in that
    dtype and the norms in float32, holds fewer weight bytes, and gives the torch backend's
    float32 tokens and logprobs (the same products, summed in another order)."""
    from pipeserve import Engine
    from pipeserve.layers.embedding import ParallelLMHead
    from pipeserve.layers.linear import LinearBase

    path = model_dir("tiny-qwen3")
    if stored == F16:
        path = float16_copy(path, tmp_path / "float16")
        assert all(t.dtype == F16 for t in load_file(path / "model.safetensors").values())
    prompts = [[(7 * j) % 500 + 1 for j in range(40)], [(3 * j) % 500 + 2 for j in range(9)]]
    sp = {"max_new_tokens": 6, "temperature": 0}
    runs, held = {}, {}
    for backend in ("native", "torch"):
        with Engine(str(path), dtype="float32", attention_backend=backend) as engine:
            runner = engine.backend.runner
            held[backend] = runner.param_bytes
            if backend == "native":
                kinds = (LinearBase, ParallelLMHead)
                linear = [m.weight for m in runner.model.modules() if isinstance(m, kinds)]
                assert linear and all(w.dtype == stored for w in linear)
                lookup = runner.model.model.embed_tokens
                assert lookup.weight is runner.model.lm_head.weight
                assert lookup(torch.tensor([1, 2])).dtype == F32
                norms = [p for n, p in runner.model.named_parameters() if "norm" in n]
                assert norms and all(p.dtype == F32 for p in norms)
            runs[backend] = engine.generate(
                input_ids=prompts, sampling_params=sp, return_logprob=True
            )
    assert held["native"] < 0.6 * held["torch"]
    for got, want in zip(runs["native"], runs["torch"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        for key in ("prompt_logprobs", "output_logprobs"):
            a, b = (torch.tensor(r[key], dtype=torch.float64) for r in (got, want))
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
