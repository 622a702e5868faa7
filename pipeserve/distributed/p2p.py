"""Typed point-to-point messages between adjacent pipeline stages.

A message is a fixed-size header (sizes), the stage command (a batch description, or a
control message) encoded by `wire` (msgpack, never pickle) and the batch's activations
`hidden_states` and `residual` [tokens, hidden]. Sends are non-blocking: `send()` returns a
handle that keeps the payload alive until `wait()` at the sender's commit point. Each link
has its own process group, so a stage's receiving thread and its sending thread never share
one.

Under TP every rank of a stage holds the same activations, so each sends only its 1/T share
of the rows to its peer in the next stage, whose ranks put the rows back together with one
all-gather inside their stage (on a group of its own, so the receiving thread never shares
a group with the forward's all-reduces): a boundary carries the activations once, not T
times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeserve.device import stream_synchronize
from pipeserve.distributed import wire
from pipeserve.distributed.messages import STAGE, StageCommand
from pipeserve.scheduler.batch import ScheduledBatch

HEADER = 6  # command bytes, tokens, rows sent, hidden size, has residual, dtype code
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class StageMessage:
    """A stage command; a batch's comes with its activations (None on the first stage)."""

    command: StageCommand
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None


@dataclass(frozen=True)
class Shard:
    """Which share of a boundary's rows this rank sends and receives: share `index` of
    `count` (the stage's TP rank and size); `group` reassembles the shares (None: count 1)."""

    index: int = 0
    count: int = 1
    group: Any = None

    def rows(self, tokens: int) -> tuple[int, int]:
        """[start, end) of this share: torch.tensor_split's cut of `tokens` rows."""
        per, extra = divmod(tokens, self.count)
        start = self.index * per + min(self.index, extra)
        return start, start + per + (self.index < extra)


class PendingSend:
    """Handles of an in-flight send; holds the tensors until the sends complete."""

    def __init__(self, works: list[Any], payload: list[torch.Tensor]) -> None:
        self._works, self._payload = works, payload
        self.bytes = sum(t.numel() * t.element_size() for t in payload)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._payload = [], []


def send(
    msg: StageMessage, dst: int, group: Any, device: torch.device, shard: Shard = Shard()
) -> PendingSend:
    """Post the message (this rank's share of the activations rows) without waiting."""
    meta = STAGE.encode(msg.command)
    hidden = msg.hidden
    tokens = hidden.shape[0] if hidden is not None else 0
    start, end = shard.rows(tokens)
    tensors = [t[start:end].contiguous() for t in (msg.hidden, msg.residual) if t is not None]
    tensors = [t for t in tensors if t.numel()]  # an idle rank's step: zero rows, none sent
    header = torch.tensor(
        [
            len(meta),
            tokens,
            end - start,
            hidden.shape[1] if hidden is not None else 0,
            int(msg.residual is not None),
            DTYPES.index(hidden.dtype) if hidden is not None else 0,
        ],
        dtype=torch.long,
        device=device,
    )
    meta_bytes = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device)
    payload = [header, meta_bytes, *tensors]
    works = [dist.isend(t, dst, group=group) for t in payload]
    return PendingSend(works, payload)


def recv(src: int, group: Any, device: torch.device, shard: Shard = Shard()) -> StageMessage:
    """The next message from the previous stage, its activations whole again."""
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.recv(header, src, group=group)
    meta_len, tokens, rows, hidden_size, has_residual, dtype_code = header.tolist()
    command = _recv_command(meta_len, src, group, device)
    if not isinstance(command, ScheduledBatch):
        return StageMessage(command)
    start, end = shard.rows(tokens)
    if end - start != rows:
        raise RuntimeError(
            f"the previous stage sent {rows} of {tokens} activation rows; this rank expected "
            f"{end - start} (share {shard.index} of {shard.count})"
        )
    width = 1 + has_residual
    share = -(-tokens // shard.count)  # rows of the largest share; smaller ones are padded
    parts = torch.empty(width, share, hidden_size, dtype=DTYPES[dtype_code], device=device)
    for i in range(width if rows else 0):
        dist.recv(parts[i, :rows], src, group=group)
    whole = _reassemble(parts, tokens, shard)
    stream_synchronize(device)  # complete before the compute stream (another thread's) reads it
    return StageMessage(command, whole[0], whole[1] if has_residual else None)


def _recv_command(size: int, src: int, group: Any, device: torch.device) -> StageCommand:
    if not 0 < size <= wire.BATCH_MAX_BYTES:
        raise RuntimeError(f"the previous stage announced a {size}-byte stage command")
    meta = torch.empty(size, dtype=torch.uint8, device=device)
    dist.recv(meta, src, group=group)
    return STAGE.decode(meta.cpu().numpy().tobytes())


def _reassemble(parts: torch.Tensor, tokens: int, shard: Shard) -> torch.Tensor:
    """[width, share, hidden] of this rank -> [width, tokens, hidden] of the whole stage."""
    if shard.count == 1:
        return parts[:, :tokens]
    gathered = [torch.empty_like(parts) for _ in range(shard.count)]
    dist.all_gather(gathered, parts, group=shard.group)
    pieces = []
    for i, part in enumerate(gathered):
        start, end = Shard(i, shard.count).rows(tokens)
        pieces.append(part[:, : end - start])
    return torch.cat(pieces, dim=1)
