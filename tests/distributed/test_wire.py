"""The wire format: every message round-trips to what was sent (same classes, same field
types), every dataclass field is on the wire, and bytes that are not one of the engine's
messages (random, truncated, pickled, type-confused) raise WireError and nothing else."""

from __future__ import annotations

import contextlib
import math
import pickle
import random
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import msgpack
import pytest

from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.distributed import wire
from pipeserve.distributed.wire import MsgType, WireError
from pipeserve.scheduler.batch import BatchResult, ReqSlice, ScheduledBatch
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.streams import StreamDelta
from pipeserve.timeline import Event

SAMPLING = SamplingParams(
    max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, stop=("\n\n", "é"),
    stop_token_ids=(2, 151645), seed=2**63 - 1, ignore_eos=True,
)
DESTINATION = KVDestination(
    "0f" * 16, ("tcp://10.0.0.2:5001", "tcp://10.0.0.2:5002"), SideLayout(((0, 4),), 2, 2)
)
BATCH = ScheduledBatch(
    batch_id=41,
    slices=[
        ReqSlice("a", [5, 6, 7], 12, [(0, 8), (64, 7)], sample=True, sampling=SAMPLING,
                 return_logprob=True, top_logprobs=3, logprob_targets=[6, 7], chunk_index=2),
        ReqSlice("b", [-3], 4, [(9, 5)], sample=True, sampling=SamplingParams(), future_slot=3),
        ReqSlice("profile", [1, 2], 0, [], sample=False),
        ReqSlice("pd", [3, 4], 0, [(16, 2)], sample=False, chunk_index=0, kv_dest=DESTINATION),
    ],
    released=["old-1", "old-2"],
    stage_times=[0.012, 0.0131],
    micro_batches=[2, 0, 1],
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
    "a", "héllo", [17, 3], [-0.25, -1.0], [[(17, -0.25)], [(3, -1.0)]], "stop", "\n\n", 5, 2, 4,
    0.031, None, "invalid",
)
DELTA_2 = StreamDelta("b", finish_reason="error", matched_stop=151645, error="bad", ttft=None)
POINTS, RUNS = [(0, 256), (1024, 512)], [(0, 4096)]

STAGE_MESSAGES: list[tuple[MsgType, wire.StageBody]] = [
    (MsgType.PROXY, BATCH),
    (MsgType.SHUTDOWN, None),
    (MsgType.TIMELINE, None),
    (MsgType.PROFILE, (POINTS, RUNS)),
]
STATUS_MESSAGES: list[tuple[str, int, Any]] = [
    ("ready", 3, {"num_pages": 4096, "partition": [3, 1], "stage": 1, "tp_rank": 1,
                  "ep_rank": 0, "expert_bytes": 1 << 20, "tp_all_reduce": "shared memory",
                  "kv_endpoint": "tcp://127.0.0.1:40001", "kv_control": "ipc:///tmp/x/kv",
                  "kv_control_secret": "ab" * 32}),
    ("result", 1, RESULT),
    ("heartbeat", 2, None),
    ("error", 0, "Traceback (most recent call last):\n  ...\nValueError: boom"),
    ("refused", 1, "number of attention heads (4) is not divisible by --tp-size 3"),
    ("timeline", 1, ([EVENT, Event("forward", 0, 0, 1.0, 2.0)], True)),
    ("profile", 0, (1, [0.004, 0.0091])),
]
SAMPLING_DICT = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                 "min_p": 0.0, "stop": ["\n"], "seed": None, "ignore_eos": False}
TO_ENGINE: list[tuple[Any, ...]] = [
    ("add", "rid-1", [1, 2, 3], SAMPLING_DICT, True, 5, None),
    ("add", "rid-2", [1], SAMPLING_DICT, False, 0, DESTINATION.to_json()),
    ("pd_reserve", "rid-3", [1, 2], SAMPLING_DICT, False, 2),
    ("pd_prefilled", "rid-3", 17, -0.5, [(17, -0.5), (3, -1.25)]),
    ("abort", "rid-1"),
    ("shutdown",),
]
FROM_ENGINE: list[tuple[str, Any]] = [
    ("ready", {"context_len": 4096, "vocab_size": 512, "model_path": "/models/tiny"}),
    ("deltas", [DELTA, DELTA_2]),
    ("stats", {"loop": "overlap", "overlap_schedule": True, "kv_pages_free": 10,
               "stage_busy_s": [0.5, 0.25]}),
    ("fatal", "engine failed: worker rank 1 exited with code -9"),
    ("reserved", ["rid-3", DESTINATION.to_json()]),
]


