"""Weights kept in GGUF blocks (layers/block_quant.py, kernels/skinny_linear.cpp's
`skinny_linear_blocks`): the blocks of a dequantised Q4_1 or Q8_0 tensor found again bitwise
(against gguf's own quantiser), a Q4_0 one's as Q4_1 blocks of the same values, anything
else refused; the rows grouped in the layout the
kernel streams and back; the kernel, in each form this CPU compiles, equal to a float64
product of the weight with x rounded in two 8-bit parts per block; the native
linears keep such weights in blocks and send larger products to torch's GEMM on the values;
a tied embedding reads its rows from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pipeserve.backends.native_backend import SKINNY_MAX_ROWS_NARROW, BlockKernels, NativeLinears
from pipeserve.device import native_block_kernels, native_skinny_linear
from pipeserve.kernels import native
from pipeserve.layers.block_quant import (
    BLOCK_FORMATS,
    GROUP,
    Q4_1,
    Q8_0,
    BlockFormat,
    block_format,
    describe_blocks,
    gguf_values,
    group,
    row_values,
    ungroup,
    values,
)
from pipeserve.layers.embedding import VocabParallelEmbedding

KERNEL = native_skinny_linear()
COMPILED = native_block_kernels()
BLOCKS, DEQUANTIZE, REQUANTIZE = COMPILED or (None, None, None)
needs_kernel = pytest.mark.skipif(COMPILED is None, reason="the native CPU kernels do not build")
# GGUF's format -> the format it is kept in: Q4_0's d (q - 8) is Q4_1's d q + m with m = -8 d
FORMATS = {"q4_1": (Q.Q4_1, Q4_1), "q8_0": (Q.Q8_0, Q8_0), "q4_0": (Q.Q4_0, Q4_1)}
MODULE = native()
FORMS = MODULE.int8_product_forms() if MODULE is not None else []  # 1 portable, 2 AVX2, 3 VNNI


def gguf_weight(n: int, k: int, kind: Q, seed: int = 0) -> tuple[torch.Tensor, bytes]:
    """A weight as GGUF's quantiser stores it and as its dequantiser gives it back:
    (float32 values [n, k], the blocks' bytes)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1))).astype(np.float32)
    w[0, :32] = 0.5  # a block of one value
    raw = quants.quantize(w, kind)
    return torch.from_numpy(quants.dequantize(raw, kind).copy()), raw.tobytes()


def requantize(weight: torch.Tensor) -> torch.Tensor | None:
    """The compiled search, in the native backend's order of formats: the GGUF blocks."""
    assert REQUANTIZE is not None
    for fmt in BLOCK_FORMATS:
        if (found := REQUANTIZE(weight, fmt.code)) is not None:
            return found
    return None


def kept(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the native linears keep it: its blocks, rows grouped."""
    found = requantize(weight)
    assert found is not None and (fmt := block_format(found)) is not None
    return group(found, fmt)


@needs_kernel
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_the_blocks_of_a_dequantised_tensor_are_found_again(name: str) -> None:
    """The very bytes GGUF's quantiser stored, and `values` gives the values back."""
    kind, fmt = FORMATS[name]
    w, raw = gguf_weight(40, 96, kind)
    blocks = requantize(w)
    assert blocks is not None and block_format(blocks) is fmt
    assert blocks.shape == (40, 96 // 32 * fmt.block_bytes)
    assert blocks.numpy().tobytes() == raw
    assert torch.equal(gguf_values(blocks, fmt), w)
    assert torch.equal(values(group(blocks, fmt), fmt), w)


@needs_kernel
def test_q4_0_blocks_are_kept_as_the_q4_1_blocks_of_the_same_values() -> None:
    """GGUF's Q4_0 block (fp16 d, 32 nibbles q; d (q - 8)) found as a Q4_1 block: its d as it
    is (negative where the block's largest magnitude is positive), m = -8 d and the same
    nibbles; every value back bitwise."""
    w, raw = gguf_weight(40, 96, Q.Q4_0)
    blocks = requantize(w)
    assert blocks is not None and block_format(blocks) is Q4_1
    # Q4_1's own form (m the minimum, d >= 0) is tried first and fits some blocks too (a
    # block of one value; levels 0 to 15 all used, with 7 d exact in fp16); a negative d is
    # the Q4_0 form's, which must be GGUF's block
    ours = blocks.view(torch.uint8).reshape(40 * 3, Q4_1.block_bytes)
    theirs = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(40 * 3, 18)
    negative = ours[:, :2].contiguous().view(torch.float16)[:, 0] < 0
    assert negative.sum() > 30  # of 120
    ours, theirs = ours[negative], theirs[negative]
    d = theirs[:, :2].contiguous().view(torch.float16)[:, 0]
    assert torch.equal(ours[:, :2], theirs[:, :2])  # d
    assert torch.equal(ours[:, 2:4].contiguous().view(torch.float16)[:, 0], -8 * d)  # m
    assert torch.equal(ours[:, 4:], theirs[:, 2:])  # the nibbles
    assert torch.equal(gguf_values(blocks, Q4_1), w)
    assert torch.equal(values(group(blocks, Q4_1), Q4_1), w)


@needs_kernel
def test_q4_0_blocks_whose_levels_skip_q_0_are_kept_too() -> None:
    """Q4_0 blocks made elsewhere than GGUF's reference quantiser (an importance matrix's
    fit): levels that never reach q = 0, so the largest magnitude is d (q - 8) for another q."""
    gen = torch.Generator().manual_seed(2)
    n, k = 16, 64
    d = (0.01 + torch.rand(n * k // 32, generator=gen)) * torch.randn(
        n * k // 32, generator=gen
    ).sign()
    d = d.half()
    q = torch.randint(2, 14, (n * k // 32, 32), generator=gen, dtype=torch.uint8)  # never 0
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    raw = torch.cat([d.view(torch.uint8).view(-1, 2), nibbles], dim=1).numpy().tobytes()
    w = quants.dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(n, -1), Q.Q4_0)
    w = torch.from_numpy(w.reshape(n, k).copy())
    assert REQUANTIZE is not None
    blocks = REQUANTIZE(w, Q4_1.code)
    assert blocks is not None
    assert torch.equal(gguf_values(blocks, Q4_1), w)


def refused(kind: Q) -> list[torch.Tensor]:
    """Weights with no blocks of `kind`: float32 and bfloat16 values, and a weight of that
    kind (whose other blocks would be found) with one value off its block's grid, a NaN, an
    infinity, or rows that are not whole blocks."""
    w, _ = gguf_weight(8, 64, kind)
    w[0, :32] = w[1, :32]  # no block of one value: each case is refused by its own fault
    assert REQUANTIZE is not None and REQUANTIZE(w, FORMATS[kind.name.lower()][1].code) is not None
    nudged, nan, inf = w.clone(), w.clone(), w.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(9.0))
    nan[7, 3], inf[2, 60] = float("nan"), float("inf")
    return [torch.randn(16, 64), torch.randn(16, 64).bfloat16().float(), nudged, nan, inf,
            w[:, :48].contiguous()]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_anything_else_stays_a_matrix(name: str) -> None:
    kind, fmt = FORMATS[name]
    assert REQUANTIZE is not None
    for weight in refused(kind):
        assert REQUANTIZE(weight, fmt.code) is None
    q4_1, _ = gguf_weight(8, 64, Q.Q4_1)
    q8_0, _ = gguf_weight(8, 64, Q.Q8_0)
    assert REQUANTIZE(q8_0, Q4_1.code) is None and REQUANTIZE(q4_1, Q8_0.code) is None
    with pytest.raises(RuntimeError, match="float32"):
        REQUANTIZE(q4_1.bfloat16(), fmt.code)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [5, 8, 21])
def test_grouped_rows_lie_as_the_kernel_reads_them(fmt: BlockFormat, n: int) -> None:
    """Each group's block b: the rows' scales (and minimums), then quad u of every row's
    integers; rows past the last whole group as they were; `ungroup` undoes it."""
    gen = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n, 3 * fmt.block_bytes), generator=gen, dtype=torch.uint8)
    raw = raw.view(fmt.storage)
    grouped = group(raw, fmt)
    assert grouped.shape == raw.shape and grouped.dtype == raw.dtype
    assert torch.equal(ungroup(grouped, fmt), raw)
    whole, bb = n - n % GROUP, fmt.block_bytes
    assert torch.equal(grouped[whole:], raw[whole:])
    head = 4 if fmt is Q4_1 else 2
    data, src = grouped.view(torch.uint8).reshape(-1), raw.view(torch.uint8)
    for r in range(whole):
        for b in range(3):
            tile = data[(r - r % GROUP) * 3 * bb + b * GROUP * bb :][: GROUP * bb]
            j, block = r % GROUP, src[r, b * bb : (b + 1) * bb]
            for h in range(0, head, 2):
                assert torch.equal(tile[GROUP * h + 2 * j :][:2], block[h : h + 2])
            for u in range((bb - head) // 4):
                quad = tile[GROUP * head + 32 * u + 4 * j :][:4]
                assert torch.equal(quad, block[head + 4 * u : head + 4 * u + 4])
    ids = torch.tensor([[0, n - 1], [n // 2, 0]])
    values_ = torch.nan_to_num(gguf_values(raw, fmt))  # random bytes: some fp16 NaNs
    assert torch.equal(torch.nan_to_num(row_values(grouped, fmt, ids)), values_[ids])


def two_part_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far x . w^T may be from the exact product with x rounded in two 8-bit parts per
    block of 32 (the first with scale max|x| / 127, what it leaves with a 254th of that): one
    step of the second part on every value, sum_j |w_ij| max|x|_block(j) / (127 * 254), twice
    the rounding's half step (a level on either side of a near-tie), plus float32's rounding
    of the sums. One 8-bit part alone is 127 times as far."""
    m, k = x.shape
    step = x.double().view(m, k // 32, 32).abs().amax(-1, keepdim=True) / (127 * 254)
    size = x.double().abs() @ w.double().abs().T
    return step.expand(m, k // 32, 32).reshape(m, k) @ w.double().abs().T + 1e-6 * size + 1e-6


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, SKINNY_MAX_ROWS_NARROW])
def test_the_kernel_on_blocks_is_the_product_with_x_rounded_in_two_8_bit_parts(
    name: str, rows: int
) -> None:
    """Every compiled form, on 77 rows (9 groups and 5 rows past them), x with a large value
    in some blocks (where rounding shows): within the two parts' rounding of the exact
    product, far inside one 8-bit part's; every form the same sums but for float32's
    rounding (they share x's rounding)."""
    kind, fmt = FORMATS[name]
    w, _ = gguf_weight(77, 160, kind, seed=rows)
    blocks = kept(w)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=gen)
    x[:, 37] *= 30  # an outlier channel, as real activations have
    bias = torch.randn(77, generator=gen)
    exact = x.double() @ w.double().T + bias.double()
    bound = two_part_bound(x, w)
    size = x.double().abs() @ w.double().abs().T  # the sums' scale
    best = BLOCKS(x, blocks, fmt.code, bias).double()
    assert ((best - exact).abs() <= bound).all()
    assert (best - exact).abs().max() > 0  # x was rounded
    for form in FORMS:
        got = BLOCKS(x, blocks, fmt.code, bias, form).double()
        assert ((got - best).abs() <= 1e-6 * size + 1e-6).all(), form
        got16 = BLOCKS(x.bfloat16(), blocks, fmt.code, bias.bfloat16(), form)
        assert got16.dtype == torch.bfloat16
        want16 = x.bfloat16().double() @ w.double().T + bias.bfloat16().double()
        torch.testing.assert_close(got16.double(), want16, atol=0.05, rtol=0.01)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_compiled_dequantisation_gives_the_values(name: str) -> None:
    kind, fmt = FORMATS[name]
    w, _ = gguf_weight(130, 224, kind)  # 16 groups and 2 rows past them
    blocks = kept(w)
    assert DEQUANTIZE is not None
    assert torch.equal(DEQUANTIZE(blocks, fmt.code), w)
    assert torch.equal(DEQUANTIZE(blocks[16:32], fmt.code), w[16:32])  # groups of it
    assert torch.equal(DEQUANTIZE(blocks[120:], fmt.code), w[120:])  # a group and the rest
    with pytest.raises(RuntimeError, match="whole blocks"):
        DEQUANTIZE(blocks[:, :-1].contiguous(), fmt.code)


@needs_kernel
def test_the_kernel_refuses_blocks_that_do_not_fit() -> None:
    w, _ = gguf_weight(4, 64, Q.Q4_1)
    blocks = requantize(w)
    assert blocks is not None
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="format"):
        BLOCKS(x, blocks, 3)
    with pytest.raises(RuntimeError, match="blocks of"):
        BLOCKS(torch.randn(1, 96), blocks, Q4_1.code)
    with pytest.raises(RuntimeError, match="blocks of"):
        BLOCKS(x, blocks, Q8_0.code)  # 40 bytes a row: not 34-byte blocks
    with pytest.raises(RuntimeError, match="at most"):
        BLOCKS(torch.randn(17, 64), blocks, Q4_1.code)


@needs_kernel
def test_native_linears_keep_blocks_and_use_the_gemm_for_many_rows() -> None:
    assert KERNEL is not None
    calls: list[int] = []

    def blocks_kernel(x, w, code, b=None):
        calls.append(x.shape[0])
        return BLOCKS(x, w, code, b)

    assert COMPILED is not None
    compiled = BlockKernels(blocks_kernel, *COMPILED[1:])
    linears = NativeLinears(KERNEL, blocks=compiled)
    w, _ = gguf_weight(300, 128, Q.Q4_1)
    kept = linears.store(w)
    assert block_format(kept) is Q4_1 and kept.nbytes == w.nbytes * 20 // 128
    q8_0, _ = gguf_weight(300, 128, Q.Q8_0)
    assert block_format(linears.store(q8_0)) is Q8_0
    assert NativeLinears(KERNEL, narrow=False, blocks=compiled).store(w) is w
    assert NativeLinears(KERNEL).store(w) is w  # no compiled block kernels: no blocks
    x = torch.randn(SKINNY_MAX_ROWS_NARROW + 300, 128)
    for rows in (1, SKINNY_MAX_ROWS_NARROW, SKINNY_MAX_ROWS_NARROW + 1, 300):
        got = linears.linear(x[:rows].view(1, rows, 128), kept)
        assert got.shape == (1, rows, 300)
        want = x[:rows] @ w.T
        if rows <= SKINNY_MAX_ROWS_NARROW:  # the kernel: x rounded in two 8-bit parts
            error = (got[0].double() - x[:rows].double() @ w.double().T).abs()
            assert (error <= two_part_bound(x[:rows], w)).all()
        else:  # torch's GEMM on the exact values
            torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-5)
    assert calls == [1, SKINNY_MAX_ROWS_NARROW]  # more rows: torch's GEMM on the values


@needs_kernel
def test_a_tied_embedding_kept_in_blocks_looks_up_its_values() -> None:
    w, _ = gguf_weight(50, 64, Q.Q8_0)
    embed = VocabParallelEmbedding(50, 64, torch.float32)
    embed.weight.data = kept(w)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(embed(ids), w[ids])


@needs_kernel
def test_what_is_kept_is_described_in_a_line() -> None:
    q4_1, q8_0 = (requantize(gguf_weight(64, 128, kind)[0]) for kind in (Q.Q4_1, Q.Q8_0))
    assert q4_1 is not None and q8_0 is not None
    line = describe_blocks([q4_1, torch.ones(3), q8_0])
    assert line is not None and "(Q4_1, Q8_0): 2 tensors" in line
    assert f"{(q4_1.nbytes + q8_0.nbytes) / 2**20:.1f} MiB (as float32: 0.1 MiB)" in line
    assert describe_blocks([torch.ones(3, 4)]) is None
