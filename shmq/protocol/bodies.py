"""Message bodies: the fields of each type (``protocol.schemas``) to bytes and back.

Body encoders and decoders are generated once, at import, from the schemas: runs of
fixed-width integers (and the length prefix that follows them) become one precompiled
``struct.Struct``, so a hot body such as DELIVER is one ``unpack_from`` plus two slices.
The list kinds (blobs, settles, offsets, records) are columnar, encoded and decoded with
a few array operations each.  A malformed body raises ProtocolError(PROTOCOL_ERROR); a
bad argument to an encoder, ``ValueError``.  Frames (headers, the decoder, the hot
single-message builders) are in ``codec``, which re-exports the public names here.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Callable
from itertools import accumulate
from operator import itemgetter
from typing import Any

from shmq import options
from shmq.errors import ProtocolError, Status
from shmq.joined import Joined
from shmq.protocol.schemas import SCHEMAS, TYPES, Schema, T

__all__ = ["Columns", "body_parts", "decode_body", "decode_joined", "encode_body", "malformed",
           "records_arrays", "records_columns", "records_field"]


def _count(value: Any) -> int:
    n = len(value)
    if n > options.MAX_BATCH:
        raise ValueError(f"{n} items in one batch (the limit is {options.MAX_BATCH})")
    return n


def _seq(value: Any) -> Any:
    return value if type(value) in (list, tuple) else list(value)


_U32 = struct.Struct(">I")
_first, _second = itemgetter(0), itemgetter(1)
_BIG = sys.byteorder == "big"
for _code, _size in (("H", 2), ("I", 4), ("Q", 8)):
    assert array(_code).itemsize == _size, _code  # the columns below rely on it
del _code, _size

# The list kinds are columnar (drawn in docs/protocol.md): a count, then each fixed-width
# field of every item as one big-endian column, then the variable bytes of every item
# back to back.  So a batch is encoded and decoded with a few array operations, not
# one struct call per item.


def _column(code: str, values: Any) -> bytes:
    """One big-endian column of ints (OverflowError when one is out of range)."""
    col = array(code, values)
    if not _BIG:
        col.byteswap()
    return col.tobytes()


def _ints(code: str, raw: bytes | memoryview) -> array[int]:
    col = array(code)
    col.frombytes(raw)
    if not _BIG:
        col.byteswap()
    return col


def _slices(body: bytes, lens: Any, pos: int, n: int, what: str) -> tuple[list[bytes], int]:
    """The byte strings of ``lens`` back to back from ``pos``, and where they end."""
    ends = list(accumulate(lens, initial=pos))
    if ends[-1] > n:
        raise malformed(f"truncated {what}")
    return [body[a:b] for a, b in zip(ends, ends[1:], strict=False)], ends[-1]


def _enc_blobs(items: Any) -> bytes:
    return _column("I", [len(p) for p in items]) + b"".join(items)


def _dec_blobs(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[bytes], int]:
    end = pos + 4 * ln
    if end > n:
        raise malformed(f"truncated {what}")
    return _slices(body, _ints("I", body[pos:end]), end, n, what)


def _dec_blobs_joined(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[Joined, int]:
    """``_dec_blobs``'s byte strings as one ``Joined`` (their lengths and their bytes, no copy)."""
    end = pos + 4 * ln
    if end > n:
        raise malformed(f"truncated {what}")
    lens = _ints("I", body[pos:end]).tolist()
    stop = end + sum(lens)
    if stop > n:
        raise malformed(f"truncated {what}")
    return Joined(lens, memoryview(body)[end:stop]), stop


def _enc_settles(items: Any) -> bytes:
    return _column("Q", map(_first, items)) + _column("H", map(_second, items))


def _dec_settles(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[tuple[int, int]], int]:
    mid, end = pos + 8 * ln, pos + 10 * ln
    if end > n:
        raise malformed(f"truncated {what}")
    return list(zip(_ints("Q", body[pos:mid]), _ints("H", body[mid:end]), strict=True)), end


