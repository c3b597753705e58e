"""The client's side of the wire protocol as a state machine, without I/O: :class:`ClientConnection`.

In the manner of h11's ``Connection``: no socket, thread, clock or event loop here.  A
driver -- ``shmq.client.tcp`` (a blocking socket that threads share) or ``shmq.client.aio`` (asyncio
streams and a reader task) -- asks the connection for the bytes of each request, writes
them wherever it likes, and feeds it whatever it reads; the connection answers with
events.  So both clients choose message ids, match answers to requests, keep the
errors of unwaited requests and grant subscription credit in one way::

    driver                          ClientConnection                            socket
    ------                          ----------------                            ------
    send(request, waiter)      -->  id = the first free id after the last one;
                               <--  (id, frame)   pending[id] = waiter  ------> write
    subscribe(request, credit, --> the same, but the id names a subscription:
              waiter)               subs[id] = (waiter, credit step)
    handed_out_counter(sub)()  -->  one of its messages reached the caller:
                               <--  True once a step of credit is owed, then
    grant(sub)                 <--  the CREDIT frame  --------------------------> write
    receive_data(bytes)        -->  FrameDecoder: the frames completed, each by its id
                               <--  [Reply(id, frame, waiter)    id was pending; it is not any more
                                     Push(sub, frame, waiter)    a frame of a live subscription: the
                                                                 SUBSCRIBE's answer first, then pushes
                                     NowaitFailed(error)         an unwaited request (id NO_REPLY_ID)
                                                                 failed; also kept in nowait_errors
                                     Closing(reason)]            id 0 ERROR: the broker closes next
                                    (any other frame -- an answer to a CREDIT, a push after the
                                     subscription ended -- is dropped)
    abandon(id, waiter)        -->  nobody waits for id's answer: it comes as a Reply with waiter
    end(sub)                   -->  the subscription is over (UNSUBSCRIBE_OK came, or it was refused)
    lost(reason)               -->  closed; every pending and subscription waiter is handed back
                                    once, to fail, and forgotten

A *waiter* is whatever the driver wants back with an answer (a deque for the blocking
client, a future or an asyncio.Queue for the asyncio one); the connection never looks
inside it.  A *request* (:class:`Request`, built by ``shmq.protocol.commands``) knows its frame
and how its answer becomes a result; the connection only encodes it with its id.

Invariants:

* a message id is 1 .. NO_REPLY_ID-1: never 0 (the broker's, for what is about the
  whole connection) nor NO_REPLY_ID (every unwaited request's: ACK_NO_REPLY and the like);
* the HANDSHAKE, sent before anything is heard, has the id ``HANDSHAKE_ID`` (0x0D0A): its
  header then ends in ``\r\n``, so a server of a line protocol reached by mistake (an HTTP
  server reads a request line before it answers) answers at once, and ``receive_data``
  names it, rather than both sides waiting for the connect timeout;
* an id is *in use* from ``send``/``subscribe`` until its Reply (``end`` or refusal for a
  subscription) or ``lost``, and no id in use is given out again; ids go up from the last
  one given, wrapping after NO_REPLY_ID-1 (a CREDIT's id, which is never answered, is not
  in use after it is made);
* every request sent gets exactly one Reply, or its waiter comes back from ``lost``;
* once closed, nothing more is sent (``send`` raises ConnectionLost) and nothing is waited for.

Thread-safety: none as a whole.  The blocking client makes every send-side call (``send``,
``subscribe``, ``grant``, ``end``) under its send lock and feeds received bytes from
one thread at a time; the two sides share only the pending and subscription tables, each
touched by single dict operations, which CPython makes atomic.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, KeysView
from typing import Any, Generic, NamedTuple, TypeVar

from shmq import options
from shmq.errors import ConnectionLost, LimitExceeded, MessageTooLarge, ProtocolError, ShmqError, Status
from shmq.protocol.codec import NO_REPLY_ID, Frame, FrameDecoder, T, error_of, frame

R = TypeVar("R")

MAX_ID = NO_REPLY_ID - 1  # request ids are 1 .. MAX_ID, wrapping
HANDSHAKE_ID = 0x0D0A  # the HANDSHAKE's: b"\r\n" ends its header, and a line-reading peer's line
NOWAIT_ERRORS = 100  # how many errors of unwaited requests are kept, the latest


class Request(NamedTuple, Generic[R]):
    """One request: its frame is ``encode(msg_id, *args)`` (a bad argument raises there,
    before anything is sent), and its answer becomes the result as ``parse(frame, ctx)``,
    which raises the typed error of an ERROR answer."""

    encode: Callable[..., bytes]
    args: tuple[Any, ...]
    parse: Callable[[Frame, Any], R]
    ctx: Any = None


class Reply(NamedTuple):
    """The answer to request ``msg_id``, which is no longer pending; ``waiter`` as given
    to ``send`` (or to ``abandon``)."""

    msg_id: int
    frame: Frame
    waiter: Any


class Push(NamedTuple):
    """A frame of live subscription ``sub_id``: the SUBSCRIBE's answer, then pushed leases."""

    sub_id: int
    frame: Frame
    waiter: Any


