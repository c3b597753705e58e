"""A kombu message as a shmq message, and back.

The payload is the message's body, as bytes (a ``str`` body is UTF-8 encoded, as kombu's
virtual transports deliver it), never base64'd: ``shmq consume celery`` shows a task's
JSON.  Everything else kombu gives a message -- its properties (``correlation_id``,
``reply_to``, ``priority``, ``expiration``, ...), its headers, content type and encoding,
the exchange and routing key it was published with -- is one JSON object in the header
``kombu`` (with kombu's JSON: a ``datetime``, ``Decimal`` or ``UUID`` in the headers comes
back as one).  When that object is too large for a header block
(``options.MAX_HEADERS_BYTES``), the header ``kombu-len`` gives its length and it goes
before the body in the payload.  A message with neither header (put by a plain shmq
producer) is a body of type ``application/data`` whose shmq headers are its headers.

The property ``expiration`` (milliseconds, as kombu and AMQP write it) becomes the put's
``ttl``: the message expires if no consumer has had it within that time.
"""

from __future__ import annotations

from typing import Any

from kombu.utils.json import dumps, loads

from shmq import options

META = "kombu"
META_LEN = "kombu-len"
_INLINE = options.MAX_HEADERS_BYTES - 64  # what the header block leaves the object (key, lengths)
_DROPPED = ("delivery_info", "delivery_tag", "body_encoding")  # the transport's own, made again


class Encoded:
    """One kombu message ready to put: payload, headers and TTL (seconds or None)."""

    __slots__ = ("headers", "payload", "priority", "ttl")

    def __init__(self, payload: bytes, headers: dict[str, bytes | str], ttl: float | None,
                 priority: int = 0) -> None:
        self.payload = payload
        self.headers = headers
        self.ttl = ttl
        self.priority = priority  # the message's AMQP priority property (0 when it has none)


def encode(message: dict[str, Any], exchange: str, routing_key: str) -> Encoded:
    """``message`` (kombu's ``prepare_message`` dict) as published to ``exchange`` with
    ``routing_key``."""
    body = message.get("body")
    if body is None:
        body = b""
    elif isinstance(body, str):
        body = body.encode("utf-8")
    props = message.get("properties") or {}
    info = props.get("delivery_info") or {}
    meta: dict[str, Any] = {"p": {k: v for k, v in props.items() if k not in _DROPPED},
                            "h": message.get("headers") or {}, "ct": message.get("content-type"),
                            "ce": message.get("content-encoding"), "x": exchange, "k": routing_key}
    extra = {k: v for k, v in info.items() if k not in ("exchange", "routing_key")}
    if extra:
        meta["d"] = extra
    blob = dumps(meta, separators=(",", ":")).encode("utf-8")
    ttl = expiration_ttl(props.get("expiration"))
    prio = props.get("priority")
    prio = prio if isinstance(prio, int) and not isinstance(prio, bool) and prio > 0 else 0
    if len(blob) <= _INLINE:
        return Encoded(bytes(body), {META: blob}, ttl, prio)
    return Encoded(blob + bytes(body), {META_LEN: str(len(blob))}, ttl, prio)


def expiration_ttl(expiration: Any) -> float | None:
    """The TTL in seconds of AMQP's ``expiration`` property (milliseconds, a string or a
    number); None when there is none.  0 or less expires as soon as it can (1 ms)."""
    if expiration is None or expiration == "":
        return None
    try:
        ms = float(expiration)
    except (TypeError, ValueError):
        from shmq.errors import InvalidArgument
        raise InvalidArgument(f"expiration must be milliseconds (a number), not {expiration!r}") from None
    return max(ms, 1.0) / 1000.0


class Decoded:
    """What a kombu Message is made of (``decode``)."""

    __slots__ = ("body", "content_encoding", "content_type", "delivery_info", "headers", "properties")

    def __init__(self, body: bytes, properties: dict[str, Any], headers: dict[str, Any],
                 content_type: str | None, content_encoding: str | None,
                 delivery_info: dict[str, Any]) -> None:
        self.body = body
        self.properties = properties
        self.headers = headers
        self.content_type = content_type
        self.content_encoding = content_encoding
        self.delivery_info = delivery_info


def decode(payload: Any, headers: Any, redelivered: bool) -> Decoded:
    """A delivered shmq message's kombu parts (``payload``: bytes-like; ``headers``: its
    ``str`` to ``bytes`` mapping)."""
    blob = headers.get(META)
    raw = bytes(payload)
    if blob is None:
        n = headers.get(META_LEN)
        if n is None:  # put by a plain shmq producer: a body and its headers
            plain = {k: bytes(v).decode("utf-8", "replace") for k, v in headers.items()}
            info = {"exchange": "", "routing_key": "", "redelivered": redelivered}
            return Decoded(raw, {"delivery_info": info}, plain, "application/data", "binary", info)
        size = int(n)
        blob, raw = raw[:size], raw[size:]
    meta = loads(bytes(blob))
    info = dict(meta.get("d") or {})
    info.update(exchange=meta.get("x", ""), routing_key=meta.get("k", ""), redelivered=redelivered)
    props = meta.get("p") or {}
    props["delivery_info"] = info
    return Decoded(raw, props, meta.get("h") or {}, meta.get("ct"), meta.get("ce"), info)
