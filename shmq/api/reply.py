"""Request/reply: ``broker.request`` and ``Message.reply`` (docs/operations.md, "Request/reply").

A requester (one per broker handle and process) owns a *reply queue*, created on its
first request and named ``reply.`` + 24 random hex digits (``names.is_reply_name``).  A
request is an ordinary put with two headers, ``reply-to`` (that queue) and
``correlation-id`` (``<requester>.<n>``, unique per request); ``Message.reply`` puts the
answer to ``reply-to`` with the same ``correlation-id``, never blocking: a reply whose
queue is gone, or full, is dropped and counted: in the process (:func:`stats`) and in the
instance (``broker.info().replies_dropped``, the metric ``shmq_replies_dropped_total``).

Threads share a requester as they share the TCP client's socket: whoever finds nobody
reading the reply queue reads it for everyone and files each reply under its
correlation id; a reply nobody waits for any more (its request timed out) is dropped
and counted as ``late``.  The replies read are acknowledged together by the next read,
after the next request was put: off the round trip (the reply queue's leases last
``options.MAX_VISIBILITY_TIMEOUT``, so an idle requester's last reply is not delivered
again).

The reply queue goes with ``broker.close()``, at the process's exit (co-located), when
the TCP connection that made it closes (the worker deletes it), and when the process
that created it (the co-located requester, or the worker) is found dead by the reaper.
"""

from __future__ import annotations

import atexit
import itertools
import math
import multiprocessing.util as mp_util
import os
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from shmq import headers as _headers
from shmq import options
from shmq.errors import Empty, Full, InvalidArgument, QueueNotFound, ShmqError, Timeout
from shmq.names import is_reply_name, new_reply_name

REPLY_TO = "reply-to"
CORRELATION_ID = "correlation-id"

_U16 = struct.Struct(">H")
_CID_KEY = _U16.pack(len(CORRELATION_ID)) + CORRELATION_ID.encode()  # then u16 length, value
_NAME_LEN = len(options.REPLY_PREFIX) + 24
# a request's block as a requester makes it: reply-to first, then correlation-id, nothing else
_REQUEST_START = (bytes((_headers.TAG, 0, 2)) + _U16.pack(len(REPLY_TO)) + REPLY_TO.encode()
                  + _U16.pack(_NAME_LEN))
_CID_AT = len(_REQUEST_START) + _NAME_LEN  # where its correlation-id entry starts
_VALUE_AT = _CID_AT + len(_CID_KEY) + 2  # and its value
_REPLY_START = bytes((_headers.TAG, 0, 1))  # a reply's block: then the request's correlation-id entry
ReplyHeaders = _headers.Block | dict[str, str | bytes]  # a request's or a reply's (one block when it can)
_names: dict[bytes, str] = {}  # reply-to values found valid (reply_target), a few hundred at most
_counts = {"late": 0, "gone": 0, "full": 0}
_counts_lock = threading.Lock()
_pid = os.getpid()  # this process's, renewed in a forked child (os.getpid is a system call)


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def count_dropped(what: str, via: Any = None) -> None:
    """One more reply dropped, for ``what``: in this process (:func:`stats`) and, when
    ``via`` is a co-located handle (a queue or a broker), in its instance's registry
    (``broker.info().replies_dropped``, the metrics).  Over TCP the worker counts the
    replies it drops itself; a TCP requester's late ones are this process's alone."""
    with _counts_lock:
        _counts[what] += 1
    if via is not None:
        via._reply_dropped(what)


def stats() -> dict[str, int]:
    """This process's dropped replies: ``late`` (read by a requester after its request timed
    out), ``gone`` (sent by ``reply`` to a reply queue that no longer exists) and ``full``
    (sent to a full reply queue).  The instance's, whoever dropped them:
    ``broker.info().replies_dropped``."""
    with _counts_lock:
        return dict(_counts)


def check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def request_head(reply_to: str) -> bytes:
    """The start of the header block of every request of the requester whose reply queue
    is ``reply_to`` (encoded once): the correlation id's length and value follow."""
    return _headers.encode({REPLY_TO: reply_to, CORRELATION_ID: ""})[:-2]


