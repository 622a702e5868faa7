"""Typed point-to-point messages between adjacent pipeline stages.

A message is a fixed-size header (type, sizes), the batch description (pickled plain data,
as bytes) and the activations `hidden_states` and `residual` [tokens, hidden]. Sends are
non-blocking: `send()` returns a handle that keeps the payload alive until `wait()` at the
sender's commit point. Each link has its own process group, so a stage's receiving thread
and its sending thread never share one.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from pipeserve.scheduler.batch import ScheduledBatch

HEADER = 6  # type, meta bytes, tokens, hidden size, has residual, dtype code
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class MsgType(IntEnum):
    PROXY = 1  # a micro-batch's description and activations for the next stage
    SHUTDOWN = 2
    TIMELINE = 3  # report the recorded timeline, then pass it on
    PROFILE = 4  # first stage only: time prefills for dynamic chunking


@dataclass
class StageMessage:
    kind: MsgType
    batch: ScheduledBatch | None = None
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    profile: tuple[list[int], list[tuple[int, int]]] | None = None  # lengths, KV slot runs


class PendingSend:
    """Handles of an in-flight send; holds the tensors until the sends complete."""

    def __init__(self, works: list[Any], payload: list[torch.Tensor]) -> None:
        self._works, self._payload = works, payload

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._payload = [], []


def send(msg: StageMessage, dst: int, group: Any, device: torch.device) -> PendingSend:
    meta = pickle.dumps(msg.batch) if msg.batch is not None else b""
    tensors = [t for t in (msg.hidden, msg.residual) if t is not None]
    hidden = msg.hidden
    header = torch.tensor(
        [
            int(msg.kind),
            len(meta),
            hidden.shape[0] if hidden is not None else 0,
            hidden.shape[1] if hidden is not None else 0,
            int(msg.residual is not None),
            DTYPES.index(hidden.dtype) if hidden is not None else 0,
        ],
        dtype=torch.long,
        device=device,
    )
    payload = [header]
    if meta:
        payload.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
    payload += [t.contiguous() for t in tensors]
    works = [dist.isend(t, dst, group=group) for t in payload]
    return PendingSend(works, payload)


def recv(src: int, group: Any, device: torch.device) -> StageMessage:
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.recv(header, src, group=group)
    kind, meta_len, tokens, hidden_size, has_residual, dtype_code = header.tolist()
    if MsgType(kind) is not MsgType.PROXY:
        return StageMessage(MsgType(kind))
    meta = torch.empty(meta_len, dtype=torch.uint8, device=device)
    dist.recv(meta, src, group=group)
    batch = pickle.loads(meta.cpu().numpy().tobytes())
    dtype = DTYPES[dtype_code]
    hidden = torch.empty(tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src, group=group)
    residual = None
    if has_residual:
        residual = torch.empty(tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(residual, src, group=group)
    return StageMessage(MsgType.PROXY, batch, hidden, residual)
