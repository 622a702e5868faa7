"""The engine's wire format: every message between its processes, as msgpack (never pickle).

A message is a msgpack array whose first element is its kind. A dataclass travels as the
array of its fields in declaration order; a list of ints or floats as the bytes of an int64
or float64 array (fast to pack, typed by construction). Decoders check every element and
build only the classes named here, so anything malformed or hostile raises WireError and
nothing else: the receiver drops it, and no code runs. Each channel has a byte cap for one
message that fits what it carries (STATUS_MAX_BYTES, BATCH_MAX_BYTES, ENGINE_LINK_MAX_BYTES;
the sockets refuse longer ones, the decoders check again, and the encoders refuse to make
them), and msgpack's length limits follow from it. msgpack builds a Python object for every
container before any schema check, so decoding one message can take up to about 80 times
its bytes (empty maps or arrays: 1 byte each on the wire, 64-80 in memory): 650 MB for a
status message at its cap, from a peer allowed on that channel. The worker timeline travels
in pieces of TIMELINE_PIECE events so that the status cap stays small.

  stage messages, scheduler -> first stage (ZMQ) and stage -> stage (P2P meta):
      encode_stage / decode_stage           MsgType + ScheduledBatch | (points, runs) | None
  status, worker -> scheduler:
      encode_status / decode_status         (kind, rank, payload)
  HTTP process <-> engine process:
      encode_to_engine / decode_to_engine   ("add", ...), ("abort", rid), ("shutdown",)
      encode_from_engine / decode_from_engine  ("ready", info), ("deltas", [...]),
                                            ("stats", dict), ("fatal", message)
"""

from __future__ import annotations

import functools
import reprlib
import sys
from array import array
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any, TypeVar

import msgpack

from pipeserve.disaggregation.pd.kv_remap import KVDestination
from pipeserve.mem_cache.hicache import TIERS, CacheOp
from pipeserve.scheduler.batch import BatchResult, ReqSlice, Run, ScheduledBatch, TwoBatchSplit
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.streams import StreamDelta
from pipeserve.timeline import Event

# a result's prompt logprobs (8 bytes a token: a 1M-token chunk), a timeline piece, a ready
# message, a traceback; the one channel other nodes' workers speak on
STATUS_MAX_BYTES = 8 << 20
BATCH_MAX_BYTES = 64 << 20  # a batch's token ids (8 bytes each: 8M tokens) and KV runs
ENGINE_LINK_MAX_BYTES = 64 << 20  # a request's token ids; a step's deltas with logprobs
TIMELINE_PIECE = 4096  # events per timeline status message (~150 bytes each)
MAX_MAP_LEN = 256  # maps only carry small dicts (settings, stats)
MAX_PLAIN_DEPTH = 4  # nesting allowed inside those dicts

T = TypeVar("T")
Profile = tuple[list[tuple[int, int]], list[Run]]  # (prefix, chunk) points and lent KV runs
StageBody = ScheduledBatch | Profile | None


class WireError(ValueError):
    """A message that does not decode: not msgpack, or not one of the engine's messages."""


class MsgType(IntEnum):
    """Kinds of stage message: the tag on the batch channel and in the P2P header."""

    PROXY = 1  # a micro-batch's description (and, between stages, its activations)
    SHUTDOWN = 2
    TIMELINE = 3  # report the recorded timeline, then pass it on
    PROFILE = 4  # time chunks for dynamic chunking (payload: points, KV runs), then pass it on


# --- bytes <-> msgpack values -------------------------------------------------------------


def _pack(value: Any, limit: int) -> bytes:
    try:
        data = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode {reprlib.repr(value)}: {exc}") from None
    if len(data) > limit:
        raise WireError(f"a message of {len(data)} bytes exceeds its channel's {limit}")
    return data


def _unpack(data: bytes, limit: int) -> Any:
    if len(data) > limit:
        raise WireError(f"message of {len(data)} bytes exceeds its channel's {limit}")
    try:  # no length inside can claim more than the cap (nor more than the message)
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several kinds for malformed input
        raise WireError(f"not a msgpack message: {exc}") from None