def request_headers(headers: Mapping[str, str | bytes] | None, head: bytes, reply_to: str, cid: bytes
                    ) -> ReplyHeaders:
    """A request's headers: without the caller's, its block made from ``head``
    (:func:`request_head`); else the caller's, then ``reply-to`` and ``correlation-id``
    (which the caller may not set)."""
    if not headers:
        return _headers.Block(head + _U16.pack(len(cid)) + cid)
    h = dict(headers)
    if REPLY_TO in h or CORRELATION_ID in h:
        raise InvalidArgument(f"{REPLY_TO!r} and {CORRELATION_ID!r} are set by request itself")
    h[REPLY_TO] = reply_to
    h[CORRELATION_ID] = cid.decode()
    return h


def reply_target(meta: bytes | memoryview, headers: Mapping[str, str | bytes] | None
                 ) -> tuple[str, ReplyHeaders]:
    """Where a reply to a message with metadata ``meta`` goes, and its headers.
    ``InvalidArgument``: the message is no request (no ``reply-to`` naming a reply queue,
    or no ``correlation-id``), or ``headers`` sets ``correlation-id``.  A request as a
    requester makes it (and no headers of the reply's own) is read without decoding: its
    block has one shape, and the reply's block is its correlation-id entry."""
    if not isinstance(meta, bytes):
        meta = bytes(meta)
    n = len(meta)
    if (headers is None and n >= _VALUE_AT and meta.startswith(_REQUEST_START)
            and meta.startswith(_CID_KEY, _CID_AT)
            and n == _VALUE_AT + (meta[_VALUE_AT - 2] << 8 | meta[_VALUE_AT - 1])):
        raw = meta[_CID_AT - _NAME_LEN:_CID_AT]
        known = _names.get(raw)
        if known is None and is_reply_name(text := raw.decode("ascii", "replace")):
            if len(_names) >= 256:
                _names.clear()
            known = _names[raw] = text
        if known is not None:
            return known, _headers.Block(_REPLY_START + meta[_CID_AT:])
    msg_headers = _headers.decode(meta)
    to, cid = msg_headers.get(REPLY_TO), msg_headers.get(CORRELATION_ID)
    name = to.decode("ascii", "replace") if to is not None else ""
    if cid is None or not is_reply_name(name):
        raise InvalidArgument("the message is not a request: it has no reply-to naming a reply queue "
                              "and correlation-id (broker.request sets them)")
    h = dict(headers) if headers else {}
    if CORRELATION_ID in h:
        raise InvalidArgument(f"{CORRELATION_ID!r} is set by reply itself")
    h[CORRELATION_ID] = cid
    return name, h


def send_reply(handle: Any, name: str, payload: Any, headers: ReplyHeaders) -> bool:
    """Put a reply into reply queue ``name`` (through ``handle``'s broker) without
    waiting; False (counted) when the queue is gone or full."""
    try:
        handle._reply_queue(name).put(payload, block=False, headers=headers)
    except QueueNotFound:
        count_dropped("gone", handle)
        return False
    except Full:
        count_dropped("full", handle)
        return False
    return True


