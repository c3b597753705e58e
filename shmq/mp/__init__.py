"""A drop-in for ``multiprocessing``'s queues, on shmq's shared memory.

    >>> from shmq import mp
    >>> q = mp.Queue()                    # as multiprocessing.Queue(), in a Process or a Pool
    >>> q.put({"order": 42})
    >>> q.get(timeout=1.0)
    {'order': 42}

``Queue(maxsize=0)``, ``JoinableQueue(maxsize=0)`` and ``SimpleQueue()`` have the stdlib's
methods and exceptions (``queue.Empty``, ``queue.Full``; ``ValueError`` once closed), and
pickle objects as multiprocessing does (``multiprocessing.reduction.ForkingPickler``).
``put_many`` and ``get_many`` are extras, a batch in one call.

What is not as in the stdlib:

- **No feeder thread.**  ``put`` pickles and stores the object before it returns, so an
  object that cannot be pickled raises in ``put`` (the stdlib prints it from its feeder
  thread), and what was put is visible to every process at once.
- **Bounded.**  ``maxsize=0`` means ``options.MP_CAPACITY`` objects; the pickled objects
  held share ``max_bytes`` (default ``options.MP_MAX_BYTES``, reserved in /dev/shm when the
  queue is made), and one may be at most ``max_bytes // 16`` (``MessageTooLarge``).
- **Survives a SIGKILL.**  The queue's locks are shmq's, which a dead holder gives back,
  so a process killed at any instruction never leaves the others stuck.  A
  ``JoinableQueue``'s object stays leased by the process that got it until that process
  calls ``task_done()``; if it dies (or ends) first, the object is delivered again.  So
  ``task_done()`` settles the oldest object *this* process got and has not settled
  (``ValueError`` when there is none), and ``join()`` waits until every object put was
  got and settled.  A task that takes more than ``options.MAX_VISIBILITY_TIMEOUT``
  (12 hours) is delivered again.
- **Passes anywhere.**  A queue pickles to its name, so it can go to a child under fork,
  spawn or forkserver (as an argument to ``Process``, or in a ``Pool`` initializer), and
  also through another queue.

Where it lives: each queue is its own shmq instance, ``shm://mp-<pid>-<random>``, in
/dev/shm.  It belongs to the processes that use it: when the last of them closes it, lets
go of it or exits, it is removed.  When the last one was SIGKILLed, the next queue made by
any process (or ``shmq doctor --clean``) removes it; a queue some live process still
holds is never touched (``shmq.reclaim``'s proof: an flock every user holds).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from multiprocessing import util as _mp_util
from multiprocessing.reduction import ForkingPickler
from typing import Any

from shmq import options
from shmq.api import Message
from shmq.core.cleanup import reclaim, reclaim_dead
from shmq.core.colocated import ShmBroker
from shmq.errors import InstanceNotFound, QueueNotFound

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]

INSTANCE_PREFIX = "mp-"  # the instances of this module: mp-<pid>-<random>
_QUEUE = "q"  # the one queue of each
_DEFAULT = options.DEFAULT_GROUP


# ----------------------------------------------------------------- pickling
# ForkingPickler.dumps copies the copyreg table and ForkingPickler's reducers into each new
# pickler (1.5-2.5 us a call); this module keeps one copy, taken again whenever a queue is
# made or unpickled here and when copyreg's table grows (so a reducer registered with
# ForkingPickler.register counts from the next queue on), and one pickler on it that a
# thread reuses when no other thread is using it.  Objects of these exact types never
# reach a reducer: plain pickle.dumps gives the same bytes.
_PLAIN: frozenset[type] = frozenset({bytes, str, int, float, bool, type(None)})


class _Pickler(pickle.Pickler):
    dispatch_table: dict[Any, Any] = {}
    seen = -1  # len(copyreg.dispatch_table) when the copy was taken


_spare: tuple[io.BytesIO, _Pickler] | None = None  # the pickler to reuse, on the current copy
_spare_lock = threading.Lock()


def _take_reducers() -> None:
    global _spare
    _Pickler.dispatch_table = ForkingPickler(io.BytesIO()).dispatch_table  # a fresh copy of both
    _Pickler.seen = len(copyreg.dispatch_table)
    buf = io.BytesIO()
    _spare = (buf, _Pickler(buf))  # a pickler reads its table when it is made


def _dumps(obj: Any, _plain: frozenset[type] = _PLAIN, _dumps: Any = pickle.dumps) -> bytes:
    """``obj`` pickled as ``ForkingPickler.dumps`` pickles it."""
    if type(obj) in _plain:
        return _dumps(obj)  # type: ignore[no-any-return]
    if len(copyreg.dispatch_table) != _Pickler.seen:
        _take_reducers()
    spare = _spare
    if spare is not None and _spare_lock.acquire(False):
        try:
            buf, pickler = spare
            buf.seek(0)
            buf.truncate()
            pickler.clear_memo()
            pickler.dump(obj)
            return buf.getvalue()
        finally:
            _spare_lock.release()
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def _after_fork_in_child() -> None:
    global _spare_lock
    _spare_lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


_loads = ForkingPickler.loads


# ----------------------------------------------------------------- lifetime
def _release(broker: ShmBroker, instance: str) -> None:
    """Let go of this process's hold of a queue; remove it when no process holds it."""
    try:
        broker.close()
    finally:
        reclaim(instance)  # removes nothing while another process is attached


