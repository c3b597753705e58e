"""The journal writer: makes `interval` and `always` queues durable, and rebuilds them.

One process per broker (started and restarted by the supervisor), one thread per
journaled queue.  Each thread tails its queue's ring and repeats a *round*:

1. take a snapshot of the group state (under the consumer lock), then read
   ``Q_NEXT_OFFSET`` and the idempotent-producer table (under the producer lock):
   the snapshot never mentions an offset the round does not journal;
2. append the new messages and the snapshot to the queue's journal
   (``shmq.journal``) and fsync it;
3. publish ``Q_DURABLE_OFFSET`` / ``Q_DURABLE_SETTLE`` and wake whoever waits on
   them: `always` producers and ackers, `always` consumers (they are only shown
   journaled messages), and producers waiting for room (memory is freed only
   below ``Q_DURABLE_OFFSET``, so nothing leaves the ring before it is on disk).

An `always` queue runs a round as soon as anything changes (producers and
ackers post the queue's ``.j`` semaphore), so every producer waiting at that
moment shares one fsync (group commit).  An `interval` queue runs one at least
every ``sync_interval`` seconds, and sooner when producers wait for room.

A failing write (ENOSPC, EIO, ...) puts the errno into ``Q_JOURNAL_ERRNO``: new
produces are refused with ``StorageError`` while consumers carry on; the round
is retried every ``options.JOURNAL_RETRY_INTERVAL`` and the error clears once a write succeeds.

:func:`recover` runs in the supervisor before anything else: every queue with
a journal but no shared memory (a reboot, or a stop that removed it) is rebuilt
with its messages at their offsets and its groups as last journaled.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from shmq import crashpoints, options
from shmq.api import QueueConfig
from shmq.core.durability import Durability
from shmq.core.serverqueue import ServerBroker, ServerQueue, restore_fill
from shmq.errors import ShmqError, StorageError
from shmq.journal import Journal, JournalError, list_queues
from shmq.journal.files import journal_bytes
from shmq.progress import Progress
from shmq.resources import SPACE_ERRNOS, disk_full
from shmq.text import plural

from . import replication
from .replication import Hub
from .scoreboard import JournalMeter, Scoreboard

log = logging.getLogger("shmq.journal")
PROCESS_NAME = b"shmq-journal"  # its name in ps (PR_SET_NAME): it listens for standbys, not clients
# round points: the journal process only; the recovery point: the supervisor, before it forks

def data_dir_for(instance: str, data_dir: str | None = None) -> Path:
    """The data dir of an instance: ``data_dir``, else ``$SHMQ_DATA_DIR``, else
    ``$XDG_DATA_HOME/shmq/<instance>`` (``~/.local/share/shmq/<instance>``)."""
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    env = os.environ.get(options.DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return default_data_dir(instance)


def default_data_dir(instance: str) -> Path:
    """The data dir shmq chooses for an instance when none is given: a folder of shmq's own,
    which it removes once it is empty (``remove_retired``)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) / "shmq" if xdg else Path(options.DEFAULT_DATA_DIR).expanduser()
    return (base / instance).resolve()


