"""The engine's wire format: one codec for every message between its processes, derived
from the messages' annotations, as msgpack (never pickle).

A message is a frozen dataclass (`distributed/messages.py` declares them). A channel carries
one type, usually a union of messages, and has a byte cap for one message that fits what it
carries (STATUS_MAX_BYTES, BATCH_MAX_BYTES, ENGINE_LINK_MAX_BYTES: the sockets refuse longer
ones, `Channel.decode` checks again and `Channel.encode` refuses to make them); msgpack's
length limits follow from the cap. The encoding, per annotation:

- a dataclass: the array of its fields in declaration order (every field travels);
- a union of dataclasses: [index of the member's type in the union, its fields];
- `list[int]`, `tuple[int, ...]` (and float): the bytes of one int64 (float64) array, fast to
  pack and typed by construction; a list of fixed tuples of ints and floats, such as
  `list[tuple[int, float]]`: one such array per column;
- other lists and tuples: arrays; `dict[str, Any]`: a small map of plain values (None,
  bool, int, float, str, lists and string-keyed maps of them, MAX_PLAIN_DEPTH deep);
- `FreeText`: a string whose lone surrogates are escaped first (a traceback must go out).

Decoding checks every element against its annotation and builds only the annotated classes
(then their `wire_check`, where one has it), so anything malformed or hostile raises
WireError and nothing else: the receiver drops it, and no code runs. msgpack builds a Python
object for every container before any schema check, so decoding one message can take up to
about 80 times its bytes (empty maps or arrays: 1 byte each on the wire, 64-80 in memory):
650 MB for a status message at its cap, from a peer allowed on that channel.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import reprlib
import sys
import types
import typing
from array import array
from collections.abc import Callable
from typing import Annotated, Any, Generic, TypeVar

import msgpack

# a result's prompt logprobs (8 bytes a token: a 1M-token chunk), a timeline piece, a ready
# message, a traceback; the one channel other nodes' workers speak on
STATUS_MAX_BYTES = 8 << 20
BATCH_MAX_BYTES = 64 << 20  # a batch's token ids (8 bytes each: 8M tokens) and KV runs
ENGINE_LINK_MAX_BYTES = 64 << 20  # a request's token ids; a step's deltas with logprobs
PD_CONTROL_MAX_BYTES = 16 << 20  # a room's open lists a request's slot runs
KV_HEADER_MAX_BYTES = 1 << 20  # a kv message's header lists its positions' runs
TIMELINE_PIECE = 4096  # events per timeline status message (~150 bytes each)
MAX_MAP_LEN = 256  # maps only carry small dicts (settings, stats)
MAX_PLAIN_DEPTH = 4  # nesting allowed inside those dicts

T = TypeVar("T")
Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]

FreeText = Annotated[str, "free text"]  # a report of what went wrong: never fails to encode


class WireError(ValueError):
    """A message that does not encode or decode: not msgpack, or not what its channel
    carries."""


@dataclasses.dataclass(frozen=True)
class Channel(Generic[T]):
    """One kind of link and what it carries: `kind`, a message class or a union of them
    (a union's message is tagged with its class's place in the union)."""

    name: str
    max_bytes: int
    kind: Any

    def __post_init__(self) -> None:
        _codec(self.kind)  # an annotation the codec cannot carry fails at import

    def encode(self, msg: T) -> bytes:
        try:
            value = _codec(self.kind)[0](msg)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:  # WireError too
            raise WireError(f"cannot encode a message for the {self.name} channel: {exc}") from None
        try:
            data = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireError(f"cannot encode {reprlib.repr(msg)}: {exc}") from None
        if len(data) > self.max_bytes:
            raise WireError(
                f"a message of {len(data)} bytes exceeds the {self.name} channel's {self.max_bytes}"
            )
        return data

    def decode(self, data: bytes) -> T:
        """The message `data` holds, or WireError (whatever the bytes)."""
        value = _unpack(data, self.max_bytes, self.name)
        try:
            return typing.cast(T, _codec(self.kind)[1](value))
        except WireError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            # a class built from checked fields could still refuse a value: malformed too
            raise WireError(f"{self.name}: {exc}") from None


def _unpack(data: bytes, limit: int, name: str) -> Any:
    if len(data) > limit:
        raise WireError(f"a message of {len(data)} bytes exceeds the {name} channel's {limit}")
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


# --- the codec of one annotation --------------------------------------------------------


def _fail(what: str, value: Any) -> WireError:
    return WireError(f"{what}: unexpected {type(value).__name__} {reprlib.repr(value)}")


@functools.cache
def _codec(kind: Any) -> tuple[Encode, Decode]:
    """(encode, decode) of values annotated `kind`: encode gives a msgpack value, decode
    checks one and gives the Python value back."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind in _PRIMITIVES:
        return _primitive(kind)
    if kind is Any:
        return _plain, _plain
    if origin is Annotated and args[0] is str and "free text" in args[1:]:
        return _free_text, _primitive(str)[1]
    if dataclasses.is_dataclass(kind):
        return _dataclass(typing.cast(type, kind))
    if origin in (typing.Union, types.UnionType):
        return _union(args)
    if origin in (list, tuple):
        return _sequence(origin, args)
    if origin is dict and args[0] is str:
        return _plain_dict, _plain_dict
    raise TypeError(f"the wire has no encoding for {kind!r}")


