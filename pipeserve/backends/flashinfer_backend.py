"""The FlashInfer backend: paged attention through FlashInfer (--attention-backend flashinfer;
CUDA, float16/bfloat16). It plans as the torch backend does and replaces its two kernels.

The pool keeps each layer's K and V as [kv_heads, slots, head_dim], which is FlashInfer's HND
layout for one request's keys: a long run of slots is handed over in place (a strided view; the
kernel reads the head and token strides) and the gathered rest as one tensor, each part through
`single_prefill_with_kv_cache(..., return_lse=True)`, GQA inside the kernel. A prompt chunk also
attends to itself from its fresh k/v ([n, kv_heads, d], NHD, causal: query and key lengths are
equal, so FlashInfer's bottom-right causal mask is the engine's top-left one). The parts merge by
log-sum-exp (`merge_partials`); FlashInfer's is base 2, the engine's natural.

A decode step is the same call with one query, per request (its long runs, then its gathered
keys). FlashInfer's batch wrappers (one plan for all requests of a step) would launch fewer
kernels; the single-request calls are the part of its API that is stable across versions.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from pipeserve.backends.torch_backend import (
    StepPlan,
    TorchBackend,
    cached_parts,
    in_place_parts,
)
from pipeserve.layers.attention_parts import KVPart, merge_partials

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention

LN2 = math.log(2.0)


class FlashInferBackend(TorchBackend):
    """The torch backend's plans, FlashInfer's kernels over a flashinfer module."""

    name = "flashinfer"

    def __init__(self, module: ModuleType) -> None:
        super().__init__("cuda")
        self.fi = module

    def attend_part(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: str,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, d] over one KV part (k/v [kv_heads, L, d] for "HND", [L, kv_heads, d]
        for "NHD") -> (out [n, heads, d], lse [n, heads] float32, natural log)."""
        out, lse = self.fi.single_prefill_with_kv_cache(
            q, k, v, causal=causal, kv_layout=layout, sm_scale=scale, return_lse=True
        )
        return out, lse * LN2

    def prompt_chunk(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: list[KVPart],
    ) -> torch.Tensor:
        """q [n, heads, d], the chunk's k/v [n, kv_heads, d], cached parts [kv_heads, L_i, d]
        -> [n, heads, d]."""
        q, scale = q.contiguous(), layer.scale
        parts = [self.attend_part(q, kc, vc, "HND", False, scale) for kc, vc in cached]
        parts.append(self.attend_part(q, k.contiguous(), v.contiguous(), "NHD", True, scale))
        return merge_partials(parts)

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
    ) -> torch.Tensor:
        """q [b, heads, d] of the plan's steps -> [b, heads, d]: per step, its long runs in
        place and the gathered rest (`in_place_parts`)."""
        out = torch.empty_like(q)
        for i in range(len(plan.runs)):
            qi = q[i : i + 1].contiguous()
            parts = [
                self.attend_part(qi, kc, vc, "HND", False, layer.scale)
                for kc, vc in cached_parts(k_cache, v_cache, *in_place_parts(plan, i))
            ]
            out[i] = merge_partials(parts)[0]
        return out
