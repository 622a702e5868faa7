"""The wire format (`distributed/wire.py`, the channels of `distributed/messages.py`):

- every message of every channel round-trips to what was sent (same classes, same field
  types), for a rich example of each message type and for random values of every dataclass;
  a message type without an example fails;
- every dataclass field is on the wire, and a union's message is tagged with its class's place
  in the union;
- free text with lone surrogates still goes out, escaped; encoding what no message holds is a
  WireError;
- bytes that are not one of the channel's messages (random, truncated, extended, pickled,
  type-confused, of a hostile shape, refused by a class's `wire_check`) raise WireError and
  nothing else, on every channel, and whatever does decode is a message the channel sends;
- each channel's byte cap fits what it carries and is enforced by both ends, and decoding
  takes memory bounded by the status channel's cap."""

from __future__ import annotations

import math
import pickle
import random
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import msgpack
import pytest

from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.distributed import messages, wire
from pipeserve.distributed.messages import (
    FROM_ENGINE,
    STAGE,
    STATUS,
    TO_ENGINE,
    Abort,
    AddRequest,
    AskDropped,
    CloseRoom,
    Deltas,
    EngineReady,
    Failed,
    Fatal,
    Heartbeat,
    KVHeader,
    OpenRoom,
    Profile,
    ProfileTimes,
    Ready,
    Refused,
    ReportTimeline,
    RoomAnswer,
    RoomDone,
    Shutdown,
    Stats,
    Status,
    StatusBody,
    StopEngine,
    TimelinePiece,
)
from pipeserve.distributed.wire import MAX_MAP_LEN, MAX_PLAIN_DEPTH, Channel, WireError
from pipeserve.mem_cache.hicache import CacheOp
from pipeserve.scheduler.batch import BatchResult, ReqSlice, ScheduledBatch, TwoBatchSplit
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.timeline import Event

SAMPLING = SamplingParams(
    max_new_tokens=7,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    stop=("\n\n", "é"),
    stop_token_ids=(2, 151645),
    seed=2**63 - 1,
    ignore_eos=True,
)
DESTINATION = KVDestination(
    "0f" * 16, ("tcp://10.0.0.2:5001", "tcp://10.0.0.2:5002"), SideLayout(((0, 4),), 2, 2)
)
DESTINATION_2 = KVDestination(
    "a1" * 16, ("tcp://[::1]:1", "tcp://d:65535"), SideLayout(((0, 1), (1, 3)), 1, 8, True)
)
CACHE_OP = CacheOp("device", "host", (1, 2), (3, 4))
CACHE_OP_2 = CacheOp("host", "disk", (9,), (2**63 - 1,))
BATCH = ScheduledBatch(
    batch_id=41,
    slices=[
        ReqSlice(
            "a",
            [5, 6, 7],
            12,
            [(0, 8), (64, 7)],
            sample=True,
            sampling=SAMPLING,
            return_logprob=True,
            top_logprobs=3,
            logprob_targets=[6, 7],
            chunk_index=2,
        ),
        ReqSlice("b", [-3], 4, [(9, 5)], sample=True, sampling=SamplingParams(), future_slot=3),
        ReqSlice("profile", [1, 2], 0, [], sample=False),
        ReqSlice("pd", [3, 4], 0, [(16, 2)], sample=False, chunk_index=0, kv_dest=DESTINATION),
    ],
    released=["old-1", "old-2"],
    stage_times=[0.012, 0.0131],
    two_batch=TwoBatchSplit(1, 2, False),
    combine_blocks=4,
    micro_batches=[2, 0, 1],
    cache_ops=[CACHE_OP, CACHE_OP_2],
)
RESULT = BatchResult(
    batch_id=41,
    next_token_ids=[17, 3],
    output_logprobs=[-0.25, math.nan],
    prompt_logprobs=[[-1.5, -0.5], [], []],
    top_logprobs=[[(17, -0.25), (4, -2.0), (9, -3.5)], []],
    stage_times=[0.01, 0.02],
)
EVENT = Event("send", 1, 0, 1.7e9, 1.7e9 + 0.003, 41, ["a", "b"], [2, -1], [3, 1], [12, 4], 4096)
DELTA = StreamDelta(
    "a",
    "héllo",
    [17, 3],
    [-0.25, -1.0],
    [[(17, -0.25)], [(3, -1.0)]],
    "stop",
    "\n\n",
    5,
    2,
    4,
    0.031,
    None,
    "invalid",
    3,
)
DELTA_2 = StreamDelta("b", finish_reason="error", matched_stop=151645, error="bad", ttft=None)
POINTS, RUNS = [(0, 256), (1024, 512)], [(0, 4096)]
TRACEBACK = "Traceback (most recent call last):\n  ...\nValueError: boom"