def _timeout(block: bool, timeout: float | None) -> float | None:
    # as the stdlib: a timeout counts only when blocking, and a negative one is 0
    return None if timeout is None or not block else max(float(timeout), 0.0)


class Queue:
    """``multiprocessing.Queue`` on shmq: see the module's doc for what differs."""

    _joinable = False

    def __init__(self, maxsize: int = 0, *, max_bytes: int = options.MP_MAX_BYTES, ctx: Any = None) -> None:
        """A new queue of up to ``maxsize`` objects (0 or less: ``options.MP_CAPACITY``) and
        ``max_bytes`` bytes of pickled objects.  ``ctx``: accepted as the stdlib's, unused
        (the queue passes to a child under every start method)."""
        if not isinstance(maxsize, int) or isinstance(maxsize, bool):
            raise TypeError(f"maxsize must be an int, not {type(maxsize).__name__}")
        reclaim_dead(INSTANCE_PREFIX)  # queues whose every user was SIGKILLed
        instance = f"{INSTANCE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        broker = ShmBroker(instance)
        try:
            broker.create_queue(
                _QUEUE, capacity=maxsize if maxsize > 0 else options.MP_CAPACITY, max_bytes=max_bytes,
                max_message_size=max(1, max_bytes // 16), visibility_timeout=options.MAX_VISIBILITY_TIMEOUT)
        except BaseException:
            broker.destroy()
            raise
        self._setup(broker, instance, maxsize)

    def _setup(self, broker: ShmBroker, instance: str, maxsize: int) -> None:
        _take_reducers()
        self._broker = broker
        self._instance = instance
        self._maxsize = maxsize
        self._q = broker.queue(_QUEUE)
        self._put, self._get = self._q.put, self._q.get  # (bound once: the hot path)
        self._closed = False
        self._leases: deque[Message] = deque()  # a JoinableQueue's, oldest first
        self._finalizer = _mp_util.Finalize(self, _release, (broker, instance), exitpriority=-10)
        _mp_util.register_after_fork(self, Queue._after_fork)

    def _after_fork(self) -> None:
        # a multiprocessing child made by fork: the parent's leases are not ours, and this
        # process lets go of the queue when it ends (its finalizers were cleared)
        self._leases = deque()
        self._finalizer = _mp_util.Finalize(self, _release, (self._broker, self._instance), exitpriority=-10)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self._instance, self._maxsize)

    def __repr__(self) -> str:
        return f"<shmq.mp.{type(self).__name__} shm://{self._instance} maxsize={self._maxsize}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    # --------------------------------------------------------- put
    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` (pickled now).  A full queue waits for room as ``block`` and ``timeout``
        say, then raises ``queue.Full``; ``ValueError`` once closed."""
        if self._closed:
            self._check_open()
        if timeout is not None:
            timeout = _timeout(block, timeout)
        self._put(_dumps(obj), block, timeout)

    def put_nowait(self, obj: Any) -> None:
        """``put(obj, False)``."""
        self.put(obj, False)

    def put_many(self, objs: Iterable[Any], block: bool = True, timeout: float | None = None) -> None:
        """Put every object of ``objs``, in order, all or none (``queue.Full`` when they do
        not fit in time): an extra, a batch in one call."""
        self._check_open()
        data = [_dumps(o) for o in objs]
        if data:
            self._q.put_many(data, block, _timeout(block, timeout))

    # --------------------------------------------------------- get
    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return the oldest object, waiting for one as ``block`` and ``timeout``
        say (then ``queue.Empty``); ``ValueError`` once closed."""
        if self._closed:
            self._check_open()
        if timeout is not None:
            timeout = _timeout(block, timeout)
        m = self._get(block, timeout)
        if self._joinable:
            self._leases.append(m)
        else:
            m.ack()
        return _loads(m.payload)

    def get_nowait(self) -> Any:
        """``get(False)``."""
        return self.get(False)

    def get_many(self, block: bool = True, timeout: float | None = None,
                 max_messages: int = options.MP_GET_MANY) -> list[Any]:
        """Remove and return up to ``max_messages`` of the oldest objects, at least one
        (waiting for it as ``get`` does): an extra, a batch in one call."""
        self._check_open()
        msgs = self._q.get_many(max_messages, block, _timeout(block, timeout))
        if self._joinable:
            self._leases.extend(msgs)
        else:
            self._q.ack_many(msgs)
        return [_loads(m.payload) for m in msgs]

    # --------------------------------------------------------- size
    def _default_group(self) -> dict[str, int]:
        group: dict[str, int] = self._q.stats()["groups"][_DEFAULT]
        return group

    def qsize(self) -> int:
        """The number of objects put and not yet got (approximate while others use it)."""
        return self._default_group()["depth"]

    def empty(self) -> bool:
        """Whether ``qsize()`` is 0."""
        return self.qsize() == 0

    def full(self) -> bool:
        """Whether ``maxsize`` objects are held (got and not settled ones of a
        ``JoinableQueue`` included), so that ``put`` would wait."""
        s = self._q.stats()
        return bool(s["retained"] >= s["capacity"])

    # --------------------------------------------------------- close
    def close(self) -> None:
        """This process is done with the queue: ``put`` and ``get`` raise ``ValueError``.
        Its hold of the shared memory goes now, and the queue with it if no other process
        holds it (what is in it is lost then, as with the stdlib's pipe)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def join_thread(self) -> None:
        """As the stdlib's, after ``close()``; there is no feeder thread to wait for."""
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")

    def cancel_join_thread(self) -> None:
        """As the stdlib's: nothing to cancel (every ``put`` is stored when it returns)."""


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue`` on shmq: an object got stays leased by the process
    that got it until it calls ``task_done()``, and comes back if that process dies first."""

    _joinable = True

    def task_done(self) -> None:
        """Settle the oldest object this process got and has not settled: ``ValueError``
        when there is none."""
        self._check_open()
        try:
            m = self._leases.popleft()
        except IndexError:
            raise ValueError("task_done() called too many times") from None
        m.ack()

    def join(self) -> None:
        """Wait until every object put has been got and settled (``task_done``)."""
        self._check_open()
        pause = options.MP_JOIN_POLL_MIN
        while True:
            g = self._default_group()
            if not g["depth"] and not g["in_flight"]:
                return
            time.sleep(pause)
            pause = min(pause * 2, options.MP_JOIN_POLL_MAX)


class SimpleQueue(Queue):
    """``multiprocessing.SimpleQueue`` on shmq: ``put``, ``get``, ``empty``, ``close`` (the
    other methods of ``Queue`` work too)."""

    def __init__(self, *, max_bytes: int = options.MP_MAX_BYTES, ctx: Any = None) -> None:
        super().__init__(0, max_bytes=max_bytes, ctx=ctx)


def _rebuild(cls: type[Queue], instance: str, maxsize: int) -> Queue:
    """A queue unpickled: this process attaches it (never creates it)."""
    try:
        broker = ShmBroker(instance, create=False)
    except InstanceNotFound:
        raise InstanceNotFound(f"the shmq.mp queue shm://{instance} is gone: every process that held it "
                               "closed it or exited") from None
    q = cls.__new__(cls)
    try:
        q._setup(broker, instance, maxsize)
    except QueueNotFound:
        broker.close()
        raise InstanceNotFound(f"the shmq.mp queue shm://{instance} is gone") from None
    return q

