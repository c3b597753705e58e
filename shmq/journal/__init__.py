"""The on-disk journal of one durable queue: append-only segment files, nothing else.

No shared memory and no broker knowledge: the broker's journal writer hands
this module batches of ``(offset, timestamp_ns, payload)`` and opaque state
snapshots, calls :meth:`Journal.sync` to make them durable, and after a
reboot :meth:`Journal.recover` hands them back.  The format is drawn in
``docs/architecture.md`` ("Journal file format").  In short, a queue's
directory ``<root>/q-<name>/`` holds ``meta.json`` and segment files named by
their first offset (``00000000000000000000.log``), each a run of records::

    0       4      5       6          8            12        16          20           24
    | magic | type | flags | reserved | body length | count | body crc32 | header crc32 | body

all integers little-endian.  A MESSAGES record's body is ``count`` entries of
``offset u64, timestamp_ns u64, length u32, payload``; a STATE record's body is
the snapshot.  The header has its own CRC, so a torn tail (a valid header whose
body runs past the end of the file, less than a header, or a record cut short
by the zeros after it) is told apart from corruption (a bad CRC, an impossible
length), which is quarantined, never silently dropped.

The active segment is *preallocated*: real zeros are written ahead of its
logical end (``JOURNAL_PREALLOC_BYTES`` at a time, never past ``segment_bytes``)
and records are ``pwrite``-n over them, so most syncs do not change the file's
size (an fdatasync that must also commit a new size costs more: see the docs).
Zeros after the last record are a segment's normal end.

One Journal per queue directory at a time (an flock on ``lock`` enforces it);
a Journal is not thread-safe: one writer thread owns it.

The journal is three modules: the files (names, record encoding, errors) in
``journal.files``, reading them back in ``journal.recovery``, and the Journal object
here, which re-exports the public names of both.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shmq import options
from shmq.errors import InvalidArgument
from shmq.journal.files import (
    ENTRY_SIZE,
    HEADER_SIZE,
    LOCK_FILE,
    MAGIC,
    MESSAGES,
    META_FILE,
    QUEUE_DIR_PREFIX,
    SEGMENT_RE,
    STATE,
    TMP_SUFFIX,
    JournalError,
    encode_messages,
    encode_state,
    fsync_dir,
    list_queues,
    os_error,
    pwrite_all,
    queue_dir,
    segment_name,
    unlink_quietly,
    write_all,
)
from shmq.journal.recovery import Records, Recovery, Scan, SegmentRecovery, check_records, read_records

__all__ = ["ENTRY_SIZE", "HEADER_SIZE", "LOCK_FILE", "MAGIC", "MESSAGES", "META_FILE", "QUEUE_DIR_PREFIX",
           "STATE", "Journal", "JournalError", "Records", "Recovery", "check_records", "encode_messages",
           "encode_state", "list_queues", "queue_dir", "read_records", "segment_name"]

_log = logging.getLogger("shmq.journal")


class Journal(SegmentRecovery):
    """The journal of one queue: see the module docstring and docs/architecture.md."""

    def __init__(self, root: Path | str, queue_name: str, *,
                 segment_bytes: int = options.JOURNAL_SEGMENT_BYTES,
                 log: logging.Logger | None = None, create: bool = True) -> None:
        if not isinstance(segment_bytes, int) or not 0 < segment_bytes <= 1 << 40:
            raise InvalidArgument(f"segment_bytes must be 1..2**40, not {segment_bytes!r}")
        self.name = queue_name
        self.path = queue_dir(root, queue_name)
        self.segment_bytes = segment_bytes
        self.log = log or _log
        self._dirfd = -1
        self._lockfd = -1
        self._segments: list[int] = []  # first offsets, ascending; the last one is the active segment
        self._active = -1  # fd of the active segment, -1 if there is none yet
        self._active_size = 0  # its length up to the end of the last complete record
        self._active_alloc = 0  # its file's length: zeros from _active_size on (preallocated)
        self._prealloc_after = 0  # no preallocation for records ending below this (it failed)
        self._unsynced: dict[int, Path] = {}  # fds written since the last sync()
        self._retired: list[int] = []  # rolled segments' fds, closed once synced
        self._dir_dirty = False  # a file was created, renamed or removed since the last sync()
        self._tail_dirty = False  # a failed append could not be truncated away yet
        self._failed = ""  # set when an fsync failed: nothing is known about what reached the disk
        self._next = 0
        self._state_record: bytes | None = None  # the latest snapshot, copied into each new segment
        self._open_dirs(Path(root), create)
        # A journal with data must be recover()ed before it is appended to.
        self._ready = not any(SEGMENT_RE.match(n) for n in os.listdir(self._dirfd))

    def _open_dirs(self, root: Path, create: bool) -> None:
        created = False
        try:
            if create:
                os.makedirs(root, mode=options.JOURNAL_DIR_MODE, exist_ok=True)
                try:
                    os.mkdir(self.path, options.JOURNAL_DIR_MODE)
                    created = True
                except FileExistsError:
                    pass
            self._dirfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if created:
                fsync_dir(self.path.parent)
            self._lockfd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                   options.JOURNAL_FILE_MODE)
        except FileNotFoundError as e:
            self.close()
            if not create:
                raise JournalError(f"no journal for queue {self.name!r} in {root}", e.errno) from e
            raise os_error("cannot open the journal directory", self.path, e) from e
        except OSError as e:
            self.close()
            raise os_error("cannot create or open the journal directory", self.path, e) from e
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.close()
            raise JournalError(f"the journal {self.path} is in use by another Journal (flock: "
                               f"{_errno.errorcode.get(e.errno or 0, e)})", e.errno) from e

    # ----------------------------------------------------------------- metadata
    def write_meta(self, meta: dict[str, Any]) -> None:
        """Replace ``meta.json`` atomically (tmp file, fsync, rename, fsync of the directory)."""
        self._check_usable()
        try:
            data = json.dumps(meta, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"journal meta must be a JSON-serialisable dict: {e}") from e
        if not isinstance(meta, dict) or len(data) > options.JOURNAL_MAX_META_BYTES:
            raise InvalidArgument(f"journal meta must be a dict of at most {options.JOURNAL_MAX_META_BYTES} "
                                  f"bytes as JSON (got {type(meta).__name__}, {len(data)} bytes)")
        path = self.path / META_FILE
        tmp = self.path / (META_FILE + TMP_SUFFIX)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, options.JOURNAL_FILE_MODE)
        except OSError as e:
            raise os_error("cannot create", tmp, e) from e
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            os.fsync(self._dirfd)
        except OSError as e:
            unlink_quietly(tmp)
            raise os_error("cannot write", path, e) from e

    def read_meta(self) -> dict[str, Any] | None:
        """The last meta written, or None if there is none (a leftover tmp file is ignored)."""
        path = self.path / META_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise os_error("cannot read", path, e) from e
        try:
            meta = json.loads(data)
        except ValueError as e:
            raise JournalError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(meta, dict):
            raise JournalError(f"{path} does not hold a JSON object")
        return meta

    # ---------------------------------------------------------------- appending
    @property
    def next_offset(self) -> int:
        """One past the last message offset appended or recovered; 0 if none."""
        self._check_ready()
        return self._next

    @property
    def active_size(self) -> int:
        """The active segment's length up to the end of its last complete record (its file
        may be longer: zeros preallocated for the next records); 0 if there is none."""
        self._check_ready()
        return self._active_size

    @property
    def failed(self) -> bool:
        """An fsync failed: this Journal refuses everything; close it, reopen and recover()."""
        return bool(self._failed)

    def append_messages(self, items: Sequence[tuple[Any, ...]]) -> None:
        """Append ``(offset, timestamp_ns, payload[, metadata])`` items, offsets strictly increasing.

        One write per call.  Nothing is durable until :meth:`sync`.
        """
        self.append(items)

    def append_state(self, blob: bytes | bytearray | memoryview) -> None:
        """Append an opaque state snapshot; recovery returns the last complete one.

        Nothing is durable until :meth:`sync`.
        """
        self.append((), blob)

    def append(self, items: Sequence[tuple[Any, ...]] = (),
               state: bytes | bytearray | memoryview | None = None) -> bytearray:
        """``append_messages(items)`` then ``append_state(state)`` in one write: if it fails,
        neither is in the file (and next_offset has not moved).  Returns the records written
        (what a replication stream ships: ``server.replication``)."""
        self._check_ready()
        buf = encode_messages(items, self._next - 1) if items else bytearray()
        record = None if state is None else bytes(encode_state(state))
        if record is not None:
            buf += record
        if buf:
            self._append_encoded(buf, (items[0][0], items[-1][0]) if items else None, record)
        return buf

    def append_records(self, records: Records) -> None:
        """Append records another journal wrote (a replicated round, checked by
        :func:`~shmq.journal.recovery.check_records`) as they are: the standby's path,
        which encodes nothing again.  Its offsets must follow this journal's."""
        self._check_ready()
        if records.offsets is not None and records.offsets[0] < self._next:
            raise InvalidArgument(f"journal offsets must strictly increase: {records.offsets[0]} after "
                                  f"{self._next - 1}")
        buf = bytearray(records.messages)
        if records.state is not None:
            buf += records.state
        if buf:
            self._append_encoded(buf, records.offsets, records.state)

    def _append_encoded(self, buf: bytearray, offsets: tuple[int, int] | None, record: bytes | None) -> None:
        """Write ``buf`` (message records of ``offsets`` = (first, last), then the state record
        ``record``) into the active segment, or a new one."""
        if offsets is not None:
            has_messages = bool(self._segments) and self._next > self._segments[-1]
            # A segment holding only snapshots takes the messages whatever its size: it is
            # named next_offset, so a new one could not be named by the batch's first offset.
            roll = has_messages and self._active_size + len(buf) > self.segment_bytes
            base = offsets[0]
        else:
            limit = max(self.segment_bytes, options.JOURNAL_STATE_ROLL_FACTOR * len(buf))
            roll = self._active_size > 0 and self._active_size + len(buf) > limit
            base = self._next
        if self._active < 0 or roll:
            self._start_segment(base, buf, with_state=offsets is not None)
        else:
            self._write_active(buf)
        if offsets is not None:
            self._next = offsets[1] + 1
        if record is not None:
            self._state_record = record

    def sync(self) -> None:
        """Make everything appended so far durable (fdatasync, and an fsync of the directory if needed).

        If an fsync fails the journal is unusable afterwards: the kernel may have dropped the
        dirty pages, so what is on disk is unknown until the journal is reopened and recovered.
        """
        self._check_usable()
        path = self.path
        try:
            for fd, seg in self._unsynced.items():
                path = seg
                os.fdatasync(fd)
            path = self.path
            if self._dir_dirty:
                os.fsync(self._dirfd)
        except OSError as e:
            err = os_error("fsync failed for", path, e)
            self._failed = f"{err}; reopen the journal and recover() it"
            raise JournalError(self._failed, e.errno) from e
        self._unsynced.clear()
        self._dir_dirty = False
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()

    def drop_below(self, offset: int) -> int:
        """Delete the segments all of whose messages are below ``offset`` (never the active one).

        Syncs first, so the newest snapshot (copied into every new segment) is durable before
        an older copy goes.  Returns the number of segment files deleted.
        """
        self._check_ready()
        segs = self._segments
        doomed = [segs[i] for i in range(len(segs) - 1) if segs[i + 1] <= offset]
        if not doomed:
            return 0
        self.sync()
        for base in doomed:
            path = self.path / segment_name(base)
            try:
                os.unlink(path)
            except OSError as e:
                raise os_error("cannot delete", path, e) from e
            self._segments.remove(base)
        try:
            os.fsync(self._dirfd)
        except OSError as e:
            raise os_error("fsync failed for", self.path, e) from e
        return len(doomed)

    def segment_files(self) -> list[Path]:
        """The segment files, oldest first."""
        return [self.path / segment_name(base) for base in self._segments]

    # ----------------------------------------------------------------- recovery
    def recover(self, floor: int = 0, progress: Callable[[int], None] | None = None) -> Recovery:
        """Read every segment back; messages below ``floor`` are skipped (but counted for next_offset).
        ``progress`` is called with each segment file's size once it is read.

        Zeros after the last record are the segment's preallocated end: kept, and not a
        problem.  A torn tail is truncated; a record that fails its CRC, or is otherwise
        impossible, is quarantined with everything after it in its file (moved to
        ``<file>.corrupt-<n>``) and the scan goes on with the next file.  Each event is logged
        with ``log.error`` and listed in ``problems``; bad data never raises (I/O errors do, as
        JournalError).  Afterwards, appends continue after the last good record.
        """
        self._check_usable()
        self._close_segments()
        self._remove_leftover_tmp()
        scan = Scan(floor)
        names = sorted(n for n in os.listdir(self.path) if SEGMENT_RE.match(n))
        bases = [int(n[:20]) for n in names]
        ends = [self._scan_file(self.path / name, int(name[:20]), scan, progress) for name in names]
        self._segments = bases
        self._next = max([scan.last + 1, *bases]) if bases else 0  # a segment's name is its first offset
        self._state_record = None if scan.state is None else bytes(encode_state(scan.state))
        if bases:
            path = self.path / names[-1]
            try:
                self._active = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                self._active_alloc = os.fstat(self._active).st_size  # the zeros after the end stay
            except OSError as e:
                raise os_error("cannot open", path, e) from e
            self._active_size = ends[-1]
            self._prealloc_after = 0
        self._ready = True
        return Recovery(scan.messages, scan.state, self._next, scan.problems, scan.metas, scan.expires)

    # ---------------------------------------------------------------- internals
    def _check_usable(self) -> None:
        if self._failed:
            raise JournalError(self._failed)
        if self._dirfd < 0:
            raise JournalError(f"the journal {self.path} is closed")

    def _check_ready(self) -> None:
        self._check_usable()
        if not self._ready:
            raise JournalError(f"the journal {self.path} holds data: call recover() before using it")

    def _write_active(self, buf: bytes | bytearray) -> None:
        path = self.path / segment_name(self._segments[-1])
        if self._tail_dirty:
            try:
                os.ftruncate(self._active, self._active_size)
            except OSError as e:
                raise os_error("cannot truncate a failed append away from", path, e) from e
            self._tail_dirty = False
            self._active_alloc = self._active_size
        end = self._active_size + len(buf)
        if end > self._active_alloc:
            self._active_alloc = self._preallocate(self._active, self._active_alloc, end)
        try:
            pwrite_all(self._active, buf, self._active_size)
        except OSError as e:
            # the failed range may hold part of the record: cut it off (the preallocation with it)
            err = os_error("cannot append to", path, e)
            try:
                os.ftruncate(self._active, self._active_size)
            except OSError as e2:
                self._tail_dirty = True
                raise JournalError(f"{err}; truncating it back to {self._active_size} bytes failed too "
                                   f"({_errno.errorcode.get(e2.errno or 0, e2)}): the next append retries",
                                   e.errno) from e
            self._active_alloc = self._active_size
            self._unsynced[self._active] = path
            raise JournalError(f"{err}; truncated back to its last complete record", e.errno) from e
        self._active_size = end
        self._active_alloc = max(self._active_alloc, end)
        self._unsynced[self._active] = path

    def _preallocate(self, fd: int, size: int, end: int) -> int:
        """Best effort: write zeros from ``size`` (the file's length) to ``JOURNAL_PREALLOC_BYTES``
        past ``end`` (a record's end), never past ``segment_bytes``; returns the file's length.

        Skipped when the file system would be left with less free space than it takes.  On any
        error the file is cut back to ``size`` (its zeros past the logical end are harmless if
        that fails too) and the segment is not extended again for the next chunk's worth of
        appends, so a nearly full disk costs one failed attempt per chunk, not one per round.
        """
        chunk = options.JOURNAL_PREALLOC_BYTES
        target = min(end + chunk, self.segment_bytes)
        if chunk <= 0 or target <= end or end < self._prealloc_after:
            return size
        try:
            fs = os.fstatvfs(fd)
            if fs.f_bavail * fs.f_frsize < 2 * (target - size):
                self._prealloc_after = end + chunk
                return size
            zeros = bytes(min(target - size, 1 << 20))
            at = size
            while at < target:
                pwrite_all(fd, memoryview(zeros)[:target - at], at)
                at += min(len(zeros), target - at)
            return target
        except OSError:
            self._prealloc_after = end + chunk
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            return size

    def _start_segment(self, base: int, buf: bytes | bytearray, with_state: bool) -> None:
        """Make a new active segment named ``base`` holding ``buf`` (after the latest snapshot if asked).

        If the active segment already has that name (it holds only snapshots), the new one
        replaces it through a synced tmp file and a rename, so a crash leaves one or the other.
        """
        if len(self._retired) >= options.JOURNAL_MAX_OPEN_SEGMENTS:
            self.sync()
        if with_state and self._state_record is not None:
            buf = self._state_record + buf
        path = self.path / segment_name(base)
        replace = bool(self._segments) and self._segments[-1] == base
        target = Path(f"{path}{TMP_SUFFIX}") if replace else path
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
                         | (os.O_TRUNC if replace else os.O_EXCL), options.JOURNAL_FILE_MODE)
        except OSError as e:
            raise os_error("cannot create", target, e) from e
        try:
            self._prealloc_after = 0
            alloc = max(self._preallocate(fd, 0, len(buf)), len(buf))
            pwrite_all(fd, buf, 0)
            if replace:
                os.fdatasync(fd)
                os.rename(target, path)
        except OSError as e:
            os.close(fd)
            unlink_quietly(target)
            raise os_error("cannot write a new segment", target, e) from e
        old = self._active
        if old >= 0:
            if replace:
                self._unsynced.pop(old, None)
                os.close(old)
            elif old in self._unsynced:
                self._retired.append(old)
            else:
                os.close(old)
        if not replace:
            self._segments.append(base)
        self._active, self._active_size, self._active_alloc = fd, len(buf), alloc
        self._unsynced[fd] = path
        self._dir_dirty = True

    def _close_segments(self) -> None:
        for fd in {self._active, *self._retired, *self._unsynced} - {-1}:
            os.close(fd)
        self._active, self._active_size, self._active_alloc = -1, 0, 0
        self._retired.clear()
        self._unsynced.clear()
        self._tail_dirty = False

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Close the files (without syncing: call sync() first to keep what was appended)."""
        self._close_segments()
        for fd in (self._dirfd, self._lockfd):
            if fd >= 0:
                os.close(fd)
        self._dirfd = self._lockfd = -1

    def destroy(self) -> None:
        """Delete the queue's journal directory and everything in it (the queue was deleted)."""
        try:
            if os.path.lexists(self.path):
                shutil.rmtree(self.path)
                fsync_dir(self.path.parent)
        except OSError as e:
            raise os_error("cannot delete the journal directory", self.path, e) from e
        finally:
            self.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}, segments={len(self._segments)}, next_offset={self._next})"
