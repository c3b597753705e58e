"""A lock in shared memory whose holder's death is detected by the kernel.

It is a process-shared *robust* pthread mutex, reached through ctypes.  When
a process dies holding it (SIGKILL at any instruction), the kernel marks the
mutex and hands it to the next waiter with ``EOWNERDEAD``; we then mark it
consistent and carry on.  Nothing is ever stolen on a timeout: a lock is taken
over only when the kernel has proven its holder dead.  Uncontended lock and
unlock stay in user space (a futex), a waiter sleeps in the kernel.

shmq keeps its shared state so that a holder that dies mid-section leaves
nothing to undo: every change is published by one aligned 8-byte store
(see ``layout``), and the derived fields are re-derived by the next holder.
So recovery here is only "make consistent, count it".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from collections.abc import Callable

from shmq.accel import ext
from shmq.core.layout import MUTEX_SIZE
from shmq.errors import InstanceError

_LIBC_NAME = ctypes.util.find_library("c") or "libc.so.6"
_libc = ctypes.CDLL(_LIBC_NAME, use_errno=True)  # releases the GIL: for calls that may block
_libc_gil = ctypes.PyDLL(_LIBC_NAME)  # keeps the GIL: cheaper, for calls that never block
_lock = _libc.pthread_mutex_lock
_trylock = _libc_gil.pthread_mutex_trylock
_unlock = _libc_gil.pthread_mutex_unlock
_consistent = _libc.pthread_mutex_consistent
_init = _libc.pthread_mutex_init
for _f in (_lock, _unlock, _trylock, _consistent):
    _f.argtypes = [ctypes.c_void_p]
    _f.restype = ctypes.c_int
EBUSY = errno.EBUSY
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
EOWNERDEAD = errno.EOWNERDEAD
ENOTRECOVERABLE = errno.ENOTRECOVERABLE
_TID_MASK = 0x3FFFFFFF  # the holder's thread id in a robust mutex's lock word (FUTEX_TID_MASK)

# The threads of this process asleep in pthread_mutex_lock (without the GIL), per
# address: the only way a thread of ours can come to hold a lock while another runs
# Python.  ``RobustLock.busy_here`` reads it.
_sleeping: dict[int, int] = {}
_sleeping_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _sleeping_lock
    _sleeping.clear()  # the parent's sleepers are not this process's threads
    _sleeping_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def init_mutex(address: int) -> None:
    """Initialise a process-shared robust mutex at ``address`` (fresh memory only)."""
    attr = ctypes.create_string_buffer(64)
    rc = _libc.pthread_mutexattr_init(attr)
    rc = rc or _libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)
    rc = rc or _libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)
    rc = rc or _init(ctypes.c_void_p(address), attr)
    _libc.pthread_mutexattr_destroy(attr)
    if rc:
        raise InstanceError(f"pthread_mutex_init failed: {errno.errorcode.get(rc, rc)}")


# for hot paths: rc = trylock(lock.address); if rc: lock.acquire_slow(rc).  The compiled
# ones (shmq.accel) make the same libc calls as the ctypes ones, at a fraction of the cost.
trylock: Callable[[int], int] = _trylock if ext is None else ext.trylock
unlock: Callable[[int], int] = _unlock if ext is None else ext.unlock


class RobustLock:
    """One robust mutex at a byte offset of a mapped segment.

    ``acquire()`` returns True when the previous holder died inside the
    critical section (the caller may want to count it); the lock is held
    either way.  Use ``with lock:`` when the flag does not matter.
    """

    __slots__ = ("_anchor", "address", "_counter", "on_recover")

    def __init__(self, mm: mmap.mmap, offset: int, counter: tuple[memoryview, int] | None = None) -> None:
        self._anchor = (ctypes.c_char * MUTEX_SIZE).from_buffer(mm, offset)
        self.address = ctypes.addressof(self._anchor)
        self._counter = counter  # (words, index): a shared count of recoveries, bumped under the lock
        # called (lock held) when the previous holder died inside: re-derive what it may have left stale
        self.on_recover: Callable[[], object] | None = None

    def initialise(self) -> None:
        init_mutex(self.address)

    def acquire(self) -> bool:
        # Try without letting go of the GIL (cheap); sleep in the kernel only when busy.
        rc = trylock(self.address)
        if rc:
            return self.acquire_slow(rc)
        return False

    def acquire_slow(self, rc: int) -> bool:
        """Finish an acquire whose ``trylock`` returned rc != 0 (hot paths inline the try)."""
        if rc == EBUSY:
            a = self.address
            with _sleeping_lock:
                _sleeping[a] = _sleeping.get(a, 0) + 1
            try:
                rc = _lock(a)
            finally:
                with _sleeping_lock:
                    n = _sleeping.pop(a) - 1
                    if n:
                        _sleeping[a] = n
            if rc == 0:
                return False
        return self._recover(rc)

    def busy_here(self) -> bool:
        """Does a thread of this process hold this lock, or sleep waiting for it?  (Asked,
        with the GIL held, before the memory under the lock is let go of: a robust mutex
        that a thread holds is on that thread's robust list, which must never point into
        memory that is gone.)"""
        if self._anchor is None:
            return False
        if self.address in _sleeping:
            return True
        tid = ctypes.c_uint32.from_address(self.address).value & _TID_MASK
        return bool(tid) and os.path.exists(f"/proc/self/task/{tid}")

    def _recover(self, rc: int) -> bool:
        if rc == EOWNERDEAD:
            _consistent(self.address)
            if self._counter is not None:
                words, index = self._counter
                words[index] += 1
            if self.on_recover is not None:
                self.on_recover()
            return True
        if rc == ENOTRECOVERABLE:
            raise InstanceError("a shared lock is unrecoverable; run `shmq doctor`")
        raise InstanceError(f"pthread_mutex_lock failed: {errno.errorcode.get(rc, rc)}")

    def release(self) -> None:
        unlock(self.address)

    def __enter__(self) -> RobustLock:
        self.acquire()
        return self


    def __exit__(self, *exc: object) -> None:
        unlock(self.address)

    def detach(self) -> None:
        """Drop the export of the mapping so that it can be closed."""
        self._anchor = None  # type: ignore[assignment]
        self._counter = None
        self.on_recover = None
