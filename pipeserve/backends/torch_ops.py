"""PyTorch's attention kernels that return the log-sum-exp (softmax attention whose results
over disjoint key sets merge exactly): what the torch backend (torch_backend.py), MLA and
context parallelism compute with.

- CPU: PyTorch's fused CPU kernel (`attention_with_lse`).
- Accelerators (`SdpaAttention`): PyTorch's fused flash or memory-efficient CUDA kernel where it
  takes the inputs (`fused_kernels`), else `chunked_attention_with_lse`, plain PyTorch that holds
  one block of float32 scores at a time, never [heads, queries, keys].

Every branch runs on a CPU in the tests: `SdpaAttention(ops=None)` is the chunked fallback on
CPU tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeserve.device import queues_on_streams
from pipeserve.layers.attention_parts import merge_partials

log = logging.getLogger(__name__)

KEY_BLOCK = 1024  # chunked fallback: keys per block
SCORE_BLOCK_ELEMENTS = 2**24  # chunked fallback: float32 scores of one block (64 MiB)
GRID_LIMIT = 65535  # the fused CUDA kernels put batch and heads on grid dimensions y and z
HALF = (torch.float16, torch.bfloat16)
GATHER_BLOCK_BYTES = 2**27  # the gathered attention calls: rows gathered per block of queries

Attention = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # attention_with_lse's signature


# -- PyTorch's fused CUDA kernels -----------------------------------------------------------


@dataclass(frozen=True)
class SdpaOps:
    """PyTorch's fused CUDA attention kernels that return the log-sum-exp (private aten ops,
    the same schemas from torch 2.1 through 2.13; called with keyword arguments)."""

    flash: Any = torch.ops.aten._scaled_dot_product_flash_attention
    efficient: Any = torch.ops.aten._scaled_dot_product_efficient_attention
    # variable-length sequences packed along the rows, causal aligned bottom-right (a query
    # of a sequence with more keys than queries sees the keys before its own position too)
    flash_varlen: Any = torch.ops.aten._flash_attention_forward


CUDA_OPS = SdpaOps()


def fused_kernels(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
) -> list[str]:
    """The fused kernels that take these inputs, best first: "flash" (float16/bfloat16, no
    mask, equal head dims up to 256, causal only for Lq == Lk: its causal mask is aligned
    bottom-right, the engine's top-left) and "efficient" (also float32 and masks; top-left
    causal); none for GQA head counts, empty inputs, misaligned strides or a causal flag with
    a mask."""
    if q.dim() != 4 or q.shape[2] == 0 or k.shape[2] == 0 or (causal and mask is not None):
        return []
    if not q.shape[:2] == k.shape[:2] == v.shape[:2] or max(q.shape[:2]) > GRID_LIMIT:
        return []
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (*HALF, torch.float32):
        return []
    if not all(_aligned(t) for t in (q, k, v)):
        return []
    d, dv = q.shape[-1], v.shape[-1]
    flash = q.dtype in HALF and mask is None and d == dv <= 256
    if causal and q.shape[2] != k.shape[2]:
        flash = False
    return ["flash", "efficient"] if flash else ["efficient"]


def _aligned(t: torch.Tensor) -> bool:
    """Rows of 8-element multiples, every stride too (where the size is above 1), the last
    one 1, the data 16-byte aligned: what the fused kernels load in vectors."""
    if t.stride(-1) != 1 or t.shape[-1] % 8 or t.data_ptr() % 16:
        return False
    return all(s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1)


class SdpaAttention:
    """`attention_with_lse` on an accelerator: the first fused kernel of `fused_kernels` that
    takes the inputs, else `chunked_attention_with_lse`. A fused kernel that raises on inputs
    the rule let through (an older GPU, a build without it) is not asked again for that kind of
    input in this process. ops=None: the chunked fallback only."""

    def __init__(self, ops: SdpaOps | None = CUDA_OPS) -> None:
        self.ops = ops
        self.refused: set[tuple[Any, ...]] = set()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kinds = fused_kernels(q, k, v, causal, mask) if self.ops is not None else []
        for kind in kinds:
            key = (kind, q.dtype, q.shape[-1], v.shape[-1], causal, mask is not None)
            if key in self.refused:
                continue
            try:
                return self._fused(kind, q, k, v, causal, scale, mask)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:
                log.warning("torch's %s attention kernel refused %s: %s", kind, key[1:], e)
                self.refused.add(key)
        return chunked_attention_with_lse(q, k, v, causal, scale, mask)

    def _fused(
        self,
        kind: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.ops is not None
        if kind == "flash":
            res = self.ops.flash(
                q, k, v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale
            )
        else:
            bias = None if mask is None else efficient_bias(mask, q, k)
            res = self.ops.efficient(
                q,
                k,
                v,
                attn_bias=bias,
                compute_log_sumexp=True,
                dropout_p=0.0,
                is_causal=causal,
                scale=scale,
            )
        out, lse = res[0], res[1]
        return out, lse[..., : q.shape[2]]  # the efficient kernel pads Lq to a multiple of 32


def efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A mask as the memory-efficient kernel takes it: additive in q's dtype, [B, H, Lq, Lk]
    (broadcast dimensions stay strided views), every row starting 16-element aligned (the
    compact mask padded and sliced back, as torch's own SDPA does)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        mask = additive.masked_fill_(~mask, float("-inf"))
    mask = mask.to(q.dtype).expand(*mask.shape[:-1], lk)
    strides = [s for s, n in zip(mask.stride()[:-1], mask.shape[:-1], strict=True) if n > 1]
    if mask.stride(-1) != 1 or lk % 16 or any(s % 16 for s in strides) or mask.data_ptr() % 16:
        padded = mask.new_zeros(*mask.shape[:-1], lk + -lk % 16)
        padded[..., :lk] = mask
        mask = padded[..., :lk]
    return mask.expand(b, h, lq, lk)


# -- the chunked fallback -------------------------------------------------------------------


def chunked_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp in plain PyTorch, holding one block of float32
    scores [B, H, block_q, block_k] at a time: the keys walked in blocks merged by a running
    max and sum (flash attention's recurrence), the queries in blocks. q [B, H, Lq, D],
    k [B, Hk, Lk, D], v [B, Hk, Lk, Dv], H a multiple of Hk (query head j reads key head
    j // (H / Hk)); mask broadcastable to [B, H, Lq, Lk], bool (True: may read) or additive;
    causal: query i reads keys 0..i (top-left) -> out [B, H, Lq, Dv] in q's dtype, lse
    [B, H, Lq] float32. A query that may read no key gets zeros and lse -inf."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    bk = max(1, min(lk, block_k or KEY_BLOCK))
    bq = max(1, min(lq, block_q or SCORE_BLOCK_ELEMENTS // (b * h * bk)))
    full = None if mask is None else mask.expand(b, h, lq, lk)
    out = q.new_empty(b, h, lq, v.shape[-1])
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    for s in range(0, lq, bq):
        e = min(s + bq, lq)
        part = None if full is None else full[:, :, s:e]
        o, m = _query_block(q[:, :, s:e], k, v, s, causal, scale, part, bk)
        out[:, :, s:e], lse[:, :, s:e] = o, m
    return out, lse


def _query_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries at positions first.. (q [B, H, n, D]) over every key block. A key head's
    query heads are folded into its rows, so keys are never repeated."""
    b, h, n, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = h // hk
    rows = q.reshape(b, hk, group * n, d).float() * scale  # row: (head in group, query)
    run_max = torch.full((b, hk, group * n), float("-inf"), device=q.device)
    run_sum = torch.zeros(b, hk, group * n, device=q.device)
    acc = torch.zeros(b, hk, group * n, dv, device=q.device)
    end = min(lk, first + n) if causal else lk  # later keys: no query of the block reads them
    for ks in range(0, end, block_k):
        ke = min(ks + block_k, end)
        scores = torch.matmul(rows, k[:, :, ks:ke].float().transpose(-1, -2))
        _mask_block(scores.view(b, hk, group, n, ke - ks), first, ks, causal, mask)
        new_max = torch.maximum(run_max, scores.amax(-1))
        shift = new_max.masked_fill(new_max == float("-inf"), 0.0)  # nothing readable yet
        probs = scores.sub_(shift[..., None]).exp_()
        alpha = torch.exp(run_max - shift)
        run_sum = run_sum * alpha + probs.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(probs, v[:, :, ks:ke].float())
        run_max = new_max
    lse = run_max + torch.log(run_sum)  # -inf where no key was readable
    out = acc / run_sum.masked_fill(run_sum == 0, 1.0)[..., None]
    return out.view(b, h, n, dv).to(q.dtype), lse.view(b, h, n)


