"""Every message between the engine's processes, declared once as frozen dataclasses, and
the channels that carry them; `wire` encodes and decodes all of them from these
annotations (msgpack, never pickle).

    STAGE        scheduler -> first pipeline stage (ZMQ), stage -> stage (the P2P meta):
                 a ScheduledBatch to run, or Shutdown, ReportTimeline, Profile
    STATUS       worker -> scheduler: Status(rank, Ready | BatchResult | Heartbeat | Failed
                 | Refused | TimelinePiece | ProfileTimes)
    TO_ENGINE    HTTP process -> engine process: AddRequest, Abort, StopEngine
    FROM_ENGINE  engine process -> HTTP process: EngineReady, Deltas, Stats, Fatal
    KV_CONTROL   a decode engine -> its ranks' KV receivers (pd/transfer.py): OpenRoom,
                 CloseRoom, AskDropped; answered on KV_ANSWER by RoomAnswer, and RoomDone
                 once a room's KV has all arrived
    KV_HEADER    a prefill worker -> a decode rank: the header of a kv message (its KV
                 bytes follow in frames of their own)
    PD_PREFILL   a decode server's engine -> a prefill server: the body of `POST
                 /pd/prefill` (PrefillRequest)

The data objects inside them (ScheduledBatch, BatchResult, StreamDelta, Event,
SamplingParams, ...) live with the code that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeserve.distributed.wire import (
    BATCH_MAX_BYTES,
    ENGINE_LINK_MAX_BYTES,
    KV_HEADER_MAX_BYTES,
    PD_CONTROL_MAX_BYTES,
    STATUS_MAX_BYTES,
    Channel,
    FreeText,
)
from pipeserve.scheduler.batch import BatchResult, Run, ScheduledBatch
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.timeline import Event

# --- the batch channel and the P2P meta --------------------------------------------------


@dataclass(frozen=True)
class Shutdown:
    """Stop, after passing this on down the pipeline."""


@dataclass(frozen=True)
class ReportTimeline:
    """Report the recorded timeline, then pass this on (so every earlier batch is in it)."""


@dataclass(frozen=True)
class Profile:
    """Time these (prefix, chunk) points on this stage's layers for dynamic chunking, using
    the KV slots lent in `runs`; report, then pass this on."""

    points: list[tuple[int, int]]
    runs: list[Run]


StageCommand = ScheduledBatch | Shutdown | ReportTimeline | Profile

# --- status: worker -> scheduler ---------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """A worker has loaded its share of the model."""

    num_pages: int
    partition: list[int]  # layers of each pipeline stage
    stage: int
    tp_rank: int
    ep_rank: int
    expert_bytes: int
    tp_all_reduce: str  # which all-reduce this rank's TP group uses (for the log)
    # prefill/decode disaggregation, decode side: where this rank takes KV ("" elsewhere)
    kv_endpoint: str = ""
    kv_control: str = ""
    kv_control_secret: str = ""  # the control link's secret, random per receiver (hex)


@dataclass(frozen=True)
class Heartbeat:
    """Alive (sent every HEARTBEAT_S, idle or not)."""


@dataclass(frozen=True)
class Failed:
    """The worker stops on an error: its traceback."""

    text: FreeText


@dataclass(frozen=True)
class Refused:
    """A start-up check refused the settings: its message, for the user."""

    message: FreeText


@dataclass(frozen=True)
class TimelinePiece:
    """Up to TIMELINE_PIECE of a rank's recorded events; `last` ends its report."""

    events: list[Event]
    last: bool


@dataclass(frozen=True)
class ProfileTimes:
    """A stage's seconds for each profile point."""

    stage: int
    seconds: list[float]


StatusBody = Ready | BatchResult | Heartbeat | Failed | Refused | TimelinePiece | ProfileTimes


@dataclass(frozen=True)
class Status:
    rank: int
    body: StatusBody


# --- the HTTP process <-> the engine process ---------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """A request, validated where it entered. `transfer`: a prefill server's request sends
    its prompt's KV there (a peer's JSON: the engine checks it against its own layout).
    `prefill_url`: a decode server's request whose prompt that prefill server computes (the
    engine reserves its pages, calls it, and decodes once the KV is in)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    top_logprobs: int
    transfer: dict[str, Any] | None = None
    prefill_url: str | None = None


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class StopEngine:
    """Shut the engine (and its workers) down."""


ToEngine = AddRequest | Abort | StopEngine


@dataclass(frozen=True)
class EngineReady:
    context_len: int  # what one request can hold: the model's context, or the KV pool's
    vocab_size: int
    model_path: str


@dataclass(frozen=True)
class Deltas:
    deltas: list[StreamDelta]


@dataclass(frozen=True)
class Stats:
    values: dict[str, Any]


@dataclass(frozen=True)
class Fatal:
    """The engine failed (or did not start): every request fails with this message."""

    message: FreeText


FromEngine = EngineReady | Deltas | Stats | Fatal

# --- prefill/decode disaggregation's KV transfer ------------------------------------------


@dataclass(frozen=True)
class PrefillRequest:
    """A decode server's request that a prefill server compute a prompt, sending its KV to
    `transfer` (checked by the prefill server against its own layout and allowed hosts),
    and answer with the first token."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    top_logprobs: int
    transfer: dict[str, Any]


@dataclass(frozen=True)
class OpenRoom:
    """Hold these slots for one request's KV, for at most `ttl_s`."""

    room: str
    runs: list[Run]
    num_tokens: int
    ttl_s: float


@dataclass(frozen=True)
class CloseRoom:
    room: str


@dataclass(frozen=True)
class AskDropped:
    """How many kv messages has this rank dropped? (answered "dropped")"""


@dataclass(frozen=True)
class RoomAnswer:
    answer: str  # "opened", "closed", "refused" or "dropped"
    room: str  # "" for "dropped"
    dropped: int  # kv messages this rank has dropped so far


@dataclass(frozen=True)
class RoomDone:
    """Every piece of the room's KV has arrived at this rank, at this cost."""

    room: str
    nbytes: int
    wire_s: float
    exposed_s: float


@dataclass(frozen=True)
class KVHeader:
    """Heads [h0, h1) of one layer at the room's `positions` (runs); `sent`: wall time."""

    room: str
    layer: int
    h0: int
    h1: int
    positions: list[Run]
    sent: float


STAGE: Channel[StageCommand] = Channel("batch", BATCH_MAX_BYTES, StageCommand)
STATUS: Channel[Status] = Channel("status", STATUS_MAX_BYTES, Status)
TO_ENGINE: Channel[ToEngine] = Channel("to-engine", ENGINE_LINK_MAX_BYTES, ToEngine)
FROM_ENGINE: Channel[FromEngine] = Channel("from-engine", ENGINE_LINK_MAX_BYTES, FromEngine)
KV_CONTROL: Channel[OpenRoom | CloseRoom | AskDropped] = Channel(
    "kv control", PD_CONTROL_MAX_BYTES, OpenRoom | CloseRoom | AskDropped
)
KV_ANSWER: Channel[RoomAnswer | RoomDone] = Channel(
    "kv answer", PD_CONTROL_MAX_BYTES, RoomAnswer | RoomDone
)
KV_HEADER: Channel[KVHeader] = Channel("kv header", KV_HEADER_MAX_BYTES, KVHeader)
PD_PREFILL: Channel[PrefillRequest] = Channel("pd prefill", ENGINE_LINK_MAX_BYTES, PrefillRequest)