class Requester:
    """One broker handle's requests in one process (see the module's doc)."""

    def __init__(self, broker: Any) -> None:
        self.pid = os.getpid()
        self.broker = broker
        self.name = new_reply_name()
        self._q = broker.create_queue(self.name, capacity=options.REPLY_CAPACITY,
                                      max_bytes=options.REPLY_MAX_BYTES, durability="memory",
                                      visibility_timeout=options.MAX_VISIBILITY_TIMEOUT)
        if hasattr(self._q, "_spin"):  # co-located: a reply comes within tens of µs; a sleep costs ~100
            self._q._spin = int(options.REPLY_SPIN_US * 1000)
        self._prefix = self.name[len(options.REPLY_PREFIX):][:12].encode()
        self._head = request_head(self.name)
        self._ids = itertools.count(1)
        self._cond = threading.Condition(threading.Lock())
        self._reading = False  # a thread reads the reply queue (for everyone)
        self._sleepers = 0  # threads waiting for the reader to file their reply
        self._waiting: dict[bytes, Any] = {}  # correlation id -> its reply (None until it came)
        self._unacked: list[Any] = []  # replies read, acked by the next read (off the round trip)
        self._targets: dict[str, Any] = {}  # queue handles requests were put to
        self.closed = False
        if broker.url.startswith("shm://"):
            _local.add(self)
            _exit_hooks()

    def request(self, queue: str, payload: Any, timeout: float,
                headers: Mapping[str, str | bytes] | None) -> Any:
        timeout = check_timeout(timeout)
        deadline = time.monotonic() + timeout
        key = b"%b.%d" % (self._prefix, next(self._ids))  # the correlation id
        h = request_headers(headers, self._head, self.name, key)
        q = self._targets.get(queue)
        if q is None:
            q = self._targets[queue] = self.broker.queue(queue)
        cond = self._cond
        cond.acquire()
        self._waiting[key] = None
        cond.release()
        try:
            q.put(payload, timeout=timeout, headers=h)
        except BaseException as e:
            with cond:
                del self._waiting[key]
            if isinstance(e, QueueNotFound):
                self._targets.pop(queue, None)
            raise
        return self._wait(key, deadline, queue)

    def _wait(self, key: bytes, deadline: float, queue: str) -> Any:
        """Wait for the reply to ``key`` (reading for everyone while nobody else does);
        ``key`` is no longer awaited once this returns or raises."""
        cond = self._cond
        cond.acquire()
        try:
            while True:
                got = self._waiting[key]
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise Timeout(f"no reply from {queue!r} within the timeout")
                if self._reading:
                    self._sleepers += 1
                    try:
                        cond.wait(left)
                    finally:
                        self._sleepers -= 1
                    continue
                self._reading = True
                unacked, self._unacked = self._unacked, []
                cond.release()
                msg = None
                try:
                    if unacked:  # the replies read before: acked while this request is served
                        _ack(self._q, unacked)
                    msg = self._q.get(timeout=left)
                except (Empty, Timeout):
                    pass
                finally:
                    cond.acquire()
                    self._reading = False
                    if msg is not None:
                        self._file(msg, key)
                    if self._sleepers:
                        cond.notify_all()
        finally:
            del self._waiting[key]
            cond.release()

    def _file(self, msg: Any, mine: bytes) -> None:
        """A reply read: to the request waiting for it, else dropped (late; a reply
        delivered again, its lease lost, is dropped uncounted: it was read once).
        ``mine``: the reader's own correlation id, looked for first at the end of the
        header block, where ``Message.reply`` puts it (no decoding in the usual case)."""
        self._unacked.append(msg)
        meta = msg.meta
        tail = _CID_KEY + _U16.pack(len(mine)) + mine
        if meta[-len(tail):] == tail:
            key: bytes | None = mine
        else:
            key = msg.headers.get(CORRELATION_ID)
        if key is not None and self._waiting.get(key, 0) is None:
            self._waiting[key] = msg
        elif msg.deliveries == 1:
            count_dropped("late", self.broker)

    def close(self) -> None:
        """Delete the reply queue (a request waiting now times out)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        _local.discard(self)
        try:
            self.broker.delete_queue(self.name)
        except ShmqError:
            pass  # gone already (reaped, or the broker stopped)


def _ack(q: Any, msgs: list[Any]) -> None:
    try:
        if len(msgs) == 1:  # the usual case: the single ack's path is the shorter
            msgs[0].ack(wait=False)
        else:
            q.ack_many(msgs, wait=False)
    except ShmqError:
        pass  # a lease lost meanwhile: that reply is read again, and dropped then


_local: weakref.WeakSet[Requester] = weakref.WeakSet()  # co-located ones: closed at exit
_make_lock = threading.Lock()


def requester_of(broker: Any) -> Requester:
    """``broker``'s requester in this process, made on first use."""
    r = broker.__dict__.get("_requester")
    if r is None or r.pid != _pid or r.closed:
        with _make_lock:
            r = broker.__dict__.get("_requester")
            if r is None or r.pid != _pid or r.closed:
                r = broker._requester = Requester(broker)
    return r


def end_requests(broker: Any) -> None:
    """``broker`` closes: its reply queue goes (this process's requester only)."""
    r = broker.__dict__.get("_requester")
    if r is not None:
        r.close()


def _at_exit() -> None:
    for r in list(_local):
        r.close()


_hooked_pid = 0


def _exit_hooks() -> None:
    """Delete this process's co-located reply queues when it ends normally (atexit, and
    multiprocessing's finalizers: its children end with os._exit, which skips atexit)."""
    global _hooked_pid
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        atexit.register(_at_exit)
        mp_util.Finalize(None, _at_exit, exitpriority=101)
