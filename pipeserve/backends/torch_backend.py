"""The torch backend: attention over the paged KV cache in PyTorch ops, on any device.

Per request, the keys are: the cached prefix, read from the pool, and (for a prompt chunk)
the chunk itself, causally, straight from the fresh k/v. Long runs of consecutive slots are
read in place as views; the short, scattered rest is gathered into one tensor, so no
request's KV is copied whole.

- long prompt chunks on a CPU (`blockwise_prefill`): per KV head and block of queries, the
  scores against all key parts are written side by side into one buffer, softmaxed once, and
  multiplied back with each part's values (memory-bound at long prefixes).
- otherwise `attention_with_lse` per key part (torch_ops.py: a fused kernel returning the
  log-sum-exp; on CUDA PyTorch's flash/memory-efficient kernels or the chunked fallback), the
  parts merged exactly. Query heads of one KV head (GQA) are folded into the query length, so
  keys are never repeated.
- decode steps: one batched call over their short KV parts (padded gather + mask), plus
  per-request calls over long runs read in place.

A kernel library that reads the same parts (FlashInfer, flashinfer_backend.py) subclasses
this backend and replaces `prompt_chunk` and `decode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipeserve.backends.base import AttentionBackend, Segment
from pipeserve.backends.torch_ops import SDPA, Attention, attention_with_lse
from pipeserve.layers.attention_parts import KVPart, gather_index, merge_partials, split_runs
from pipeserve.scheduler.batch import Run

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention

BLOCKWISE_MIN_TOKENS = 64  # prompt chunks at least this long use the blockwise kernel
SCORE_BLOCK_ELEMENTS = 2**20  # bound on one score buffer (query rows x keys); ~L2-sized blocks


@dataclass
class ChunkPlan:
    """How a prompt chunk reads the cache: long slot runs of its prefix in place, the rest
    gathered."""

    q_start: int
    q_len: int
    prefix_len: int
    views: list[Run] = field(default_factory=list)  # long slot runs of the prefix, in place
    gather: torch.Tensor | None = None  # slot ids of the rest of the prefix


@dataclass
class GatherSteps:
    """All single-token steps of a batch: one batched call over their short KV parts
    (padded gather + mask), plus per-request calls over long runs read in place."""

    rows: torch.Tensor  # [b] token rows of the steps
    gather: torch.Tensor  # [b, n] slot ids of each step's short part (pad: 0)
    mask: torch.Tensor  # [b, 1, 1, n] additive: 0 real keys, -inf padding
    views: list[tuple[int, list[Run]]] = field(default_factory=list)  # (step, long runs)
    lengths: list[int] = field(default_factory=list)  # each step's real keys in `gather`


@dataclass
class TorchMeta:
    chunks: list[ChunkPlan]
    decode: GatherSteps | None


class TorchBackend(AttentionBackend):
    """`dense`: attention_with_lse's kernel (PyTorch's for the device where None);
    `blockwise`: long prompt chunks as plain matmul blocks (faster on a CPU)."""

    name = "torch"

    def __init__(self, device: torch.device | str, dense: Attention | None = None) -> None:
        cpu = torch.device(device).type == "cpu"
        self.dense: Attention = dense or (attention_with_lse if cpu else SDPA)
        self.blockwise = cpu

    def plan(
        self,
        segments: list[Segment],
        device: torch.device,
        dtype: torch.dtype,
        prompts: frozenset[int] = frozenset(),
    ) -> TorchMeta:
        """A single-token step reads every key from the pool (its own was just written; it
        always lands in the gathered part, so no padded row is empty); a prompt chunk reads
        its prefix from the pool and attends to itself from the fresh k/v."""
        chunks: list[ChunkPlan] = []
        rows: list[int] = []
        shorts: list[list[Run]] = []
        views: list[tuple[int, list[Run]]] = []
        for q_start, q_len, prefix_len, runs in segments:
            long, short = split_runs(runs, prefix_len)
            if q_len > 1:
                gather = gather_index([short], device)[0][0] if short else None
                chunks.append(ChunkPlan(q_start, q_len, prefix_len, long, gather))
                continue
            short.append((last_slot(runs, prefix_len + 1), 1))
            if long:
                views.append((len(rows), long))
            rows.append(q_start)
            shorts.append(short)
        if not rows:
            return TorchMeta(chunks, None)
        row_ids = torch.tensor(rows, dtype=torch.long, device=device)
        gather, lengths = gather_index(shorts, device)
        keep = torch.arange(gather.shape[1], device=device)[None, :] < lengths[:, None]
        mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(
            ~keep, float("-inf")
        )
        counts = [sum(n for _, n in short) for short in shorts]
        return TorchMeta(
            chunks, GatherSteps(row_ids, gather, mask[:, None, None, :], views, counts)
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
        if meta.decode is not None:
            steps = meta.decode.rows
            out[steps] = self.decode(layer, q[steps], k_cache, v_cache, meta.decode)
        for p in meta.chunks:
            rows = slice(p.q_start, p.q_start + p.q_len)
            assert fresh is not None, "a torch prompt chunk reads its fresh K/V"
            cached = cached_parts(k_cache, v_cache, p.views, p.gather)
            out[rows] = self.prompt_chunk(layer, q[rows], fresh[0][rows], fresh[1][rows], cached)

    def prompt_chunk(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: list[KVPart],
    ) -> torch.Tensor:
        """q [n, heads, d] of a chunk over its cached parts and causally over itself (k/v
        [n, kv_heads, d]) -> [n, heads, d]."""
        if self.blockwise and q.shape[0] >= BLOCKWISE_MIN_TOKENS:
            return blockwise_prefill(q, k, v, cached, layer.scale)
        return fused_prompt_chunk(layer, q, k, v, cached, self.dense)

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: GatherSteps,
    ) -> torch.Tensor:
        """q [b, heads, d] of the steps -> [b, heads, d]."""
        b, hk, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        q = q.view(b, hk, layer.group, d)
        k = k_cache[:, plan.gather].transpose(0, 1)  # [b, hk, n, d]
        v = v_cache[:, plan.gather].transpose(0, 1)
        o, lse = self.dense(q, k, v, False, layer.scale, plan.mask)
        for i, views in plan.views:
            parts = [
                self.dense(
                    q[i : i + 1],
                    k_cache[None, :, s : s + n],
                    v_cache[None, :, s : s + n],
                    False,
                    layer.scale,
                )
                for s, n in views
            ]
            o[i] = merge_partials([*parts, (o[i : i + 1], lse[i : i + 1])])[0]
        return o.reshape(b, layer.num_heads, d)


def fused_prompt_chunk(
    layer: PagedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached: list[KVPart],
    dense: Attention = attention_with_lse,
) -> torch.Tensor:
    """A short prompt chunk: the fused kernel per cached part, then causally over itself."""
    n, h, hk, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    group = layer.group
    q_heads = q.transpose(0, 1).contiguous()  # [h, n, d]
    q_fold = q_heads.view(1, hk, group * n, d)  # GQA: a KV head's queries in a row
    parts = [dense(q_fold, kc[None], vc[None], False, layer.scale) for kc, vc in cached]
    kr = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, h, n, d]
    vr = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    o, lse = dense(q_heads[None], kr, vr, True, layer.scale)
    parts.append((o.reshape(1, hk, group * n, d), lse.reshape(1, hk, group * n)))
    o = merge_partials(parts)  # [1, hk, group * n, d]
    return o.reshape(h, n, d).transpose(0, 1)


def last_slot(runs: list[Run], num: int) -> int:
    """Slot of position num - 1."""
    for start, length in runs:
        if num <= length:
            return start + num - 1
        num -= length
    raise ValueError("KV runs are shorter than the sequence")


def cached_parts(
    k_cache: torch.Tensor, v_cache: torch.Tensor, views: list[Run], gather: torch.Tensor | None
) -> list[KVPart]:
    parts = [(k_cache[:, s : s + n], v_cache[:, s : s + n]) for s, n in views]
    if gather is not None:
        parts.append((k_cache[:, gather], v_cache[:, gather]))
    return parts


def blockwise_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: list[KVPart], scale: float
) -> torch.Tensor:
    """Causal attention of a prompt chunk over its cached prefix parts and itself.
    q [n, h, d], k/v [n, hk, d] (the chunk), cached parts [hk, len_i, d] -> [n, h, d].

    Computed in float32 whatever the storage: bfloat16 scores (|s| ~ 10 rounded to 0.03)
    measured 2-3x the attention error of PyTorch's fused kernel on the built-in model
    (issue 48), and a CPU without native bf16 multiplies float32 faster anyway. A KV head's
    cached keys and values are widened once for all its query blocks."""
    n, h, d = q.shape
    hk = k.shape[1]
    group = h // hk
    prefix = sum(kc.shape[1] for kc, _ in cached)
    qb = max(16, min(128, SCORE_BLOCK_ELEMENTS // (group * (prefix + n))))
    f32 = torch.float32
    qs = q.to(f32) * scale
    kt, vt = k.transpose(0, 1).to(f32), v.transpose(0, 1).to(f32)  # [hk, n, d]
    future = torch.ones(qb, qb, dtype=torch.bool, device=q.device).triu(1)
    future = future.repeat_interleave(group, dim=0)  # rows are (query, head) pairs
    out = torch.empty_like(q)
    for j in range(hk):
        keys = [kc[j].to(f32) for kc, _ in cached]
        values = [vc[j].to(f32) for _, vc in cached]
        heads = slice(j * group, (j + 1) * group)
        for s in range(0, n, qb):
            e = min(s + qb, n)
            rows = qs[s:e, heads].reshape((e - s) * group, d)
            scores = torch.empty(rows.shape[0], prefix + e, dtype=f32, device=q.device)
            offset = 0
            for kc in keys:
                torch.matmul(rows, kc.T, out=scores[:, offset : offset + kc.shape[0]])
                offset += kc.shape[0]
            torch.matmul(rows, kt[j, :e].T, out=scores[:, prefix:])
            scores[:, prefix + s :].masked_fill_(future[: rows.shape[0], : e - s], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs[:, prefix:], vt[j, :e])
            offset = 0
            for vc in values:
                o += torch.matmul(probs[:, offset : offset + vc.shape[0]], vc)
                offset += vc.shape[0]
            out[s:e, heads] = o.view(e - s, group, d)
    return out
