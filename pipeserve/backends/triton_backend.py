"""The Triton backend: batched paged attention (pipeserve/kernels/triton_attention.py), one
launch per layer for all of a batch's decode steps and one for all its prompt chunks; its
RMSNorm with the residual add in one launch (triton_norm.py), the q/k norms, rotary and KV
write in one (triton_rope.py), MLA's absorbed decode steps in one launch, and MLA's prompt
chunks on up-projected keys in one (`latent_prompts`). CUDA; on a CPU
only under Triton's interpreter (TRITON_INTERPRET=1, the tests' way to run it).

The plan is int32 page tables of one slot per page, read by every layer: the slots of each
step's and each chunk's sequence (its prefix and its new tokens, which the layer writes first).
They are built on the host in O(runs + requests) as their slot runs (`SlotRuns`) and expanded
on the device after the copy (`after_copy`), so no host work grows with the context. Decode
steps read the page table from device memory with a grid that depends on the batch size
only, so they can be captured in CUDA graphs over persistent buffers (`graph_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from pipeserve.backends.base import (
    AttentionBackend,
    DirectKernels,
    ExpandedSpan,
    NormKernels,
    QKNorms,
    Rope,
    Segment,
    StepTable,
)
from pipeserve.backends.step_tables import (
    UNEXPANDED,
    TableSteps,
    chosen_slots,
    decode_steps,
    expanded,
    step_runs,
    step_table,
    table_steps,
)
from pipeserve.device import small_tensor
from pipeserve.layers.attention_parts import SlotRuns
from pipeserve.mem_cache.kv_pool import PAD_SLOT
from pipeserve.scheduler.batch import Run, runs_prefix

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention


@dataclass
class ExtendPlan:
    """All prompt chunks of a batch (one launch per layer): each chunk's KV slots (its prefix
    and itself, in order), its rows and positions, and the launch's blocks of query rows."""

    chunks: torch.Tensor  # [c, 3] int32: (first row, rows, prefix length)
    block_chunk: torch.Tensor  # [blocks] int32: the chunk of each block of query rows
    block_first: torch.Tensor  # [blocks] int32: its first row within the chunk
    slot_runs: SlotRuns | None = None  # the page table until `after_copy`, then:
    kv_indptr: torch.Tensor | None = None  # [c + 1] int32: where each chunk's slots start
    kv_indices: torch.Tensor | None = None  # int32: the slot of every position of each chunk


@dataclass
class TritonMeta:
    extend: ExtendPlan | None
    decode: TableSteps | None
    # MLA's expanded prompt chunks: their launch's tables, made on the device by the first
    # layer that runs them and read by the rest (`latent_prompts`)
    prompt_tables: dict[tuple[ExpandedSpan, ...], tuple[torch.Tensor, ...]] = field(
        default_factory=dict
    )