def _enc_offsets(items: Any) -> bytes:
    return _column("Q", items)


def _dec_offsets(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[int], int]:
    end = pos + 8 * ln
    if end > n:
        raise malformed(f"truncated {what}")
    return _ints("Q", body[pos:end]).tolist(), end


def _enc_records(items: Any) -> bytes:
    if not items:
        return b""
    offsets, deliveries, stamps, metas, payloads = zip(*items, strict=True)
    mlens = [len(m) for m in metas]
    data = (b"".join([x for m, p in zip(metas, payloads, strict=True) for x in (m, p)]) if any(mlens)
            else b"".join(payloads))
    return _records_columns(offsets, deliveries, stamps, mlens, [len(p) for p in payloads], data)


def _records_columns(offsets: Any, deliveries: Any, stamps: Any, meta_lens: Any, payload_lens: Any,
                     data: bytes) -> bytes:
    return b"".join((_column("Q", offsets), _column("H", deliveries), _column("Q", stamps),
                     _column("I", meta_lens), _column("I", payload_lens), data))


def records_field(offsets: Any, deliveries: Any, stamps: Any, meta_lens: Any, payload_lens: Any,
                  data: bytes) -> bytes:
    """A whole ``records`` field (count, columns, bytes) straight from its columns, with
    every record's meta and payload already back to back in ``data``.  DELIVER_BATCH
    and READ_OK bodies are this field alone: the server's batch path sends it as is."""
    n = _count(payload_lens)
    if not len(offsets) == len(deliveries) == len(stamps) == len(meta_lens) == n:
        raise ValueError("the columns of a records field differ in length")
    if sum(meta_lens) + sum(payload_lens) != len(data):
        raise ValueError("the records' lengths do not add up to their bytes")
    try:
        return _U32.pack(n) + _records_columns(offsets, deliveries, stamps, meta_lens, payload_lens, data)
    except OverflowError as e:
        raise ValueError(f"bad records field: {e}") from None


def _dec_records(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[Any], int]:
    columns, end = _records_columns_at(body, pos, n, ln, what)
    return list(zip(*columns, strict=True)), end


Columns = tuple[Any, Any, Any, list[bytes], list[bytes]]  # offsets, deliveries, stamps, metas, payloads


