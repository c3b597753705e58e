"""Placement: which worker serves a connection.

The kernel hands each new connection to one of the workers' SO_REUSEPORT
sockets by a hash of its addresses.  Over thousands of connections that evens
out; over the few long-lived connections a broker typically has, it often does
not (4 clients on 4 workers all land on different workers 4!/4**4 = 9 % of the
time), and two busy clients sharing a worker while another idles halve the
throughput the pool is there for.  So once a connection's HANDSHAKE is read,
the worker that accepted it decides who serves it:

* ``affinity`` empty: the worker with the fewest connections.  The accepting
  worker keeps the connection unless another has at least 2 fewer than it
  (counting this one), so ties never move a connection.
* ``affinity`` set: worker ``crc32(affinity) % workers``, so every connection
  with the same affinity shares a worker.  A request/reply pair (ping-pong, RPC)
  then skips the doorbell hop between workers (docs/operations.md).

A connection that should move is handed over whole: its socket descriptor goes
to the chosen worker over that worker's handoff socket (a UNIX datagram socket
in Linux's abstract namespace, like the doorbell) with ``SCM_RIGHTS``, and the
HANDSHAKE bytes read so far ride in the same datagram.  The new worker feeds
them to a fresh connection before it reads the socket itself, so the client
sees one ordinary handshake.  Only a connection that has sent nothing but its
HANDSHAKE moves (no lease, no subscription, nothing buffered), and it moves at
most once.

Connection counts live in a table the supervisor maps (anonymous shared memory,
inherited by every worker it forks; nothing in /dev/shm): word ``i`` is worker
``i``'s count, written only by worker ``i`` (one aligned 8-byte store), so a
reader sees a count that may be a moment old, never a torn one::

    word:   0          1          ...   MAX_WORKERS - 1
          +----------+----------+-----+----------+
          | worker 0 | worker 1 | ... | worker 63|   connections served now
          +----------+----------+-----+----------+

Failure is always "the accepting worker keeps it": the chosen worker is not
listening (dead, restarting: ``sendmsg`` fails), or its receive queue is full.
A descriptor in flight to a worker that dies before reading it is closed by the
kernel with that worker's socket: the client sees its handshake's connection
lost, exactly as if the worker it connected to had died.  A restarted worker
zeroes its own word.

The worker that receives a socket trusts nothing it came with: it takes sockets
only from processes of its own user (the kernel's ``SCM_CREDENTIALS``), and the
preface is handled as any connection's first bytes (token checked, malformed
refused).
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct
import zlib

from shmq import options

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FD = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(4 * _FD) + socket.CMSG_SPACE(_UCRED.size)
MAX_PREFACE = 4096  # the longest HANDSHAKE handed over with its socket (a longer one stays put)


def address(instance_uid: int, worker: int) -> bytes:
    """The abstract socket name of a worker's handoff socket."""
    return b"\0shmq-hand-%016x-%d" % (instance_uid, worker)


class Counts:
    """The connection-count table: one 64-bit word per worker, in anonymous shared memory
    (made by the supervisor before it forks the workers)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._mm = mmap.mmap(-1, 8 * options.MAX_WORKERS)  # MAP_SHARED | MAP_ANONYMOUS
        self.words = memoryview(self._mm).cast("Q")

    def set(self, worker: int, n: int) -> None:
        self.words[worker] = n

    def snapshot(self) -> list[int]:
        return self.words[:self.workers].tolist()


def choose(counts: list[int], me: int, affinity: str) -> int:
    """The worker that should serve a new connection accepted by ``me``; ``counts``: every
    worker's connections, ``me``'s including this one."""
    if affinity:
        return zlib.crc32(affinity.encode()) % len(counts)
    best = min(range(len(counts)), key=counts.__getitem__)
    return best if counts[best] + 1 < counts[me] else me


def affinity_for(worker: int, workers: int) -> str:
    """An affinity that a broker of ``workers`` workers serves on ``worker`` (for tests and
    benchmarks that want a client on a given worker)."""
    j = 0
    while zlib.crc32(f"w{worker}.{j}".encode()) % workers != worker:
        j += 1
    return f"w{worker}.{j}"


class Handoff:
    """A worker's end: receives the connections handed to it, sends the ones it hands on."""

    def __init__(self, instance_uid: int, worker: int) -> None:
        self.uid = instance_uid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # who sent each datagram
        self.sock.bind(address(instance_uid, worker))
        self.user = os.getuid()  # the only user whose processes may hand us sockets

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, worker: int, fd: int, preface: bytes) -> bool:
        """Hand ``fd`` (still ours to close afterwards: the kernel passes a duplicate) and the
        bytes read from it to ``worker``.  False when that worker cannot take it now."""
        if len(preface) > MAX_PREFACE:
            return False
        try:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            # (socket.send_fds would drop the address: 3.11 and 3.12 ignore that argument)
            return self.sock.sendmsg([preface], rights, 0, address(self.uid, worker)) == len(preface)
        except OSError:
            return False  # nobody listening there (dead, restarting), or its queue is full

    def receive(self) -> list[tuple[socket.socket, bytes]]:
        """The connections handed to us since the last call, with their preface bytes."""
        out: list[tuple[socket.socket, bytes]] = []
        while True:
            try:
                data, ancillary, flags, _ = self.sock.recvmsg(MAX_PREFACE, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return out
            fds: list[int] = []
            uid = -1
            for level, kind, item in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", item[:len(item) - len(item) % _FD]))
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    uid = _UCRED.unpack(item[:_UCRED.size])[1]
            socks = [socket.socket(fileno=fd) for fd in fds]
            if len(socks) != 1 or uid != self.user or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for s in socks:  # not one of ours: close what came
                    s.close()
                continue
            out.append((socks[0], data))

    def close(self) -> None:
        self.sock.close()