def _primitive(kind: type) -> tuple[Encode, Decode]:
    name = {int: "an int", float: "a float", str: "a string", bool: "a bool"}[kind]

    def check(v: Any) -> Any:
        if type(v) is not kind:  # exact: a bool is no int here
            raise _fail(f"expected {name}", v)
        return v

    def encode_int(v: Any) -> int:
        if type(v) is not int or not INT_MIN <= v <= UINT_MAX:
            raise _fail("expected an int of at most 64 bits", v)
        return v

    def encode_float(v: Any) -> float:
        if type(v) is not float and type(v) is not int:  # an int is a float's value too
            raise _fail("expected a float", v)
        return float(v)

    encoders: dict[type, Encode] = {float: encode_float, int: encode_int}
    return encoders.get(kind, check), check


INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # what msgpack carries


_PRIMITIVES = (int, float, str, bool)


def _free_text(v: Any) -> str:
    if type(v) is not str:
        raise _fail("expected a string", v)
    return v.encode("utf-8", "backslashreplace").decode()


def _dataclass(cls: type) -> tuple[Encode, Decode]:
    """Generated code per class (a message's fields are read and checked inline, primitives
    without a call each: the hot path of every step's batch and deltas)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    if any(not f.init or f.kw_only for f in fields):
        raise TypeError(f"{cls.__name__} has fields the constructor does not take in order")
    if hasattr(cls, "__post_init__"):  # it would run again on every decode
        raise TypeError(f"{cls.__name__} has a __post_init__: a message holds values only")
    names = tuple(f.name for f in fields)
    codecs = [_codec(hints[n]) for n in names]
    what = cls.__name__
    scope: dict[str, Any] = {
        "cls": cls,
        "check": getattr(cls, "wire_check", None),
        "fail": _fail,
        "which": _which_field,
        "ERRORS": _ERRORS,
        "WireError": WireError,
        "repr": reprlib.repr,
        "INT_MIN": INT_MIN,
        "UINT_MAX": UINT_MAX,
        "encoders": [(n, c[0]) for n, c in zip(names, codecs, strict=True)],
        "decoders": [(n, c[1]) for n, c in zip(names, codecs, strict=True)],
    }
    enc_lines, enc_values, dec_lines, dec_values = [], [], [], []
    for i, (name, hint, (enc, dec)) in enumerate(
        zip(names, (hints[n] for n in names), codecs, strict=True)
    ):
        scope[f"e{i}"], scope[f"d{i}"] = enc, dec
        x = f"x{i}"
        enc_lines.append(f"{x} = v.{name}")
        if hint is int:
            enc_lines.append(
                f"if type({x}) is not int or not INT_MIN <= {x} <= UINT_MAX: raise TypeError"
            )
            dec_lines.append(f"if type({x}) is not int: raise TypeError")
        elif hint in (str, bool):
            kind = hint.__name__
            enc_lines.append(f"if type({x}) is not {kind}: raise TypeError")
            dec_lines.append(f"if type({x}) is not {kind}: raise TypeError")
        elif hint is float:
            enc_lines.append(f"if type({x}) is not float: {x} = e{i}({x})")
            dec_lines.append(f"if type({x}) is not float: raise TypeError")
        elif (inner := _optional_of(hint)) is not None:
            if inner in (int, str, bool, float):  # checked by the call (rarely not None)
                enc_lines.append(f"if {x} is not None: {x} = e{i}({x})")
                dec_lines.append(
                    f"if {x} is not None and type({x}) is not {inner.__name__}: raise TypeError"
                )
            else:
                scope[f"e{i}"], scope[f"d{i}"] = _codec(inner)
                enc_lines.append(f"if {x} is not None: {x} = e{i}({x})")
                dec_lines.append(f"if {x} is not None: {x} = d{i}({x})")
        else:
            enc_lines.append(f"{x} = e{i}({x})")
            dec_lines.append(f"{x} = d{i}({x})")
        enc_values.append(x)
        dec_values.append(x)
    count = len(names)
    unpack = f"{', '.join(dec_values)}, = v" if count else "pass"
    # built without the constructor where it only stores the fields (a frozen class's
    # __init__ sets each through object.__setattr__)
    frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    plain = frozen and not hasattr(cls, "__slots__")
    stores = "; ".join(f"d[{n!r}] = x{i}" for i, n in enumerate(names))
    build = (
        f"obj = new(cls); d = obj.__dict__; {stores}"
        if plain and count
        else (f"obj = cls({', '.join(dec_values)})")
    )
    scope["new"] = object.__new__
    source = f"""