def _decoder(decode: Callable[[bytes], T]) -> Callable[[bytes], T]:
    """A public decoder raises WireError and nothing else, whatever the bytes (a class built
    from checked fields could still refuse a value: that is a malformed message too)."""

    @functools.wraps(decode)
    def checked(data: bytes) -> T:
        try:
            return decode(data)
        except WireError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise WireError(f"{decode.__name__}: {exc}") from None

    return checked


# --- checked primitives -------------------------------------------------------------------


def _fail(what: str, value: Any) -> WireError:
    return WireError(f"{what}: unexpected {type(value).__name__} {reprlib.repr(value)}")


def _int(v: Any) -> int:
    if type(v) is not int:  # not bool either
        raise _fail("expected an int", v)
    return v


def _float(v: Any) -> float:
    if type(v) is not float:
        raise _fail("expected a float", v)
    return v


def _str(v: Any) -> str:
    if type(v) is not str:
        raise _fail("expected a string", v)
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _fail("expected a bool", v)
    return v


def _optional(check: Callable[[Any], T], v: Any) -> T | None:
    return None if v is None else check(v)


def _list(check: Callable[[Any], T], v: Any) -> list[T]:
    if type(v) is not list:
        raise _fail("expected a list", v)
    return [check(x) for x in v]


def _fields(v: Any, count: int, what: str) -> list[Any]:
    if type(v) is not list or len(v) != count:
        raise WireError(f"{what}: expected {count} fields, got {reprlib.repr(v)}")
    return v