def same(a: Any, b: Any) -> bool:
    """Equal, with the same container types (tuple vs list) and NaN equal to NaN."""
    return repr(a) == repr(b)


@pytest.mark.parametrize("kind,body", STAGE_MESSAGES, ids=lambda m: str(m)[:20])
def test_stage_messages_round_trip(kind: MsgType, body: wire.StageBody) -> None:
    assert same(wire.decode_stage(wire.encode_stage(kind, body)), (kind, body))


@pytest.mark.parametrize(
    "command,expected",
    [(BATCH, (MsgType.PROXY, BATCH)), ("shutdown", (MsgType.SHUTDOWN, None)),
     ("timeline", (MsgType.TIMELINE, None)),
     (("profile", POINTS, RUNS), (MsgType.PROFILE, (POINTS, RUNS)))],
    ids=["batch", "shutdown", "timeline", "profile"],
)
def test_batch_channel_commands_decode_to_stage_messages(command: Any, expected: Any) -> None:
    assert same(wire.decode_stage(wire.encode_batch_command(command)), expected)


@pytest.mark.parametrize("msg", STATUS_MESSAGES, ids=lambda m: m[0])
def test_status_messages_round_trip(msg: tuple[str, int, Any]) -> None:
    assert same(wire.decode_status(wire.encode_status(*msg)), msg)


@pytest.mark.parametrize("msg", TO_ENGINE, ids=lambda m: m[0])
def test_messages_to_the_engine_round_trip(msg: tuple[Any, ...]) -> None:
    assert same(wire.decode_to_engine(wire.encode_to_engine(msg)), msg)


@pytest.mark.parametrize("msg", FROM_ENGINE, ids=lambda m: m[0])
def test_messages_from_the_engine_round_trip(msg: tuple[str, Any]) -> None:
    assert same(wire.decode_from_engine(wire.encode_from_engine(msg)), msg)


@pytest.mark.parametrize(
    "obj,encode",
    [(SAMPLING, wire.encode_sampling), (BATCH.slices[0], wire.encode_slice),
     (BATCH, wire.encode_batch), (RESULT, wire.encode_result), (EVENT, wire.encode_event),
     (DELTA, wire.encode_delta)],
    ids=lambda x: type(x).__name__,
)
def test_every_field_is_on_the_wire(obj: Any, encode: Callable[[Any], list[Any]]) -> None:
    """A field added to one of these classes must be added to its codec too."""
    assert len(encode(obj)) == len(fields(obj))


def test_a_failure_report_with_a_lone_surrogate_still_goes_out() -> None:
    kind, rank, text = wire.decode_status(wire.encode_status("error", 1, "bad stop '\ud800'"))
    assert (kind, rank, text) == ("error", 1, "bad stop '\\ud800'")
    assert wire.decode_from_engine(wire.encode_from_engine(("fatal", "\udc80"))) == (
        "fatal", "\\udc80")


def test_encoding_what_no_message_holds_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        wire.encode_status("exec", 0, "os.system")
    with pytest.raises(WireError):
        wire.encode_status("ready", 0, {"num_pages": 1})
    with pytest.raises(WireError):
        wire.encode_batch_command(("run", "this"))
    with pytest.raises(WireError):
        wire.encode_to_engine(("add", "r", [1], {"top_k": 2**80}, False, 0))


# --- malformed input ------------------------------------------------------------------------

DECODERS = [wire.decode_stage, wire.decode_status, wire.decode_to_engine,
            wire.decode_from_engine]
VALID = (
    [wire.encode_stage(k, b) for k, b in STAGE_MESSAGES]
    + [wire.encode_status(*m) for m in STATUS_MESSAGES]
    + [wire.encode_to_engine(m) for m in TO_ENGINE]
    + [wire.encode_from_engine(m) for m in FROM_ENGINE]
)
CONFUSERS: list[Any] = [None, True, -1, 2**64 - 1, 1.5, "x", b"\x00" * 7, [], {}, [[1]],
                        {"k": 1}, msgpack.ExtType(5, b"x")]


def decodes_or_wire_error(data: bytes) -> None:
    for decode in DECODERS:
        with contextlib.suppress(WireError):
            decode(data)