def encode(v):
    if type(v) is not cls:
        raise fail("expected a {what}", v)
    try:
        {_block(enc_lines, 8)}
    except ERRORS:
        raise which("{what}", [(n, e, getattr(v, n)) for n, e in encoders]) from None
    return [{", ".join(enc_values)}]

def decode(v):
    if type(v) is not list or len(v) != {count}:
        raise WireError(f"{what}: expected {count} fields, got {{repr(v)}}")
    try:
        {unpack}
        {_block(dec_lines, 8)}
        {build}
    except ERRORS:
        raise which("{what}", [(n, d, x) for (n, d), x in zip(decoders, v)]) from None
    if check is not None:
        check(obj)
    return obj
"""
    exec(compile(source, f"<wire codec of {what}>", "exec"), scope)
    return scope["encode"], scope["decode"]


def _optional_of(hint: Any) -> Any:
    """X of `X | None` (None for anything else)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(hint)
    rest = [a for a in args if a is not type(None)]
    return rest[0] if len(args) == 2 and len(rest) == 1 else None


def _block(lines: list[str], indent: int) -> str:
    return ("\n" + " " * indent).join(lines) or "pass"


_ERRORS = (WireError, TypeError, ValueError, OverflowError)


def _which_field(what: str, fields: list[tuple[str, Callable[[Any], Any], Any]]) -> WireError:
    """The error of the first field that fails, named: `what.field: why` (found again,
    only once something has failed)."""
    for name, code, value in fields:
        try:
            code(value)
        except _ERRORS as exc:
            return WireError(f"{what}.{name}: {exc}")
    return WireError(f"{what}: its fields are valid, the class refused them")


def _union(args: tuple[Any, ...]) -> tuple[Encode, Decode]:
    optional = type(None) in args
    rest = tuple(a for a in args if a is not type(None))
    if len(rest) == 1:  # X | None
        inner = _codec(rest[0])
        return _or_none(inner[0]), _or_none(inner[1])
    if all(a in _PRIMITIVES for a in rest):  # e.g. str | int
        allowed = rest + ((type(None),) if optional else ())

        def check(v: Any) -> Any:
            if type(v) not in allowed:
                raise _fail(f"expected one of {[a.__name__ for a in allowed]}", v)
            return v

        return check, check
    if not all(dataclasses.is_dataclass(a) for a in rest):
        raise TypeError(f"the wire has no encoding for a union of {args!r}")
    classes = typing.cast(tuple[type, ...], rest)
    codecs = [_codec(a) for a in classes]
    index = {cls: i for i, cls in enumerate(classes)}

    def encode(v: Any) -> list[Any]:
        i = index.get(type(v))
        if i is None:
            raise _fail(f"expected one of {[c.__name__ for c in classes]}", v)
        return [i, codecs[i][0](v)]

    def decode(v: Any) -> Any:
        if type(v) is not list or len(v) != 2 or type(v[0]) is not int:
            raise _fail("expected [tag, message]", v)
        if not 0 <= v[0] < len(codecs):
            raise _fail("unknown message tag", v[0])
        return codecs[v[0]][1](v[1])

    return (_or_none(encode), _or_none(decode)) if optional else (encode, decode)