def _packed(values: Iterable[Any], code: str) -> bytes:
    try:
        packed = array(code, values)
    except (TypeError, OverflowError) as exc:
        raise WireError(f"cannot pack a list as {code!r}: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpacked(v: Any, code: str) -> array:
    if type(v) is not bytes or len(v) % 8:
        raise _fail(f"expected {code!r} array bytes", v)
    values = array(code, v)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _pack_ints(values: Iterable[int]) -> bytes:
    return _packed(values, "q")


def _ints(v: Any) -> list[int]:
    return _unpacked(v, "q").tolist()


def _pack_floats(values: Iterable[float]) -> bytes:
    return _packed(values, "d")


def _floats(v: Any) -> list[float]:
    return _unpacked(v, "d").tolist()


def _pack_pairs(pairs: Iterable[tuple[int, int]]) -> bytes:
    return _pack_ints(x for pair in pairs for x in pair)


def _pairs(v: Any) -> list[tuple[int, int]]:
    flat = _ints(v)
    if len(flat) % 2:
        raise WireError(f"expected pairs, got {len(flat)} ints")
    return list(zip(flat[::2], flat[1::2], strict=True))


def _pack_top(top: list[list[tuple[int, float]]]) -> list[list[bytes]]:
    """Per slice: the k most likely (token, logprob) as [tokens, logprobs]."""
    return [[_pack_ints(t for t, _ in k), _pack_floats(lp for _, lp in k)] for k in top]


def _top(v: Any) -> list[list[tuple[int, float]]]:
    out = []
    for item in _list(lambda x: _fields(x, 2, "top logprobs"), v):
        tokens, logprobs = _ints(item[0]), _floats(item[1])
        if len(tokens) != len(logprobs):
            raise WireError("top logprobs: as many tokens as logprobs expected")
        out.append(list(zip(tokens, logprobs, strict=True)))
    return out


def _encode_text(text: str) -> str:
    """Free text (a traceback, a failure) made encodable: lone surrogates escaped, so a
    report of what went wrong never fails itself."""
    return _str(text).encode("utf-8", "backslashreplace").decode()


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON-like value (dicts of settings or stats): None, bool, int, float, str, and
    lists or string-keyed dicts of them, nested at most MAX_PLAIN_DEPTH deep."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if depth >= MAX_PLAIN_DEPTH or type(v) not in (list, dict):
        raise _fail("expected a plain value", v)
    if type(v) is list:
        return [_plain(x, depth + 1) for x in v]
    return {_str(k): _plain(x, depth + 1) for k, x in v.items()}


def _plain_dict(v: Any) -> dict[str, Any]:
    if type(v) is not dict:
        raise _fail("expected a dict", v)
    return _plain(v)


# --- the engine's data objects ------------------------------------------------------------


def encode_sampling(sp: SamplingParams) -> list[Any]:
    return [
        sp.max_new_tokens,
        float(sp.temperature),
        float(sp.top_p),
        sp.top_k,
        float(sp.min_p),
        list(sp.stop),
        _pack_ints(sp.stop_token_ids),
        sp.seed,
        sp.ignore_eos,
    ]


def decode_sampling(v: Any) -> SamplingParams:
    max_new, temp, top_p, top_k, min_p, stop, stop_ids, seed, ignore_eos = _fields(v, 9, "sampling")
    return SamplingParams(
        _int(max_new),
        _float(temp),
        _float(top_p),
        _int(top_k),
        _float(min_p),
        tuple(_list(_str, stop)),
        tuple(_ints(stop_ids)),
        _optional(_int, seed),
        _bool(ignore_eos),
    )


def encode_slice(s: ReqSlice) -> list[Any]:
    return [
        s.rid,
        _pack_ints(s.input_ids),
        s.prefix_len,
        _pack_pairs(s.kv_runs),
        s.sample,
        None if s.sampling is None else encode_sampling(s.sampling),
        s.return_logprob,
        s.top_logprobs,
        _pack_ints(s.logprob_targets),
        s.chunk_index,
        s.future_slot,
        None if s.kv_dest is None else _plain_dict(s.kv_dest.to_json()),
    ]


def decode_slice(v: Any) -> ReqSlice:
    rid, ids, prefix, runs, sample, sampling, logprob, top, targets, chunk, slot, dest = _fields(
        v, 12, "request slice"
    )
    return ReqSlice(
        _str(rid),
        _ints(ids),
        _int(prefix),
        _pairs(runs),
        _bool(sample),
        _optional(decode_sampling, sampling),
        _bool(logprob),
        _int(top),
        _ints(targets),
        _int(chunk),
        _int(slot),
        _optional(_decode_destination, dest),
    )


def _decode_destination(v: Any) -> KVDestination:
    try:
        return KVDestination.from_json(_plain_dict(v))
    except ValueError as exc:
        raise _fail(str(exc), v) from None


def encode_batch(b: ScheduledBatch) -> list[Any]:
    slices = [encode_slice(s) for s in b.slices]
    split = b.two_batch
    tbo = None if split is None else [split.index, split.tokens, split.decode]
    return [
        b.batch_id,
        slices,
        list(b.released),
        _pack_floats(b.stage_times),
        tbo,
        b.combine_blocks,
        _pack_ints(b.micro_batches),
        [encode_cache_op(op) for op in b.cache_ops],
    ]


def decode_batch(v: Any) -> ScheduledBatch:
    batch_id, slices, released, stage_times, tbo, blocks, micro, ops = _fields(v, 8, "batch")
    return ScheduledBatch(
        _int(batch_id),
        _list(decode_slice, slices),
        _list(_str, released),
        _floats(stage_times),
        _optional(_decode_split, tbo),
        _int(blocks),
        _ints(micro),
        _list(decode_cache_op, ops),
    )


def encode_cache_op(op: CacheOp) -> list[Any]:
    return [op.src, op.dst, _pack_ints(op.src_pages), _pack_ints(op.dst_pages)]


def decode_cache_op(v: Any) -> CacheOp:
    src, dst, src_pages, dst_pages = _fields(v, 4, "cache op")
    src, dst = _str(src), _str(dst)
    if src not in TIERS or dst not in TIERS or src == dst:
        raise _fail("cache op tiers", (src, dst))
    pages = tuple(_ints(src_pages)), tuple(_ints(dst_pages))
    if len(pages[0]) != len(pages[1]) or any(p < 1 for p in pages[0] + pages[1]):
        raise _fail("cache op pages", pages)
    return CacheOp(src, dst, *pages)


def _decode_split(v: Any) -> TwoBatchSplit:
    index, tokens, decode = _fields(v, 3, "two-batch split")
    return TwoBatchSplit(_int(index), _int(tokens), _bool(decode))


def encode_result(r: BatchResult) -> list[Any]:
    return [
        r.batch_id,
        _pack_ints(r.next_token_ids),
        _pack_floats(r.output_logprobs),
        [_pack_floats(p) for p in r.prompt_logprobs],
        _pack_top(r.top_logprobs),
        _pack_floats(r.stage_times),
    ]


def decode_result(v: Any) -> BatchResult:
    batch_id, tokens, logprobs, prompt, top, stage_times = _fields(v, 6, "batch result")
    return BatchResult(
        _int(batch_id),
        _ints(tokens),
        _floats(logprobs),
        _list(_floats, prompt),
        _top(top),
        _floats(stage_times),
    )


def encode_event(e: Event) -> list[Any]:
    return [
        e.kind,
        e.stage,
        e.tp_rank,
        float(e.start),
        float(e.end),
        e.batch_id,
        list(e.rids),
        _pack_ints(e.chunks),
        _pack_ints(e.tokens),
        _pack_ints(e.prefix),
        e.nbytes,
        e.nbytes_recv,
        e.layer,
        e.micro_batch,
    ]


def decode_event(v: Any) -> Event:
    kind, stage, tp_rank, start, end, batch_id, rids, chunks, tokens, prefix, *more = _fields(
        v, 14, "timeline event"
    )
    nbytes, nbytes_recv, layer, micro_batch = more
    return Event(
        _str(kind),
        _int(stage),
        _int(tp_rank),
        _float(start),
        _float(end),
        _int(batch_id),
        _list(_str, rids),
        _ints(chunks),
        _ints(tokens),
        _ints(prefix),
        _int(nbytes),
        _int(nbytes_recv),
        _int(layer),
        _int(micro_batch),
    )


def encode_delta(d: StreamDelta) -> list[Any]:
    return [
        d.rid,
        d.text,
        _pack_ints(d.token_ids),
        _pack_floats(d.logprobs),
        _pack_top(d.top_logprobs),
        d.finish_reason,
        d.matched_stop,
        d.prompt_tokens,
        d.completion_tokens,
        d.cached_tokens,
        None if d.ttft is None else float(d.ttft),
        d.error,
        d.error_kind,
        d.prefilled,
    ]


def decode_delta(v: Any) -> StreamDelta:
    (
        rid,
        text,
        ids,
        lps,
        top,
        finish,
        stop,
        prompt,
        completion,
        cached,
        ttft,
        error,
        kind,
        prefilled,
    ) = _fields(v, 14, "stream delta")
    if stop is not None and type(stop) not in (str, int):
        raise _fail("matched stop: expected a string or an int", stop)
    return StreamDelta(
        _str(rid),
        _str(text),
        _ints(ids),
        _floats(lps),
        _top(top),
        _optional(_str, finish),
        stop,
        _int(prompt),
        _int(completion),
        _int(cached),
        _optional(_float, ttft),
        _optional(_str, error),
        _str(kind),
        _optional(_int, prefilled),
    )


# --- stage messages: the batch channel and the P2P meta -----------------------------------


def encode_stage(kind: MsgType, body: StageBody = None) -> bytes:
    if kind is MsgType.PROXY:
        assert isinstance(body, ScheduledBatch)
        return _pack([int(kind), encode_batch(body)], BATCH_MAX_BYTES)
    if kind is MsgType.PROFILE:
        assert isinstance(body, tuple)
        points, runs = body
        return _pack([int(kind), _pack_pairs(points), _pack_pairs(runs)], BATCH_MAX_BYTES)
    return _pack([int(kind)], BATCH_MAX_BYTES)


@_decoder
def decode_stage(data: bytes) -> tuple[MsgType, StageBody]:
    msg = _unpack(data, BATCH_MAX_BYTES)
    tag = msg[0] if type(msg) is list and msg else None
    if type(tag) is not int or tag not in MsgType._value2member_map_:
        raise _fail("not a stage message", msg)
    kind = MsgType(tag)
    if kind is MsgType.PROXY:
        return kind, decode_batch(_fields(msg, 2, "batch message")[1])
    if kind is MsgType.PROFILE:
        _, points, runs = _fields(msg, 3, "profile message")
        return kind, (_pairs(points), _pairs(runs))
    _fields(msg, 1, f"{kind.name.lower()} message")
    return kind, None


def encode_batch_command(obj: ScheduledBatch | str | tuple[Any, ...]) -> bytes:
    """What the scheduler puts on the batch channel, as workers.py hands it over: a batch,
    "shutdown", "timeline" or ("profile", points, runs)."""
    if isinstance(obj, ScheduledBatch):
        return encode_stage(MsgType.PROXY, obj)
    if obj == "shutdown":
        return encode_stage(MsgType.SHUTDOWN)
    if obj == "timeline":
        return encode_stage(MsgType.TIMELINE)
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "profile":
        return encode_stage(MsgType.PROFILE, (obj[1], obj[2]))
    raise WireError(f"not a batch channel message: {reprlib.repr(obj)}")


# --- status: worker -> scheduler ----------------------------------------------------------

READY_FIELDS = (
    "num_pages",
    "partition",
    "stage",
    "tp_rank",
    "ep_rank",
    "expert_bytes",
    "tp_all_reduce",
    "kv_endpoint",
    "kv_control",
    "kv_control_secret",
)


def _encode_ready(info: dict[str, Any]) -> list[Any]:
    if set(info) != set(READY_FIELDS):
        raise WireError(f"a ready message has the fields {READY_FIELDS}, not {sorted(info)}")
    return [info["num_pages"], _pack_ints(info["partition"]), *(info[k] for k in READY_FIELDS[2:])]


def _decode_ready(v: Any) -> dict[str, Any]:
    pages, partition, stage, tp_rank, ep_rank, expert_bytes, all_reduce, *kv = _fields(
        v, 10, "ready"
    )
    ranks = (_int(stage), _int(tp_rank), _int(ep_rank))
    values = (
        _int(pages),
        _ints(partition),
        *ranks,
        _int(expert_bytes),
        _str(all_reduce),
        *(_str(x) for x in kv),
    )
    return dict(zip(READY_FIELDS, values, strict=True))


def _encode_profile_times(payload: tuple[int, list[float]]) -> list[Any]:
    stage, times = payload
    return [stage, _pack_floats(times)]


def _decode_profile_times(v: Any) -> tuple[int, list[float]]:
    stage, times = _fields(v, 2, "profile times")
    return _int(stage), _floats(times)


def _encode_nothing(payload: None) -> None:
    if payload is not None:
        raise WireError(f"a heartbeat carries nothing, not {payload!r}")


def _decode_nothing(v: Any) -> None:
    if v is not None:
        raise _fail("expected nothing", v)


STATUS_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "ready": (_encode_ready, _decode_ready),
    "result": (encode_result, decode_result),
    "heartbeat": (_encode_nothing, _decode_nothing),
    "error": (_encode_text, _str),
    "refused": (_encode_text, _str),  # a start-up check refused the settings (its message)
    # (events, last): a rank's timeline in pieces of at most TIMELINE_PIECE events
    "timeline": (
        lambda piece: [_bool(piece[1]), [encode_event(e) for e in piece[0]]],
        lambda v: (_list(decode_event, _fields(v, 2, "timeline piece")[1]), _bool(v[0])),
    ),
    "profile": (_encode_profile_times, _decode_profile_times),
}


