"""The native backend: the compiled CPU kernels (pipeserve/kernels) over the paged KV cache.

Prompt chunks in bfloat16 or float32 read their whole KV along the request's slot runs in one
flash-style pass that stays in cache and uses every thread (`device.native_prefill_kernel`:
AVX512-BF16 or AVX2); decode steps likewise, all of a batch's steps in one call
(`paged_decode_attention`). Where no prefill kernel builds for the dtype or head dim, the
registry pairs this backend's decode steps with the torch backend's prompt chunks (split.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pipeserve.backends.base import (
    AttentionBackend,
    DecodeStack,
    DirectKernels,
    LinearKernels,
    NormKernels,
    QKNorms,
    Rope,
    Segment,
    StackLayer,
)
from pipeserve.device import (
    cpu_native_bf16,
    native_block_kernels,
    native_decode_kernel,
    native_decode_stack,
    native_index_scores,
    native_index_topk,
    native_index_topk_segments,
    native_norm_kernels,
    native_prefill_kernel,
    native_rope_store,
    native_skinny_linear,
    native_sparse_expanded_kernel,
    native_sparse_kernel,
)
from pipeserve.layers import batch_invariant
from pipeserve.layers.block_quant import (
    BLOCK_FORMATS,
    GROUP,
    block_format,
    group,
)
from pipeserve.op_profile import region

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention


@dataclass
class RunChunk:
    q_start: int
    q_len: int
    prefix_len: int
    runs: torch.Tensor  # [r, 2] (first slot, length): positions [0, prefix + q_len)


@dataclass
class RunSteps:
    """All single-token steps of a batch: every step's runs of KV slots, read in one pass."""

    rows: torch.Tensor  # [b] token rows of the steps
    runs: torch.Tensor  # [r, 2] (first slot, length), steps in order
    offsets: torch.Tensor  # [b + 1] where each step's runs start
    leading: bool  # the rows are 0 .. b - 1: a batch of steps alone reads and writes q whole


@dataclass
class NativeMeta:
    chunks: list[RunChunk]
    decode: RunSteps | None


# Rows of x up to which a linear layer's product runs on the compiled skinny kernel rather
# than torch's GEMM (decode steps of a few requests; see NativeLinears). benchmarks/
# skinny_linear.py, Zen 3, one thread, SmolLM2's shapes, float32 weights against torch's
# float32 GEMM: at 8 rows 0.8-0.9x on qkv/o/down, 1.8x on gate_up, 2.2x on the LM head, 1.5x
# over a whole step's products; at 16 rows 1.0x overall. bfloat16 weights kept for float32
# activations: 1.3-1.8x over a step's products up to 16 rows (the kernel's most).
SKINNY_MAX_ROWS = 8
SKINNY_MAX_ROWS_NARROW = 16
# bfloat16 activations and weights on a CPU with native bf16 products (AVX512-BF16, AMX),
# where torch's GEMM runs on bf16 dot-product instructions and the kernel on float32 FMAs.
# Zen 4, one thread, the bench model's decode against the kernel for up to 8 rows
# (benchmarks/compare_commits.py): torch's GEMM from 3 rows on 0.86x at 4 requests; from 5
# rows on 0.97x at 6; from 7 on 1.09x at 8 (two threads: 1.01x). SmolLM2's shapes alone
# (benchmarks/skinny_linear.py) put the break-even near 3 rows: in a whole step the kernel
# holds on longer.
SKINNY_MAX_ROWS_BF16_NATIVE = 6
SKINNY_DTYPES = (torch.float32, torch.bfloat16)
# A narrow weight on torch's GEMM: for a few rows of x (batched decode steps) widened a block
# of about WIDEN_BLOCK_BYTES at a time, so the widened copy stays in cache and only the
# narrow bytes come from memory; from WIDEN_WHOLE_MIN_ROWS rows on (prompt chunks, whose GEMM
# outweighs the copy by far and runs best as one call) widened whole for the one product.
# Zen 3, one thread, the bench model's linears at 64 rows: 1 MiB blocks 0.83x the time of
# float32 weights (256 KiB blocks 1.14x: too many small GEMMs; whole 1.10-1.18x); 8 prompts
# of 2048 (compare_commits): blocks for every size made the prompts 1.3x slower.
WIDEN_BLOCK_BYTES = 1 << 20
WIDEN_WHOLE_MIN_ROWS = 256


class NativeNorms(NormKernels):
    """RMSNorm and its residual add in one compiled pass per row (kernels/rms_norm.cpp: a
    norm's ~10 torch ops in one call; Zen 4, one thread, 1-8 rows of 576: 2-4 us against
    17-23), bitwise the torch ops' results in float32 and bfloat16: the same roundings, and
    the sum of squares added in the order of torch's own sum (rows of fewer than 32,768
    values, which torch never splits between threads)."""

    def __init__(self, rms_norm: Callable[..., torch.Tensor], add_rms_norm: Callable[..., Any]):
        self.native_rms_norm, self.native_add_rms_norm = rms_norm, add_rms_norm

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if _norm_fits(x, weight):
            return self.native_rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _norm_fits(x, weight, residual):
            return self.native_add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)