def _records_columns_at(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[Columns, int]:
    """The ``ln`` records from ``pos`` as columns (offsets, deliveries, timestamps, metas,
    payloads), and where they end."""
    a, b, c, d, e = (pos + 8 * ln, pos + 10 * ln, pos + 18 * ln, pos + 22 * ln, pos + 26 * ln)
    if e > n:
        raise malformed(f"truncated {what}")
    mlens, plens = _ints("I", body[c:d]), _ints("I", body[d:e])
    if any(mlens):  # meta and payload of each record, one after the other
        both, end = _slices(body, [x for pair in zip(mlens, plens, strict=True) for x in pair], e, n, what)
        metas, payloads = both[0::2], both[1::2]
    else:
        payloads, end = _slices(body, plens, e, n, what)
        metas = [b""] * ln
    return (_ints("Q", body[pos:a]), _ints("H", body[a:b]), _ints("Q", body[b:c]), metas, payloads), end


def records_columns(type: int, body: bytes | bytearray | memoryview) -> Columns:
    """A DELIVER_BATCH or READ_OK body (a ``records`` field alone) as columns: (offsets,
    deliveries, timestamps, metas, payloads), each of one item per record; the records
    of ``decode_body(type, body)["records"]`` without a tuple per record (a batch's
    consumer makes its messages straight from the columns).  Malformed: the same
    ProtocolError as ``decode_body``."""
    if type not in (T.DELIVER_BATCH, T.READ_OK):
        raise ValueError(f"{TYPES[type].name if type in TYPES else type!r} is no records body")
    if body.__class__ is not bytes:
        body = bytes(body)
    n = len(body)
    name = TYPES[type].name
    if n < 4:
        raise malformed(f"truncated records of the {name} body")
    ln = _U32.unpack_from(body)[0]
    if ln > options.MAX_BATCH:
        raise malformed(f"{ln} records in the {name} body (the limit is {options.MAX_BATCH})")
    columns, end = _records_columns_at(body, 4, n, ln, f"records of the {name} body")
    if end != n:
        raise malformed(f"{n - end} bytes past the end of the {name} body")
    return columns


def records_arrays(body: bytes) -> tuple[array[int], array[int], array[int], array[int], memoryview]:
    """A READ_OK body (a ``records`` field alone) as its columns, with no object per record:
    (offsets, timestamps, meta lengths, payload lengths) as arrays in native byte order
    ("Q", "Q", "I", "I"; the deliveries, 0 in a read, are left out) and a view of ``body``'s
    bytes, each record's meta then its payload.  Malformed: the ProtocolError of ``decode_body``."""
    size = len(body)
    if size < 4:
        raise malformed("truncated records of the READ_OK body")
    (n,) = _U32.unpack_from(body)
    if n > options.MAX_BATCH:
        raise malformed(f"{n} records in the READ_OK body (the limit is {options.MAX_BATCH})")
    b, c, d, e = 4 + 10 * n, 4 + 18 * n, 4 + 22 * n, 4 + 26 * n  # deliveries from 4 + 8n
    if e > size:
        raise malformed("truncated records of the READ_OK body")
    view = memoryview(body)
    mlens, plens = _ints("I", view[c:d]), _ints("I", view[d:e])
    if sum(mlens) + sum(plens) != size - e:
        raise malformed("the records' lengths in the READ_OK body do not add up to its bytes")
    return _ints("Q", view[4:4 + 8 * n]), _ints("Q", view[b:c]), mlens, plens, view[e:]


def _json_dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def malformed(what: str) -> ProtocolError:
    return ProtocolError(what, Status.PROTOCOL_ERROR)


_INT = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}
_PREFIXED = {"str": "H", "blob": "I", "json": "I", "blobs": "I", "settles": "I", "offsets": "I",
             "records": "I"}
_KINDS = set(_INT) | set(_PREFIXED) | {"rest"}

# The generated functions see only these names (and their own structs).
_GLOBALS: dict[str, Any] = {
    "_bad": malformed, "_count": _count, "_seq": _seq, "_options": options,
    "_str_encode": str.encode, "_json_dumps": _json_dumps, "_json_loads": json.loads,
    **{f"_{d}_{k}": globals()[f"_{d}_{k}"] for d in ("enc", "dec")
       for k in ("blobs", "settles", "offsets", "records")},
}


