"""The server's side of one client connection, with no I/O (as h11's ``Connection``).

::

    bytes ──► receive() ──► frames ──► (shmq.server.handlers) ──► send(), reply(), error()
                 │                                                       │
           ProtocolError: ERROR 0 and close                 outbox, or the sink at once
                                                          (the driver's transport.write)

States: ``HANDSHAKE`` (only a HANDSHAKE may come; ``placed`` says whether the
connection may still be handed to another worker) → ``READY`` → ``CLOSED``.
Everything that belongs to the connection and not to a queue lives here: its
leases (:class:`Leases`), its subscriptions and their credit, its produces
parked for room (so that its later produces to that queue wait behind them),
and the replies of one read, held to go out in one write.

The driver (``shmq.server.driver``) feeds it bytes and gives it a sink; tests
give it a list (``tests/server/test_handlers.py``).
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from shmq import options
from shmq.core.serverqueue import ServerQueue
from shmq.errors import LimitExceeded, ProtocolError, StaleAck, Status
from shmq.protocol.codec import Frame, FrameDecoder, T, decode_body, encode_body, encode_frame, frame


class State(enum.Enum):
    HANDSHAKE = "handshake"  # nothing but a HANDSHAKE is read
    READY = "ready"
    CLOSED = "closed"


@dataclass(slots=True, eq=False)
class Subscription:
    """A push subscription: the broker sends up to ``credit`` messages ahead."""

    conn: ServerConnection
    sub_id: int  # the SUBSCRIBE's message id: its pushes carry it
    queue: str
    group: str
    credit: int
    vis_ms: int  # 0: the queue's visibility timeout


class Leases:
    """The leases one connection holds: {(queue, group reference): {offset: deliveries}}.

    A lease is ours from its delivery until it is settled, found stale, or given
    back when the connection goes.  ``count`` (all queues) is bounded by
    ``options.MAX_INFLIGHT_PER_CONNECTION``."""

    __slots__ = ("held", "count")

    NONE: dict[int, int] = {}  # the leases of a queue and group we hold none of (never written)

    def __init__(self) -> None:
        self.held: dict[tuple[ServerQueue, int], dict[int, int]] = {}
        self.count = 0

    def check_room(self, n: int) -> None:
        """Raise :class:`LimitExceeded` when ``n`` more would pass the limit (leases whose
        queue or group is gone not counted: ``forget_gone``)."""
        if self.count + n > options.MAX_INFLIGHT_PER_CONNECTION:
            self.forget_gone()
        if self.count + n > options.MAX_INFLIGHT_PER_CONNECTION:
            raise LimitExceeded(f"this connection holds {self.count} unacknowledged messages; "
                                f"the limit is {options.MAX_INFLIGHT_PER_CONNECTION}")

    def room(self) -> int:
        if self.count >= options.MAX_INFLIGHT_PER_CONNECTION:
            self.forget_gone()
        return options.MAX_INFLIGHT_PER_CONNECTION - self.count

    def forget_gone(self) -> int:
        """Drop the leases of queues deleted and groups deleted since (by anyone, anywhere):
        nobody can settle them any more (an ack is stale), so they stop counting.  The
        number dropped.  Called by the delete, for its own connection, and wherever room
        runs out, for the others."""
        gone = [key for key in self.held if key[0].deleted or not key[0].group_live(key[1])]
        n = sum(len(self.held.pop(key)) for key in gone)
        self.count -= n
        return n

    def add(self, q: ServerQueue, ref: int, offsets: Any, deliveries: Any) -> None:
        held = self.held.get((q, ref))
        if held is None:
            held = self.held[(q, ref)] = {}
        before = len(held)
        held.update(zip(offsets, deliveries, strict=True))
        self.count += len(held) - before

    def of(self, q: ServerQueue, ref: int) -> dict[int, int]:
        """The leases of one queue and group (``NONE``, read-only, when there are none)."""
        return self.held.get((q, ref), Leases.NONE)

    def require(self, q: ServerQueue, ref: int, offset: int, deliveries: int) -> dict[int, int]:
        """The leases a settle names, checking that this one is ours (:class:`StaleAck`)."""
        held = self.held.get((q, ref), Leases.NONE)
        if held.get(offset) != deliveries:
            raise StaleAck(f"message {offset} (delivery {deliveries}) of {q.name!r} is not leased to "
                           "this connection")
        return held

    def settled(self, held: dict[int, int], offset: int) -> None:
        """Settled, or found stale: either way no longer ours."""
        if held.pop(offset, None) is not None:
            self.count -= 1

    def take(self, held: dict[int, int], offsets: list[int], asked: list[int]
             ) -> tuple[list[int], list[int], list[int]]:
        """Settling many leases of ``held``: (offsets ours, their deliveries, offsets stale).
        Ours are no longer ours afterwards; a lease of which we hold another delivery
        stays."""
        had = list(map(held.pop, offsets, repeat(None)))  # (at C speed)
        if had == asked:  # all of them ours (the usual case)
            self.count -= len(offsets)
            return offsets, asked, []
        mine: list[int] = []
        dcs: list[int] = []
        stale: list[int] = []
        for o, dc, h in zip(offsets, asked, had, strict=True):
            if h == dc:
                mine.append(o)
                dcs.append(dc)
            else:
                stale.append(o)
                if h is not None:  # we hold another delivery of it: still ours
                    held[o] = h
        self.count -= len(mine)
        return mine, dcs, stale

    def drain(self) -> Iterator[tuple[ServerQueue, int, dict[int, int]]]:
        """Every lease, removed: (queue, group reference, {offset: deliveries})."""
        held, self.held, self.count = self.held, {}, 0
        for (q, ref), leases in held.items():
            yield q, ref, leases


Sink = Callable[[bytes], None]


def agree_heartbeat(server_s: float, client_ms: int) -> int:
    """The heartbeat interval of a connection, in ms: the shorter of the two ends'
    proposals, and none (0) when either end wants none."""
    ours = round(server_s * 1000)
    return 0 if not ours or not client_ms else min(ours, client_ms)


class ServerConnection:
    """One client connection's protocol state (no I/O)."""

    def __init__(self, token: str = "", sink: Sink | None = None, placed: bool = False) -> None:
        self._token = token.encode()
        self.sink = sink  # where replies go when they are not held (None: held until data_to_send)
        self.state = State.HANDSHAKE
        self.placed = placed  # it stays with this worker (handed over already, or it pipelined)
        self.decoder = FrameDecoder()
        self.leases = Leases()
        self.subs: dict[int, Subscription] = {}
        self.reply_queues: set[str] = set()  # reply queues it created: deleted when it closes
        self.parked_produces: dict[str, int] = {}  # queue -> produces of ours waiting for room there
        self.busy = False  # a request is being handled (a graceful stop waits for it)
        self.trusted = False  # the peer's uid is ours (a Unix socket's SO_PEERCRED): no token needed
        self.peer = ""  # who is at the other end: an IP address, or "uid N" on a Unix socket
        self.heartbeat = 0.0  # s between HEARTBEATs each way, agreed in the handshake (0: none)
        self._out: list[bytes] | None = None  # replies held to go out in one write

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    # ------------------------------------------------------------ input
    def receive(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data`` (:class:`ProtocolError` on a malformed stream:
        answer with :meth:`error` for message id 0, then close).  Several frames in one
        read are a pipelining client: the connection stays where it is, and its replies
        are held (:meth:`hold`) to go out together."""
        frames = self.decoder.feed(data)
        if len(frames) > 1:
            self.placed = True
        return frames

    def check_handshake(self, f: Frame) -> dict[str, Any] | None:
        """The fields of a HANDSHAKE whose token is right (compared in constant time), None
        when it is wrong or missing (answer with :meth:`refuse_handshake`, then close).
        :class:`ProtocolError` on a malformed one."""
        try:
            fields = decode_body(T.HANDSHAKE, f.body)
        except ProtocolError:  # a client from before heartbeats: its body lacks heartbeat_ms, so
            fields = decode_body(T.HANDSHAKE, bytes(f.body) + bytes(4))  # it reads as 0, none
        token = fields["token"].encode()
        # a trusted peer (our own uid on the Unix socket) needs no token, but one it presents
        # must be right: a wrong token is refused wherever it comes from
        if self._token and (token or not self.trusted) and not hmac.compare_digest(token, self._token):
            return None
        return fields

    def refuse_handshake(self, f: Frame, reason: str = "bad or missing token") -> None:
        self.reply(f, T.HANDSHAKE_NACK, reason=reason)

    def may_move(self) -> bool:
        """May the connection be handed to another worker now?  Once, right after its
        HANDSHAKE, if it sent nothing more.  Asking settles it: it stays afterwards."""
        move = not self.placed and not self.decoder.buffered
        self.placed = True
        return move

    def accept(self, f: Frame, worker: int, server: str, heartbeat_ms: int = 0) -> None:
        """Answer the HANDSHAKE ``f`` with the heartbeat interval agreed (``heartbeat``):
        the connection is READY."""
        self.state = State.READY
        self.heartbeat = heartbeat_ms / 1000
        self.reply(f, T.HANDSHAKE_ACK, worker=worker, max_frame=self.decoder.max_frame, server=server,
                   heartbeat_ms=heartbeat_ms)

    # ------------------------------------------------------------ output
    def send(self, data: bytes) -> None:
        if self.state is State.CLOSED:
            return
        if self._out is not None or self.sink is None:
            if self._out is None:
                self._out = []
            self._out.append(data)
        else:
            self.sink(data)

    def error(self, msg_id: int, status: int, message: str) -> None:
        self.send(encode_frame(T.ERROR, msg_id, encode_body(T.ERROR, message=message[:1000]), int(status)))

    def reply(self, f: Frame, type_: int, **fields: Any) -> None:
        self.send(frame(type_, f.msg_id, **fields))

    def hold(self) -> bool:
        """Hold what is sent until :meth:`flush` (one write for many replies).  False when
        it was held already (the caller that started holding flushes)."""
        if self._out is not None:
            return False
        self._out = []
        return True

    def data_to_send(self) -> bytes:
        """What is held, taken (empty when nothing is)."""
        out, self._out = self._out, None
        return b"".join(out) if out else b""

    def flush(self) -> None:
        """Send what is held to the sink."""
        data = self.data_to_send()
        if data and self.sink is not None and self.state is not State.CLOSED:
            self.sink(data)

    def close(self) -> bool:
        """CLOSED (what is held is flushed first).  False when it was closed already."""
        if self.state is State.CLOSED:
            return False
        self.flush()
        self.state = State.CLOSED
        return True

    def refuse(self, status: int, message: str) -> None:
        """Refused as it arrives (too many connections, a stopping worker): an ERROR for
        message id 0, and nothing read from it is handled."""
        self.error(0, status, message)
        self.flush()
        self.state = State.CLOSED


__all__ = ["Leases", "ServerConnection", "Sink", "State", "Status", "Subscription"]
