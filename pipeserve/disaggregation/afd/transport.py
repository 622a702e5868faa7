"""Rows between the attention (A) and FFN (F) workers of attention-FFN disaggregation, point
to point over the AFD group. Per MoE layer and step each A worker sends every F worker a row
count, then its packed rows (when it has any); the F worker answers with one partial sum per
row. Every pair's messages of a kind travel in the order both sides issue them (one tag per
kind), so A and F only have to agree on the order of layers. A work holds the tensor it
sends or fills until it is done (c10d's works keep their tensors), so callers keep only
the works."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import Work

from pipeserve.distributed.parallel_state import AfdState
from pipeserve.moe.dispatcher.all_to_all import RowLayout

COUNT_TAG, ROWS_TAG, PARTIAL_TAG = 0, 1, 2

# An F worker's experts: (hidden [R, H], weights [R, k], local ids [R, k]) -> [R, H]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def post_rows(
    afd: AfdState, packed: torch.Tensor, counts: Sequence[int], like: torch.Tensor
) -> tuple[list[Work], torch.Tensor]:
    """A side: send each F worker its count and `counts[f]` rows of `packed` (grouped by F
    worker), and post the receives of their partial sums (rows like `like`'s). Returns the
    works and the [R + 1, H] buffer the partial sums land in, in send order, once every
    work is done (the last row stays zero: padding)."""
    rows = packed.shape[0]
    returned = like.new_empty((rows + 1, like.shape[1]))
    returned[rows].zero_()
    sizes = torch.tensor(list(counts), dtype=torch.long, device=packed.device)
    works, start = [], 0
    for f, n in enumerate(counts):
        peer = afd.global_rank(f)
        works.append(isend(sizes[f : f + 1], peer, group=afd.group, tag=COUNT_TAG))
        if n:
            part = slice(start, start + n)
            works.append(isend(packed[part], peer, group=afd.group, tag=ROWS_TAG))
            works.append(irecv(returned[part], peer, group=afd.group, tag=PARTIAL_TAG))
        start += n
    return works, returned


def receive_rows(
    afd: AfdState, layout: RowLayout, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """F side: every A worker's count, then its rows: ([R, nbytes] packed rows by source, rows
    per source)."""
    sizes = torch.empty(afd.attention_size, dtype=torch.long, device=device)
    for work in [
        irecv(sizes[a : a + 1], a, group=afd.group, tag=COUNT_TAG)
        for a in range(afd.attention_size)
    ]:
        work.wait()
    counts = sizes.tolist()
    packed = layout.empty(sum(counts), device)
    works, start = [], 0
    for a, n in enumerate(counts):
        if n:
            works.append(irecv(packed[start : start + n], a, group=afd.group, tag=ROWS_TAG))
        start += n
    for work in works:
        work.wait()
    return packed, counts


def send_partials(afd: AfdState, partials: torch.Tensor, counts: Sequence[int]) -> list[Work]:
    """F side: each A worker's rows' partial sums back, in the order they came."""
    works, start = [], 0
    for a, n in enumerate(counts):
        if n:
            works.append(isend(partials[start : start + n], a, group=afd.group, tag=PARTIAL_TAG))
        start += n
    return works


def isend(tensor: torch.Tensor, peer: int, group: object, tag: int) -> Work:
    work = dist.isend(tensor, peer, group=group, tag=tag)  # type: ignore[arg-type]
    assert work is not None, "both ends of an AFD transfer are in the AFD group"
    return work


def irecv(tensor: torch.Tensor, peer: int, group: object, tag: int) -> Work:
    work = dist.irecv(tensor, peer, group=group, tag=tag)  # type: ignore[arg-type]
    assert work is not None, "both ends of an AFD transfer are in the AFD group"
    return work
