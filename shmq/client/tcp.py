"""``tcp://``: the same ``api.Broker`` interface over the wire protocol (``codec``).

A thin driver: the protocol's state (message ids, answers, unwaited acks' errors,
subscription credit) is a :class:`~shmq.protocol.connection.ClientConnection`, and every
command is ``shmq.protocol.commands``'s, shared with the asyncio client (``shmq.client.aio``).  What is
this module's own is the blocking I/O: one socket per broker handle, which threads
may share -- one sends at a time (the send lock), and whoever needs an answer and
finds nobody reading reads for everyone, filing each answer in the box of the thread
waiting for it, while the others wait on a condition.  A handle pickles as its URL
and reconnects in the child.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import weakref
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from shmq import options
from shmq.api import (
    Broker,
    BrokerInfo,
    Headers,
    Message,
    Payload,
    Queue,
    QueueInfo,
    RecordColumns,
    group_as_block,
    shares_docs,
)
from shmq.api.reply import end_requests
from shmq.errors import ConnectionLost, GroupExists, ProtocolError, ShmqError
from shmq.joined import Joined
from shmq.protocol import commands as cmd
from shmq.protocol import group_commands as gcmd
from shmq.protocol.codec import HEARTBEAT_FRAME
from shmq.protocol.commands import Batch, Command, batch_acks, batch_payloads, settles_by_group
from shmq.protocol.connection import ClientConnection, Push, Reply, Request
from shmq.protocol.consume_ack import rides
from shmq.protocol.subscription import Feed
from shmq.seektime import Start, When
from shmq.settle import Settle
from shmq.spin import Spin, check_spin_us, recv_into
from shmq.urls import BrokerUrl, client_settings, parse_tcp_url

RECV_SIZE = 1 << 18  # bytes one read takes at most
MSG_MORE = getattr(socket, "MSG_MORE", 0)  # Linux: hold a frame for the next send

R = TypeVar("R")
Box = deque[Any]  # where the reader files the frames one waiter waits for


@shares_docs(Broker)
class TcpBroker(Broker):
    """A broker handle talking to ``shmq serve``."""

    def __init__(self, url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                 client: str = "shmq-python", affinity: str = "",
                 heartbeat: float = options.HEARTBEAT, spin_us: float = options.CLIENT_SPIN_US) -> None:
        self.spin_us = check_spin_us(spin_us)
        u, self._token = client_settings(url, token)  # refused here: a token in clear text off loopback
        self.url = url = u.without_token()  # (in errors, logs and pickles: the token travels apart)
        self.affinity = affinity
        self._heartbeat = heartbeat  # what we propose; self.heartbeat is what was agreed
        self._conn = ClientConnection(url)
        self._lock = threading.Lock()  # one sender at a time: it picks the message id and writes
        self._cond = threading.Condition(threading.Lock())  # guards _reading; wakes the waiters
        self._reading = False
        self._waiting = 0  # threads waiting on the condition for another's read
        self._rbuf = bytearray(RECV_SIZE)  # reused by every read: no allocation per recv
        self._rview = memoryview(self._rbuf)
        self._spin = Spin(0)  # the handshake reads with a timeout: no polling before it is done
        self._received = 0  # bytes read so far: the heartbeat thread's sign of life
        self._seen = 0  # ..._received when the heartbeat thread last looked
        self._stop_beating = threading.Event()
        self.nowait_errors = self._conn.nowait_errors  # the latest errors of unwaited acks
        self._sock = _open_socket(u, connect_timeout)
        try:  # the handshake is bounded by connect_timeout too: a peer that never answers is no broker
            self.worker, self.server, self.heartbeat = self._execute(
                cmd.handshake(self._token, client, affinity, heartbeat))
        except BaseException as e:
            self._conn.lost("the handshake failed")
            self._sock.close()
            if u.tls and isinstance(e, ConnectionLost):  # closed during TLS: a client certificate?
                from shmq import tls
                raise tls.handshake_lost(e, u) from None
            raise
        self._sock.settimeout(None)
        if isinstance(self._sock, socket.socket):  # (not a TLS stream: it reads whole records)
            self._spin = Spin(spin_us)
        if self.heartbeat:
            threading.Thread(target=_beating, args=(weakref.ref(self), self._stop_beating, self.heartbeat),
                             name=f"shmq heartbeat {url}", daemon=True).start()

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_reconnect, (self.url, self._token, self.affinity, self._heartbeat, self.spin_us))

    def __repr__(self) -> str:
        return f"TcpBroker({self.url!r})"

    # ------------------------------------------------------------ transport
    def _sendall(self, data: bytes, flags: int = 0) -> None:
        """Write ``data`` (the send lock is held)."""
        try:
            self._sock.sendall(data, flags)
        except OSError as e:
            self._conn.lost(f"lost: {e}")
            raise self._conn.lost_error() from None

    def _send_frame(self, data: bytes, flags: int = 0) -> None:
        """Write a frame made already (an unwaited request's)."""
        with self._lock:
            if self._conn.closed:
                raise self._conn.lost_error()
            self._sendall(data, flags)

    def _send_no_reply(self, data: bytes) -> None:
        """Send a request frame (message id NO_REPLY_ID) that is answered only if it fails
        (ACK_NO_REPLY, ACK_BATCH_NO_REPLY, ACK_RANGE_NO_REPLY; the reader keeps such errors
        in ``nowait_errors``).  The kernel may hold the frame back (``MSG_MORE``) until this
        connection's next request, its close, or its cork timer (about 200 ms on Linux),
        whichever comes first: the next request then carries it in the same segment, and
        the broker reads both at once and applies them in order."""
        self._send_frame(data, MSG_MORE)

    def _finish(self, req: Request[R], box: Box) -> R:
        """The result of ``req``, sent by :meth:`_begin` with ``box``: its answer, parsed."""
        return req.parse(self._wait(box), req.ctx)

    def _begin(self, req: Request[Any]) -> Box:
        """Send a request; the box its answer will be filed in."""
        box: Box = deque()
        with self._lock:
            self._sendall(self._conn.send(req, box)[1])  # a bad argument raises before sending
        return box

    def _wait(self, box: Box) -> Any:
        """The next frame filed in ``box``.  Threads share the socket: whoever finds nobody
        reading reads for everyone, the others wait on the condition."""
        with self._cond:
            while True:
                if box:
                    return box.popleft()
                if self._conn.closed:
                    raise self._conn.lost_error()
                if self._reading:
                    self._waiting += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiting -= 1
                    continue
                self._reading = True
                self._cond.release()
                try:
                    self._read_some()
                finally:
                    self._cond.acquire()
                    self._reading = False
                    if self._waiting:  # the common case, one thread, skips notify_all's cost
                        self._cond.notify_all()

    def _read_some(self) -> None:
        """Read from the socket and file the frames in their waiters' boxes (this thread is
        the reader)."""
        conn = self._conn
        try:
            n = recv_into(self._sock, self._rbuf, self._spin)  # polls a while first (shmq.spin)
        except TimeoutError:  # only the handshake reads with a timeout (and a close: its reason is set)
            conn.lost(f"did not answer the handshake within {self._sock.gettimeout()} s: "
                      "is it a shmq broker?")
            raise conn.lost_error() from None
        except OSError as e:
            conn.lost(f"lost: {e}")
            raise conn.lost_error() from None
        if not n:
            conn.lost("closed by the broker")
            raise conn.lost_error()
        self._received += n
        try:
            events = conn.receive_data(self._rview[:n])
        except ProtocolError as e:  # raised here; the other threads get ConnectionLost
            conn.lost(f"closed: the broker sent a malformed frame ({e})")
            raise
        for ev in events:
            if ev.__class__ is Reply or ev.__class__ is Push:
                ev.waiter.append(ev.frame)  # type: ignore[union-attr]

    def _execute(self, command: Command[R]) -> R:
        """Run a command of ``shmq.protocol.commands``: send it, wait for its answers, its result."""
        if isinstance(command, Batch):
            for data in command.nowait:
                self._send_no_reply(data)
            boxes = [(req, self._begin(req)) for req in command.requests]  # pipelined
            return command.combine([self._finish(req, box) for req, box in boxes])
        box: Box = deque()  # as _begin, inlined: the one-request commands are the hot path
        with self._lock:
            self._sendall(self._conn.send(command, box)[1])
        return command.parse(self._wait(box), command.ctx)

    # ------------------------------------------------------------ heartbeats
    def _beat(self, quiet: int) -> int:
        """One heartbeat interval (the heartbeat thread's): a HEARTBEAT out, whatever came
        in read if nobody else reads, and the count of intervals in a row in which nothing
        came, returned.  After ``options.HEARTBEAT_MISSES`` the broker is dead or frozen:
        the connection is lost, and whoever waits on it raises ConnectionLost.  -1: stop."""
        conn = self._conn
        if conn.closed:
            return -1
        if self._lock.acquire(timeout=self.heartbeat):  # not: a send is stuck (the broker reads nothing)
            try:
                if not conn.closed:
                    self._sock.sendall(HEARTBEAT_FRAME)
            except OSError as e:
                return self._went(f"lost: {e}")
            finally:
                self._lock.release()
        self._drain()
        if self._received != self._seen:  # something came in this interval
            self._seen = self._received
            return 0
        quiet += 1
        if quiet < options.HEARTBEAT_MISSES:
            return quiet
        return self._went(f"went silent: no heartbeat from the broker for {quiet * self.heartbeat:.3g} s")

    def _drain(self) -> None:
        """Read what has come, if nobody is reading and it can be read without waiting: a
        handle nobody uses still hears the broker's heartbeats (and its socket buffer never
        fills with them)."""
        with self._cond:
            if self._reading or self._conn.closed:
                return
            sock = self._sock
            poll = select.poll()
            poll.register(sock, select.POLLIN)
            pending = getattr(sock, "pending", None)  # a TLS socket's bytes decrypted already
            if not poll.poll(0) and not (pending and pending()):
                return
            self._reading = True
        try:
            self._read_some()
        except ShmqError:
            pass  # the connection is lost: whoever waits on it hears so
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _went(self, reason: str) -> int:
        """The connection is lost for ``reason``: a reader blocked in recv wakes (shutdown)
        and raises, and so does every thread that waits."""
        self._conn.lost(reason)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._cond:
            self._cond.notify_all()
        return -1

    # ------------------------------------------------------------ push mode
    def _subscription(self, q: TcpQueue, group: str, credit: int,
                      visibility_timeout: float | None) -> Generator[Message, None, None]:
        """``q.subscribe``'s generator (its arguments are checked at the first ``next``)."""
        feed = Feed(q, group, credit, visibility_timeout)
        box: Box = deque()
        with self._lock:
            sub, data = self._conn.subscribe(feed.request, feed.credit, box)
            handed_out = self._conn.handed_out_counter(sub)  # before a refusal can end it
            self._sendall(data)
        ready = feed.ready
        try:
            while True:
                while not ready:
                    feed.take(self._wait(box))
                if handed_out():  # the message goes out: its credit comes back, in steps
                    with self._lock:
                        self._sendall(self._conn.grant(sub))
                yield ready.popleft()
        finally:
            if not feed.refused and not self._conn.closed:
                self._execute(cmd.unsubscribe(sub))
            # nothing comes for ``sub`` after UNSUBSCRIBE_OK (the broker answers in order),
            # so what is given back now cannot be pushed to it again
            self._conn.end(sub)
            try:
                self._execute(feed.leftovers(box))
            except ConnectionLost:
                pass  # the broker gives a lost connection's leases back itself

    # ------------------------------------------------------------ Broker
    def create_queue(self, name: str, **limits: Any) -> TcpQueue:
        self._execute(cmd.create_queue(name, limits))
        return TcpQueue(self, name)

    def queue(self, name: str) -> TcpQueue:
        q = TcpQueue(self, name)
        q.stats()  # raises QueueNotFound now rather than on first use
        return q

    def list_queues(self) -> list[QueueInfo]:
        return self._execute(cmd.list_queues())

    def delete_queue(self, name: str) -> None:
        self._execute(cmd.delete_queue(name))

    def info(self) -> BrokerInfo:
        return self._execute(cmd.info())

    def promote(self, force: bool = False) -> int:
        """Make this broker, a standby (``shmq serve --replica-of``), the primary: its new epoch
        (``shmq promote``).  ``force``: even while its primary still streams to it."""
        return int(self._execute(cmd.promote(force)))

    def close(self, timeout: float = 5.0) -> None:
        """Delete this handle's reply queue, DISCONNECT (its leases go back) and close; a broker
        that does not answer within ``timeout`` seconds (frozen) is not waited for longer."""
        if not self._conn.closed:  # (the heartbeat beats on: it frees a thread stuck reading)
            self._conn.close_reason = "was closed by the client"  # (also if it times out)
            self._sock.settimeout(timeout)  # every read and write from here on is bounded
            end_requests(self)  # its reply queue goes (the worker would delete it anyway)
            try:
                self._execute(cmd.disconnect())
            except ShmqError:
                pass
            self._conn.lost("is closed")
        self._stop_beating.set()
        self._sock.close()  # also after the connection was lost
        with self._cond:
            self._cond.notify_all()


@shares_docs(Queue)
class TcpQueue(Queue):
    message_class = Message  # what its messages are made of (shmq.protocol.commands)

    def __init__(self, broker: TcpBroker, name: str) -> None:
        self.broker = broker
        self.name = name
        self.name_bytes = str.encode(name)  # the name on the wire, for the one-message frames

    def __reduce__(self):  # type: ignore[no-untyped-def]
        b = self.broker
        return (_tcp_queue, (b.url, b._token, self.name, b.affinity, b._heartbeat, b.spin_us))

    def __repr__(self) -> str:
        return f"TcpQueue({self.broker.url!r}, {self.name!r})"

    def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
            headers: Headers | None = None, delay: float | None = None, ttl: float | None = None,
            priority: int = 0) -> int:
        return self.broker._execute(cmd.put(self, payload, block, timeout, headers, delay, ttl, priority))

    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None, headers: Sequence[Headers | None] | None = None,
                 delay: float | None = None, ttl: float | None = None, priority: int = 0) -> list[int]:
        return self.broker._execute(cmd.put_many(self, payloads, block, timeout, producer, seq, headers,
                                                 delay, ttl, priority))

    def _publish(self, payload: Payload, block: bool, timeout: float | None, headers: Headers | None = None,
                 delay: float | None = None, ttl: float | None = None) -> tuple[Request[int], Box]:
        req = cmd.put(self, payload, block, timeout, headers, delay, ttl)
        return req, self.broker._begin(req)

    def _confirm(self, token: tuple[Request[int], Box]) -> int:
        return self.broker._finish(*token)

    def _publish_many(self, payloads: Sequence[Payload], block: bool, timeout: float | None,
                      headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                      ttl: float | None = None) -> tuple[Request[list[int]], Box]:
        req = cmd.put_many(self, payloads, block, timeout, None, None, headers, delay, ttl)
        assert isinstance(req, Request)  # (a batch that is not empty is one request)
        return req, self.broker._begin(req)

    def _confirm_many(self, token: tuple[Request[list[int]], Box]) -> list[int]:
        return self.broker._finish(*token)

    def get(self, block: bool = True, timeout: float | None = None, *, group: str = options.DEFAULT_GROUP,
            visibility_timeout: float | None = None, ack: Message | None = None) -> Message:
        if block.__class__ is str:  # get("billing"): the order before group became a keyword
            raise group_as_block("get", block)
        if ack is not None and not rides(self, group, (ack,)):
            ack.ack()  # not a lease of this queue and group here: acked apart
            ack = None
        return self.broker._execute(cmd.get(self, group, block, timeout, visibility_timeout, ack))

    def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                 group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                 ack: Iterable[Message] = ()) -> list[Message]:
        if block.__class__ is str:
            raise group_as_block("get_many", block)
        acks = list(ack)
        if acks and not rides(self, group, acks):
            self.ack_many(acks)  # not all leases of this queue and group here: acked apart
            acks = []
        return self.broker._execute(cmd.get_many(self, max_messages, group, block, timeout,
                                                 visibility_timeout, acks))

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        self.broker._execute(cmd.ack_many(self, messages, wait))  # unwaited: they ride with the next request

    def _ack_nowait(self, msg: Message) -> None:
        self.broker._send_no_reply(cmd.ack_nowait_frame(self.name_bytes, msg))

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        self.broker._execute(cmd.settle(self, msg, action, arg))

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        return self.broker._execute(cmd.read(self, offset, max_messages))

    def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        """``Queue.read_columns``: one READ, its answer's columns seen as arrays and its
        bytes as a view (``commands.read_columns``)."""
        return self.broker._execute(cmd.read_columns(self, offset, max_messages))

    def iter_columns(self, start: int, end: int) -> Iterator[RecordColumns]:
        """``Queue.iter_columns`` one round trip ahead: the next READ is sent before this
        one's answer is used, asking from where a full answer would stop, and is asked
        again from the right offset when the answer stopped short (a frame's worth)."""
        if start >= end:
            return
        b = self.broker

        def ask(at: int) -> tuple[int, Request[RecordColumns], Box]:
            req = cmd.read_columns(self, at, end - at)
            return at + min(end - at, options.MAX_BATCH), req, b._begin(req)

        asked, ahead = ask(start), None
        while True:
            full_end, req, box = asked
            if ahead is None and full_end < end:
                ahead = ask(full_end)
            r = b._finish(req, box)
            yield r
            if not len(r) or (start := r.offsets[-1] + 1) >= end:
                break
            if ahead is not None and start == full_end:
                asked, ahead = ahead, None
                continue
            if ahead is not None:  # this answer stopped short: the one asked ahead starts too far
                b._wait(ahead[2])
                ahead = None
            asked = ask(start)
        if ahead is not None:
            b._wait(ahead[2])  # not needed, but the connection's next answer: read it off

    def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                   producer: str | None = None, seq: int | None = None, priority: int = 0) -> int:
        """``Queue.put_joined``: one PRODUCE_BATCH (PRODUCE_IDEMPOTENT with ``producer``) made
        of the lengths and the bytes as they are, no object per payload."""
        return self.broker._execute(cmd.put_joined(self, batch, block, timeout, producer, seq, priority))

    def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        try:
            self.broker._execute(gcmd.create_group(self, name, start))
        except GroupExists:
            if not exist_ok:
                raise

    def delete_group(self, name: str) -> None:
        self.broker._execute(gcmd.delete_group(self, name))

    def groups(self) -> list[str]:
        return self.broker._execute(gcmd.groups(self))

    def commit(self, group: str, offset: int) -> None:
        self.broker._execute(gcmd.commit(self, group, offset))

    def seek(self, group: str, when: When) -> int:
        return self.broker._execute(gcmd.seek(self, group, when))

    def _reply_queue(self, name: str) -> TcpQueue:
        return TcpQueue(self.broker, name)

    def purge(self) -> int:
        return self.broker._execute(cmd.purge(self))

    def stats(self) -> dict[str, Any]:
        return self.broker._execute(cmd.stats(self))

    def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                  visibility_timeout: float | None = None) -> Generator[Message, None, None]:
        """Push mode: the broker sends up to ``credit`` unacknowledged messages ahead
        (in batches when ``credit`` > 1); the messages handed out here return their
        credit in steps of half the window.  Use a dedicated broker handle.  Closing
        the iterator unsubscribes, and gives the messages received but not handed out
        back to the queue."""
        return self.broker._subscription(self, group, credit, visibility_timeout)