def _or_none(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else f(v)


def _sequence(origin: type, args: tuple[Any, ...]) -> tuple[Encode, Decode]:
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return _fixed_tuple(args)
    item = args[0]
    if item in (int, float):
        return _packed(item, origin)
    inner = typing.get_args(item)
    if typing.get_origin(item) is tuple and inner and all(a in (int, float) for a in inner):
        return _columns(inner, origin)
    enc, dec = _codec(item)

    def encode(v: Any) -> list[Any]:
        if not isinstance(v, list | tuple):
            raise _fail("expected a sequence", v)
        return [enc(x) for x in v]

    def decode(v: Any) -> Any:
        if type(v) is not list:
            raise _fail("expected a list", v)
        return origin(dec(x) for x in v) if origin is tuple else [dec(x) for x in v]

    return encode, decode


def _fixed_tuple(args: tuple[Any, ...]) -> tuple[Encode, Decode]:
    codecs = [_codec(a) for a in args]

    def encode(v: Any) -> list[Any]:
        if not isinstance(v, tuple | list) or len(v) != len(codecs):
            raise _fail(f"expected {len(codecs)} values", v)
        return [c[0](x) for c, x in zip(codecs, v, strict=True)]

    def decode(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or len(v) != len(codecs):
            raise _fail(f"expected {len(codecs)} values", v)
        return tuple(c[1](x) for c, x in zip(codecs, v, strict=True))

    return encode, decode


_ARRAY_CODE = {int: "q", float: "d"}


def _pack_array(values: Any, code: str) -> bytes:
    """The container's type is checked, not each element's (a Python loop over every token
    of a long prompt): a bool inside goes as 0 or 1, as it would in any int arithmetic."""
    kind = type(values)
    if kind is not list and kind is not tuple and kind is not itertools.chain:
        raise _fail("expected a list", values)
    if not values and kind is not itertools.chain:
        return b""
    try:
        packed = array(code, values)
    except (TypeError, OverflowError) as exc:
        raise WireError(f"cannot pack a list as {code!r}: {exc}") from None
    if BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


BIG_ENDIAN = sys.byteorder == "big"  # the wire's arrays are little-endian


def _unpack_array(v: Any, code: str) -> array:
    if type(v) is not bytes or len(v) % 8:
        raise _fail(f"expected {code!r} array bytes", v)
    values = array(code, v)
    if BIG_ENDIAN:
        values.byteswap()
    return values


def _packed(item: type, origin: type) -> tuple[Encode, Decode]:
    code = _ARRAY_CODE[item]

    def decode(v: Any) -> Any:
        if v == b"" and type(v) is bytes:  # most of a batch's lists are empty
            return () if origin is tuple else []
        values = _unpack_array(v, code).tolist()
        return tuple(values) if origin is tuple else values

    return (lambda v: _pack_array(v, code)), decode


def _columns(inner: tuple[Any, ...], origin: type) -> tuple[Encode, Decode]:
    """A sequence of fixed tuples of ints and floats, one packed array per column."""
    codes = [_ARRAY_CODE[a] for a in inner]
    width = len(codes)
    if len(set(codes)) == 1:
        return _interleaved(codes[0], width, origin)

    def encode(v: Any) -> list[bytes]:
        if not isinstance(v, list | tuple) or any(len(row) != width for row in v):
            raise _fail(f"expected rows of {width}", v)
        return [_pack_array([row[i] for row in v], c) for i, c in enumerate(codes)]

    def decode(v: Any) -> Any:
        if type(v) is not list or len(v) != width:
            raise _fail(f"expected {width} columns", v)
        cols = [_unpack_array(x, c) for x, c in zip(v, codes, strict=True)]
        if any(len(c) != len(cols[0]) for c in cols):
            raise WireError("columns of different lengths")
        rows = list(zip(*cols, strict=True))
        return tuple(rows) if origin is tuple else rows

    return encode, decode


def _interleaved(code: str, width: int, origin: type) -> tuple[Encode, Decode]:
    """Rows of one type (runs, pairs) as one packed array, row after row."""

    def encode(v: Any) -> bytes:
        if type(v) not in (list, tuple):
            raise _fail("expected a list", v)
        if any(len(row) != width for row in v):
            raise _fail(f"expected rows of {width}", v)
        return _pack_array(itertools.chain.from_iterable(v), code)

    def decode(v: Any) -> Any:
        if v == b"" and type(v) is bytes:
            return () if origin is tuple else []
        flat = _unpack_array(v, code)
        if len(flat) % width:
            raise WireError(f"expected rows of {width}, got {len(flat)} values")
        rows = list(zip(*(flat[i::width] for i in range(width)), strict=True))
        return tuple(rows) if origin is tuple else rows

    return encode, decode


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON-like value (dicts of settings or stats): None, bool, int, float, str, and
    lists or string-keyed dicts of them, nested at most MAX_PLAIN_DEPTH deep."""
    if v is None or type(v) in _PRIMITIVES:
        return v
    if depth >= MAX_PLAIN_DEPTH or type(v) not in (list, tuple, dict):
        raise _fail("expected a plain value", v)
    if type(v) is dict:
        return {_key(k): _plain(x, depth + 1) for k, x in v.items()}
    return [_plain(x, depth + 1) for x in v]


def _key(k: Any) -> str:
    if type(k) is not str:
        raise _fail("expected a string key", k)
    return k


def _plain_dict(v: Any) -> dict[str, Any]:
    if type(v) is not dict:
        raise _fail("expected a dict", v)
    return typing.cast(dict[str, Any], _plain(v))
