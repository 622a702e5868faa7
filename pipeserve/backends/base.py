"""The attention-backend interface, and the defaults a backend inherits.

A backend is chosen once per run (registry.py) and then asked, per batch:
- `for_batch(segments)`: the backend of this batch (a split backend may hand the whole batch
  to another, e.g. long prompt chunks to a library kernel);
- `plan(segments, device, dtype, prompts)`: its metadata for the batch (one dataclass per
  backend, built on the host; its tensors are moved to the device field by field), and
  `after_copy(meta)` once they are there;
- per layer, `attend(layer, q, k_cache, v_cache, meta, fresh, out)`: the attention of every
  row of its segments, written into `out`.

It also owns the layers' other per-device kernels: `linears` (the linear layers' and the LM
head's products, `LinearKernels`), `norms` (RMSNorm with its residual add),
`rope_and_store` (q/k norms, rotary and the KV write in one kernel, or None for the torch
ops), `latent_plan`/`latent_decode` (MLA's decode steps all at once, or None),
`latent_prompts` (MLA's prompt chunks on up-projected keys in one launch, or not), and
`kernels` (the compiled kernels MLA, DeepSeek-V3.2's indexer and context parallelism call on
tensors of their own, outside a batch's plan; `DirectKernels`).
`graph_buffers` says whether decode steps can be captured in a CUDA graph and owns the
buffers a captured step reads. `decode_stack(layers)`: a stage's dense Llama-family layers as
one kernel for decode-only batches (one native call a step instead of ~10 a layer), or None.

Segments: (first row, rows, prefix length, KV runs) per request of the batch; a row is a
token of the batch, a prompt chunk's rows attend to its prefix and causally to themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from pipeserve.layers import batch_invariant
from pipeserve.scheduler.batch import Run

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention

Segment = tuple[int, int, int, list[Run]]  # (first row, rows, prefix length, KV runs)
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [tokens, 1, head_dim]
QKNorms = tuple[torch.Tensor, torch.Tensor, float]  # q and k norm weights, their epsilon
Kernel = Callable[..., torch.Tensor]


def _no_prefill(dtype: torch.dtype) -> Kernel | None:
    return None


@dataclass(frozen=True)
class DirectKernels:
    """Compiled kernels that layers call on tensors of their own rather than through a
    batch's plan; None (and `prefill` giving None): the layer's PyTorch ops run instead.

    - prefill(dtype): dense causal attention over per-head pools [h, L, d] read along slot
      runs (the native prefill kernel's signature): MLA's expanded prompt chunks, context
      parallelism's blocks;
    - sparse_latent / sparse_expanded: DeepSeek-V3.2's sparse attention in latent space, or
      on up-projected keys (layers/mla.py);
    - index_scores / index_topk: V3.2's indexer scores, and its selection fused with them
      (layers/indexer.py); index_topk_segments: the selection of a batch's segments in one
      call."""

    prefill: Callable[[torch.dtype], Kernel | None] = _no_prefill
    sparse_latent: Kernel | None = None
    sparse_expanded: Kernel | None = None
    index_scores: Kernel | None = None
    index_topk: Kernel | None = None
    index_topk_segments: Kernel | None = None


TORCH_KERNELS = DirectKernels()


class NormKernels:
    """RMSNorm computed in float32, the result cast back before the weight is applied, and
    the pre-norm residual step; PyTorch ops (a backend with its own kernels subclasses)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        x = x + residual
        return self.rms_norm(x, weight, eps), x


TORCH_NORMS = NormKernels()


class LinearKernels:
    """y = x W^T (+ b) for the linear layers and the LM head: torch's product (batch-invariant
    inside a deterministic run's forwards), and FP8 block-quantised weights kept in FP8
    through the Triton kernel (kernels/triton_fp8.py). A backend with its own products (a
    CPU GEMV for decode steps, a quantised format) subclasses; the model runner hands the
    run's to every layer once (`layers.linear.use_linear_kernels`), which also lets it choose
    the form a weight is kept in (`store`)."""

    def store(self, weight: torch.Tensor, keep_blocks: bool = True) -> torch.Tensor:
        """The form this run keeps a loaded weight in, which `linear` is then given (the
        weight itself: as loaded, in the compute dtype); `keep_blocks`: a dequantised GGUF
        weight may go back to its blocks (--gguf-weights)."""
        return weight

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return batch_invariant.linear(x, weight, bias)

    def fp8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        """x W^T for a float8_e4m3fn weight whose rows start at `row_offset` of the weight its
        128 x 128 block scales `scale_inv` cover (no bias)."""
        from pipeserve.kernels.triton_fp8 import fp8_linear

        return fp8_linear(x, weight, scale_inv, row_offset=row_offset)


TORCH_LINEARS = LinearKernels()


class StackLayer(NamedTuple):
    """A dense Llama-family decoder layer as a whole-stack decode kernel takes it: pre-norm
    residual steps, fused QKV (optional bias, optional per-head q/k norms) with rotary over
    the whole head, GQA over the layer's cache, o_proj, SwiGLU; weights as the layer's
    linears keep them."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norms: tuple[torch.Tensor, float, torch.Tensor, float] | None  # Qwen3's, with their eps
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    cache: tuple[torch.Tensor, torch.Tensor]  # K and V: [kv_heads, slots, head_dim]


class DecodeStack(Protocol):
    """A stage's layers (StackLayer) run as one kernel."""

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        meta: Any,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stage's layers over a batch (its plan's `meta`, the new tokens' KV `slots`):
        (the last layer's output, the residual stream), or None where this batch does not
        qualify (the layers run one by one)."""
        ...


class GraphBuffers(Protocol):
    """A capturable backend's persistent decode metadata: what a captured step reads. A
    step's plan reaches it moved into the graphs' input buffer (`staged`, not expanded):
    the plan's tensors whose size the row count fixes lie at the same place for every step
    of that many rows, so a graph may read them there; what varies is expanded or copied
    into buffers the backend owns (`load`)."""

    def meta(self, rows: int, staged: Any) -> Any:
        """The metadata a captured step of `rows` rows reads, `staged` being such a step's
        plan in the input buffer (a bucket's padding step, at capture)."""
        ...

    def holds(self, keys: int, rows: int) -> bool:
        """Whether a step of `rows` rows reading `keys` keys in all fits the buffers."""
        ...

    def load(self, staged: Any, rows: int) -> None:
        """Make a step's plan, as copied into the input buffer, what `meta(rows, ...)` reads
        (on the current stream, no host sync)."""
        ...


class AttentionBackend(ABC):
    """See the module's docstring. A plain class, not a dataclass: it travels inside the
    attention plan, whose tensors are moved to the device field by field."""

    name: str = "?"
    norms: NormKernels = TORCH_NORMS
    linears: LinearKernels = TORCH_LINEARS
    kernels: DirectKernels = TORCH_KERNELS
    capturable = False  # decode steps can be captured in a CUDA graph (`graph_buffers`)

    def for_batch(self, segments: list[Segment]) -> AttentionBackend:
        return self

    @abstractmethod
    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> Any:
        """The batch's metadata, built on `device` (the host where the runner copies it);
        `prompts`: the indices of segments that are prompt chunks (a one-token prompt chunk
        matters to batch-invariant kernels)."""

    def after_copy(self, meta: Any) -> Any:
        """The metadata once on the device (e.g. page tables expanded from slot runs)."""
        return meta

    @abstractmethod
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
        """out[rows] for the rows of the planned segments: q [tokens, heads, d] over the
        cache [kv_heads, slots, d] (the batch's new keys written already); `fresh`: those
        new keys and values [tokens, kv_heads, d] where the caller has them."""

    def rope_and_store(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rope: Rope,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        norms: QKNorms | None,
    ) -> torch.Tensor | None:
        """q/k norms, rotary and the KV write in one kernel -> q as attention reads it;
        None: this backend has none for these tensors (the layer runs the torch ops)."""
        return None

    def latent_plan(self, segments: list[Segment], device: torch.device) -> Any | None:
        """MLA: the batch's metadata for `latent_decode` (its decode steps) and
        `latent_prompts` (its expanded prompt chunks), or None (MLA's own paths)."""
        return None

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: Any,
        chosen: torch.Tensor | None,
        scale: float,
        rope_dim: int,
    ) -> torch.Tensor:
        """MLA's absorbed decode steps all at once (see `latent_plan`): Triton's in one
        launch, torch's a call per group of similar lengths."""
        raise NotImplementedError(f"the {self.name} backend has no batched latent decode")

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
        """MLA's expanded prompt chunks of a batch in one launch, over keys and values
        up-projected for them: q [tokens, heads, d + rope]; keys (k_nope [rows, heads, d],
        k_rope [rows, rope] shared by the heads); v [rows, heads, dv]; `spans` place each
        chunk. Writes the chunks' rows of out [tokens, heads, dv] and says True; False: this
        backend has no such launch (MLA attends a chunk at a time)."""
        return False

    def latent_rows(self, meta: Any) -> torch.Tensor | None:
        """The token rows of the decode steps in a `latent_plan` (None: it has none)."""
        raise NotImplementedError(f"the {self.name} backend has no batched latent decode")

    def latent_table(self, meta: Any) -> StepTable | None:
        """The decode steps of a `latent_plan` as a page table grouped by length: what
        V3.2's indexer selects all steps over at once (None: it has none, and the indexer
        takes a step at a time)."""
        return None

    def decode_stack(self, layers: list[StackLayer]) -> DecodeStack | None:
        """These layers as one kernel for the decode steps it takes, or None (none here)."""
        return None

    def graph_buffers(self, pool_slots: int, rows: int, device: torch.device) -> GraphBuffers:
        """Persistent decode metadata for CUDA graphs of up to `rows` rows over a pool of
        `pool_slots` slots (a `capturable` backend's)."""
        raise NotImplementedError(f"the {self.name} backend's steps cannot be captured")


def per_head_keys(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """MLA's up-projected keys [L, heads, qk_nope + qk_rope]: each head's k_nope [L, heads,
    qk_nope], then the rope part [L, qk_rope] the heads share."""
    return torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1)], dim=-1)