def _compile(t: T, schema: Schema, joined: bool = False) -> tuple[Callable[[dict[str, Any]], tuple[Any, ...]],
                                                                 Callable[[bytes], dict[str, Any]]]:
    """Generate the encoder (fields -> tuple of byte parts) and the decoder
    (body -> fields) of one schema.  A run of ints, with the length or count
    prefix that follows it, is one precompiled Struct.  ``joined``: the decoder gives
    a ``blobs`` field as one ``Joined``."""
    names = [n for n, _ in schema]
    kinds = [k for _, k in schema]
    assert all(k in _KINDS for k in kinds), schema
    assert "rest" not in kinds[:-1], schema
    ns = dict(_GLOBALS)
    if joined:
        ns["_dec_blobs"] = _dec_blobs_joined
    structs: list[struct.Struct] = []

    def struct_name(fmt: str) -> str:
        structs.append(struct.Struct(">" + fmt))
        ns[f"_s{len(structs) - 1}"] = structs[-1]
        return f"_s{len(structs) - 1}"

    # ---- encoder: parts of the body, joined by the caller
    enc: list[str] = []
    parts: list[str] = []
    fmt = ""
    args: list[str] = []

    def enc_flush() -> None:
        nonlocal fmt, args
        if fmt:
            parts.append(f"{struct_name(fmt)}.pack({', '.join(args)})")
            fmt, args = "", []

    for i, (name, kind) in enumerate(schema):
        v = f"v{i}"
        if kind in _INT:
            fmt += _INT[kind]
            args.append(f"f[{name!r}]")
            continue
        if kind == "rest":
            enc_flush()
            parts.append(f"f[{name!r}]")
            continue
        if kind == "str":
            enc.append(f"{v} = _str_encode(f[{name!r}])")
            length, data = f"len({v})", v
        elif kind == "json":
            enc.append(f"{v} = _json_dumps(f[{name!r}])")
            length, data = f"len({v})", v
        elif kind == "blob":
            enc.append(f"{v} = f[{name!r}]")
            length, data = f"len({v})", v
        else:  # a list
            enc.append(f"{v} = _seq(f[{name!r}])")
            length, data = f"_count({v})", f"_enc_{kind}({v})"
        fmt += _PREFIXED[kind]
        args.append(length)
        enc_flush()
        parts.append(data)
    enc_flush()
    enc_src = "def _enc(f):\n" + "".join(f"    {line}\n" for line in enc)
    enc_src += f"    return ({''.join(p + ', ' for p in parts)})\n"

    # ---- decoder
    dec: list[str] = []
    fmt = ""
    targets: list[str] = []
    fixed = all(k in _INT for k in kinds)

    def dec_flush() -> None:
        nonlocal fmt, targets
        if fmt:
            s = struct_name(fmt)
            dec.append(f"{''.join(x + ', ' for x in targets)}= {s}.unpack_from(body, pos)")
            dec.append(f"pos += {structs[-1].size}")
            fmt, targets = "", []

    def take(var: str, ln: str, what: str) -> None:  # var = body[pos:pos+ln], checked
        dec.append(f"end = pos + {ln}")
        dec.append(f"if end > n: raise _bad('truncated {what} of the {t.name} body')")
        dec.append(f"{var} = body[pos:end]")
        dec.append("pos = end")

    if fixed and kinds:
        s = struct_name("".join(_INT[k] for k in kinds))
        dec.append(f"if len(body) != {structs[-1].size}:")
        dec.append(f"    raise _bad(f'the {t.name} body is {structs[-1].size} bytes, not {{len(body)}}')")
        dec.append(f"{''.join(f'x{i}, ' for i in range(len(kinds)))}= {s}.unpack(body)")
    elif kinds:
        dec.append("n = len(body)")
        dec.append("pos = 0")
        for i, (name, kind) in enumerate(schema):
            v = f"x{i}"
            if kind in _INT:
                fmt += _INT[kind]
                targets.append(v)
                continue
            if kind == "rest":
                dec_flush()
                dec.append(f"{v} = body[pos:]")
                dec.append("pos = n")
                continue
            fmt += _PREFIXED[kind]
            targets.append("ln")
            dec_flush()
            if kind in ("str", "blob", "json"):
                take(v, "ln", name)
                if kind == "str":
                    dec.append(f"{v} = {v}.decode()")
                elif kind == "json":
                    dec.append(f"{v} = _json_loads({v}.decode())")
                continue
            dec.append("if ln > _options.MAX_BATCH:")
            dec.append(f"    raise _bad(f'{{ln}} {name} in the {t.name} body (the limit is "
                       f"{{_options.MAX_BATCH}})')")
            dec.append(f"{v}, pos = _dec_{kind}(body, pos, n, ln, '{name} of the {t.name} body')")
        dec_flush()
        if kinds[-1] != "rest":
            dec.append(f"if pos != n: raise _bad(f'{{n - pos}} bytes past the end of the {t.name} body')")
    else:
        dec.append(f"if body: raise _bad(f'the {t.name} body is empty, not {{len(body)}} bytes')")
    fields = ", ".join(f"{n!r}: x{i}" for i, n in enumerate(names))
    dec.append(f"return {{{fields}}}")
    dec_src = "def _dec(body):\n" + "".join(f"    {line}\n" for line in dec)

    exec(compile(enc_src, f"<shmq.protocol.codec encoder of {t.name}>", "exec"), ns)
    exec(compile(dec_src, f"<shmq.protocol.codec decoder of {t.name}>", "exec"), ns)
    return ns["_enc"], ns["_dec"]