def _beating(ref: weakref.ref[TcpBroker], stop: threading.Event, interval: float) -> None:
    """The heartbeat thread of a TcpBroker, until it closes, its connection is lost or it
    is garbage (the thread holds it only while it beats)."""
    quiet = 0
    while not stop.wait(interval):
        broker = ref()
        if broker is None:
            return
        quiet = broker._beat(quiet)
        del broker
        if quiet < 0:
            return


def _open_socket(u: BrokerUrl, connect_timeout: float) -> Any:
    """The connected socket of a handle (TLS wrapped and checked for ``tcps://``), with
    ``connect_timeout`` set; ConnectionLost when it cannot be had."""
    url = u.without_token()
    if u.tls:  # (imported here: ssl takes a while to load, and a plain connection needs none of it)
        import ssl

        from shmq import tls
    ctx = tls.client_context(u) if u.tls else None  # a file that cannot be used: InvalidArgument
    try:
        if u.scheme == "unix":  # (shmq serve --unix): a peer of the broker's uid needs no token
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout)
            try:
                sock.connect(u.path)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((u.host, u.port), timeout=connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as e:
        hint = (" (the socket is not this user's to use)" if isinstance(e, PermissionError)
                else " (is `shmq serve` running?)")
        raise ConnectionLost(f"cannot connect to {url}: {e.strerror or e}{hint}") from None
    if ctx is None:
        return sock
    stream = tls.TlsStream(ctx, sock, u.host)
    try:  # the TLS handshake, bounded by connect_timeout too
        stream.handshake()
        return stream
    except ssl.SSLError as e:
        sock.close()
        raise ConnectionLost(f"cannot connect to {url}: {tls.describe(e, u)}") from None
    except TimeoutError:
        sock.close()
        raise ConnectionLost(f"cannot connect to {url}: no TLS handshake within {connect_timeout} s "
                             "(is it a TLS port?)") from None
    except OSError as e:
        sock.close()
        raise ConnectionLost(f"cannot connect to {url}: TLS handshake failed: {e.strerror or e}") from None


def _reconnect(url: str, token: str, affinity: str, heartbeat: float = options.HEARTBEAT,
               spin_us: float = options.CLIENT_SPIN_US) -> TcpBroker:
    return TcpBroker(url, token, affinity=affinity, heartbeat=heartbeat, spin_us=spin_us)


def _tcp_queue(url: str, token: str, name: str, affinity: str = "", heartbeat: float = options.HEARTBEAT,
               spin_us: float = options.CLIENT_SPIN_US) -> TcpQueue:
    return TcpQueue(_reconnect(url, token, affinity, heartbeat, spin_us), name)


__all__ = ["TcpBroker", "TcpQueue", "batch_acks", "batch_payloads", "parse_tcp_url", "settles_by_group"]