_SPLIT_ROW = 32768  # at::internal::GRAIN_SIZE: a reduction at least this long may run split


def _norm_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    same = residual is None or (
        residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    )
    return (
        same
        and x.dtype in SKINNY_DTYPES
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[0]
        and x.shape[-1] < _SPLIT_ROW  # a longer row torch may sum in two threads' halves
    )


class BlockKernels(NamedTuple):
    """The compiled kernels for weights kept in GGUF blocks (kernels/skinny_linear.cpp)."""

    linear: Callable[..., torch.Tensor]  # (x, blocks, format code, bias) -> y
    dequantize: Callable[..., torch.Tensor]  # (blocks, format code) -> float32 values
    requantize: Callable[..., torch.Tensor | None]  # (float32 weight, format code) -> blocks


class NativeLinears(LinearKernels):
    """Decode-sized products on the compiled skinny kernel (kernels/skinny_linear.cpp: each
    weight byte read once, at the memory's speed, threads over output rows, no packing): up
    to SKINNY_MAX_ROWS rows of x, SKINNY_MAX_ROWS_NARROW for a narrow weight, `bf16_max_rows`
    for bfloat16 x and weight (SKINNY_MAX_ROWS_BF16_NATIVE on CPUs with native bf16); larger
    ones on torch's GEMM, as are all of a deterministic run's forward (its prompt rows run
    there, so a decode row must too).

    `narrow`: float32 runs keep a linear weight whose values are all a GGUF dequantisation
    (Q4_1, Q8_0: a GGUF checkpoint's, found again by `blocks.requantize`) in those blocks
    (rows grouped for the kernel: layers/block_quant.py), multiplied by integer products on x
    rounded in two 8-bit parts, and one whose values are all bfloat16 numbers (a bfloat16
    checkpoint's) in bfloat16, else all float16 numbers (a float16 checkpoint's or F16
    GGUF's) in float16, the same products: a quarter or half of the bytes a decode step
    reads. Torch's GEMM gets such a weight's exact values rebuilt (a group of rows at a
    time: WIDEN_BLOCK_BYTES)."""

    def __init__(
        self,
        kernel: Callable[..., torch.Tensor],
        narrow: bool = True,
        bf16_max_rows: int = SKINNY_MAX_ROWS,
        blocks: BlockKernels | None = None,
    ) -> None:
        self.kernel = kernel
        self.narrow = narrow
        self.bf16_max_rows = bf16_max_rows  # rows of bfloat16 x with a bfloat16 weight
        self.blocks = blocks  # the compiled kernels for weights kept in GGUF blocks

    def store(self, weight: torch.Tensor, keep_blocks: bool = True) -> torch.Tensor:
        if not self.narrow or weight.dtype != torch.float32 or weight.dim() != 2:
            return weight
        if keep_blocks and self.blocks is not None:
            for fmt in BLOCK_FORMATS:  # the smallest first
                if (found := self.blocks.requantize(weight, fmt.code)) is not None:
                    return group(found, fmt)
        for dtype in (torch.bfloat16, torch.float16):
            narrow = weight.to(dtype)
            if torch.equal(narrow.float(), weight):
                return narrow
        return weight

    def kernel_rows(
        self, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> int:
        """The most rows of x in `dtype` whose product with `weight` (as `store` keeps it)
        runs on a compiled skinny kernel; 0: none does (torch's GEMM). A deterministic run
        (batch_invariant) puts every product on torch's GEMM whatever this says."""
        if dtype not in SKINNY_DTYPES or (bias is not None and bias.dtype != dtype):
            return 0
        if block_format(weight) is not None:
            return SKINNY_MAX_ROWS_NARROW
        if weight.dtype not in (*SKINNY_DTYPES, torch.float16) or not weight.is_contiguous():
            return 0
        if weight.dtype != dtype:
            return SKINNY_MAX_ROWS_NARROW
        return self.bf16_max_rows if dtype == torch.bfloat16 else SKINNY_MAX_ROWS

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Up to `kernel_rows` rows on the skinny kernels (integer products for a weight in
        GGUF blocks); more on torch's GEMM, over the exact values of a weight kept narrower
        than x rebuilt by the compiled pass (WIDEN_BLOCK_BYTES; whole at WIDEN_WHOLE_MIN_ROWS
        rows and above: the built-in model, 64 requests, Zen 4: decode 1.24x rebuilding whole
        weights)."""
        rows = x.numel() // max(1, x.shape[-1])
        fmt = block_format(weight)
        if rows <= self.kernel_rows(x.dtype, weight, bias) and not batch_invariant.enabled():
            flat = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])
            if fmt is None:
                y = self.kernel(flat, weight, bias)
            else:
                assert self.blocks is not None, "a weight in blocks is stored by linears with them"
                y = self.blocks.linear(flat, weight, fmt.code, bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
        if fmt is not None:
            blocks = self.blocks
            assert blocks is not None, "a weight in blocks is stored by linears with them"
            return _widened_linear(
                x, weight, bias, lambda w: blocks.dequantize(w, fmt.code).to(x.dtype)
            )
        if weight.dtype != x.dtype:
            return _widened_linear(x, weight, bias, lambda w: w.to(x.dtype))
        return super().linear(x, weight, bias)


def _widened_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    widen: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x W^T (+ b) for a weight kept narrower than x (bfloat16, or GGUF blocks), widened by
    `widen` (rows of the weight -> their values in x's dtype) for torch's GEMM (see
    WIDEN_BLOCK_BYTES)."""
    flat = x.reshape(-1, x.shape[-1])
    m, n, k = flat.shape[0], weight.shape[0], flat.shape[1]
    if m >= WIDEN_WHOLE_MIN_ROWS:
        y = torch.nn.functional.linear(flat, widen(weight), bias)
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        # whole groups of a weight kept in blocks (layers/block_quant.py), ~WIDEN_BLOCK_BYTES
        rows = max(2, WIDEN_BLOCK_BYTES // (k * x.element_size() * GROUP)) * GROUP
        for s in range(0, n, rows):
            y[:, s : s + rows] = flat @ widen(weight[s : s + rows]).T
        if bias is not None:
            y += bias
    return y.view(*x.shape[:-1], n)


class NativeBackend(AttentionBackend):
    """`deterministic`: one-token prompt chunks run the prefill kernel too, so a prompt token
    is computed alike however it was chunked (batch-invariant inference)."""

    name = "native"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self.rope_store = native_rope_store()
        self.kernels = DirectKernels(
            native_prefill_kernel,
            native_sparse_kernel(),
            native_sparse_expanded_kernel(),
            native_index_scores(),
            native_index_topk(),
            native_index_topk_segments(),
        )
        if not deterministic and (norms := native_norm_kernels()) is not None:
            self.norms = NativeNorms(*norms)  # deterministic runs: every batch's norms alike
        if (skinny := native_skinny_linear()) is not None:
            bf16_rows = SKINNY_MAX_ROWS_BF16_NATIVE if cpu_native_bf16() else SKINNY_MAX_ROWS
            blocks = native_block_kernels()
            self.linears = NativeLinears(
                skinny,
                not deterministic,
                bf16_rows,
                None if blocks is None else BlockKernels(*blocks),
            )

    def rope_and_store(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rope: Rope,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        norms: QKNorms | None,
    ) -> torch.Tensor | None:
        """Rotary and the KV write in one compiled call (kernels/rope_store.cpp, bitwise the
        torch ops): float32 or bfloat16 layers rotated over the whole head; Qwen3's q/k norms
        first, by this backend's norms (bitwise the torch ops too)."""
        q, k, v = qkv
        if (
            self.rope_store is None
            or q.dtype not in SKINNY_DTYPES
            or cache[0].dtype != q.dtype  # the kernel checks the rest, and refuses
            or rope[0].shape[-1] != q.shape[-1]
        ):
            return None
        if norms is not None:
            q_weight, k_weight, eps = norms
            if q_weight.dtype != q.dtype or k_weight.dtype != q.dtype:
                return None  # the torch ops promote; the kernel takes one dtype
            q = self.norms.rms_norm(q.contiguous(), q_weight, eps)
            k = self.norms.rms_norm(k.contiguous(), k_weight, eps)
        return self.rope_store(q, k, v, *rope, *cache, slots)

    def decode_stack(self, layers: list[StackLayer]) -> DecodeStack | None:
        """The layers as one compiled call per decode step (kernels/decode_stack.cpp), where
        every product has a skinny kernel, the rotary spans whole heads of the pool's dtype,
        and the run is not deterministic; batches of up to the fewest rows any of its
        products takes there (NativeStack.run)."""
        build = native_decode_stack()
        linears = self.linears
        if build is None or self.deterministic or not isinstance(linears, NativeLinears):
            return None
        dtype = layers[0].input_norm.dtype
        rows = min(
            linears.kernel_rows(dtype, w, b)
            for layer in layers
            for w, b in (
                (layer.qkv, layer.qkv_bias),
                (layer.o, None),
                (layer.gate_up, None),
                (layer.down, None),
            )
        )
        norm_weights = [
            w
            for layer in layers
            for w in (layer.input_norm, layer.post_norm, *(layer.qk_norms or ())[0::2])
        ]
        if (
            rows == 0
            or self.rope_store is None
            or not isinstance(self.norms, NativeNorms)  # the stack's norms are the compiled one
            or any(t.dtype != dtype for layer in layers for t in layer.cache)
            or any(w.dtype != dtype or w.shape[0] >= _SPLIT_ROW for w in norm_weights)
        ):
            return None
        stack = build()
        for layer in layers:
            weights = [layer.qkv, layer.o, layer.gate_up, layer.down]
            stack.add_layer(
                layer.input_norm,
                layer.input_eps,
                layer.post_norm,
                layer.post_eps,
                weights,
                [0 if (f := block_format(w)) is None else f.code for w in weights],
                layer.qkv_bias,
                *(layer.qk_norms or (None, 0.0, None, 0.0)),
                layer.heads,
                layer.kv_heads,
                layer.head_dim,
                layer.scale,
                *layer.cache,
            )
        return NativeStack(stack, rows, layers[0].head_dim, dtype)

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> NativeMeta:
        chunks: list[RunChunk] = []
        rows: list[int] = []
        steps: list[list[tuple[int, int]]] = []  # each step's runs (its prefix and itself)
        step_lens: list[int] = []
        for i, (q_start, q_len, prefix_len, runs) in enumerate(segments):
            if q_len > 1 or (self.deterministic and i in prompts):
                table = torch.tensor(runs, dtype=torch.long).view(-1, 2)
                chunks.append(RunChunk(q_start, q_len, prefix_len, table))
                continue
            rows.append(q_start)
            steps.append(runs)
            step_lens.append(prefix_len + 1)
        if not rows:
            return NativeMeta(chunks, None)
        return NativeMeta(chunks, _run_steps(rows, steps, step_lens, device))

    def attend(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        fresh: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor,
    ) -> None:
        if (steps := meta.decode) is not None:
            if steps.leading and q.shape[0] == steps.rows.shape[0]:  # no gather, no scatter
                out.copy_(self._decode(layer, q, k_cache, v_cache, steps))
            else:
                out[steps.rows] = self._decode(layer, q[steps.rows], k_cache, v_cache, steps)
        for p in meta.chunks:
            rows = slice(p.q_start, p.q_start + p.q_len)
            prefill = native_prefill_kernel(q.dtype)
            assert prefill is not None
            out[rows] = prefill(q[rows], k_cache, v_cache, p.runs, p.prefix_len, layer.scale)

    def _decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: RunSteps,
    ) -> torch.Tensor:
        b, d = q.shape[0], layer.head_dim
        kernel = native_decode_kernel()
        assert kernel is not None
        q = q.reshape(b, layer.num_kv_heads, layer.group, d)  # GQA: a group shares its KV head
        o = kernel(q.contiguous(), k_cache, v_cache, plan.runs, plan.offsets, layer.scale)
        return o.reshape(b, layer.num_heads, d)


class NativeStack:
    """A stage's layers compiled as one call (NativeBackend.decode_stack), for batches of
    decode steps alone (the layer-by-layer path takes the rest)."""

    def __init__(self, stack: Any, rows: int, head_dim: int, dtype: torch.dtype) -> None:
        self.stack, self.rows, self.head_dim, self.dtype = stack, rows, head_dim, dtype

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        meta: Any,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        steps = meta.decode if isinstance(meta, NativeMeta) and not meta.chunks else None
        n = hidden.shape[0]
        if (
            steps is None
            or not steps.leading
            or n != steps.rows.shape[0]
            or n > self.rows
            or hidden.dtype != self.dtype
            or rope[0].shape[-1] != self.head_dim
            or batch_invariant.enabled()
        ):
            return None
        with region("decode_stack"):
            return self.stack.run(hidden, residual, *rope, slots, steps.runs, steps.offsets)


def _run_steps(
    rows: list[int], steps: list[list[tuple[int, int]]], lengths: list[int], device: torch.device
) -> RunSteps:
    offsets = [0]
    for step in steps:
        offsets.append(offsets[-1] + len(step))
    flat = torch.tensor([r for step in steps for r in step], dtype=torch.long).view(-1, 2)
    ends = torch.tensor(offsets, dtype=torch.long)
    covered = torch.cat([flat.new_zeros(1), flat[:, 1].cumsum(0)])[ends]
    if not torch.equal(covered.diff(), torch.tensor(lengths)):  # the kernel reads them all
        raise ValueError("a decode step's KV runs do not cover exactly its sequence")
    row_ids = torch.tensor(rows, dtype=torch.long, device=device)
    return RunSteps(row_ids, flat, ends, rows == list(range(len(rows))))