class NowaitFailed(NamedTuple):
    """An unwaited request (message id NO_REPLY_ID) failed; ``error`` is also in ``nowait_errors``."""

    error: ShmqError


class Closing(NamedTuple):
    """The broker is closing the connection, for ``reason`` (its message id 0 ERROR)."""

    reason: str


Event = Reply | Push | NowaitFailed | Closing

_ABSENT: Any = object()


def _steps(step: int) -> Iterator[bool]:
    """For each message handed out: False, but True for the last of each ``step``."""
    each = itertools.repeat
    while True:
        for _ in each(None, step - 1):
            yield False
        yield True


class _Subscription:
    __slots__ = ("waiter", "step", "due", "answered")

    def __init__(self, waiter: Any, credit: int) -> None:
        self.waiter = waiter
        self.step = step = max(1, credit // 2)  # credit goes back in steps of half the window
        self.due: Callable[[], bool] = _steps(step).__next__  # a generator's: cheaper than a method
        self.answered = False  # the SUBSCRIBE's answer came


class ClientConnection:
    """The protocol state of one client connection (see the module's docstring).

    ``peer`` names the other end in error messages.  ``last_id`` is the id given out
    last: the next is the first id after it that is not in use."""

    __slots__ = ("peer", "closed", "close_reason", "refused", "nowait_errors", "last_id", "max_frame",
                 "heard", "_pending", "_subs", "_decoder")

    def __init__(self, peer: str = "the broker") -> None:
        self.peer = peer
        self.closed = False
        self.close_reason = ""  # why it closed: a Closing's reason, else the first lost()'s
        self.refused = False  # the broker closes it for want of room (LIMIT_EXCEEDED): not "lost"
        self.nowait_errors: deque[ShmqError] = deque(maxlen=NOWAIT_ERRORS)  # the latest, oldest first
        self.last_id = 0
        self.max_frame = options.MAX_FRAME  # the broker's limit: a larger request is never sent
        self.heard = False  # a frame came from the peer: it speaks the protocol
        self._pending: dict[int, Any] = {}  # request id -> its waiter
        self._subs: dict[int, _Subscription] = {}  # subscription (its SUBSCRIBE's) id -> its state
        self._decoder = FrameDecoder()

    def __repr__(self) -> str:
        state = f"closed: {self.close_reason}" if self.closed else "open"
        return (f"ClientConnection({self.peer!r}, {state}, {len(self._pending)} pending, "
                f"{len(self._subs)} subscriptions)")

    @property
    def pending(self) -> KeysView[int]:
        """The ids of the requests sent and not answered yet (a live view)."""
        return self._pending.keys()

    @property
    def subscriptions(self) -> KeysView[int]:
        """The ids of the live subscriptions (a live view)."""
        return self._subs.keys()

    def lost_error(self) -> ConnectionLost | LimitExceeded:
        """The error of a request on this connection once it is closed (or closing):
        :class:`LimitExceeded` when the broker refused it for want of room (too many
        connections; its descriptor limit), else :class:`ConnectionLost`."""
        cls = LimitExceeded if self.refused else ConnectionLost
        return cls(f"connection to {self.peer} {self.close_reason or 'is closed'}")

    # ------------------------------------------------------------ sending
    def _next_id(self) -> int:
        i = self.last_id
        pending, subs = self._pending, self._subs
        while True:  # ends: far fewer than MAX_ID ids can be in use at once
            i = i % MAX_ID + 1
            if i not in pending and i not in subs:
                self.last_id = i
                return i

    def send(self, request: Request[Any], waiter: Any = None) -> tuple[int, bytes]:
        """The id and the frame of ``request``, pending from now on with ``waiter``.
        Raises ConnectionLost once closed, MessageTooLarge for a frame over the broker's
        limit (which would close the connection), and what ``request.encode`` raises;
        then nothing is pending and the connection stays usable."""
        if self.closed:
            raise self.lost_error()
        if not self.heard and request.args[:1] == (T.HANDSHAKE,) and HANDSHAKE_ID not in self._pending:
            msg_id = HANDSHAKE_ID  # (see the invariants: a line-reading peer answers it at once)
        else:
            msg_id = self._next_id()
        data = request.encode(msg_id, *request.args)
        if len(data) > self.max_frame:
            raise MessageTooLarge(f"a request of {len(data)} bytes is over the frame limit of "
                                  f"{self.max_frame} bytes ({self.peer} would close the connection): "
                                  "nothing was sent")
        self._pending[msg_id] = waiter
        return msg_id, data

    def subscribe(self, request: Request[Any], credit: int, waiter: Any = None) -> tuple[int, bytes]:
        """As ``send`` for a SUBSCRIBE of ``credit``: its id names the subscription, whose
        every frame (its answer first) comes as a Push with ``waiter`` until ``end``.  A
        SUBSCRIBE answered with ERROR ends it at once (the broker made none)."""
        sub_id, data = self.send(request)
        del self._pending[sub_id]  # (nothing is received meanwhile: the frame is not sent yet)
        self._subs[sub_id] = _Subscription(waiter, credit)
        return sub_id, data

    def handed_out_counter(self, sub_id: int) -> Callable[[], bool]:
        """What the consumer of subscription ``sub_id`` calls as each of its messages
        reaches the caller: the credit of handed-out messages goes back to the broker in
        steps of max(1, credit // 2), and the call returns True when a step is complete
        -- then ``grant`` makes the CREDIT to send.  It runs once per message, so it is a
        generator's ``__next__``, and takes no id (the blocking client calls it without its
        send lock)."""
        return self._subs[sub_id].due

    def grant(self, sub_id: int) -> bytes:
        """The CREDIT frame giving subscription ``sub_id`` back one step of credit (b""
        once the subscription is over)."""
        s = self._subs.get(sub_id)
        if s is None:
            return b""
        return frame(T.CREDIT, self._next_id(), subscription=sub_id, credit=s.step)

    def end(self, sub_id: int) -> Any:
        """Forget subscription ``sub_id``: after its UNSUBSCRIBE_OK nothing more comes for
        it (the broker answers in order), so its id is free again.  Its waiter, or None
        when it was over already."""
        s = self._subs.pop(sub_id, None)
        return None if s is None else s.waiter

    def abandon(self, msg_id: int, waiter: Any = None) -> None:
        """Nobody waits for request ``msg_id``'s answer any more (a cancelled caller): it
        still comes as a Reply, with ``waiter`` now, so that the driver can undo what the
        request did (give leases back); until then its id stays in use."""
        if msg_id in self._pending:
            self._pending[msg_id] = waiter

    # ------------------------------------------------------------ receiving
    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """The events of the frames completed by ``data`` (bytes as they were read: a
        frame may span calls).  A malformed frame raises ProtocolError, and so does every
        later call: the driver then calls ``lost``.  A peer whose very first bytes are no
        frame is named for what it looks like (an HTTP, Redis or TLS server, ...)."""
        events: list[Event] = []
        append = events.append
        pending, subs = self._pending, self._subs
        new = tuple.__new__  # Reply(...) and Push(...) without their Python __new__: one per frame
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as e:
            if self.heard or e.code != Status.BAD_MAGIC:
                raise
            raise ProtocolError(f"{self.peer} is not a shmq broker: {describe_peer(bytes(data[:64]))}",
                                Status.BAD_MAGIC) from None
        if frames:
            self.heard = True
        for f in frames:
            i = f.msg_id
            w = pending.pop(i, _ABSENT)
            if w is not _ABSENT:
                append(new(Reply, (i, f, w)))
                continue
            s = subs.get(i)
            if s is not None:
                if not s.answered:
                    s.answered = True
                    if f.type == T.ERROR:  # refused: the broker made no subscription
                        del subs[i]
                append(new(Push, (i, f, s.waiter)))
            elif f.type != T.ERROR:
                continue  # a HEARTBEAT, the answer to a CREDIT, or a push after its subscription ended
            elif i == NO_REPLY_ID:
                err = error_of(f)
                self.nowait_errors.append(err)
                append(NowaitFailed(err))
            elif i == 0:  # about the connection: the broker closes it next
                self.close_reason = f"closed by the broker: {error_of(f)}"
                self.refused = f.status == Status.LIMIT_EXCEEDED
                append(Closing(self.close_reason))
        return events

    def lost(self, reason: str) -> list[Any]:
        """The connection is gone (closed by either end, reset, unreadable): closed from
        now on, with ``reason`` unless a reason was known already (``close_reason``).
        The waiters of every pending request and live subscription, for the driver to
        fail; they are forgotten here, so each is handed back once."""
        if not self.close_reason:
            self.close_reason = reason
        self.closed = True
        waiters = list(self._pending.values())  # copied in one C call: another thread may be sending
        waiters += [s.waiter for s in list(self._subs.values())]
        self._pending.clear()
        self._subs.clear()
        return waiters


def describe_peer(first: bytes) -> str:
    """What a peer that does not speak the protocol looks like, from the first bytes it sent."""
    line = first.split(b"\r\n", 1)[0][:60].decode("latin-1")
    if first.startswith(b"HTTP/"):
        return f"it answered like an HTTP server ({line!r})"
    if first.lstrip()[:1] == b"<" and b"html" in first.lower():  # an HTTP/0.9 answer: no status line
        page = first.lstrip().split(b"\n", 1)[0].strip()[:60].decode("latin-1")
        return f"it answered like an HTTP server (an HTML page: {page!r})"
    if first[:1] in (b"\x15", b"\x16") and first[1:2] == b"\x03":
        return "it answered like a TLS server"
    if first[:1] and first[:1] in b"+-:$*%_#,(=~>|" and b"\r\n" in first:
        return f"it answered like a Redis server ({line!r})"
    if first.startswith(b"AMQP"):
        return "it answered like an AMQP broker (RabbitMQ?)"
    if first.startswith(b"SSH-"):
        return f"it answered like an SSH server ({line!r})"
    return f"its first bytes, 0x{first[:8].hex()}, are no shmq frame (magic 0xdeadbeef)"


__all__ = ["HANDSHAKE_ID", "MAX_ID", "ClientConnection", "Closing", "Event", "NowaitFailed", "Push", "Reply",
           "Request", "describe_peer"]
