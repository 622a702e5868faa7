"""Shard linear in the engine: the named projections of a stage's layers live whole on one CP
rank each and travel to the others by broadcast just before they are needed
(pipeserve/context_parallel/shard_linear plans when; this module moves the tensors).

A parameter that is not held here keeps its place in the model with an empty tensor; a
receiver allocates the buffer when the broadcast is launched and frees it after the layer ran.
The broadcasts run on a process group of their own, so a layer's K/V exchange never queues
behind a prefetch. Every CP rank runs every forward, so the broadcasts match across ranks.

The bytes of parameters this rank holds are counted as they come and go; `peak_bytes` is the
most held at any point since loading (the checkpoint is read whole, then the layers not held
here are freed at once, before any forward), `expected_peak_bytes` the plan's closed form plus
every parameter that is not sharded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeserve.context_parallel.shard_linear import ShardLinearPlan
from pipeserve.timeline import now, record_comm


class LayerShards:
    def __init__(
        self,
        model: nn.Module,
        layers: list[nn.Module],
        names: list[str],
        warm_layers: int,
        rank: int,
        group: Any,
        group_ranks: list[int],
    ) -> None:
        self.plan = ShardLinearPlan(len(layers), len(group_ranks), min(warm_layers, len(layers)))
        self.rank, self.group, self.group_ranks = rank, group, group_ranks
        self.params: list[list[nn.Parameter]] = [_named_params(layer, names) for layer in layers]
        self.shapes = [[p.shape for p in ps] for ps in self.params]
        self.layer_bytes = sum(p.nbytes for p in self.params[0])
        self.pending: dict[int, list[Any]] = {}
        total = sum(p.nbytes for p in model.parameters())
        self.other_bytes = total - sum(p.nbytes for ps in self.params for p in ps)
        self.held_bytes = self.peak_bytes = total
        held = self.plan.between_forwards(rank)
        for i in range(len(layers)):
            if i not in held:
                self._free(i)
        self.peak_bytes = self.held_bytes  # the peak counts from here (loading read all)

    @property
    def expected_peak_bytes(self) -> int:
        return self.other_bytes + self.plan.expected_peak_bytes(self.rank, self.layer_bytes)

    def before(self, i: int) -> None:
        """Layer i (the stage's i-th) is about to run: start the prefetch its start triggers,
        then wait for its own projections if they are coming by broadcast."""
        for j in self.plan.layers_to_prefetch_at(i):
            self._broadcast(j)
        for j in self.plan.layers_to_wait_before(i, self.rank):
            works = self.pending.pop(j, [])
            if works:
                waited = now()
                for w in works:
                    w.wait()
                record_comm("shard_linear_wait", waited, j)

    def after(self, i: int) -> None:
        for j in self.plan.layers_to_release_after(i, self.rank):
            self._free(j)

    def _broadcast(self, j: int) -> None:
        start = now()
        owner = self.plan.owner(j)
        mine = owner == self.rank
        works = []
        for p, shape in zip(self.params[j], self.shapes[j], strict=True):
            if not mine and p.numel() == 0:  # a receiver holds the buffer from now on
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
                self._count(p.nbytes)
            works.append(
                dist.broadcast(p.data, self.group_ranks[owner], group=self.group, async_op=True)
            )
        sent = self.layer_bytes * (len(self.group_ranks) - 1) if mine else 0
        record_comm("shard_linear_launch", start, j, sent, 0 if mine else self.layer_bytes)
        if mine:
            return  # the source's copy is never rewritten: nothing to wait for
        self.pending[j] = works

    def _free(self, j: int) -> None:
        for p in self.params[j]:
            if p.numel():
                self._count(-p.nbytes)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _count(self, delta: int) -> None:
        self.held_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)


def _named_params(layer: nn.Module, names: list[str]) -> list[nn.Parameter]:
    """The parameters of the modules named `names` (e.g. qkv_proj, o_proj) inside a layer."""
    found = []
    for name in names:
        modules = [m for path, m in layer.named_modules() if path.split(".")[-1] == name]
        if not modules:
            known = sorted({path.split(".")[-1] for path, _ in layer.named_modules() if path})
            raise ValueError(
                f"--shard-linear-layers {name}: no module of that name in a decoder layer "
                f"(its modules: {', '.join(known)})"
            )
        found += [p for m in modules for p in m.parameters(recurse=False)]
    return found