STAGE_MESSAGES: list[Any] = [BATCH, Shutdown(), ReportTimeline(), Profile(POINTS, RUNS)]
STATUS_MESSAGES: list[Any] = [
    Status(
        3,
        Ready(
            num_pages=4096,
            partition=[3, 1],
            stage=1,
            tp_rank=1,
            ep_rank=0,
            expert_bytes=1 << 20,
            tp_all_reduce="shared memory",
            kv_endpoint="tcp://127.0.0.1:40001",
            kv_control="ipc:///tmp/x/kv",
            kv_control_secret="ab" * 32,
        ),
    ),
    Status(1, RESULT),
    Status(2, Heartbeat()),
    Status(0, Failed(TRACEBACK)),
    Status(1, Refused("number of attention heads (4) is not divisible by --tp-size 3")),
    Status(1, TimelinePiece([EVENT, Event("forward", 0, 0, 1.0, 2.0)], True)),
    Status(0, ProfileTimes(1, [0.004, 0.0091])),
]
TO_ENGINE_MESSAGES: list[Any] = [
    AddRequest("rid-1", [1, 2, 3], SAMPLING, True, 5, None),
    AddRequest("rid-2", [1], SamplingParams(), False, 0, DESTINATION.to_json()),
    AddRequest("rid-3", [1, 2], SAMPLING, False, 2, None, "http://10.0.0.3:8000"),
    Abort("rid-1"),
    StopEngine(),
]
FROM_ENGINE_MESSAGES: list[Any] = [
    EngineReady(4096, 512, "/models/tiny"),
    Deltas([DELTA, DELTA_2]),
    Stats(
        {
            "loop": "overlap",
            "overlap_schedule": True,
            "kv_pages_free": 10,
            "stage_busy_s": [0.5, 0.25],
            "tiers": {"host": {"pages": [1, None, -2.5]}},
        }
    ),
    Fatal("engine failed: worker rank 1 exited with code -9"),
]
KV_CONTROL_MESSAGES: list[Any] = [
    OpenRoom("0f" * 16, [(20, 40), (4096, 8)], 48, 3600.0),
    CloseRoom("0f" * 16),
    AskDropped(),
]
KV_ANSWER_MESSAGES: list[Any] = [
    RoomAnswer("opened", "0f" * 16, 3),
    RoomDone("0f" * 16, 1 << 20, 0.25, 0.01),
]
KV_HEADER_MESSAGES: list[Any] = [KVHeader("0f" * 16, 5, 0, 2, [(0, 40), (64, 8)], 1.7e9)]
CHANNELS: list[tuple[Channel[Any], list[Any]]] = [
    (STAGE, STAGE_MESSAGES),
    (STATUS, STATUS_MESSAGES),
    (TO_ENGINE, TO_ENGINE_MESSAGES),
    (FROM_ENGINE, FROM_ENGINE_MESSAGES),
    (messages.KV_CONTROL, KV_CONTROL_MESSAGES),
    (messages.KV_ANSWER, KV_ANSWER_MESSAGES),
    (messages.KV_HEADER, KV_HEADER_MESSAGES),
    (
        messages.PD_PREFILL,
        [messages.PrefillRequest([1, 2, 3], SAMPLING, True, 5, DESTINATION.to_json())],
    ),
]
DECODERS = [channel for channel, _ in CHANNELS]
EXAMPLES = [(channel, msg) for channel, msgs in CHANNELS for msg in msgs]
BODY_TYPES = get_args(StatusBody)
FAILED = BODY_TYPES.index(Failed)
EXAMPLE_IDS = [f"{c.name}-{type(getattr(m, 'body', m)).__name__}" for c, m in EXAMPLES]