class QueueWriter(threading.Thread):
    """The journal of one queue, written by one thread."""

    def __init__(self, q: ServerQueue, root: Path, interval: float,
                 segment_bytes: int = options.JOURNAL_SEGMENT_BYTES,
                 meter: JournalMeter | None = None, hub: Hub | None = None,
                 replication: str = options.DEFAULT_REPLICATION) -> None:
        super().__init__(name=f"journal-{q.name}", daemon=True)
        self.q = q
        self.meter = meter  # --metrics: fsync times and failures (server.scoreboard)
        self.d: Durability = q.durability  # the writer's side of the marks
        self.root = root
        self.interval = interval
        self.always = self.d.always
        self.hub = hub  # the standbys (server.replication), None: replication is off
        mode = q.config.replication or replication
        self.sync_replicated = hub is not None and self.always and mode == "sync"
        self.lock = threading.Lock()  # held over a round and a drop: a standby's copy is made under it
        # sync rounds journaled here but not yet confirmed by a standby: (seq, next, settle, new, since)
        self.unconfirmed: list[tuple[int, int, int, int, float]] = []
        self.stopping = threading.Event()
        self.segment_bytes = segment_bytes
        self.journal = Journal(root, q.name, log=log, segment_bytes=segment_bytes)
        meta = self.journal.read_meta()
        if meta is not None and meta.get("created_ns") != self.d.created_ns:
            # an earlier queue of the same name whose journal outlived it
            log.warning("journal of %r belongs to an earlier queue of that name: replaced", q.name)
            self.journal.destroy()
            self.journal = Journal(root, q.name, log=log, segment_bytes=segment_bytes)
            meta = None
        if meta is None:
            self.journal.write_meta(q.meta())
            self.journal.recover()
        else:
            rec = self.journal.recover(floor=1 << 63)  # only the end matters here
            for p in rec.problems:
                log.error("journal of %r: %s", q.name, p)
        # resume after what the journal holds, or after a rebuilt queue's tombstones
        self.next = max(self.journal.next_offset, self.d.free_offset, self.d.offset())
        self.settled = -1  # Q_SETTLE_SEQ of the last snapshot written
        self.last_sync = 0.0
        self.last_drop = 0.0
        self.error_at = 0.0

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        while True:
            stopping = self.stopping.is_set()
            try:
                if self.d.deleted:
                    break
                if self.hub is not None and self.hub.fenced:  # a newer primary exists: confirm nothing
                    if self.d.fail(errno.ESTALE):
                        log.error("queue %r: fenced by epoch %d; its produces fail (StorageError)",
                                  self.q.name, self.hub.fenced)
                    self.error_at = time.monotonic()
                    if stopping:
                        break
                    self._sleep()
                    continue
                if self.d.error:  # room first: what every group settled goes even now
                    self.drop()
                with self.lock:
                    self.round(force=stopping)
                    self.drop()
                if self.unconfirmed:
                    self.confirm()
            except (JournalError, OSError) as e:
                self._failed(e)
            except Exception:  # noqa: BLE001 - report, then keep the queue's journal going
                log.exception("journal of %r: round failed", self.q.name)
                self._failed(OSError(5, "internal error"))
            if stopping:
                break
            self._sleep()
        self.journal.close()

    def _sleep(self) -> None:
        if self.d.error:
            timeout = options.JOURNAL_RETRY_INTERVAL
        elif self.always:
            timeout = options.WAIT_SLICE
        else:
            timeout = min(options.WAIT_SLICE, max(0.0, self.last_sync + self.interval - time.monotonic()))
        if self.unconfirmed:  # a standby's ACK posts .j too
            timeout = min(timeout, options.WAIT_SLICE)
        if self._pending() or self.stopping.is_set():
            return
        self.d.sleep(timeout, self._pending)

    def _pending(self) -> bool:
        """Is a round due now?"""
        d = self.d
        if self.unconfirmed and self.hub is not None and self.hub.confirmed(self.q.name,
                                                                            self.unconfirmed[0][0]):
            return True
        if d.error:
            return time.monotonic() - self.error_at >= options.JOURNAL_RETRY_INTERVAL
        if not d.changed(self.next, self.settled):
            return False
        if self.always:
            return True
        return time.monotonic() - self.last_sync >= self.interval or d.producers_wait

    def round(self, force: bool = False) -> bool:
        """Journal what changed since the last round; True when something was written."""
        if not force and not self._pending():
            return False
        d = self.d
        snap = d.snapshot()
        settle, nxt = snap.settle_seq, snap.next_offset
        if nxt == self.next and settle == self.settled and (not d.error or self.unconfirmed):
            return False
        items = d.records(self.next, nxt)  # published and not yet freed (free <= durable <= next)
        state = json.dumps({"groups": snap.groups, "producers": snap.producers, "next": nxt,
                            "delays": snap.delays},
                           separators=(",", ":")).encode()
        records = self.journal.append(items, state)  # both or neither
        seq = self.hub.publish(self, records, nxt) if self.hub is not None else 0
        t0 = time.perf_counter_ns()
        self.journal.sync()
        if self.meter is not None:
            self.meter.fsync(time.perf_counter_ns() - t0)
        if crashpoints.active and items:  # (rounds of new messages only: a test can count them)
            crashpoints.hit("journal.round.appended")
        first = self.settled < 0  # (taking the queue on: confirmed here, standby or not)
        self.next = nxt
        self.settled = settle
        self.last_sync = time.monotonic()
        if self.sync_replicated and (items or not first):  # the marks move once a standby has it too
            self.unconfirmed.append((seq, nxt, settle, len(items), self.last_sync))
            return True
        crash = _published if crashpoints.active and items else None
        if d.publish(nxt, settle, len(items), crash):
            log.warning("journal of %r is writable again", self.q.name)
        return True

    def confirm(self) -> None:
        """Publish the marks of the sync rounds a standby confirmed; past ``--sync-timeout``
        without, fail the queue (``ENOLINK``: produces get StorageError) until one does."""
        assert self.hub is not None
        done = [u for u in self.unconfirmed if self.hub.confirmed(self.q.name, u[0])]
        if done:
            seq, nxt, settle = done[-1][:3]
            new = sum(u[3] for u in self.unconfirmed if u[0] <= seq)
            self.unconfirmed = [u for u in self.unconfirmed if u[0] > seq]
            if self.d.publish(nxt, settle, new):
                log.warning("queue %r: a standby confirms its rounds again", self.q.name)
        if self.unconfirmed and not self.d.error and (
                time.monotonic() - self.unconfirmed[0][4] > self.hub.sync_timeout):
            if self.d.fail(errno.ENOLINK):
                log.error("queue %r (replication=\"sync\"): no standby confirmed its rounds within %g s; "
                          "its produces fail (StorageError) until one does", self.q.name,
                          self.hub.sync_timeout)
            self.error_at = time.monotonic()

    def drop(self) -> None:
        """Now and then: delete the segment files every group has passed -- also while the
        journal cannot be written (a full disk), and then at every retry, since that frees
        the room it lacks.  Safe then too: what is below the free offset is settled in
        every group, and an offset whose record is gone comes back from a crash settled."""
        now = time.monotonic()
        every = options.JOURNAL_RETRY_INTERVAL if self.d.error else options.JOURNAL_DROP_INTERVAL
        if now - self.last_drop >= every:
            self.last_drop = now
            self.journal.drop_below(min(self.d.free_offset, self.next))

    def _failed(self, e: BaseException) -> None:
        q = self.q
        err = getattr(e, "errno", None) or 5  # EIO when unknown
        if self.meter is not None:
            self.meter.failed()
        if self.d.fail(err):  # mark waiters raise StorageError
            log.error("journal of %r cannot be written: %s; produce is refused until it can", q.name, e)
        self.error_at = time.monotonic()
        if self.journal.failed:  # an fsync failed: what reached the disk is unknown
            try:
                self.journal.close()
                self.journal = Journal(self.root, q.name, log=log, segment_bytes=self.segment_bytes)
                self.journal.recover(floor=1 << 63)
                self.next = min(self.next, max(self.journal.next_offset, self.d.free_offset))
            except (JournalError, OSError) as e2:
                log.error("journal of %r cannot be reopened: %s", q.name, e2)


