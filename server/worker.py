"""One broker worker: an asyncio event loop serving clients on a SO_REUSEPORT socket.

Every worker opens its own listening socket on the same address, so the kernel
spreads connections between them; all of them operate on the same queues in
shared memory, so no state depends on which worker accepted a client.

Nothing here blocks the loop: a CONSUME or PRODUCE that has to wait is parked
and retried when the queue may have changed.  "May have changed" comes from
three places: a request handled by this worker (at once), the worker's
doorbell, read on the loop, which other workers and co-located producers ring
when a message arrives in a queue this worker has flagged (``shmq.doorbell``),
and a 50 ms tick (lease expiry, nack delays, room freed by others).

Leases are per connection: a connection that closes, or dies, gives its
unacknowledged messages back at once.

The worker that accepts a connection need not be the one that serves it: once its
HANDSHAKE is read, it may be handed to another worker (``server.placement``: the
fewest connections, or the worker of its affinity).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import heapq
import hmac
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any

from shmq import crashpoints, options
from shmq import layout as L
from shmq.api import Message
from shmq.codec import (
    WAIT_FOREVER,
    Frame,
    FrameDecoder,
    T,
    decode_body,
    deliver_frame,
    encode_body,
    encode_frame,
    frame,
    produce_ok_frame,
    records_field,
)
from shmq.doorbell import Bell
from shmq.errors import (
    Empty,
    Full,
    GroupNotFound,
    InvalidArgument,
    LimitExceeded,
    ProtocolError,
    ShmqError,
    StaleAck,
    Status,
)
from shmq.queue import ShmQueue
from shmq.shm import ShmBroker

from .placement import Counts, Handoff, choose

BIND_TRIES = 20  # x 50 ms: a restarted worker waits for its predecessor's doorbell and handoff sockets to go
SERVER_NAME = "shmq/0.1"
log = logging.getLogger("shmq.worker")
_CRASH = crashpoints.watch(__name__)  # the points below are passed by workers only, never the supervisor


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@dataclass(slots=True, eq=False)
class Waiter:
    """A parked request: a CONSUME / CONSUME_BATCH / PRODUCE that waits for its queue."""

    conn: Connection
    frame: Frame
    fields: dict[str, Any]
    deadline: float | None


@dataclass(slots=True, eq=False)
class Subscription:
    """A push subscription of one connection: the broker sends up to ``credit`` ahead."""

    conn: Connection
    sub_id: int
    queue: str
    group: str
    credit: int
    vis: int


Done = Callable[[ShmqError | None], None]  # sends a held reply (or the error that replaces it)


@dataclass(slots=True, eq=False)
class MarkWait:
    """Replies held until a durable mark (a header word) of one queue reaches their value."""

    q: ShmQueue
    word: int
    held: list[tuple[int, int, Connection, Done]]  # a heap of (value, tie, conn, done)


def _release(ready: list[tuple[Connection, Done]], err: ShmqError | None) -> None:
    """Send the replies whose mark was reached: one write per connection."""
    batching = []
    for conn, done in ready:
        if conn._out is None:
            conn._out = []
            batching.append(conn)
        done(err)
    for conn in batching:
        conn._flush()


class Worker:
    def __init__(self, instance: str, host: str, port: int, worker_id: int, token: str,
                 max_connections: int = options.MAX_CONNECTIONS, counts: Counts | None = None) -> None:
        self.instance = instance
        self.host = host
        self.port = port
        self.worker_id = worker_id
        self.token = token
        self.max_connections = max_connections
        self.connections: set[Connection] = set()
        self.waiters: dict[str, list[Waiter]] = {}
        self.subs: dict[str, list[Subscription]] = {}
        self.bell: Bell | None = None
        self.counts = counts  # every worker's connection count (None: placement is the kernel's alone)
        self.handoff: Handoff | None = None  # where other workers hand us connections (server.placement)
        self.flagged: dict[str, ShmQueue] = {}  # queues whose bell flag this worker has set
        self.flagged_ids: dict[int, str] = {}  # their ids (a doorbell datagram names the id)
        self.flag_needed: dict[str, float] = {}  # queue -> when the tick last saw someone wait there
        self.stopping = False
        self.pending_mark: tuple[ShmQueue, int, int] | None = None
        self.marks: dict[tuple[int, int], MarkWait] = {}  # replies held for a durable mark
        self._marks_lock = threading.Lock()
        self._mark_seq = itertools.count()  # ties in the heap never compare the callbacks
        self.loop: asyncio.AbstractEventLoop
        self.broker: ShmBroker

    # ------------------------------------------------------------ life cycle
    def run(self, ready: Any = None) -> None:
        self.broker = ShmBroker(self.instance)
        try:  # uvloop halves the event loop's cost per request; plain asyncio works too
            import uvloop
        except ImportError:
            asyncio.run(self._main(ready))
        else:
            uvloop.run(self._main(ready))

    async def _main(self, ready: Any) -> None:
        self.loop = asyncio.get_running_loop()
        await self._open_bell()
        await self._open_handoff()
        sock = reuseport_socket(self.host, self.port)
        server = await self.loop.create_server(lambda: Connection(self), sock=sock, backlog=4096)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        tick = self.loop.create_task(self._tick())
        await stop.wait()
        # graceful: stop accepting, let requests in progress finish, give leases back
        self.stopping = True
        server.close()
        deadline = time.monotonic() + options.SHUTDOWN_GRACE
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c.close()
        tick.cancel()
        for name in list(self.flagged):
            self._unflag(name)
        if self.bell is not None:
            self.loop.remove_reader(self.bell.fileno())
            self.bell.close()
        if self.handoff is not None:  # sockets still in flight to us are closed with it
            self.loop.remove_reader(self.handoff.fileno())
            self.handoff.close()
        self.broker.close()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(options.WORKER_TICK)
            now = time.monotonic()
            for name in list(self.waiters) + list(self.subs):
                self._flag(name)  # the flag may be on a queue deleted and created again
                self.poke(name)
                self.flag_needed[name] = now
            grace = options.WORKER_FLAG_GRACE
            for name in [n for n in self.flagged if now - self.flag_needed.get(n, 0.0) > grace]:
                self._unflag(name)

    # ------------------------------------------------------------ doorbell
    async def _open_bell(self) -> None:
        """Bind this worker's doorbell and clear the flags a predecessor of the same id
        may have left set in every queue (it died: nobody reads them)."""
        att = self.broker._att
        att.bell_skip = self.worker_id
        self.bell = await _bind(Bell, att.registry.uid, self.worker_id)
        if self.bell is None:
            log.warning("worker %d: doorbell address in use; waiting requests are retried on the "
                        "%d ms tick only", self.worker_id, options.WORKER_TICK * 1000)
        else:
            self.loop.add_reader(self.bell.fileno(), self._on_bell)
        for entry in att.registry.queues():
            try:
                self.broker._att._open(entry)._mm[L.Q_BELLS + self.worker_id] = 0
            except ShmqError:
                pass  # deleted meanwhile

    # ------------------------------------------------------------ placement
    async def _open_handoff(self) -> None:
        if self.counts is None:
            return
        self.count_changed()  # a predecessor's connections died with it
        self.handoff = await _bind(Handoff, self.broker._att.registry.uid, self.worker_id)
        if self.handoff is None:
            log.warning("worker %d: handoff address in use; this worker keeps the connections it "
                        "accepts and is handed none", self.worker_id)
        else:
            self.loop.add_reader(self.handoff.fileno(), self._on_handoff)

    def count_changed(self) -> None:
        if self.counts is not None:
            self.counts.set(self.worker_id, len(self.connections))

    def place(self, conn: Connection, f: Frame, affinity: str) -> bool:
        """Hand ``conn``, which has sent its HANDSHAKE ``f`` and nothing else, to the worker
        that should serve it (``server.placement``).  True when it went."""
        if self.handoff is None or self.counts is None or self.stopping or self.counts.workers < 2:
            return False
        counts = self.counts.snapshot()
        target = choose(counts, self.worker_id, affinity)
        if target == self.worker_id or counts[target] >= self.max_connections:
            return False  # (a full worker would refuse it: it is served here instead)
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        preface = encode_frame(f.type, f.msg_id, f.body)  # the HANDSHAKE as it came
        if sock is None or not self.handoff.send(target, sock.fileno(), preface):
            return False
        conn.leave()
        return True

    def _on_handoff(self) -> None:
        assert self.handoff is not None
        for sock, preface in self.handoff.receive():
            self.loop.create_task(self._adopt(sock, preface))

    async def _adopt(self, sock: socket.socket, preface: bytes) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: Connection(self, preface), sock)
        except (OSError, ValueError):  # the client went meanwhile, or it is no stream socket
            sock.close()

    def _on_bell(self) -> None:
        assert self.bell is not None
        for qid in self.bell.drain():
            name = self.flagged_ids.get(qid)
            if name is not None:
                self.poke(name)

    def _flag(self, name: str) -> None:
        """Ask to be rung when a message arrives in the queue ``name`` (call once a request
        is parked on it, or a subscription made).  Setting the flag is followed by a retry
        of what waits: a message that came before the flag was seen is not missed."""
        try:
            q = self.queue(name)
        except ShmqError:
            return  # gone: the parked requests learn it on their next retry
        if self.flagged.get(name) is q and q._mm[L.Q_BELLS + self.worker_id]:
            return
        old = self.flagged.get(name)
        if old is not None and old is not q:
            self._unflag(name)
        q._mm[L.Q_BELLS + self.worker_id] = 1
        self.flagged[name] = q
        self.flagged_ids[q._ring.queue_id] = name
        self.flag_needed[name] = time.monotonic()
        self.loop.call_soon(self.poke, name)

    def _unflag(self, name: str) -> None:
        q = self.flagged.pop(name, None)
        self.flag_needed.pop(name, None)
        if q is not None:
            self.flagged_ids.pop(q._ring.queue_id, None)
            try:
                q._mm[L.Q_BELLS + self.worker_id] = 0
            except ValueError:
                pass  # its mapping is gone (the queue was deleted)

    # ------------------------------------------------------------ waking
    def queue(self, name: str) -> ShmQueue:
        q = self.broker._att.queue(name)  # the attachment's cache, checked against the registry generation
        if q._defer_marks is None:
            q._defer_marks = self._note_mark
        return q

    # ------------------------------------------------------------ durable marks
    # An `always` queue confirms a produce or an ack once the journal has it.  The queue
    # tells us the mark to wait for (instead of blocking the loop); the reply that follows
    # is held back until the mark is reached (see after_mark).
    def _note_mark(self, q: ShmQueue, word: int, value: int) -> None:
        self.pending_mark = (q, word, value)

    def take_mark(self) -> tuple[ShmQueue, int, int] | None:
        mark, self.pending_mark = self.pending_mark, None
        if mark is not None and mark[0]._w[mark[1]] >= mark[2]:
            return None
        return mark

    def after_mark(self, mark: tuple[ShmQueue, int, int], conn: Connection, done: Done) -> None:
        """Call ``done`` (on the loop) once the mark is reached; it sends ``conn`` a reply.
        One thread per queue and mark waits for the lowest value held; each time the mark
        moves, every reply it covers goes out together (one write per connection)."""
        q, word, value = mark
        key = (id(q), word)  # the MarkWait keeps q alive, so its id is not reused meanwhile
        with self._marks_lock:
            mw = self.marks.get(key)
            start = mw is None
            if mw is None:
                mw = self.marks[key] = MarkWait(q, word, [])
            heapq.heappush(mw.held, (value, next(self._mark_seq), conn, done))
        if start:
            threading.Thread(target=self._mark_waiter, args=(key, mw), daemon=True,
                             name=f"durable-{q.name}").start()

    def _mark_waiter(self, key: tuple[int, int], mw: MarkWait) -> None:
        while True:
            with self._marks_lock:
                if not mw.held:
                    del self.marks[key]
                    return
                target = mw.held[0][0]
            err: ShmqError | None = None
            try:
                mw.q._wait_mark(mw.word, target, None)
            except ShmqError as e:
                err = e  # the journal cannot write, or the queue is gone: every held reply fails
            except Exception as e:  # noqa: BLE001 - a reply must never be lost silently
                err = ShmqError(repr(e))
            reached = mw.q._w[mw.word] if err is None else 0
            with self._marks_lock:
                ready = []
                while mw.held and (err is not None or mw.held[0][0] <= reached):
                    _, _, conn, done = heapq.heappop(mw.held)
                    ready.append((conn, done))
            self.loop.call_soon_threadsafe(_release, ready, err)

    def drop_sub(self, s: Subscription) -> None:
        """A subscription ended (unsubscribed, or its connection closed).  The queue's entry
        goes with its last subscription: the tick flags every queue in ``subs``, and a
        stale empty entry would keep this worker rung by every put there for good."""
        lst = self.subs.get(s.queue)
        if lst is not None and s in lst:
            lst.remove(s)
            if not lst:
                del self.subs[s.queue]

    def park(self, name: str, waiter: Waiter) -> None:
        self.waiters.setdefault(name, []).append(waiter)
        self._flag(name)

    def poke(self, name: str) -> None:
        """The queue may have changed: retry what waits on it (in arrival order; a
        connection's produces stay in order: none is tried while an earlier one waits)."""
        waiters = self.waiters.get(name)
        if waiters:
            now = time.monotonic()
            keep = []
            stuck: set[Connection] = set()  # connections whose earlier produce still waits
            for w in waiters:
                if w.conn.closed:
                    continue
                produce = w.frame.type in PRODUCE_TYPES
                if not w.conn.retry(w, now, try_put=not (produce and w.conn in stuck)):
                    keep.append(w)
                    if produce:
                        stuck.add(w.conn)
                elif produce:
                    w.conn.parked_produces[name] -= 1
            if keep:
                self.waiters[name] = keep
            else:
                del self.waiters[name]
        subs = self.subs.get(name)
        if subs:
            for s in list(subs):
                if s.credit > 0 and not s.conn.closed:
                    s.conn.push(s)

    # ------------------------------------------------------------ auth
    def check_token(self, token: str) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest(token.encode(), self.token.encode())


class Connection(asyncio.Protocol):
    def __init__(self, worker: Worker, preface: bytes = b"") -> None:
        """``preface``: a connection handed over by another worker, and the bytes that worker
        read from it (its HANDSHAKE): handled first, and the connection stays here."""
        self.w = worker
        self._preface = preface
        self.placed = bool(preface)  # placed already: it moves at most once
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.ready = False
        self.closed = False
        self.busy = False
        # the leases this connection holds: (queue handle, group reference) -> {offset: deliveries}
        self.held: dict[tuple[ShmQueue, int], dict[int, int]] = {}
        self.inflight = 0  # leases held, all queues
        self.subs: dict[int, Subscription] = {}
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._out: list[bytes] | None = None  # replies held while several frames of one read are handled
        self.parked_produces: dict[str, int] = {}  # queue -> produces of ours waiting for room there

    # ------------------------------------------------------------ asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.w.connections) >= self.w.max_connections or self.w.stopping:
            self.send_error(0, Status.LIMIT_EXCEEDED,
                            f"worker {self.w.worker_id} holds {self.w.max_connections} connections already")
            self._refuse()
            return
        self.w.connections.add(self)
        self.w.count_changed()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._handshake_timer = self.w.loop.call_later(options.HANDSHAKE_TIMEOUT, self._no_handshake)
        if self._preface:  # before anything is read from the socket itself
            preface, self._preface = self._preface, b""
            self.data_received(preface)

    def _refuse(self) -> None:
        """A connection refused as it arrives, after its ERROR: our side ends with a FIN, so
        that the error reaches the client (a close with its handshake unread here would
        reset the connection, and the error with it).  What it sends meanwhile is dropped;
        the connection goes when the client closes it, or after HANDSHAKE_TIMEOUT."""
        self.closed = True
        assert self.transport is not None
        if self.transport.can_write_eof():
            self.transport.write_eof()
            # (the handshake timer's slot: connection_lost cancels it)
            self._handshake_timer = self.w.loop.call_later(options.HANDSHAKE_TIMEOUT, self.transport.abort)
        else:
            self.transport.close()

    def _no_handshake(self) -> None:
        if not self.ready:
            self.send_error(0, Status.PROTOCOL_ERROR, "no handshake")
            self.close()

    def data_received(self, data: bytes) -> None:
        if self.closed:  # refused (``_refuse``): what comes is dropped
            return
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as e:
            self.send_error(0, e.code, str(e))
            self.close()
            return
        if len(frames) > 1:  # a pipelining client: its replies go out in one write
            self._out = []
            self.placed = True  # it sent more than its HANDSHAKE: it stays where it is
        try:
            i = 0
            while i < len(frames):
                if self.closed:
                    return
                f = frames[i]
                self.busy = True
                try:
                    if f.type == T.PRODUCE and self.ready and i + 1 < len(frames):
                        i = self._produce_run(frames, i)
                    else:
                        self.handle(f)
                        i += 1
                finally:
                    self.busy = False
        finally:
            self._flush()

    def _produce_run(self, frames: list[Frame], i: int) -> int:
        """PRODUCE frames in a row, to one queue, read together (a Publisher's pipeline):
        stored with one ``put_many`` (in order, all or none), each answered on its own.
        Whenever that cannot be done (full queue, an earlier put waiting, any error) each
        frame is handled alone, exactly as if it had come by itself.  Returns the index
        of the first frame not handled."""
        run: list[tuple[Frame, dict[str, Any]]] = []
        j = i
        while j < len(frames) and frames[j].type == T.PRODUCE:
            try:
                d = decode_body(T.PRODUCE, frames[j].body)
            except ProtocolError:
                break
            if run and d["queue"] != run[0][1]["queue"]:
                break
            run.append((frames[j], d))
            j += 1
        name = run[0][1]["queue"] if run else ""
        if len(run) < 2 or self.parked_produces.get(name):
            self.handle(frames[i])
            return i + 1
        self.w.pending_mark = None
        try:
            offs = self.w.queue(name).put_many([d["payload"] for _, d in run], block=False)
        except ShmqError:
            for f, _ in run:
                if not self.closed:
                    self.handle(f)
            return j
        if _CRASH:
            crashpoints.hit("worker.produce.unanswered")
        mark = self.w.take_mark() if self.w.pending_mark is not None else None
        for (f, _), off in zip(run, offs, strict=True):
            data = produce_ok_frame(f.msg_id, off)
            if mark is None:
                self.send(data)
            else:  # one mark covers the run: confirmed together once the journal has it
                self.w.after_mark(mark, self, partial(self._send_or_fail, data, f.msg_id))
        self.w.poke(name)
        return j

    def _send_or_fail(self, data: bytes, msg_id: int, err: ShmqError | None) -> None:
        if err is None:
            self.send(data)
        else:
            self.send_error(msg_id, err.code, str(err))

    def _flush(self) -> None:
        out, self._out = self._out, None
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.close()

    # A client that does not read its replies stops being read from until it does:
    # the worker's memory per connection stays bounded by the transport's buffer limits.
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self._flush()  # the replies to the frames before the one that closes
        self._forget()
        for s in self.subs.values():
            self.w.drop_sub(s)
        self.give_back()
        if self.transport is not None:
            self.transport.close()

    def leave(self) -> None:
        """Handed to another worker (``Worker.place``): forgotten here without a word to the
        client, whose socket lives on there.  It holds nothing yet (only its HANDSHAKE came)."""
        self._forget()
        if self.transport is not None:
            self.transport.abort()  # closes our descriptor only: the one in flight keeps the connection

    def _forget(self) -> None:
        """No longer this worker's: closed, its timer stopped, out of the count."""
        self.closed = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.w.connections.discard(self)
        self.w.count_changed()

    def give_back(self) -> None:
        """Return every lease this connection holds to its queue, at once."""
        held, self.held, self.inflight = self.held, {}, 0
        touched = set()
        for (q, ref), leases in held.items():
            try:
                if q.give_back(ref, list(leases), list(leases.values())):
                    touched.add(q.name)
            except ShmqError:
                pass  # the queue is gone (leases expired and taken back already are skipped)
            if _CRASH:
                crashpoints.hit("worker.give_back.queue")
        for qname in touched:
            self.w.poke(qname)

    # ------------------------------------------------------------ output
    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            if self._out is not None:
                self._out.append(data)
            else:
                self.transport.write(data)

    def send_error(self, msg_id: int, status: int, message: str) -> None:
        self.send(encode_frame(T.ERROR, msg_id, encode_body(T.ERROR, message=message[:1000]), int(status)))

    def reply(self, f: Frame, type_: int, **fields: Any) -> None:
        self.send_reply(f, frame(type_, f.msg_id, **fields))

    def send_reply(self, f: Frame, data: bytes) -> None:
        """Send the answer to ``f``, or hold it until the journal has what it confirms."""
        if self.w.pending_mark is not None:
            mark = self.w.take_mark()
            if mark is not None:  # confirmed once the journal has it
                self.w.after_mark(mark, self, partial(self._send_or_fail, data, f.msg_id))
                return
        self.send(data)

    # ------------------------------------------------------------ dispatch
    def handle(self, f: Frame) -> None:
        if not self.ready:
            if f.type != T.HANDSHAKE:
                self.send_error(f.msg_id, Status.PROTOCOL_ERROR, "the first frame must be HANDSHAKE")
                self.close()
                return
            return self.handshake(f)
        handler = HANDLERS.get(f.type)
        if handler is None:
            self.send_error(f.msg_id, Status.INVALID_TYPE, f"type 0x{f.type:02x} is not a request")
            return
        self.w.pending_mark = None
        try:
            fields = decode_body(f.type, f.body)
            handler(self, f, fields)
        except ProtocolError as e:
            self.send_error(f.msg_id, e.code, str(e))
        except ShmqError as e:
            self.send_error(f.msg_id, e.code, str(e))
        except (ValueError, TypeError, KeyError) as e:
            self.send_error(f.msg_id, Status.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - one bad request must not take the worker down
            self.send_error(f.msg_id, Status.INTERNAL, f"{type(e).__name__}: {e}")

    def handshake(self, f: Frame) -> None:
        try:
            fields = decode_body(T.HANDSHAKE, f.body)
        except ProtocolError as e:
            self.send_error(f.msg_id, e.code, str(e))
            self.close()
            return
        if not self.w.check_token(fields["token"]):
            self.reply(f, T.HANDSHAKE_NACK, reason="bad or missing token")
            self.close()
            return
        if not self.placed and not self.decoder.buffered:
            self.placed = True
            if self.w.place(self, f, fields["affinity"]):
                return
        self.ready = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.reply(f, T.HANDSHAKE_ACK, worker=self.w.worker_id, max_frame=self.decoder.max_frame,
                   server=SERVER_NAME)

    # ------------------------------------------------------------ leases
    def _lease(self, q: ShmQueue, ref: int, offsets: Any, deliveries: Any) -> None:
        held = self.held.get((q, ref))
        if held is None:
            held = self.held[(q, ref)] = {}
        before = len(held)
        held.update(zip(offsets, deliveries, strict=True))
        self.inflight += len(held) - before

    def _check_inflight(self, n: int) -> None:
        if self.inflight + n > options.MAX_INFLIGHT_PER_CONNECTION:
            raise LimitExceeded(f"this connection holds {self.inflight} unacknowledged messages; "
                                f"the limit is {options.MAX_INFLIGHT_PER_CONNECTION}")

    def _leases(self, d: dict[str, Any]) -> tuple[ShmQueue, int, dict[int, int]]:
        """The queue, group reference and leases of ours that a settle request names
        (none when the group was deleted since, even if created again)."""
        q = self.w.queue(d["queue"])
        try:
            ref = q._group_ref(d["group"], create=False)
        except GroupNotFound:
            ref = -1
        return q, ref, self.held.get((q, ref), _NONE_HELD)

    def _held(self, d: dict[str, Any]) -> tuple[Message, dict[int, int]]:
        """The lease a settle request names, as a Message to settle, and the leases it is in."""
        q, ref, held = self._leases(d)
        if held.get(d["offset"]) != d["deliveries"]:
            raise StaleAck(f"message {d['offset']} (delivery {d['deliveries']}) of "
                           f"{d['queue']!r} is not leased to this connection")
        return _message(q, ref, d["group"], d["offset"], d["deliveries"]), held

    def _settled(self, held: dict[int, int], offset: int) -> None:
        """Settled, or found stale: either way no longer ours."""
        if held.pop(offset, None) is not None:
            self.inflight -= 1

    # ------------------------------------------------------------ requests
    def _behind(self, f: Frame, d: dict[str, Any]) -> bool:
        """A produce arriving while an earlier one of ours waits for room in the same
        queue waits behind it (or fails at once when it may not wait): order is kept."""
        if not self.parked_produces.get(d["queue"]):
            return False
        self._wait_or_fail(f, d, lambda: Full(f"queue {d['queue']!r} is full (an earlier put waits "
                                              "for room)"))
        return True

    def produce(self, f: Frame, d: dict[str, Any]) -> None:
        """PRODUCE, PRODUCE_BATCH and PRODUCE_IDEMPOTENT: stored now, or parked until there is room."""
        if self._behind(f, d):
            return
        if not self._try_produce(f, d, poke=True):
            self._wait_or_fail(f, d, lambda: Full(f"queue {d['queue']!r} is full"))

    def _try_produce(self, f: Frame, d: dict[str, Any], poke: bool = False) -> bool:
        """Store a produce request and answer it; False when the queue has no room now.
        ``poke``: then retry what waits on the queue.  A single message's waiting
        consumer is served before the answer when the answer is not held for the journal
        (its DELIVER is what a round trip through the broker waits for; the producer's
        answer can follow).  A batch is answered first: its producer builds the next
        batch while this worker pushes (+7% msgs/s for batches of 100 in push mode,
        measured A/B on 2 cores)."""
        q = self.w.queue(d["queue"])
        try:
            if f.type == T.PRODUCE:
                off = q.put(d["payload"], block=False)
            else:  # a batch, maybe an idempotent producer's
                idem = {"producer": d["producer"], "seq": d["seq"]} if "producer" in d else {}
                offs = q.put_many(d["payloads"], block=False, **idem)
        except Full:
            if f.type != T.PRODUCE and not q.could_fit(d["payloads"]):
                raise  # a batch that can never fit: waiting would never help
            return False
        if _CRASH:
            crashpoints.hit("worker.produce.unanswered")
        if poke and f.type == T.PRODUCE and self.w.pending_mark is None:
            self.w.poke(d["queue"])
            self.w.pending_mark = None  # ours had none; what the retries noted, they took
            poke = False
        if f.type == T.PRODUCE:
            self.send_reply(f, produce_ok_frame(f.msg_id, off))
        else:
            self.reply(f, T.PRODUCE_BATCH_OK, first=offs[0] if offs else 0, count=len(offs))
        if poke:
            self.w.poke(d["queue"])
        return True

    def consume(self, f: Frame, d: dict[str, Any]) -> None:
        if not self._try_consume(f, d):
            self._wait_or_fail(f, d, lambda: Empty(f"no message for group {d['group']!r} of {d['queue']!r}"))

    def _try_consume(self, f: Frame, d: dict[str, Any]) -> bool:
        n = d.get("max", 1)
        self._check_inflight(n)
        return self._deliver(self.w.queue(d["queue"]), d["group"], n, d["visibility_ms"], f.msg_id,
                             f.type == T.CONSUME, f) > 0

    def _deliver(self, q: ShmQueue, group: str, n: int, vis_ms: int, msg_id: int, one: bool,
                 f: Frame | None = None) -> int:
        """Lease up to ``n`` messages of ``group`` and send them with ``msg_id``: one
        DELIVER when ``one``, else one DELIVER_BATCH.  ``f``: the request this answers
        (its reply may be held for the journal); None for a subscription's push.  The
        number sent, 0 when none was ready."""
        vis = vis_ms / 1000 if vis_ms else None
        budget = 0
        if not one:  # a batch: new messages stored back to back go out as columns
            budget = options.MAX_FRAME - 4 - 26 * n  # its records fit one frame (26 B of columns each)
            block = q.take_block(group, n, vis, budget) if n > 1 else None
            if block is not None:
                first, stamps, lens, data = block
                k = len(lens)
                if not k:
                    return 0  # nothing to deliver at all
                offsets = range(first, first + k)
                self._lease(q, q._group_ref(group), offsets, repeat(1, k))
                if _CRASH:
                    crashpoints.hit("worker.deliver.unsent")
                self._send_to(f, encode_frame(T.DELIVER_BATCH, msg_id, records_field(
                    offsets, [1] * k, stamps, [0] * k, lens, data)))
                return k
        msgs = q.poll(group, n, vis, budget)
        if not msgs:
            return 0
        if _CRASH:
            crashpoints.hit("worker.deliver.unsent")
        if one:
            m = msgs[0]  # (queue, group reference, group, offset, deliveries, payload, meta, timestamp_ns)
            self._lease(q, m[1], (m[3],), (m[4],))
            self._send_to(f, deliver_frame(msg_id, m[3], m[4], m[7], bytes(m[6]), m[5]))
        else:
            self._lease(q, msgs[0][1], [m[3] for m in msgs], [m[4] for m in msgs])
            records = [(m[3], m[4], m[7], bytes(m[6]), m[5]) for m in msgs]
            self._send_to(f, frame(T.DELIVER_BATCH, msg_id, records=records))
        return len(msgs)

    def _send_to(self, f: Frame | None, data: bytes) -> None:
        """The answer to ``f`` (maybe held for the journal), or a push when ``f`` is None."""
        if f is None:
            self.send(data)
        else:
            self.send_reply(f, data)

    def _wait_or_fail(self, f: Frame, d: dict[str, Any], err: Callable[[], ShmqError]) -> None:
        """Park the request until its queue changes, or raise ``err()`` when it may not wait."""
        t = d["timeout_ms"]
        if t == 0 or self.w.stopping:
            raise err()
        deadline = None if t == WAIT_FOREVER else time.monotonic() + t / 1000
        if f.type in PRODUCE_TYPES:
            self.parked_produces[d["queue"]] = self.parked_produces.get(d["queue"], 0) + 1
        self.w.park(d["queue"], Waiter(self, f, d, deadline))

    def retry(self, w: Waiter, now: float, try_put: bool = True) -> bool:
        """A parked request: True when it is answered (done or failed).  ``try_put``
        False: only its deadline is checked (an earlier produce of ours still waits)."""
        f, d = w.frame, w.fields
        try:
            if try_put and (self._try_consume(f, d) if f.type in (T.CONSUME, T.CONSUME_BATCH)
                            else self._try_produce(f, d)):
                return True
        except ShmqError as e:
            self.send_error(f.msg_id, e.code, str(e))
            return True
        if w.deadline is not None and now >= w.deadline:
            if f.type in (T.CONSUME, T.CONSUME_BATCH):
                self.send_error(f.msg_id, Status.EMPTY, f"no message for group {d['group']!r} of "
                                f"{d['queue']!r} within {d['timeout_ms']} ms")
            else:
                self.send_error(f.msg_id, Status.QUEUE_FULL, f"queue {d['queue']!r} is full "
                                f"(timed out after {d['timeout_ms']} ms)")
            return True
        return False

    def ack(self, f: Frame, d: dict[str, Any]) -> None:
        """ACK, answered; ACK_NO_REPLY, answered only when it fails (by handle())."""
        m, held = self._held(d)
        try:
            m.ack()
        finally:
            self._settled(held, m[3])
        if _CRASH:
            crashpoints.hit("worker.ack.unanswered")
        if f.type == T.ACK:
            self.reply(f, T.ACK_OK)
        else:
            self.w.pending_mark = None  # an `always` ack: nobody waits for the journal either

    def ack_batch(self, f: Frame, d: dict[str, Any]) -> None:
        """ACK_BATCH, answered with the offsets that were stale; ACK_BATCH_NO_REPLY, answered
        only when some were (with ERROR STALE_ACK)."""
        offsets, asked = map(list, zip(*d["settles"], strict=True)) if d["settles"] else ([], [])
        self._ack_leases(f, d, offsets, asked)

    def ack_range(self, f: Frame, d: dict[str, Any]) -> None:
        """ACK_RANGE / ACK_RANGE_NO_REPLY: ACK_BATCH / ACK_BATCH_NO_REPLY of the ``count``
        offsets from ``first``, each with the same delivery count (one push's or one
        get_many's new messages), answered the same way."""
        n = d["count"]
        if n > options.MAX_BATCH:
            raise LimitExceeded(f"{n} acks in one frame (the limit is {options.MAX_BATCH})")
        first = d["first"]
        self._ack_leases(f, d, list(range(first, first + n)), [d["deliveries"]] * n)

    def _ack_leases(self, f: Frame, d: dict[str, Any], offsets: list[int], asked: list[int]) -> None:
        q, ref, held = self._leases(d)
        had = list(map(held.pop, offsets, repeat(None)))  # ours are no longer ours, settled or stale
        stale: list[int]
        if had == asked:  # all of them ours (the usual case)
            mine, dcs, stale = offsets, asked, []
        else:
            mine, dcs, stale = [], [], []
            for o, dc, h in zip(offsets, asked, had, strict=True):
                if h == dc:
                    mine.append(o)
                    dcs.append(dc)
                else:
                    stale.append(o)
                    if h is not None:  # we hold another delivery of it: still ours
                        held[o] = h
        self.inflight -= len(mine)
        if mine:
            stale += q.ack_offsets(ref, mine, dcs)
        if f.type in WAITED_BATCH_ACKS:
            self.reply(f, T.ACK_BATCH_OK, stale=stale)
            return
        self.w.pending_mark = None  # an `always` ack: nobody waits for the journal either
        if stale:
            raise StaleAck.of_batch(stale, len(offsets))

    def nack(self, f: Frame, d: dict[str, Any]) -> None:
        m, held = self._held(d)
        try:
            m.nack(d["delay_ms"] / 1000)
        except StaleAck:
            self._settled(held, m[3])
            raise
        self._settled(held, m[3])
        self.reply(f, T.NACK_OK)
        self.w.poke(d["queue"])

    def touch(self, f: Frame, d: dict[str, Any]) -> None:
        self._held(d)[0].touch(d["visibility_ms"] / 1000 if d["visibility_ms"] else None)
        self.reply(f, T.TOUCH_OK)

    def dead_letter(self, f: Frame, d: dict[str, Any]) -> None:
        m, held = self._held(d)
        try:
            m.dead_letter()
        except StaleAck:
            self._settled(held, m[3])
            raise
        self._settled(held, m[3])
        self.reply(f, T.DEAD_LETTER_OK)

    def create_queue(self, f: Frame, d: dict[str, Any]) -> None:
        if not isinstance(d["config"], dict):
            raise InvalidArgument("config must be a JSON object")
        self.w.broker.create_queue(d["queue"], **d["config"])
        self.reply(f, T.CREATE_QUEUE_OK)

    def delete_queue(self, f: Frame, d: dict[str, Any]) -> None:
        self.w.broker.delete_queue(d["queue"])
        self.reply(f, T.DELETE_QUEUE_OK)

    def list_queues(self, f: Frame, d: dict[str, Any]) -> None:
        infos = self.w.broker.list_queues()
        self.reply(f, T.LIST_QUEUES_OK, queues=[
            {"name": i.name, "is_dlq": i.is_dlq, "config": i.config.__dict__} for i in infos])

    def group_join(self, f: Frame, d: dict[str, Any]) -> None:
        self.w.queue(d["queue"]).create_group(d["group"], "latest" if d["start"] else "earliest")
        self.reply(f, T.GROUP_JOIN_OK)

    def group_commit(self, f: Frame, d: dict[str, Any]) -> None:
        self.w.queue(d["queue"]).commit(d["group"], d["offset"])
        self.reply(f, T.GROUP_COMMIT_OK)

    def group_delete(self, f: Frame, d: dict[str, Any]) -> None:
        self.w.queue(d["queue"]).delete_group(d["group"])
        self.reply(f, T.GROUP_DELETE_OK)

    def group_list(self, f: Frame, d: dict[str, Any]) -> None:
        self.reply(f, T.GROUP_LIST_OK, groups=self.w.queue(d["queue"]).groups())

    def read(self, f: Frame, d: dict[str, Any]) -> None:
        n = min(d["max"], options.MAX_BATCH)
        msgs = self.w.queue(d["queue"]).read(d["offset"], max(1, n))
        # a reply never outgrows a frame: the reader asks again from where this one stops
        budget = options.MAX_FRAME - 4096
        records: list[tuple[Any, ...]] = []
        for m in msgs:
            budget -= len(m.payload) + len(m.meta) + 32
            if budget < 0 and records:
                break
            records.append((m.offset, m.deliveries, m.timestamp_ns, bytes(m.meta), m.payload))
        self.reply(f, T.READ_OK, records=records)

    def stats(self, f: Frame, d: dict[str, Any]) -> None:
        self.reply(f, T.STATS_OK, stats=self.w.queue(d["queue"]).stats())

    def purge(self, f: Frame, d: dict[str, Any]) -> None:
        self.reply(f, T.PURGE_OK, purged=self.w.queue(d["queue"]).purge())

    def disconnect(self, f: Frame, d: dict[str, Any]) -> None:
        self.give_back()
        self.reply(f, T.DISCONNECT_OK)
        self.close()

    # ------------------------------------------------------------ push mode
    def subscribe(self, f: Frame, d: dict[str, Any]) -> None:
        q = self.w.queue(d["queue"])
        q._group(d["group"])  # creates the group if new, validates the name
        s = Subscription(self, f.msg_id, d["queue"], d["group"], d["credit"], d["visibility_ms"])
        self.subs[f.msg_id] = s
        self.w.subs.setdefault(d["queue"], []).append(s)
        self.w._flag(d["queue"])
        self.reply(f, T.SUBSCRIBE_OK)
        self.push(s)

    def push(self, s: Subscription) -> None:
        """Send up to the subscription's credit; the broker's round robin between a
        group's subscribers comes from each taking at most its credit."""
        total = 0
        q = self.w.queue(s.queue)
        while s.credit > 0:
            n = min(s.credit, options.MAX_INFLIGHT_PER_CONNECTION - self.inflight, options.MAX_BATCH)
            if n <= 0:
                break
            # what is ready goes out in frames of up to MAX_BATCH (DELIVER for a credit of one)
            sent = self._deliver(q, s.group, n, s.vis, s.sub_id, s.credit == 1)
            if not sent:
                break
            s.credit -= sent
            total += sent
        if not total:
            return
        # rotate so that the next subscriber of this worker goes first next time
        lst = self.w.subs.get(s.queue)
        if lst and s in lst:
            lst.remove(s)
            lst.append(s)

    def credit(self, f: Frame, d: dict[str, Any]) -> None:
        s = self.subs.get(d["subscription"])
        if s is not None:
            s.credit += d["credit"]
            self.push(s)

    def unsubscribe(self, f: Frame, d: dict[str, Any]) -> None:
        s = self.subs.pop(d["subscription"], None)
        if s is not None:
            self.w.drop_sub(s)
        self.reply(f, T.UNSUBSCRIBE_OK)


_NONE_HELD: dict[int, int] = {}  # the leases of a queue and group we hold none of (never written)


def _message(q: ShmQueue, ref: int, group: str | None, offset: int, deliveries: int) -> Message:
    """A lease as a Message to settle (settling needs no payload)."""
    return tuple.__new__(Message, (q, ref, group, offset, deliveries, b"", b"", 0))


PRODUCE_TYPES = frozenset((T.PRODUCE, T.PRODUCE_BATCH, T.PRODUCE_IDEMPOTENT))
WAITED_BATCH_ACKS = frozenset((T.ACK_BATCH, T.ACK_RANGE))  # answered with ACK_BATCH_OK

HANDLERS: dict[int, Any] = {
    T.PRODUCE: Connection.produce, T.PRODUCE_BATCH: Connection.produce,
    T.PRODUCE_IDEMPOTENT: Connection.produce,
    T.CONSUME: Connection.consume, T.CONSUME_BATCH: Connection.consume,
    T.ACK: Connection.ack, T.ACK_NO_REPLY: Connection.ack, T.ACK_BATCH: Connection.ack_batch,
    T.ACK_BATCH_NO_REPLY: Connection.ack_batch, T.ACK_RANGE: Connection.ack_range,
    T.ACK_RANGE_NO_REPLY: Connection.ack_range,
    T.NACK: Connection.nack,
    T.TOUCH: Connection.touch, T.DEAD_LETTER: Connection.dead_letter,
    T.CREATE_QUEUE: Connection.create_queue, T.DELETE_QUEUE: Connection.delete_queue,
    T.LIST_QUEUES: Connection.list_queues, T.GROUP_JOIN: Connection.group_join,
    T.GROUP_COMMIT: Connection.group_commit, T.GROUP_DELETE: Connection.group_delete,
    T.GROUP_LIST: Connection.group_list, T.READ: Connection.read, T.STATS: Connection.stats,
    T.PURGE: Connection.purge, T.DISCONNECT: Connection.disconnect, T.SUBSCRIBE: Connection.subscribe,
    T.CREDIT: Connection.credit, T.UNSUBSCRIBE: Connection.unsubscribe,
}

def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the supervisor dies, however it dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


async def _bind(kind: Callable[[int, int], Any], instance_uid: int, worker_id: int) -> Any:
    """A worker's abstract-namespace socket (doorbell, handoff), bound; None when its address
    stays in use (a predecessor of the same id that is still exiting is waited for)."""
    for _ in range(BIND_TRIES):
        try:
            return kind(instance_uid, worker_id)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(options.WORKER_TICK)
    return None


def worker_main(instance: str, host: str, port: int, worker_id: int, token: str, ready: Any,
                max_connections: int, counts: Counts | None = None) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; SIGTERM stops us
    _die_with_parent()
    sys.setswitchinterval(0.0005)  # a woken durable-mark thread gets the GIL in 0.5 ms, not 5 ms
    os.environ.pop(options.TOKEN_ENV, None)
    Worker(instance, host, port, worker_id, token, max_connections, counts).run(ready)