def encode_status(kind: str, rank: int, payload: Any = None) -> bytes:
    if kind not in STATUS_CODECS:
        raise WireError(f"unknown status kind {kind!r}; known: {', '.join(STATUS_CODECS)}")
    return _pack([kind, rank, STATUS_CODECS[kind][0](payload)], STATUS_MAX_BYTES)


@_decoder
def decode_status(data: bytes) -> tuple[str, int, Any]:
    """(kind, rank, payload), as the workers sent them."""
    kind, rank, payload = _fields(_unpack(data, STATUS_MAX_BYTES), 3, "status message")
    if type(kind) is not str or kind not in STATUS_CODECS:
        raise _fail("unknown status kind", kind)
    return kind, _int(rank), STATUS_CODECS[kind][1](payload)


# --- the HTTP process <-> the engine process ----------------------------------------------


def encode_to_engine(msg: tuple[Any, ...]) -> bytes:
    """("add", rid, input_ids, sampling dict, return_logprob, top_logprobs[, transfer]),
    ("pd_reserve", rid, input_ids, sampling dict, return_logprob, top_logprobs),
    ("pd_prefilled", rid, token, logprob, top pairs), ("abort", rid) or ("shutdown",)."""
    kind = msg[0]
    if kind in ("add", "pd_reserve") and len(msg) in (6, 7):
        _, rid, ids, params, return_logprob, top, *transfer = msg
        extra = [_optional(_plain_dict, transfer[0] if transfer else None)]
        body = [kind, rid, _pack_ints(ids), _plain_dict(params), return_logprob, top]
        return _pack(body + (extra if kind == "add" else []), ENGINE_LINK_MAX_BYTES)
    if kind == "pd_prefilled" and len(msg) == 5:
        _, rid, token, logprob, top = msg
        return _pack([kind, rid, token, logprob, _pack_top([top])[0]], ENGINE_LINK_MAX_BYTES)
    if (kind, len(msg)) in (("abort", 2), ("shutdown", 1)):
        return _pack(list(msg), ENGINE_LINK_MAX_BYTES)
    raise WireError(f"not a message to the engine: {reprlib.repr(msg)}")