class TritonNorms(NormKernels):
    """RMSNorm (and its residual add) in one launch where the kernel fits the tensors."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from pipeserve.kernels import triton_norm

        if triton_norm.fits(x, weight):
            return triton_norm.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from pipeserve.kernels import triton_norm

        if triton_norm.fits(x, weight, residual):
            return triton_norm.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)


def _sparse_latent(*args: Any) -> torch.Tensor:
    from pipeserve.kernels.triton_attention import sparse_latent

    return sparse_latent(*args)


class TritonBackend(AttentionBackend):
    name = "triton"
    norms = TritonNorms()
    # V3.2's prompt chunks over their chosen rows (its decode steps: `latent_decode`)
    kernels = DirectKernels(sparse_latent=_sparse_latent)
    capturable = True

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> TritonMeta:
        from pipeserve.kernels.triton_attention import extend_blocks

        steps: list[tuple[int, list[Run]]] = []
        chunks: list[tuple[int, int, int, list[Run]]] = []
        for q_start, q_len, prefix_len, kv_runs in segments:
            covering = runs_prefix(kv_runs, prefix_len + q_len)
            if q_len == 1:
                steps.append((q_start, covering))
            else:
                chunks.append((q_start, q_len, prefix_len, covering))
        extend = None
        if chunks:
            table = torch.tensor([c[:3] for c in chunks], dtype=torch.int32, device=device)
            block_chunk, block_first = extend_blocks([c[1] for c in chunks])
            slots = SlotRuns.build([c[3] for c in chunks], device)
            extend = ExtendPlan(table, block_chunk.to(device), block_first.to(device), slots)
        return TritonMeta(extend, table_steps(steps, device) if steps else None)

    def after_copy(self, meta: Any) -> Any:
        return replace(meta, decode=expanded(meta.decode), extend=expanded(meta.extend))

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
        from pipeserve.kernels.triton_attention import paged_decode, paged_extend

        if (e := meta.extend) is not None:
            assert e.kv_indptr is not None and e.kv_indices is not None, UNEXPANDED
            tables = (e.kv_indptr, e.kv_indices, e.chunks, e.block_chunk, e.block_first)
            paged_extend(q, k_cache, v_cache, *tables, layer.scale, out=out)
        if (p := meta.decode) is not None:
            assert p.kv_indptr is not None and p.kv_indices is not None, UNEXPANDED
            b, d = p.rows.shape[0], layer.head_dim
            qs = q[p.rows].reshape(b, layer.num_kv_heads, layer.group, d)
            o = paged_decode(qs, k_cache, v_cache, p.kv_indptr, p.kv_indices, layer.scale)
            out[p.rows] = o.reshape(b, layer.num_heads, d)

    def rope_and_store(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rope: Rope,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        norms: QKNorms | None,
    ) -> torch.Tensor | None:
        from pipeserve.kernels import triton_rope

        if not triton_rope.fits(qkv, rope, cache, norms):
            return None
        return triton_rope.norm_rope_store(*qkv, *rope, *cache, slots, norms)

    def latent_plan(self, segments: list[Segment], device: torch.device) -> TritonMeta:
        steps = step_runs(segments)
        return TritonMeta(None, decode_steps(steps, device)[0] if steps else None)

    def latent_rows(self, meta: Any) -> torch.Tensor | None:
        return None if meta.decode is None else meta.decode.rows

    def latent_prompts(
        self,
        meta: Any,
        q: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor],
        v: torch.Tensor,
        spans: tuple[ExpandedSpan, ...],
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        from pipeserve.kernels.triton_attention import expanded_block_m, expanded_extend

        tables = meta.prompt_tables.get(spans)
        if tables is None:
            made = expanded_tables(spans, v.shape[0], q.device, expanded_block_m(q.dtype))
            tables = meta.prompt_tables[spans] = made
        expanded_extend(q, *keys, v, tables, scale, out)
        return True

    def latent_table(self, meta: Any) -> StepTable | None:
        return None if meta.decode is None else step_table(meta.decode)

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: Any,
        chosen: torch.Tensor | None,
        scale: float,
        rope_dim: int,
    ) -> torch.Tensor:
        """q [b, 1 key head, heads, latent width] of the decode steps over each step's latent
        rows, or with an indexer's choice `chosen` [b, topk] (positions, -1 for none) over the
        chosen rows only -> [b, heads, kv_lora_rank]."""
        from pipeserve.kernels.triton_attention import paged_decode

        p = meta.decode
        assert p.kv_indptr is not None and p.kv_indices is not None, UNEXPANDED
        indptr, indices = p.kv_indptr, p.kv_indices
        if chosen is not None:
            indptr, indices = chosen_slots(chosen, indptr, indices)
        rows = cache[None]  # one key head: [latent | rope] rows, values their latent part
        o = paged_decode(q, rows, rows, indptr, indices, scale, rope=rope_dim)
        return o[:, 0]  # [b, 1, heads, rank]

    def graph_buffers(self, pool_slots: int, rows: int, device: torch.device) -> TableBuffers:
        return TableBuffers(pool_slots, rows, device)


class TableBuffers:
    """The decode steps' persistent page table. A step's rows and `kv_indptr` are read where
    its copy put them (their size is the bucket's); its slot runs are expanded into one
    persistent `kv_indices`, which holds twice the pool's slots (requests sharing a cached
    prefix list it each; a step with more stays eager: `holds`). A row alone reads its one
    slot: what a padded row reads in every bucket."""

    def __init__(self, pool_slots: int, rows: int, device: torch.device) -> None:
        self.kv_indices = torch.full((2 * pool_slots,), PAD_SLOT, dtype=torch.int32, device=device)
        self.captured: dict[int, TableSteps] = {}

    def meta(self, rows: int, staged: TritonMeta) -> TritonMeta:
        steps, runs = _staged(staged, rows)
        captured = TableSteps(steps.rows, kv_indptr=runs.indptr, kv_indices=self.kv_indices)
        self.captured[rows] = captured
        return TritonMeta(None, captured)

    def holds(self, keys: int, rows: int) -> bool:
        return keys <= self.kv_indices.shape[0]

    def load(self, staged: TritonMeta, rows: int) -> None:
        steps, runs = _staged(staged, rows)
        captured = self.captured[rows]
        assert captured.kv_indptr is not None
        read = ((steps.rows, captured.rows), (runs.indptr, captured.kv_indptr))
        if any(a.data_ptr() != b.data_ptr() for a, b in read):
            raise AssertionError("a step's page table was not copied where its graph reads it")
        runs.expand_into(self.kv_indices)


def expanded_tables(
    spans: tuple[ExpandedSpan, ...], keys: int, device: torch.device, block_m: int
) -> tuple[torch.Tensor, ...]:
    """`expanded_extend`'s tables for chunks placed by `spans`, one after another, in `keys`
    up-projected rows, in blocks of `block_m` query rows: built on the host and queued in
    one copy (kv_indptr, the chunks and their blocks), the rows' own index made on the
    device."""
    from pipeserve.kernels.triton_attention import extend_blocks

    chunk, first = extend_blocks([s.q_len for s in spans], block_m)
    indptr = [s.first_key for s in spans] + [keys]
    chunks = [x for s in spans for x in (s.q_start, s.q_len, s.prefix_len)]
    packed = small_tensor(indptr + chunks + chunk.tolist() + first.tolist(), torch.int32, device)
    c, b = len(spans), chunk.numel()
    indptr_d, chunks_d, chunk_d, first_d = packed.split([c + 1, 3 * c, b, b])
    indices = torch.arange(keys, dtype=torch.int32, device=device)
    return indptr_d, indices, chunks_d.view(c, 3), chunk_d, first_d


def _staged(staged: TritonMeta, rows: int) -> tuple[TableSteps, SlotRuns]:
    """A graph's step: `rows` decode steps and nothing else, with its slot runs."""
    steps = staged.decode
    assert staged.extend is None and steps is not None and steps.slot_runs is not None
    assert steps.rows.shape[0] == rows
    return steps, steps.slot_runs