def _mask_block(
    scores: torch.Tensor, first: int, ks: int, causal: bool, mask: torch.Tensor | None
) -> None:
    """scores [B, Hk, group, n, bk] of queries first.. and keys ks..: -inf where not readable."""
    n, bk = scores.shape[-2:]
    if causal and ks + bk - 1 > first:  # some key of the block lies after some query
        q_pos = torch.arange(first, first + n, device=scores.device)[:, None]
        k_pos = torch.arange(ks, ks + bk, device=scores.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
    if mask is not None:
        block = mask[..., ks : ks + bk].unflatten(1, (scores.shape[1], scores.shape[2]))
        if block.dtype == torch.bool:
            scores.masked_fill_(~block, float("-inf"))
        else:
            scores.add_(block)


SDPA = SdpaAttention()  # the process's accelerator kernels (remembers what they refused)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores, so partial results
    over disjoint key sets can be merged exactly. q [B, H, Lq, D], k/v [B, H, Lk, D] ->
    out [B, H, Lq, D], lse [B, H, Lq] (float32). `causal` aligns the mask top-left. CPU:
    PyTorch's fused CPU kernel; elsewhere PyTorch's fused CUDA kernels or a chunked fallback
    that never holds [Lq, Lk] scores (`SdpaAttention`)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse
    return SDPA(q, k, v, causal, scale, mask)


# -- MLA's absorbed attention: one key head, whose keys are whole latent rows ---------------


def gathered_latent_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    rank: int,
    scale: float,
    keys_read: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query's heads over its own rows of `rows`, gathered: q [n, h, W] (absorbed
    queries); rows [N, W] (keys are whole rows, values their first `rank` values); slots
    [n, k] (the rows each query reads, -1 for none) -> [n, h, rank]. The rows are gathered
    for a block of queries at a time (GATHER_BLOCK_BYTES) and the padding masked, so no
    [n, N] mask exists. keys_read: an int64 counter [1] the (query, row) pairs read are
    added to."""
    n, h, w = q.shape
    out = q.new_empty(n, h, rank)
    per = max(1, GATHER_BLOCK_BYTES // (max(slots.shape[1], 1) * w * q.element_size()))
    for i in range(0, n, per):
        chosen = slots[i : i + per]
        valid = chosen >= 0
        kv = rows[chosen.clamp_min(0)]  # [b, k, W]
        mask = padding_mask(valid, q.dtype)
        if mask is not None:
            mask = mask[:, None, None, :]  # broadcast over heads
        o, _ = attention_with_lse(
            q[i : i + per, None], kv[:, None], kv[:, None], False, scale, mask
        )
        out[i : i + per] = o[:, 0, :, :rank]
        if keys_read is not None:
            keys_read += valid.sum()
    return out


def latent_over_parts(q: torch.Tensor, parts: list[torch.Tensor], scale: float) -> torch.Tensor:
    """One query's heads (q [1, h, W]) over every row of `parts` ([len_i, W] each, keys and
    values alike: views of the cache read in place, or a gathered rest), part by part,
    merged by log-sum-exp -> [1, h, W]."""
    heads = q.reshape(1, 1, q.shape[1], q.shape[2])
    partials = [
        attention_with_lse(heads, p[None, None], p[None, None], False, scale) for p in parts
    ]
    return merge_partials(partials)[0, 0][None]


def padding_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A gathered attention's padding: valid [b, k] bool -> additive [b, k] (0 kept, -inf
    not), or None where every key is valid. Only a CPU looks (it reads `valid` for free); on
    a GPU the look would wait for the device, so the mask is always made."""
    if not queues_on_streams(valid.device) and bool(valid.all()):
        return None
    return additive_mask(valid, dtype)[0, 0]


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, L] bool -> [1, 1, rows, L] additive mask (0 kept, -inf not), as the fused kernel
    takes masks in the query's dtype."""
    zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return zeros.masked_fill_(~keep, float("-inf"))[None, None]
