"""One broker per instance: ``shmq serve`` holds a kernel lock on the instance's registry.

Two supervisors on one instance would both own its shared memory, and the first to stop
would remove it from under the other (every queue gone, ``QUEUE_NOT_FOUND``).  So the
supervisor takes, before it changes anything, an exclusive lock that the kernel releases
when the supervisor dies however it dies: an *open file description* (OFD) write lock on
byte ``LOCK_BYTE`` of the registry's file ``/dev/shm/shmq.<uid>.<instance>.reg``.

Why this lock and not another:

* a pid check alone cannot tell a live broker from a reused pid or a stopped one, and
  leaves a window between the check and the take-over; the kernel's lock has neither;
* every attached process holds a shared ``flock`` on the same file (``shmq.core.registry``:
  the proof of attachment that ``reclaim`` probes).  On Linux ``flock`` and ``fcntl``
  record locks are independent, so this lock neither blocks nor is blocked by them;
* a classic POSIX record lock (``F_SETLK``) belongs to the process and is dropped when
  the process closes *any* descriptor of the file; an OFD lock belongs to one open file
  description and lasts until its last descriptor is closed;
* ``fork`` shares open file descriptions, so a forked worker or journal process would
  keep the lock alive after the supervisor died: the descriptor is closed in every child
  right after the fork (``os.register_at_fork``), and it is ``O_CLOEXEC`` against
  ``exec``.  A SIGKILLed supervisor's lock is therefore gone at once, even while its
  workers are still on their way out, and a new ``shmq serve`` takes over.

The lock is taken on the registry the supervisor attached, and checked after it is taken
to still be that live registry (the file it mapped, its magic still valid):
a broker that held the lock until a moment ago removes the instance before it lets
go, and the newcomer then attaches the new one and tries again.

A refused supervisor names the live one: the registry's owner pid (written by the lock
holder right after it takes the lock, ``Registry.take_ownership``) and the address its
workers listen on, read from the kernel (psutil), so nothing can be stale.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time

import psutil

from shmq import process
from shmq.core.serverqueue import Registry, ServerBroker, registry_path
from shmq.errors import InstanceError

LOCK_BYTE = 1  # the byte of the registry file whose write lock means "served"
CLAIM_TRIES = 20  # attaches in a row that found the registry replaced meanwhile
OWNER_WAIT = 2.0  # s a refused supervisor waits for the lock holder to name itself
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding

_held: set[int] = set()  # descriptors holding a broker lock in this process


def _close_in_child() -> None:
    """After a fork, in the child: let go of the parent's lock descriptors, so that only the
    supervisor keeps its lock alive (the child's copy shares the open file description)."""
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class AlreadyServed(InstanceError):
    """Another ``shmq serve`` holds the instance's broker lock."""

    def __init__(self, instance: str, pid: int, url: str | None) -> None:
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"instance {instance!r} is already served by {who}" + (f" ({url})" if url else ""))
        self.instance = instance
        self.pid = pid
        self.url = url


class BrokerLock:
    """The broker lock of one instance, held by this process (never by the children it forks)."""

    def __init__(self, instance: str, fd: int) -> None:
        self.instance = instance
        self.fd = fd
        _held.add(fd)

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        """Let go (call after the instance is removed or closed: a newcomer may start at once)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _held.discard(fd)
            os.close(fd)  # the last descriptor of its open file description: the lock goes


def claim(instance: str) -> tuple[ServerBroker, BrokerLock]:
    """Attach the instance (creating it when none exists) and take its broker lock, without
    changing anything of an instance that is served already.

    Raises :class:`AlreadyServed` when another process holds the lock; the attachment is
    closed then (nothing is removed, no ownership taken).
    """
    for _ in range(CLAIM_TRIES):
        broker = ServerBroker(instance)
        try:
            lock = _try_lock(instance, broker.registry)
        except BaseException:
            broker.close()
            raise
        if lock is not None:
            return broker, lock
        broker.close()  # the registry we attached was removed meanwhile: attach the one there now
    raise InstanceError(f"instance {instance!r} kept being removed and created while `shmq serve` "
                        "tried to take it over")


def is_served(instance: str) -> bool:
    """Does a live ``shmq serve`` hold this instance's broker lock now?  (The kernel says so;
    nothing is attached or created: False when the instance does not exist.)"""
    try:
        fd = os.open(registry_path(instance), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:  # F_OFD_GETLK: the lock that would stop ours (F_UNLCK when none would)
        got = fcntl.fcntl(fd, _F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, LOCK_BYTE, 1, 0))
    finally:
        os.close(fd)
    return bool(struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK)


def _try_lock(instance: str, reg: Registry) -> BrokerLock | None:
    """The lock on ``reg``; None when ``reg`` is no longer the instance's live registry."""
    path = registry_path(instance)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not _same(fd, reg):
            return None
        try:
            fcntl.fcntl(fd, _F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, LOCK_BYTE, 1, 0))
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            pid, url = holder(reg)
            raise AlreadyServed(instance, pid, url) from None
        # the holder until a moment ago removes the instance before it lets go: check again
        if not _same(fd, reg):
            return None
        lock = BrokerLock(instance, fd)
        fd = -1
        return lock
    finally:
        if fd >= 0:
            os.close(fd)  # (releases the lock too, if it was taken on a dead registry)


def _same(fd: int, reg: Registry) -> bool:
    """Is ``fd`` the file ``reg`` has mapped, and ``reg`` still live?  (A removed registry's
    magic is zeroed before its name goes: ``ShmBroker.destroy``, ``reclaim``.)"""
    st, mine = os.fstat(fd), os.fstat(reg.mapping.fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) and reg.live


def holder(reg: Registry) -> tuple[int, str | None]:
    """The pid of the broker that holds the lock (0 if it did not name itself in time) and
    the address its workers listen on (None if none is found).  The holder writes its pid
    right after it takes the lock, so a newcomer that lost a race for it waits a moment."""
    deadline = time.monotonic() + OWNER_WAIT
    while True:
        pid, start = reg.owner
        if pid != os.getpid() and process.is_alive(pid, start):
            return pid, listening_url(pid)
        if time.monotonic() > deadline:
            return 0, None
        time.sleep(0.01)


def listening_url(pid: int) -> str | None:
    """``tcp://host:port`` of the first listening TCP socket of ``pid``'s children (the
    workers of a supervisor: not its journal process, which listens for standbys, nor its
    metrics process), or None."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if child.name() in ("shmq-journal", "shmq-metrics"):
                continue
        except psutil.Error:
            continue
        try:  # (``connections`` before psutil 6)
            conns = (getattr(child, "net_connections", None) or child.connections)(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                host, port = c.laddr[0], c.laddr[1]
                return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    return None
