"""Backends made of two others.

- `PrefillDecodeSplit`: prompt chunks on one backend, decode steps on another, in the same
  batch (the native CPU decode kernel beside the torch prompt chunks where no native prefill
  kernel builds for the dtype or head dim).
- `LongPromptSplit`: a whole batch on one backend unless it holds a prompt chunk over more
  keys (prefix + chunk) than a limit, then the whole batch on the other (auto on CUDA: the
  Triton kernels, long chunks on the library kernels that read keys fewer times); chosen per
  batch by `for_batch`, norms and rotary with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from pipeserve.backends.base import AttentionBackend, GraphBuffers, Segment

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention


@dataclass
class SplitMeta:
    prefill: Any  # the prompt chunks' backend's metadata, or None
    decode: Any  # the decode steps' backend's metadata, or None


class PrefillDecodeSplit(AttentionBackend):
    """The linears and direct kernels are the decode backend's (the native ones where this
    pairs them with torch prompt chunks), but for the dense prefill kernel, the prompt
    chunks'."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill, self.decode = prefill, decode
        self.name = f"{prefill.name} prompt chunks, {decode.name} decode steps"
        self.linears = decode.linears
        self.kernels = replace(decode.kernels, prefill=prefill.kernels.prefill)

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> SplitMeta:
        chunks = [s for s in segments if s[1] > 1]
        steps = [s for s in segments if s[1] == 1]
        return SplitMeta(
            self.prefill.plan(chunks, device, dtype) if chunks else None,
            self.decode.plan(steps, device, dtype) if steps else None,
        )

    def after_copy(self, meta: Any) -> Any:
        return SplitMeta(
            None if meta.prefill is None else self.prefill.after_copy(meta.prefill),
            None if meta.decode is None else self.decode.after_copy(meta.decode),
        )

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
        for backend, part in ((self.prefill, meta.prefill), (self.decode, meta.decode)):
            if part is not None:
                backend.attend(layer, q, k_cache, v_cache, part, fresh, out)


class LongPromptSplit(AttentionBackend):
    """`primary` for a batch whose prompt chunks read at most `max_keys` keys each, else
    `fallback` for the whole batch."""

    def __init__(self, primary: AttentionBackend, fallback: AttentionBackend, max_keys: int):
        self.primary, self.fallback, self.max_keys = primary, fallback, max_keys
        self.name = f"{primary.name}, prompt chunks over {max_keys} keys on {fallback.name}"
        self.norms = primary.norms
        self.linears = primary.linears
        self.kernels = primary.kernels
        self.capturable = primary.capturable

    def for_batch(self, segments: list[Segment]) -> AttentionBackend:
        long = any(n > 1 and prefix + n > self.max_keys for _, n, prefix, _ in segments)
        return self.fallback if long else self.primary

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> Any:
        raise TypeError(f"{self.name}: plan the backend `for_batch` hands the batch to")

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
        raise TypeError(f"{self.name}: attention runs on the backend `for_batch` hands it to")

    def graph_buffers(self, pool_slots: int, rows: int, device: torch.device) -> GraphBuffers:
        """Decode steps never hold a prompt chunk: they are the primary's."""
        return self.primary.graph_buffers(pool_slots, rows, device)