def union_members(channel: Channel[Any]) -> tuple[Any, ...]:
    return get_args(channel.kind) or (channel.kind,)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same classes all the way down (a tuple is no list, an int no float, a
    bool no int), NaN equal to NaN and -0.0 apart from 0.0."""
    if type(a) is not type(b):
        return False
    if is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)


def test_same_tells_apart_what_the_round_trips_must_keep() -> None:
    assert same([1, (2.0, math.nan)], [1, (2.0, math.nan)])
    assert same(Status(0, RESULT), pickle.loads(pickle.dumps(Status(0, RESULT))))
    for a, b in [([1], (1,)), (1, 1.0), (True, 1), (0.0, -0.0), (math.nan, 1.0), ({"a": 1}, {})]:
        assert not same(a, b) and not same([a], [b])
    assert not same(Abort("a"), Abort("b")) and not same(Abort("a"), Fatal("a"))


def dataclasses_in(kind: Any, found: set[type] | None = None) -> set[type]:
    """Every dataclass an annotation reaches."""
    found = set() if found is None else found
    if is_dataclass(kind) and isinstance(kind, type):
        if kind not in found:
            found.add(kind)
            for hint in get_type_hints(kind, include_extras=True).values():
                dataclasses_in(hint, found)
    else:
        for arg in get_args(kind):
            dataclasses_in(arg, found)
    return found


def instances(value: Any, found: dict[type, Any]) -> dict[type, Any]:
    """The first instance of each dataclass inside `value`."""
    if is_dataclass(value) and not isinstance(value, type):
        found.setdefault(type(value), value)
        for f in fields(value):
            instances(getattr(value, f.name), found)
    elif isinstance(value, list | tuple):
        for x in value:
            instances(x, found)
    return found


ALL_CLASSES = sorted(
    set().union(*(dataclasses_in(channel.kind) for channel in DECODERS)), key=lambda c: c.__name__
)
EXAMPLE_OF = instances([msg for _, msg in EXAMPLES], {})


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("channel,msgs", CHANNELS, ids=lambda c: getattr(c, "name", ""))
def test_every_message_type_has_an_example(channel: Channel[Any], msgs: list[Any]) -> None:
    """A message type added to a channel must be added to the examples here too."""
    assert {type(m) for m in msgs} == set(union_members(channel))
    if channel is STATUS:
        assert {type(m.body) for m in msgs} == set(BODY_TYPES)


def test_every_channel_has_its_examples() -> None:
    """A channel added to messages.py must be added to the examples here too."""
    declared = {v for v in vars(messages).values() if isinstance(v, Channel)}
    assert declared == set(DECODERS)


def test_every_dataclass_on_the_wire_has_an_example() -> None:
    assert set(EXAMPLE_OF) == set(ALL_CLASSES)
    assert {CacheOp, TwoBatchSplit, KVDestination, SideLayout, Status} <= set(ALL_CLASSES)


@pytest.mark.parametrize("channel,msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_every_message_round_trips(channel: Channel[Any], msg: Any) -> None:
    back = channel.decode(channel.encode(msg))
    assert same(back, msg), (back, msg)
    if msg is not STATUS_MESSAGES[1]:  # the result holds a NaN
        assert back == msg


def tag(channel: Channel[Any], msg: Any) -> int:
    """The tag a message of `channel` goes with: the first element on the wire."""
    return int(msgpack.unpackb(channel.encode(msg))[0])


@pytest.mark.parametrize("channel,msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_a_message_is_tagged_with_its_place_in_the_union(channel: Channel[Any], msg: Any) -> None:
    members = get_args(channel.kind)
    value = msgpack.unpackb(channel.encode(msg))
    if members:
        assert members.index(type(msg)) == value[0]
    elif channel is STATUS:  # a Status: its body is tagged
        assert BODY_TYPES.index(type(msg.body)) == value[1][0]
    else:  # one class: its fields alone
        assert type(value) is list and len(value) == len(fields(msg))


def test_tags_follow_the_order_of_the_unions() -> None:
    assert [tag(STAGE, m) for m in STAGE_MESSAGES] == [0, 1, 2, 3]
    assert [tag(TO_ENGINE, m) for m in TO_ENGINE_MESSAGES] == [0, 0, 0, 1, 2]
    assert [tag(FROM_ENGINE, m) for m in FROM_ENGINE_MESSAGES] == [0, 1, 2, 3]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_on_the_wire(cls: type) -> None:
    """A field added to one of these classes travels without any codec to change."""
    obj = EXAMPLE_OF[cls]
    encoded = wire._codec(cls)[0](obj)
    assert type(encoded) is list and len(encoded) == len(fields(cls))


# random values of every dataclass, from its annotations; the classes whose wire_check would
# refuse random values get one of a few valid instances
FIXED: dict[type, list[Any]] = {
    KVDestination: [DESTINATION, DESTINATION_2],
    CacheOp: [CACHE_OP, CACHE_OP_2],
}
INTS = [0, 1, -1, 2**63 - 1, -(2**63 - 1), -(2**63), 2**31, -(2**32)]
FLOATS = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308, -1e-300]
CHARS = "az09 \n\t\"'\\\x00\x7fé中😀\U0010ffff"


def random_str(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randrange(9)))


def random_scalar(rng: random.Random) -> Any:
    kind = rng.choice([type(None), bool, int, float, str])
    return None if kind is type(None) else random_value(kind, rng)


def random_plain(rng: random.Random, depth: int) -> Any:
    """A plain value for a `dict[str, Any]` at `depth` (the dict itself is at 0)."""
    roll = rng.randrange(4 if depth < MAX_PLAIN_DEPTH else 2)
    if roll == 2:
        return [random_plain(rng, depth + 1) for _ in range(rng.randrange(6))]
    if roll == 3:
        return {random_str(rng): random_plain(rng, depth + 1) for _ in range(rng.randrange(6))}
    return random_scalar(rng)


def random_value(kind: Any, rng: random.Random) -> Any:
    origin, args = get_origin(kind), get_args(kind)
    if kind is type(None):
        return None
    if kind is bool:
        return rng.random() < 0.5
    if kind is int:
        return rng.choice(INTS) if rng.random() < 0.5 else rng.randint(-(2**63), 2**63 - 1)
    if kind is float:
        return rng.choice(FLOATS) if rng.random() < 0.5 else rng.uniform(-1e9, 1e9)
    if kind is str or origin is Annotated:
        return random_str(rng)
    if kind in FIXED:
        return rng.choice(FIXED[kind])
    if is_dataclass(kind):
        hints = get_type_hints(kind, include_extras=True)
        return kind(*[random_value(hints[f.name], rng) for f in fields(kind)])
    if origin in (Union, UnionType):
        return random_value(rng.choice(args), rng)
    if origin is list or (origin is tuple and args[1:] == (...,)):
        return origin(random_value(args[0], rng) for _ in range(rng.randrange(6)))
    if origin is tuple:
        return tuple(random_value(a, rng) for a in args)
    if origin is dict:
        return {random_str(rng): random_plain(rng, 1) for _ in range(rng.randrange(6))}
    raise TypeError(f"no random values of {kind!r}")


RANDOM_CHANNELS = [
    *(Channel(c.__name__, wire.BATCH_MAX_BYTES, c) for c in ALL_CLASSES),
    *DECODERS,
]


@pytest.mark.parametrize("channel", RANDOM_CHANNELS, ids=lambda c: c.name)
def test_random_messages_round_trip(channel: Channel[Any]) -> None:
    for seed in range(40):
        msg = random_value(channel.kind, random.Random(f"{channel.name}-{seed}"))
        back = channel.decode(channel.encode(msg))
        assert same(back, msg), (seed, back, msg)


def test_free_text_with_a_lone_surrogate_still_goes_out_escaped() -> None:
    for body in (Failed("bad stop '\ud800'"), Refused("bad stop '\ud800'")):
        back = STATUS.decode(STATUS.encode(Status(1, body)))
        assert back == Status(1, type(body)("bad stop '\\ud800'"))
    assert FROM_ENGINE.decode(FROM_ENGINE.encode(Fatal("\udc80"))) == Fatal("\\udc80")


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


SP = SamplingParams()


def top_of(rows: list[Any]) -> StreamDelta:
    return StreamDelta("a", token_ids=[1], top_logprobs=[rows])


@pytest.mark.parametrize(
    "channel,msg",
    [
        pytest.param(STAGE, Heartbeat(), id="status-body-on-the-stage-channel"),
        pytest.param(STATUS, Heartbeat(), id="status-body-without-status"),
        pytest.param(STATUS, Status(0, Shutdown()), id="stage-command-as-status-body"),
        pytest.param(TO_ENGINE, Fatal("x"), id="from-engine-message-to-the-engine"),
        pytest.param(FROM_ENGINE, Abort("r"), id="to-engine-message-from-the-engine"),
        pytest.param(STAGE, "shutdown", id="old-command-string"),
        pytest.param(TO_ENGINE, ("add", "r", [1], {}, False, 0), id="old-tuple"),
        pytest.param(
            TO_ENGINE,
            AddRequest("r", [1], SamplingParams(top_k=2**80), False, 0),
            id="int-beyond-64-bits-in-sampling",
        ),
        pytest.param(STATUS, Status("0", Heartbeat()), id="string-for-int"),
        pytest.param(STATUS, Status(True, Heartbeat()), id="bool-for-int"),
        pytest.param(STATUS, Status(1.0, Heartbeat()), id="float-for-int"),
        pytest.param(STATUS, Status(0, ProfileTimes(None, [])), id="none-for-int"),
        pytest.param(TO_ENGINE, AddRequest("r", [1], SP, 1, 0), id="int-for-bool"),
        pytest.param(TO_ENGINE, Abort(None), id="none-for-string"),
        pytest.param(TO_ENGINE, Abort(b"r"), id="bytes-for-string"),
        pytest.param(TO_ENGINE, Abort("\ud800"), id="lone-surrogate-outside-free-text"),
        pytest.param(STATUS, Status(0, Failed(None)), id="none-for-free-text"),
        pytest.param(messages.KV_ANSWER, RoomDone("r", 1, None, 0.0), id="none-for-float"),
        pytest.param(TO_ENGINE, AddRequest("r", [2**63], SP, False, 0), id="int-list-overflow"),
        pytest.param(TO_ENGINE, AddRequest("r", [1.5], SP, False, 0), id="float-in-int-list"),
        pytest.param(TO_ENGINE, AddRequest("r", ["1"], SP, False, 0), id="string-in-int-list"),
        pytest.param(TO_ENGINE, AddRequest("r", "12", SP, False, 0), id="string-for-int-list"),
        pytest.param(TO_ENGINE, AddRequest("r", None, SP, False, 0), id="none-for-int-list"),
        pytest.param(STATUS, Status(0, ProfileTimes(0, ["1"])), id="string-in-float-list"),
        pytest.param(FROM_ENGINE, Deltas([top_of([(1, 0.5, 2)])]), id="rows-of-3-for-pairs"),
        pytest.param(FROM_ENGINE, Deltas([top_of([(0.5, 1)])]), id="float-in-int-column"),
        pytest.param(FROM_ENGINE, Deltas([top_of([1])]), id="int-for-a-row"),
        pytest.param(STAGE, Profile([(0, 1, 2)], []), id="run-of-3"),
        pytest.param(STAGE, Profile([(0, 1, 2), (3,)], []), id="rows-of-3-and-1"),
        pytest.param(FROM_ENGINE, Deltas([DELTA, "x"]), id="string-for-dataclass"),
        pytest.param(
            FROM_ENGINE, Deltas([StreamDelta("a", matched_stop=True)]), id="bool-for-str|int"
        ),
        pytest.param(
            FROM_ENGINE, Deltas([StreamDelta("a", matched_stop=1.0)]), id="float-for-str|int"
        ),
        pytest.param(STAGE, ScheduledBatch(1, [], two_batch=CACHE_OP), id="wrong-dataclass"),
        pytest.param(FROM_ENGINE, Stats({1: 2}), id="int-key"),
        pytest.param(FROM_ENGINE, Stats({"a": {1, 2}}), id="set-in-plain"),
        pytest.param(FROM_ENGINE, Stats({"a": b"x"}), id="bytes-in-plain"),
        pytest.param(FROM_ENGINE, Stats({"a": 2**64}), id="plain-int-beyond-64-bits"),
        pytest.param(FROM_ENGINE, Stats({"a": "\ud800"}), id="plain-lone-surrogate"),
        pytest.param(FROM_ENGINE, Stats({"a": nested(MAX_PLAIN_DEPTH)}), id="plain-too-deep"),
        pytest.param(FROM_ENGINE, Stats([("a", 1)]), id="list-for-dict"),
        pytest.param(
            messages.KV_ANSWER, RoomDone("r", 1, 2**1024, 0.0), id="int-too-big-for-a-float"
        ),
        pytest.param(
            messages.KV_ANSWER,
            RoomDone("r", 1, "1.5", 0.0),
            id="string-for-float",
        ),
        pytest.param(
            messages.KV_ANSWER,
            RoomDone("r", 1, True, 0.0),
            id="bool-for-float",
        ),
        pytest.param(
            TO_ENGINE,
            AddRequest("r", b"\x01" * 8, SP, False, 0),
            id="bytes-for-int-list",
        ),
    ],
)
def test_encoding_what_no_message_holds_is_a_wire_error(channel: Channel[Any], msg: Any) -> None:
    with pytest.raises(WireError):
        channel.encode(msg)


def test_a_bool_inside_a_packed_int_list_goes_as_its_int() -> None:
    """A packed list's container is checked, not each element (that would be a Python loop
    over every token of a prompt): a bool inside is the int it is in arithmetic."""
    msg = TO_ENGINE.decode(TO_ENGINE.encode(AddRequest("r", [True, 5], SP, False, 0)))
    assert isinstance(msg, AddRequest)
    assert msg.input_ids == [1, 5] and type(msg.input_ids[0]) is int


class Unsendable:
    pass


@dataclass(frozen=True)
class WithASet:
    ids: set[int]


@dataclass
class WithAComputedField:
    a: int
    b: int = field(init=False, default=0)


@dataclass(frozen=True)
class WithAPostInit:
    a: int

    def __post_init__(self) -> None:  # would run again on every decode
        pass


@dataclass(frozen=True, kw_only=True)
class KeywordsOnly:
    a: int


@pytest.mark.parametrize(
    "kind",
    [
        dict[int, int],
        set[int],
        Unsendable,
        WithASet,
        WithAComputedField,
        WithAPostInit,
        KeywordsOnly,
        bytes,
        Any | int,
    ],
)
def test_a_channel_the_codec_cannot_carry_fails_when_it_is_made(kind: Any) -> None:
    with pytest.raises(TypeError):
        Channel("bad", 1 << 10, kind)


# --- malformed input --------------------------------------------------------------------------

VALID = [channel.encode(msg) for channel, msg in EXAMPLES]
CONFUSERS: list[Any] = [
    None,
    True,
    -1,
    2**64 - 1,
    -(2**63),
    1.5,
    math.nan,
    "x",
    "",
    b"\x00" * 7,
    b"\xff" * 8,
    [],
    {},
    [[1]],
    [0, []],
    {"k": 1},
    msgpack.ExtType(5, b"x"),
]


def decodes_or_wire_error(data: bytes) -> None:
    """Every channel's decoder gives WireError or a message that channel sends itself."""
    for channel in DECODERS:
        try:
            msg = channel.decode(data)
        except WireError:
            continue
        assert type(msg) in union_members(channel)
        assert same(channel.decode(channel.encode(msg)), msg)


def paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, list):
        for i, x in enumerate(value):
            yield from paths(x, (*path, i))
    elif isinstance(value, dict):
        for k, x in value.items():
            yield from paths(x, (*path, k))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = list(value) if isinstance(value, list) else dict(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def place(cls: type, name: str) -> int:
    return [f.name for f in fields(cls)].index(name)


def test_random_bytes_raise_only_wire_errors() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        decodes_or_wire_error(rng.randbytes(rng.randrange(1, 64)))
    for _ in range(1000):  # valid msgpack headers first, random after: deeper into decoders
        head = rng.choice(
            [
                [0x92, rng.randrange(8)],
                [0x92, rng.randrange(8), 0x90 + rng.randrange(16)],
                [0x92, rng.randrange(128), 0x92, rng.randrange(8)],
                [0x92, 0x00, 0x9C, 0x29, 0x94, 0xA1, 0x61, 0xC4, 0x08],
            ]
        )
        decodes_or_wire_error(bytes(head) + rng.randbytes(rng.randrange(48)))


def test_truncated_and_extended_messages_are_wire_errors() -> None:
    for data in VALID:
        for channel in DECODERS:
            for cut in range(len(data)):
                with pytest.raises(WireError):
                    channel.decode(data[:cut])
            for extra in (b"\x00", b"\xc0", b"\x90"):
                with pytest.raises(WireError):
                    channel.decode(data + extra)


@pytest.mark.parametrize(
    "payload",
    [
        Status(0, Heartbeat()),
        Status(0, Failed("boom")),
        BATCH,
        Shutdown(),
        RESULT,
        AddRequest("r", [1], SamplingParams(), False, 0),
        Fatal("x"),
        Deltas([DELTA]),
        ("heartbeat", 0, None),
        "shutdown",
    ],
    ids=lambda p: type(p).__name__,
)
def test_pickles_are_wire_errors(payload: Any) -> None:
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        for channel in DECODERS:
            with pytest.raises(WireError):
                channel.decode(pickle.dumps(payload, protocol=protocol))


def test_type_confused_values_raise_only_wire_errors() -> None:
    for data in VALID:
        value = msgpack.unpackb(data, raw=False)
        for path in paths(value):
            for new in CONFUSERS:
                decodes_or_wire_error(msgpack.packb(replaced(value, path, new)))


@pytest.mark.parametrize("tag", [99, len(BODY_TYPES), -1, -(2**63), 2**64 - 1, True, 1.0, "1"])
def test_an_unknown_tag_is_a_wire_error(tag: Any) -> None:
    for channel in DECODERS:
        for value in ([tag, []], [0, [tag, []]]):
            with pytest.raises(WireError):
                channel.decode(msgpack.packb(value))


@pytest.mark.parametrize(
    "path,new",
    [
        ((place(ReqSlice, "kv_dest"), place(KVDestination, "room")), "zz" * 16),
        ((place(ReqSlice, "kv_dest"), place(KVDestination, "room")), "0F" * 16),
        ((place(ReqSlice, "kv_dest"), place(KVDestination, "endpoints")), ["tcp://a:1"]),
        ((place(ReqSlice, "kv_dest"), place(KVDestination, "endpoints"), 0), "ipc:///x"),
        ((place(ReqSlice, "kv_dest"), place(KVDestination, "layout"), 1), 0),
    ],
    ids=["bad-room", "upper-case-room", "too-few-endpoints", "bad-endpoint", "tp-0"],
)
def test_a_slice_with_a_bad_kv_destination_is_a_wire_error(path: tuple[int, ...], new: Any) -> None:
    """KVDestination.wire_check runs on decoding: the destination a prefill worker sends KV to
    is one the HTTP check would have accepted."""
    value = msgpack.unpackb(STAGE.encode(BATCH))
    at = (1, place(ScheduledBatch, "slices"), 3, *path)
    with pytest.raises(WireError, match="destination|endpoint|layout"):
        STAGE.decode(msgpack.packb(replaced(value, at, new)))


@pytest.mark.parametrize(
    "name,new",
    [
        ("dst", "device"),
        ("src", "gpu"),
        ("dst_pages", (3,)),
        ("src_pages", (0, 1)),
        ("dst_pages", (-4, 3)),
    ],
    ids=["equal-tiers", "unknown-tier", "unpaired-pages", "page-0", "negative-page"],
)
def test_a_bad_cache_op_is_a_wire_error(name: str, new: Any) -> None:
    """CacheOp.wire_check runs on decoding."""
    value = msgpack.unpackb(STAGE.encode(BATCH))
    bad = wire._codec(CacheOp)[0](CACHE_OP)
    bad[place(CacheOp, name)] = wire._codec(get_type_hints(CacheOp)[name])[0](new)
    at = (1, place(ScheduledBatch, "cache_ops"), 0)
    with pytest.raises(WireError, match="cache op"):
        STAGE.decode(msgpack.packb(replaced(value, at, bad)))


STATS = tag(FROM_ENGINE, Stats({}))
ADD = msgpack.unpackb(TO_ENGINE.encode(TO_ENGINE_MESSAGES[0]))


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 100_000,
        b"\xdd\xff\xff\xff\xff",
        b"\xdb\xff\xff\xff\xff",
        b"\xc6\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        msgpack.packb({i: i for i in range(5)}),
        msgpack.packb([STATS, [{1: 1}]]),
        msgpack.packb([STATS, [{str(i): i for i in range(MAX_MAP_LEN + 1)}]]),
        msgpack.packb([0, [BODY_TYPES.index(Heartbeat), nested(8)]]),
        msgpack.packb([STATS, [{"a": nested(MAX_PLAIN_DEPTH)}]]),
        msgpack.packb([STATS, [{"a": {"b": {"c": {"d": {"e": 1}}}}}]]),
        msgpack.packb(replaced(ADD, (1, place(AddRequest, "transfer")), {"a": nested(10)})),
    ],
    ids=[
        "deep",
        "huge-array",
        "huge-string",
        "huge-bytes",
        "huge-map",
        "int-keys",
        "int-keys-in-stats",
        "big-map",
        "nested",
        "nested-plain",
        "nested-plain-maps",
        "nested-transfer",
    ],
)
def test_hostile_shapes_are_wire_errors(data: bytes) -> None:
    for channel in DECODERS:
        with pytest.raises(WireError):
            channel.decode(data)