def leaf_paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, list):
        for i, x in enumerate(value):
            yield from leaf_paths(x, (*path, i))
    elif isinstance(value, dict):
        for k, x in value.items():
            yield from leaf_paths(x, (*path, k))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = list(value) if isinstance(value, list) else dict(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def test_random_bytes_raise_only_wire_errors() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        decodes_or_wire_error(data)
    for _ in range(500):  # valid msgpack headers first, random after: deeper into decoders
        decodes_or_wire_error(bytes([0x93, rng.choice([1, 4, 0xA5])]) + rng.randbytes(40))


def test_truncated_and_extended_messages_are_wire_errors() -> None:
    for data in VALID:
        for cut in range(len(data)):
            for decode in DECODERS:
                with pytest.raises(WireError):
                    decode(data[:cut])
        for decode in DECODERS:
            with pytest.raises(WireError):
                decode(data + b"\x00")


@pytest.mark.parametrize(
    "payload",
    [("heartbeat", 0, None), ("error", 0, "boom"), BATCH, RESULT, "shutdown",
     ("add", "r", [1], {}, False, 0), ("fatal", "x")],
    ids=lambda p: type(p).__name__,
)
def test_pickles_are_wire_errors(payload: Any) -> None:
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        for decode in DECODERS:
            with pytest.raises(WireError):
                decode(pickle.dumps(payload, protocol=protocol))


def test_type_confused_fields_raise_only_wire_errors() -> None:
    for data in VALID:
        value = msgpack.unpackb(data, raw=False)
        for path in leaf_paths(value):
            for new in CONFUSERS:
                decodes_or_wire_error(msgpack.packb(replaced(value, path, new)))


@pytest.mark.parametrize(
    "data",
    [b"\x91" * 100_000,  # arrays nested 100k deep
     b"\xdd\xff\xff\xff\xff",  # an array that claims 4G elements
     b"\xdb\xff\xff\xff\xff",  # a string that claims 4 GB
     msgpack.packb({i: i for i in range(5)}),  # int keys
     msgpack.packb(["stats", {str(i): i for i in range(wire.MAX_MAP_LEN + 1)}]),
     msgpack.packb(["heartbeat", 0, [[[[[[[[1]]]]]]]]]),
     msgpack.packb(["stats", {"a": [[[[[[1]]]]]]}])],
    ids=["deep", "huge-array", "huge-string", "int-keys", "big-map", "nested", "nested-plain"],
)
def test_hostile_shapes_are_wire_errors(data: bytes) -> None:
    for decode in DECODERS:
        with pytest.raises(WireError):
            decode(data)


def test_a_message_over_its_channels_cap_is_refused_before_decoding(monkeypatch) -> None:
    monkeypatch.setattr(wire, "BATCH_MAX_BYTES", 16)
    data = msgpack.packb([int(MsgType.PROXY), wire.encode_batch(BATCH)], use_bin_type=True)
    with pytest.raises(WireError, match="exceeds"):
        wire.decode_stage(data)
    with pytest.raises(WireError, match="exceeds"):  # nor is one made
        wire.encode_stage(MsgType.PROXY, BATCH)


def test_each_channel_has_a_cap_that_fits_what_it_carries() -> None:
    """Status messages are small (a 1M-token chunk's prompt logprobs, a timeline piece),
    far under the engine link's and the batch channel's; a traceback over the status cap is
    refused by the encoder and by the decoder."""
    assert wire.STATUS_MAX_BYTES <= 8 << 20 < wire.BATCH_MAX_BYTES
    assert wire.ENGINE_LINK_MAX_BYTES <= 64 << 20 and wire.BATCH_MAX_BYTES <= 64 << 20
    text = "x" * wire.STATUS_MAX_BYTES
    with pytest.raises(WireError, match="exceeds"):
        wire.encode_status("error", 0, text)
    with pytest.raises(WireError, match="exceeds"):
        wire.decode_status(msgpack.packb(["error", 0, text]))
    # what fits: prompt logprobs of a million-token chunk in one result
    result = BatchResult(1, [1], [0.0], [[-1.0] * 1_000_000], [[]], [0.1])
    assert wire.decode_status(wire.encode_status("result", 0, result))[2] == result


def test_decoding_memory_is_bounded_by_the_status_cap() -> None:
    """msgpack builds every container before a schema check: the worst case (empty maps
    or arrays, 1 byte each) takes under 100 times a message's bytes, measured here on 1 MiB;
    at the status channel's cap that is under 1 GiB."""
    n = 1 << 20
    worst = 0.0
    for filler in ([], {}, [None]):
        data = msgpack.packb(["error", 0, [filler] * (n // (1 + len(filler)))])
        tracemalloc.start()
        with pytest.raises(WireError):
            wire.decode_status(data)
        worst = max(worst, tracemalloc.get_traced_memory()[1] / len(data))
        tracemalloc.stop()
    assert worst < 100, worst
    assert worst * wire.STATUS_MAX_BYTES < 1 << 30