@_decoder
def decode_to_engine(data: bytes) -> tuple[Any, ...]:
    msg = _unpack(data, ENGINE_LINK_MAX_BYTES)
    kind = msg[0] if type(msg) is list and msg else None
    if kind in ("add", "pd_reserve"):
        count = 7 if kind == "add" else 6
        _, rid, ids, params, return_logprob, top, *transfer = _fields(msg, count, kind)
        body = (_str(rid), _ints(ids), _plain_dict(params), _bool(return_logprob), _int(top))
        extra = (_optional(_plain_dict, transfer[0]),) if transfer else ()
        return (kind, *body, *extra)
    if kind == "pd_prefilled":
        _, rid, token, logprob, top = _fields(msg, 5, kind)
        return (kind, _str(rid), _int(token), _float(logprob), _top([top])[0])
    if kind == "abort":
        return ("abort", _str(_fields(msg, 2, "abort")[1]))
    if kind == "shutdown":
        _fields(msg, 1, "shutdown")
        return ("shutdown",)
    raise _fail("not a message to the engine", msg)


FROM_ENGINE_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "ready": (_plain_dict, _plain_dict),
    "deltas": (lambda ds: [encode_delta(d) for d in ds], lambda v: _list(decode_delta, v)),
    "stats": (_plain_dict, _plain_dict),
    "fatal": (_encode_text, _str),
    # a decode server's pages and room for a request: [rid, transfer destination]
    "reserved": (
        lambda v: [_str(v[0]), _plain_dict(v[1])],
        lambda v: [_str(_fields(v, 2, "reserved")[0]), _plain_dict(v[1])],
    ),
}


def encode_from_engine(msg: tuple[str, Any]) -> bytes:
    """("ready", info), ("deltas", [StreamDelta]), ("stats", dict) or ("fatal", message)."""
    kind, payload = msg
    if kind not in FROM_ENGINE_CODECS:
        raise WireError(f"not a message from the engine: {reprlib.repr(msg)}")
    return _pack([kind, FROM_ENGINE_CODECS[kind][0](payload)], ENGINE_LINK_MAX_BYTES)


@_decoder
def decode_from_engine(data: bytes) -> tuple[str, Any]:
    kind, payload = _fields(_unpack(data, ENGINE_LINK_MAX_BYTES), 2, "message from the engine")
    if type(kind) is not str or kind not in FROM_ENGINE_CODECS:
        raise _fail("not a message from the engine", kind)
    return kind, FROM_ENGINE_CODECS[kind][1](payload)