# A type's encoder and decoder are compiled at its first use: a one-shot client (a CLI
# call) compiles the few it uses, not all of them (about 20 ms at import).
_CODERS: dict[int, tuple[Callable[[dict[str, Any]], tuple[Any, ...]], Callable[[bytes], dict[str, Any]]]] = {}
_NAMES: dict[int, frozenset[str]] = {t: frozenset(n for n, _ in schema) for t, schema in SCHEMAS.items()}


def _coders(type: int) -> tuple[Callable[[dict[str, Any]], tuple[Any, ...]],
                                Callable[[bytes], dict[str, Any]]] | None:
    """The encoder and decoder of a message type (None: no such type), compiled once."""
    found = _CODERS.get(type)
    if found is None and type in _NAMES:
        t = T(type)
        found = _CODERS[type] = _compile(t, SCHEMAS[t])
    return found


def body_parts(type: int, fields: dict[str, Any]) -> tuple[Any, ...]:
    coders = _CODERS.get(type) or _coders(type)
    if coders is None:
        raise ValueError(f"unknown message type {type!r}")
    if fields.keys() != _NAMES[type]:
        want, got = _NAMES[type], set(fields)
        raise ValueError(f"{TYPES[type].name} fields: missing {sorted(want - got)}, "
                         f"unexpected {sorted(got - want)}")
    try:
        return coders[0](fields)
    except (struct.error, OverflowError) as e:  # an int out of range, a str over 65535 bytes, ...
        raise ValueError(f"bad {TYPES[type].name} field: {e}") from None


def encode_body(type: int, **fields: Any) -> bytes:
    """The body of a ``type`` frame from its fields (all of them, by name; see
    :data:`SCHEMAS`).  A missing, unexpected or out-of-range field is a
    ``ValueError``."""
    return b"".join(body_parts(type, fields))


_JOINED: dict[int, Callable[[bytes], dict[str, Any]]] = {}


def decode_joined(type: int, body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """``decode_body`` of a PRODUCE_BATCH or PRODUCE_IDEMPOTENT, its ``payloads`` as one
    ``Joined`` (a view of ``body``: no object per payload).  The same checks and errors."""
    dec = _JOINED.get(type)
    if dec is None:
        if type not in (T.PRODUCE_BATCH, T.PRODUCE_IDEMPOTENT):
            raise ValueError(f"decode_joined reads PRODUCE_BATCH or PRODUCE_IDEMPOTENT, not {type!r}")
        dec = _JOINED[type] = _compile(T(type), SCHEMAS[T(type)], joined=True)[1]
    return decode_body(type, body, dec)


def decode_body(type: int, body: bytes | bytearray | memoryview,
                dec: Callable[[bytes], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The fields of a ``type`` body, by name (``dec``: another decoder of that type's,
    ``decode_joined``'s).  Any malformed body (truncated, trailing bytes, bad UTF-8 or
    JSON, a count over ``options.MAX_BATCH``) raises ProtocolError(PROTOCOL_ERROR); an
    unknown type, ProtocolError(INVALID_TYPE)."""
    if dec is None:
        coders = _CODERS.get(type) or _coders(type)
        if coders is None:
            raise ProtocolError(f"unknown message type {type!r}", Status.INVALID_TYPE)
        dec = coders[1]
    if body.__class__ is not bytes:
        body = bytes(body)
    try:
        return dec(body)  # type: ignore[arg-type]
    except ProtocolError:
        raise
    except (struct.error, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON
        raise ProtocolError(f"malformed {TYPES[type].name} body: {e}", Status.PROTOCOL_ERROR) from None