class JournalService:
    """Every journaled queue of an instance, each with its writer thread."""

    def __init__(self, instance: str, root: Path, interval: float,
                 segment_bytes: int = options.JOURNAL_SEGMENT_BYTES, board: Scoreboard | None = None,
                 hub: Hub | None = None, replication: str = options.DEFAULT_REPLICATION) -> None:
        self.segment_bytes = segment_bytes
        self.hub = hub
        self.replication = replication
        self.meter = None if board is None else board.journal()
        self.broker = ServerBroker(instance)
        self.root = root
        self.interval = interval
        self.writers: dict[int, QueueWriter] = {}
        self.unopened: set[int] = set()  # journaled queues whose journal could not be opened: retried
        self.stop = threading.Event()

    def scan(self) -> None:
        """Start a writer for every journaled queue that has none; forget deleted ones."""
        queues = self.broker.queues_by_id()
        gone = [qid for qid, wr in self.writers.items() if qid not in queues or not wr.is_alive()]
        for qid in gone:
            wr = self.writers.pop(qid)
            wr.stopping.set()
            wr.join()
            if self.hub is not None:
                self.hub.remove_writer(wr, deleted=qid not in queues)
        if gone:  # (with no writer left, journals are made in this thread only: none races the rmdir)
            own = not self.writers and self.root == default_data_dir(self.broker.instance)
            remove_retired(self.root, own=own)
            self.broker.prune()
        self.unopened = set()
        for qid, q in queues.items():
            if qid in self.writers or not q.durability.journaled:
                continue
            try:
                wr = QueueWriter(q, self.root, self.interval, self.segment_bytes, self.meter, self.hub,
                                 self.replication)
            except (JournalError, OSError) as e:  # (a full disk, descriptors run out: tried again)
                if q.durability.fail(getattr(e, "errno", None) or 5):  # (logged once, not per retry)
                    log.error("cannot open the journal of %r: %s; produce is refused until it can", q.name, e)
                self.unopened.add(qid)
                continue
            wr.start()
            self.writers[qid] = wr
            if self.hub is not None:
                self.hub.add_writer(wr)
        if self.hub is not None:  # memory-only queues: their definitions only
            self.hub.names = {q.name for q in queues.values()}
            self.hub.set_definitions({q.name: q.meta() for q in queues.values()
                                      if not q.durability.journaled})

    def run(self, ready: Any = None, listen: Callable[[], None] | None = None) -> None:
        """Until ``stop``: writers for the journaled queues.  ``listen``: starts taking standbys,
        called once every queue has its writer (a standby that came sooner would be told that
        the queues it holds are gone)."""
        self.broker.set_journal(str(self.root))
        if ready is not None:  # (before the scan: opening large journals takes a while)
            ready.set()
        gen = self.broker.generation
        self.scan()
        retry = time.monotonic() + options.JOURNAL_RETRY_INTERVAL
        if listen is not None:
            listen()
        while not self.stop.wait(0.05):
            g = self.broker.generation
            now = time.monotonic()
            if g != gen or any(not wr.is_alive() for wr in self.writers.values()) or (
                    self.unopened and now >= retry):
                gen = g
                retry = now + options.JOURNAL_RETRY_INTERVAL
                self.scan()
            self.broker.prune()  # memory-only queues deleted: this process mapped them too
        self.shutdown()

    def shutdown(self) -> None:
        """A last round for every queue, then the writers end."""
        for wr in self.writers.values():
            wr.stopping.set()
            try:
                wr.d.wake_writer()
            except Exception:  # noqa: BLE001 - the semaphore may be gone with its queue
                pass
        for wr in self.writers.values():
            wr.join()
        self.writers.clear()
        try:
            self.broker.set_journal(None)
        except ShmqError:
            pass
        self.broker.close()