def test_maps_and_plain_values_up_to_their_limits_decode() -> None:
    """What the hostile shapes exceed: a map of MAX_MAP_LEN entries, plain values nested
    MAX_PLAIN_DEPTH deep (counting the dict)."""
    values = {str(i): nested(MAX_PLAIN_DEPTH - 1) for i in range(MAX_MAP_LEN)}
    assert FROM_ENGINE.decode(msgpack.packb([STATS, [values]])) == Stats(values)
    assert same(FROM_ENGINE.decode(FROM_ENGINE.encode(Stats(values))), Stats(values))


# --- caps -------------------------------------------------------------------------------------


def test_a_message_over_its_channels_cap_is_refused_before_decoding() -> None:
    small = Channel("batch", 16, messages.StageCommand)
    data = STAGE.encode(BATCH)
    assert len(data) > 16
    with pytest.raises(WireError, match="exceeds"):
        small.decode(data)
    with pytest.raises(WireError, match="exceeds"):
        small.decode(b"\xc1" * 17)  # not msgpack either: the length is checked first
    with pytest.raises(WireError, match="exceeds"):  # nor is one made
        small.encode(BATCH)
    assert small.decode(small.encode(Shutdown())) == Shutdown()


def test_each_channel_has_a_cap_that_fits_what_it_carries() -> None:
    """Status messages are small (a 1M-token chunk's prompt logprobs, a timeline piece),
    far under the engine link's and the batch channel's; a traceback over the status cap is
    refused by the encoder and by the decoder."""
    assert wire.STATUS_MAX_BYTES <= 8 << 20 < wire.BATCH_MAX_BYTES
    assert wire.ENGINE_LINK_MAX_BYTES <= 64 << 20 and wire.BATCH_MAX_BYTES <= 64 << 20
    assert STATUS.max_bytes == wire.STATUS_MAX_BYTES
    assert STAGE.max_bytes == wire.BATCH_MAX_BYTES
    assert TO_ENGINE.max_bytes == FROM_ENGINE.max_bytes == wire.ENGINE_LINK_MAX_BYTES
    assert msgpack.unpackb(STATUS.encode(Status(2, Failed("x")))) == [2, [FAILED, ["x"]]]
    text = "x" * wire.STATUS_MAX_BYTES
    with pytest.raises(WireError, match="exceeds"):
        STATUS.encode(Status(0, Failed(text)))
    with pytest.raises(WireError, match="exceeds"):
        STATUS.decode(msgpack.packb([0, [FAILED, [text]]]))
    # what fits: prompt logprobs of a million-token chunk in one result, a timeline piece
    result = BatchResult(1, [1], [0.0], [[-1.0] * 1_000_000], [[]], [0.1])
    assert STATUS.decode(STATUS.encode(Status(0, result))) == Status(0, result)
    event = Event(
        "dispatch_launch",
        7,
        7,
        1.7e9,
        1.7e9,
        2**40,
        ["r" * 36] * 4,
        [1] * 4,
        [1] * 4,
        [1] * 4,
        2**40,
        2**40,
        60,
        1,
    )
    piece = Status(0, TimelinePiece([event] * wire.TIMELINE_PIECE, False))
    assert STATUS.decode(STATUS.encode(piece)) == piece


def test_decoding_memory_is_bounded_by_the_status_cap() -> None:
    """msgpack builds every container before a schema check: the worst case (empty maps
    or arrays, 1 byte each) takes under 100 times a message's bytes, measured here on 1 MiB;
    at the status channel's cap that is under 1 GiB."""
    n = 1 << 20
    worst = 0.0
    for filler in ([], {}, [None]):
        data = msgpack.packb([0, [FAILED, [[filler] * (n // (1 + len(filler)))]]])
        tracemalloc.start()
        with pytest.raises(WireError):
            STATUS.decode(data)
        worst = max(worst, tracemalloc.get_traced_memory()[1] / len(data))
        tracemalloc.stop()
    assert worst < 100, worst
    assert worst * wire.STATUS_MAX_BYTES < 1 << 30