class ExpandedSpan(NamedTuple):
    """One prompt chunk in a batch's up-projected keys (MLA, `latent_prompts`): its query
    rows [q_start, q_start + q_len) attend causally to key rows [first_key, first_key +
    prefix_len + q_len), its positions 0.. in order."""

    q_start: int
    q_len: int
    prefix_len: int
    first_key: int


@dataclass
class StepTable:
    """A batch's decode steps as a batched backend's page table reads them: step i (token row
    rows[i]) has its positions 0..len-1, its query at the last, cached at slots
    indices[indptr[i]:indptr[i + 1]]. `order` [b] lists the steps longest first and `groups`
    cuts it into ranges (first, end, width) of steps of similar length (`length_groups`), so
    that work padded to a group's longest step stays within twice the steps' own."""

    rows: torch.Tensor  # [b] long
    indptr: torch.Tensor  # [b + 1] int32
    indices: torch.Tensor  # int32
    order: torch.Tensor  # [b] long
    groups: tuple[tuple[int, int, int], ...]


def length_groups(lengths: list[int]) -> tuple[list[int], tuple[tuple[int, int, int], ...]]:
    """(the indices of `lengths` longest first, that order cut into ranges (first, end,
    width): each range as long as its steps padded to its first (its width) cost at most
    twice their own lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, first = [], 0
    while first < len(order):
        width = lengths[order[first]]
        end, total = first + 1, width
        while end < len(order) and (end + 1 - first) * width <= 2 * (total + lengths[order[end]]):
            total += lengths[order[end]]
            end += 1
        groups.append((first, end, width))
        first = end
    return order, tuple(groups)


@dataclass
class AttentionPlan:
    """How one batch's attention runs: its backend and that backend's metadata."""

    backend: AttentionBackend
    meta: Any  # None: nothing planned (MLA's own paths)

    def expanded(self) -> AttentionPlan:
        if self.meta is None:
            return self
        return replace(self, meta=self.backend.after_copy(self.meta))

    @property
    def norms(self) -> NormKernels:
        return self.backend.norms