def journal_main(instance: str, root: str, interval: float, segment_bytes: int, ready: Any,
                 board: Scoreboard | None = None, replicate: Any = None) -> None:
    """The journal process (forked by the supervisor).  ``replicate``: the primary's side of
    replication (``server.replication``): (listening socket, Hub, TLS context or None), or None."""
    hub, listen = None, None
    if replicate is not None:
        listener, hub, tls, mode = replicate

        def listen() -> None:
            threading.Thread(target=replication.serve, args=(hub, listener, tls, threading.Event()),
                             name="replication", daemon=True).start()
    svc = JournalService(instance, Path(root), interval, segment_bytes, board, hub,
                         mode if replicate is not None else options.DEFAULT_REPLICATION)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
        libc.prctl(15, PROCESS_NAME)  # PR_SET_NAME: how listening_url tells it from a worker
    except (OSError, AttributeError):
        pass
    svc.run(ready, listen)


def _published() -> None:
    crashpoints.hit("journal.round.published")


# ---------------------------------------------------------------------------- recovery


def remove_retired(root: Path, own: bool = False) -> None:
    """Remove the journals of deleted queues (see ``journal.files.retire_journal``).
    ``own``: ``root`` is the folder shmq chose (``default_data_dir``), not one it was given:
    when nothing is left in it (the last durable queue was deleted), it goes too, and so does
    the ``shmq`` folder above it if that is empty; the first durable queue makes them again.
    A data dir that was given (``--data-dir``, ``$SHMQ_DATA_DIR``) stays, empty or not."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for n in names:
        if n.startswith(".deleted-"):
            shutil.rmtree(root / n, ignore_errors=True)
    if own:
        for folder in (root, root.parent):
            try:
                os.rmdir(folder)  # only if empty
            except OSError:
                break


def check_data_dir(root: Path) -> None:
    """Prove the data dir usable at start, for a clear error then rather than at the first
    durable queue: an existing one must take a file; a missing one is left missing (the
    first durable queue makes it), and its nearest existing parent must let us make it.
    A full one is only warned of: memory queues serve, durable ones come back and serve
    their consumers, and take messages again once there is room."""
    try:
        if not root.exists():
            parent = next(p for p in root.parents if p.exists())
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise OSError(errno.EACCES, f"cannot create it in {parent}")
            return
        probe = root / f".probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        if e.errno in SPACE_ERRNOS:
            log.warning("%s; durable queues refuse messages until there is room",
                        disk_full("the data dir is full", str(root), e.errno))
            return
        raise StorageError(f"data dir {root} is not usable: {e.strerror or e}") from None


def recover(broker: ServerBroker, root: Path) -> list[str]:
    """Rebuild every journaled queue whose shared memory is gone; lines for the log.
    Its progress (journal bytes read) is a bar on a terminal, else a log line every
    ``options.PROGRESS_INTERVAL`` (``shmq.progress``)."""
    report = []
    check_data_dir(root)
    remove_retired(root)
    names = list_queues(root)
    sizes = {name: journal_bytes(root, name) for name in names}
    with Progress("journal recovery: read", "bytes", sum(sizes.values()), emit=log.info) as progress:
        for name in names:
            try:
                j = Journal(root, name, log=log)
            except (JournalError, OSError) as e:  # descriptors or room run out: left for the next start
                log.error("queue %r cannot be opened now: %s; its journal is kept for the next start",
                          name, e)
                progress.advance(sizes[name])
                continue
            try:
                meta = j.read_meta()
                existing = None if meta is None else broker.find(name)
                if meta is None:
                    report.append(f"{name}: no meta file; left alone")
                elif existing is None:
                    try:
                        report.append(_rebuild(broker, j, meta, progress.advance))
                    except (ShmqError, JournalError, OSError) as e:  # /dev/shm full, say: the rest serve
                        log.error("queue %r cannot be rebuilt now: %s; its journal is kept for the next "
                                  "start", name, e)
                        continue
                    if crashpoints.active:
                        crashpoints.hit("recovery.rebuilt")
                    continue
                elif existing.durability.created_ns != meta.get("created_ns"):
                    report.append(f"{name}: a different queue of that name exists; journal left alone")
                # else the shared memory survived: the writer resumes
                progress.advance(sizes[name])  # not read
            finally:
                j.close()
    return report


def _rebuild(broker: ServerBroker, j: Journal, meta: dict[str, Any], progress: Callable[[int], None]) -> str:
    name = meta["name"]
    config = QueueConfig(**meta["config"])
    rec = j.recover(progress=progress)
    for p in rec.problems:
        log.error("journal of %r: %s", name, p)
    state = json.loads(rec.state) if rec.state else {"groups": [], "producers": []}
    groups = state["groups"]
    metas = rec.metas
    records = {o: (ts, payload, metas.get(o, b"")) for o, ts, payload in rec.messages}
    tail = rec.next_offset
    if config.durability != "always":
        # An `interval` queue may have confirmed (and delivered) offsets the journal never
        # got: at most a ring's worth past the journal (memory is freed only below the
        # durable mark). Skip them, so no offset is ever reused.
        tail += config.capacity
    floors = [int(g["floor"]) for g in groups]
    first = min(floors) if floors else (min(records) if records else rec.next_offset)
    first = min(first, tail)
    records = {o: r for o, r in records.items() if o >= first}
    # room for what is restored (and the skipped offsets), plus the configured room for producers
    cap = max(config.capacity, tail - first) if config.durability == "always" else (
        tail - first + config.capacity)
    cap = min(cap, options.MAX_CAPACITY)
    need = sum(len(p) + len(m) for _, p, m in records.values())
    max_bytes = max(config.max_bytes, -(-need // 4096) * 4096)
    if (cap, max_bytes) != (config.capacity, config.max_bytes):
        log.warning("queue %r is rebuilt with capacity %d and max_bytes %d to hold what it had",
                    name, cap, max_bytes)
        config = QueueConfig(**{**asdict(config), "capacity": cap, "max_bytes": max_bytes})

    producers = [(int(k), int(s)) for k, s in state.get("producers", [])]
    delays = [(int(o), int(due)) for o, due in state.get("delays", [])]  # wall-clock ms
    fill = partial(restore_fill, records, groups, producers, first, tail, int(meta["created_ns"]),
                   delays=delays, expires=rec.expires)
    broker.restore_queue(name, config, bool(meta.get("is_dlq")), fill)
    live = sum(1 for o in records if o >= first)
    return (f"{name}: rebuilt from the journal: offsets {first}..{tail - 1}, "
            f"{plural(live, 'message')} retained, {plural(len(groups), 'group')}"
            + (f", {plural(len(rec.problems), 'problem')} (see above)" if rec.problems else ""))
