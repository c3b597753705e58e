"""Doorbells: how a message made available in one process wakes the broker workers
that park requests on its queue, without a thread per queue.

Each broker worker binds a UNIX datagram socket in Linux's abstract namespace
(no file, nothing to clean up: the name goes with the last descriptor), named
after the instance's random uid and the worker id, and reads it on its event
loop.  While a worker has requests parked on a queue, or subscriptions to it,
it sets its byte in the queue's bell table (``layout.Q_BELLS``).  Whoever makes
a message available there (a put by another worker or by a co-located process,
the journal writer publishing an ``always`` batch, a lease given back) sends
the queue id to every worker whose byte is set::

    producer                                   worker i (event loop)
    --------                                   ---------------------
    publish the message (under plock)          set bells[i] = 1
    unlock (a full barrier)                    retry the parked request (takes
    read bells; for each i set:                  clock: a full barrier, then
      sendto(worker i, queue id)  ----------->   reads the tail)
                                               on a datagram: retry what waits
                                               on that queue

Either the producer sees the flag, or the worker's retry sees the message: no
wake-up is lost.  A flag is only a hint: a datagram nobody reads is dropped
(the worker died, its receive buffer is full), a stale flag costs one
``sendto`` per put until its worker clears it (a restarted worker clears its
bytes in every queue), and every worker also retries on a 50 ms tick.
The sender never blocks.  The abstract namespace has no permissions, so a bell
takes a datagram only from a process of its own user (the kernel's
``SCM_CREDENTIALS``): only those can attach the queues it serves.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

from shmq import options
from shmq.core import layout as L

_QID = struct.Struct("<Q")  # a datagram: the queue id
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANCILLARY = socket.CMSG_SPACE(_UCRED.size)
NO_BELLS = bytes(L.Q_BELLS_SIZE)  # a bell table with no flag set
assert options.MAX_WORKERS <= L.Q_BELLS_SIZE, "every worker needs its byte in the bell table"


def address(instance_uid: int, worker: int) -> bytes:
    """The abstract socket name of a worker's doorbell."""
    return b"\0shmq-bell-%016x-%d" % (instance_uid, worker)


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The uid the kernel attached to a datagram (SCM_CREDENTIALS), -1 when none came."""
    for level, kind, item in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(item) >= _UCRED.size:
            return int(_UCRED.unpack(item[:_UCRED.size])[1])
    return -1


class Ringer:
    """The sending side: one non-blocking datagram socket per process.

    A broker worker holds its rings while it handles what it read (:meth:`held`): they
    go out once its answers are written, so the answer to a put is not delayed by the
    datagram, nor by the other worker that the datagram wakes (on a small machine it can
    take the CPU from the sender at once); a queue rung many times meanwhile is rung once."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None  # made on first use; a forked child shares it
        self._held: dict[tuple[int, int], tuple[bytes, int]] | None = None  # (uid, queue id) -> flags, skip
        self._holder = 0  # the thread whose rings are held

    def hold(self) -> bool:
        """Hold this thread's rings until :meth:`release` (call it in a ``finally``); False
        when they are held already (the caller that held them releases)."""
        if self._held is not None:
            return False
        self._held, self._holder = {}, threading.get_ident()
        return True

    def release(self) -> None:
        """Send the rings held, once per queue, to every worker flagged at any of them."""
        rings, self._held = self._held, None
        for (uid, qid), (flags, skip) in (rings or {}).items():
            self._send(flags, uid, qid, skip)

    def ring(self, flags: bytes, instance_uid: int, queue_id: int, skip: int) -> None:
        """Send ``queue_id`` to each worker whose byte in ``flags`` (a copy of a queue's
        bell table) is set, but ``skip`` (the calling worker itself, which retries its
        own requests directly)."""
        held = self._held
        if held is not None and self._holder == threading.get_ident():
            key = (instance_uid, queue_id)
            before = held.get(key)
            held[key] = (flags if before is None or before[0] == flags
                         else bytes(a | b for a, b in zip(flags, before[0], strict=True)), skip)
            return
        self._send(flags, instance_uid, queue_id, skip)

    def _send(self, flags: bytes, instance_uid: int, queue_id: int, skip: int) -> None:
        sock = self._sock
        if sock is None:
            sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
        data = _QID.pack(queue_id)
        i = flags.find(1)
        while i >= 0:
            if i != skip:
                try:
                    sock.sendto(data, address(instance_uid, i))
                except OSError:
                    pass  # nobody there (a dead worker's stale flag) or its buffer is full
            i = flags.find(1, i + 1)


RINGER = Ringer()


class Bell:
    """The receiving side, a worker's: read on its event loop (``fileno``)."""

    def __init__(self, instance_uid: int, worker: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # who sent each datagram
        self.sock.bind(address(instance_uid, worker))
        self.user = os.getuid()  # the only user whose processes may ring

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> set[int]:
        """The queue ids rung since the last drain (by processes of our user: others' are dropped)."""
        ids: set[int] = set()
        recvmsg = self.sock.recvmsg
        user = self.user
        while True:
            try:
                data, ancillary, _flags, _ = recvmsg(64, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return ids
            if len(data) == _QID.size and _sender_uid(ancillary) == user:
                ids.add(_QID.unpack(data)[0])

    def close(self) -> None:
        self.sock.close()
