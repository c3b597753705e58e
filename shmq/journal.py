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
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import options
from .errors import InvalidArgument, InvalidName, ShmqError, Status
from .names import check_queue_name

MAGIC = b"SQJ1"
MESSAGES = 1
STATE = 2
_HEAD = struct.Struct("<4sBBHIII")  # magic, type, flags, reserved, body length, count, body crc
_CRC = struct.Struct("<I")  # the header's own crc, over the 20 bytes before it
HEADER_SIZE = _HEAD.size + _CRC.size  # 24
_ENTRY = struct.Struct("<QQI")  # offset, timestamp_ns, payload length
ENTRY_SIZE = _ENTRY.size  # 20
_BLANK_HEADER = bytes(HEADER_SIZE)

QUEUE_DIR_PREFIX = "q-"
META_FILE = "meta.json"
LOCK_FILE = "lock"
_SEGMENT_RE = re.compile(r"(\d{20})\.log\Z")
_TMP_SUFFIX = ".tmp"

_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC

_log = logging.getLogger("shmq.journal")


class JournalError(ShmqError):
    """The journal could not be read or written (the message names the errno and the path)."""

    code = Status.INTERNAL

    def __init__(self, message: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (str(self), self.errno))


def _os_error(what: str, path: object, e: OSError) -> JournalError:
    name = _errno.errorcode.get(e.errno or 0, type(e).__name__)
    return JournalError(f"{what} {path}: {name} ({e.strerror or e})", e.errno)


@dataclass
class Recovery:
    """What :meth:`Journal.recover` found."""

    messages: list[tuple[int, int, bytes]]  # (offset, timestamp_ns, payload), offset-sorted
    state: bytes | None  # the last complete, CRC-valid state snapshot
    next_offset: int  # one past the last message offset ever appended (0 if none)
    problems: list[str] = field(default_factory=list)  # torn tails and quarantined corruption, for humans


def queue_dir(root: Path | str, queue_name: str) -> Path:
    """The directory of one queue's journal: ``<root>/q-<name>``, never outside ``root``."""
    check_queue_name(queue_name)
    base = Path(os.path.abspath(root))
    path = base / f"{QUEUE_DIR_PREFIX}{queue_name}"
    if Path(os.path.normpath(path)).parent != base:  # the prefix makes ".", ".." and "a/b" impossible
        raise InvalidName(f"queue name {queue_name!r} would leave the data directory")
    return path


def list_queues(root: Path | str) -> list[str]:
    """The names of the queues that have a journal directory under ``root`` (sorted)."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise _os_error("cannot list the data directory", root, e) from e
    names = []
    for entry in entries:
        name = entry[len(QUEUE_DIR_PREFIX):]
        if entry.startswith(QUEUE_DIR_PREFIX) and os.path.isdir(os.path.join(root, entry)):
            try:
                names.append(check_queue_name(name))
            except InvalidName:
                continue
    return sorted(names)


def segment_name(base: int) -> str:
    return f"{base:020d}.log"


def _seal(buf: bytearray, start: int, kind: int, count: int) -> None:
    """Fill in the header of the record that starts at ``buf[start]`` and runs to the end of ``buf``."""
    body_len = len(buf) - start - HEADER_SIZE
    crc = zlib.crc32(memoryview(buf)[start + HEADER_SIZE:])
    _HEAD.pack_into(buf, start, MAGIC, kind, 0, 0, body_len, count, crc)
    _CRC.pack_into(buf, start + _HEAD.size, zlib.crc32(memoryview(buf)[start:start + _HEAD.size]))


def encode_messages(items: Sequence[tuple[int, int, bytes | memoryview]], after: int = -1,
                    max_body: int | None = None) -> bytearray:
    """MESSAGES records for a batch: one, or several if the batch's body is over ``max_body``.

    Offsets must be above ``after`` and strictly increase; anything wrong raises
    :class:`InvalidArgument` before a byte is written anywhere.
    """
    limit = options.JOURNAL_MAX_RECORD_BYTES if max_body is None else max_body
    buf = _encode_record(items, after)
    if len(buf) - HEADER_SIZE <= limit:
        return buf
    # Rare: split into records of at most ``limit`` bytes of body (the batch is encoded twice).
    out, first, size = bytearray(), 0, 0
    for i, (_, _, payload) in enumerate(items):
        n = ENTRY_SIZE + len(payload)
        if n > limit:
            raise InvalidArgument(f"a payload of {n - ENTRY_SIZE} bytes is over the journal's record "
                                  f"limit ({limit - ENTRY_SIZE} bytes)")
        if size + n > limit:
            out += _encode_record(items[first:i], after)
            after, first, size = items[i - 1][0], i, 0
        size += n
    out += _encode_record(items[first:], after)
    return out


def _encode_record(items: Sequence[tuple[int, int, bytes | memoryview]], after: int) -> bytearray:
    """One MESSAGES record, whatever its size.  The hot loop: keep it short."""
    buf = bytearray(_BLANK_HEADER)
    prev = after
    payload_bytes = 0
    pack = _ENTRY.pack
    try:
        for off, ts, payload in items:
            if off <= prev:
                raise InvalidArgument(f"journal offsets must strictly increase: {off} after {prev}")
            n = len(payload)
            buf += pack(off, ts, n)
            buf += payload
            payload_bytes += n
            prev = off
    except InvalidArgument:
        raise
    except (struct.error, TypeError, ValueError) as e:
        raise InvalidArgument(f"a journal item must be (offset u64, timestamp_ns u64, payload bytes): {e}"
                              ) from e
    if len(buf) != HEADER_SIZE + ENTRY_SIZE * len(items) + payload_bytes:  # len() of a memoryview
        raise InvalidArgument("journal payloads must be bytes-like objects with 1-byte items")
    _seal(buf, 0, MESSAGES, len(items))
    return buf


def encode_state(blob: bytes | bytearray | memoryview) -> bytearray:
    """One STATE record holding ``blob``."""
    buf = bytearray(_BLANK_HEADER)
    try:
        buf += blob
    except TypeError as e:
        raise InvalidArgument(f"a journal state snapshot must be bytes-like: {e}") from e
    if len(buf) - HEADER_SIZE > options.JOURNAL_MAX_RECORD_BYTES:
        raise InvalidArgument(f"a state snapshot of {len(buf) - HEADER_SIZE} bytes is over the journal's "
                              f"record limit ({options.JOURNAL_MAX_RECORD_BYTES} bytes)")
    _seal(buf, 0, STATE, 0)
    return buf


@dataclass
class _Scan:
    """Recovery's running state across the files of one journal."""

    floor: int
    messages: list[tuple[int, int, bytes]] = field(default_factory=list)
    state: bytes | None = None
    last: int = -1  # the highest message offset seen
    problems: list[str] = field(default_factory=list)


class Journal:
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
        self._ready = not any(_SEGMENT_RE.match(n) for n in os.listdir(self._dirfd))

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
                _fsync_dir(self.path.parent)
            self._lockfd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                   options.JOURNAL_FILE_MODE)
        except FileNotFoundError as e:
            self.close()
            if not create:
                raise JournalError(f"no journal for queue {self.name!r} in {root}", e.errno) from e
            raise _os_error("cannot open the journal directory", self.path, e) from e
        except OSError as e:
            self.close()
            raise _os_error("cannot create or open the journal directory", self.path, e) from e
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
        tmp = self.path / (META_FILE + _TMP_SUFFIX)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, options.JOURNAL_FILE_MODE)
        except OSError as e:
            raise _os_error("cannot create", tmp, e) from e
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            os.fsync(self._dirfd)
        except OSError as e:
            _unlink_quietly(tmp)
            raise _os_error("cannot write", path, e) from e

    def read_meta(self) -> dict[str, Any] | None:
        """The last meta written, or None if there is none (a leftover tmp file is ignored)."""
        path = self.path / META_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _os_error("cannot read", path, e) from e
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

    def append_messages(self, items: Sequence[tuple[int, int, bytes | memoryview]]) -> None:
        """Append ``(offset, timestamp_ns, payload)`` items, offsets strictly increasing across calls.

        One write per call.  Nothing is durable until :meth:`sync`.
        """
        self.append(items)

    def append_state(self, blob: bytes | bytearray | memoryview) -> None:
        """Append an opaque state snapshot; recovery returns the last complete one.

        Nothing is durable until :meth:`sync`.
        """
        self.append((), blob)

    def append(self, items: Sequence[tuple[int, int, bytes | memoryview]] = (),
               state: bytes | bytearray | memoryview | None = None) -> None:
        """``append_messages(items)`` then ``append_state(state)`` in one write: if it fails,
        neither is in the file (and next_offset has not moved)."""
        self._check_ready()
        buf = encode_messages(items, self._next - 1) if items else bytearray()
        record = None if state is None else bytes(encode_state(state))
        if record is not None:
            buf += record
        if not buf:
            return
        if items:
            has_messages = bool(self._segments) and self._next > self._segments[-1]
            # A segment holding only snapshots takes the messages whatever its size: it is
            # named next_offset, so a new one could not be named by the batch's first offset.
            roll = has_messages and self._active_size + len(buf) > self.segment_bytes
            base = items[0][0]
        else:
            limit = max(self.segment_bytes, options.JOURNAL_STATE_ROLL_FACTOR * len(buf))
            roll = self._active_size > 0 and self._active_size + len(buf) > limit
            base = self._next
        if self._active < 0 or roll:
            self._start_segment(base, buf, with_state=bool(items))
        else:
            self._write_active(buf)
        if items:
            self._next = items[-1][0] + 1
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
            err = _os_error("fsync failed for", path, e)
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
                raise _os_error("cannot delete", path, e) from e
            self._segments.remove(base)
        try:
            os.fsync(self._dirfd)
        except OSError as e:
            raise _os_error("fsync failed for", self.path, e) from e
        return len(doomed)

    def segment_files(self) -> list[Path]:
        """The segment files, oldest first."""
        return [self.path / segment_name(base) for base in self._segments]

    # ----------------------------------------------------------------- recovery
    def recover(self, floor: int = 0) -> Recovery:
        """Read every segment back; messages below ``floor`` are skipped (but counted for next_offset).

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
        scan = _Scan(floor)
        names = sorted(n for n in os.listdir(self.path) if _SEGMENT_RE.match(n))
        bases = [int(n[:20]) for n in names]
        ends = [self._scan_file(self.path / name, int(name[:20]), scan) for name in names]
        self._segments = bases
        self._next = max([scan.last + 1, *bases]) if bases else 0  # a segment's name is its first offset
        self._state_record = None if scan.state is None else bytes(encode_state(scan.state))
        if bases:
            path = self.path / names[-1]
            try:
                self._active = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                self._active_alloc = os.fstat(self._active).st_size  # the zeros after the end stay
            except OSError as e:
                raise _os_error("cannot open", path, e) from e
            self._active_size = ends[-1]
            self._prealloc_after = 0
        self._ready = True
        return Recovery(scan.messages, scan.state, self._next, scan.problems)

    def _scan_file(self, path: Path, base: int, scan: _Scan) -> int:
        """Read one segment into ``scan``; returns the end of its last good record."""
        try:
            data = path.read_bytes()
        except OSError as e:
            raise _os_error("cannot read", path, e) from e
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            if not data[pos] and data.count(0, pos) == len(data) - pos:
                return pos  # the preallocated end: appends continue into it
            verdict, why, size = self._check_record(data, view, pos, base, scan)
            if verdict == "ok":
                pos += size
                continue
            end = len(data.rstrip(b"\0"))  # zeros from here to the end of the file
            if verdict == "mismatch":  # a checksum: a write cut short if the zeros start inside the record
                verdict = "torn" if end < pos + size else "corrupt"
                if verdict == "torn":
                    why = f"{why}; zeros from byte {end} on, inside the record"
            zeros = f" ({len(data) - end} of them trailing zeros)" if end < len(data) else ""
            if verdict == "torn":
                self._problem(scan, f"{path}: torn tail at byte {pos} ({why}): truncated, "
                                    f"{len(data) - pos} bytes dropped{zeros}")
                self._truncate(path, pos)
            else:
                quarantine = self._quarantine(path, memoryview(data)[pos:end], pos)
                self._problem(scan, f"{path}: corrupt record at byte {pos} ({why}): the last "
                                    f"{len(data) - pos} bytes{zeros} cut off, all but the trailing zeros "
                                    f"moved to {quarantine.name}")
            return pos
        return pos

    @staticmethod
    def _check_record(data: bytes, view: memoryview, pos: int, base: int,
                      scan: _Scan) -> tuple[str, str, int]:
        """("ok", "", size) once the record at ``pos`` is in ``scan``; ("torn"/"corrupt", why, 0);
        or ("mismatch", why, size): a checksum failed over the ``size`` bytes the record claims."""
        rest = len(data) - pos
        if rest < HEADER_SIZE:
            return "torn", f"{rest} bytes, less than a record header", 0
        magic, kind, flags, reserved, body_len, count, body_crc = _HEAD.unpack_from(data, pos)
        (header_crc,) = _CRC.unpack_from(data, pos + _HEAD.size)
        if magic != MAGIC or zlib.crc32(view[pos:pos + _HEAD.size]) != header_crc:
            return "mismatch", "bad magic" if magic != MAGIC else "header checksum mismatch", HEADER_SIZE
        if kind not in (MESSAGES, STATE) or flags or reserved:
            return "corrupt", f"unknown record type {kind} (flags {flags}, reserved {reserved})", 0
        if body_len > options.JOURNAL_MAX_RECORD_BYTES:
            return "corrupt", f"impossible body length {body_len}", 0
        if rest - HEADER_SIZE < body_len:
            return "torn", f"a record of {HEADER_SIZE + body_len} bytes with {rest} present", 0
        start, end = pos + HEADER_SIZE, pos + HEADER_SIZE + body_len
        if zlib.crc32(view[start:end]) != body_crc:
            return "mismatch", "body checksum mismatch", HEADER_SIZE + body_len
        if kind == STATE:
            if count:
                return "corrupt", f"a state record with count {count}", 0
            scan.state = data[start:end]
            return "ok", "", HEADER_SIZE + body_len
        found = []
        prev = max(scan.last, base - 1)
        at = start
        for _ in range(count):
            if at + ENTRY_SIZE > end:
                return "corrupt", "message entries overrun the record", 0
            off, ts, n = _ENTRY.unpack_from(data, at)
            at += ENTRY_SIZE
            if at + n > end:
                return "corrupt", "a payload overruns the record", 0
            if off <= prev:
                return "corrupt", f"offset {off} does not follow {prev}", 0
            if off >= scan.floor:
                found.append((off, ts, data[at:at + n]))
            prev = off
            at += n
        if at != end or not count:
            return "corrupt", f"a message record of {count} messages with {end - at} stray bytes", 0
        scan.messages += found
        scan.last = prev
        return "ok", "", HEADER_SIZE + body_len

    def _problem(self, scan: _Scan, text: str) -> None:
        self.log.error("journal of queue %r: %s", self.name, text)
        scan.problems.append(text)

    def _truncate(self, path: Path, size: int) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _os_error("cannot truncate", path, e) from e

    def _quarantine(self, path: Path, data: memoryview, pos: int) -> Path:
        """Copy ``data`` (a file's bytes from ``pos`` on, less its trailing zeros: a record's header
        gives its length) to ``<path>.corrupt-<n>`` (made durable first), then truncate ``path``
        at ``pos``."""
        n = 1
        while os.path.lexists(f"{path}.corrupt-{n}"):
            n += 1
        target = Path(f"{path}.corrupt-{n}")
        try:
            fd = os.open(target, _O_NEW, options.JOURNAL_FILE_MODE)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(self._dirfd)
        except OSError as e:
            raise _os_error("cannot quarantine corrupt records to", target, e) from e
        self._truncate(path, pos)
        return target

    def _remove_leftover_tmp(self) -> None:
        for name in os.listdir(self.path):
            if name.endswith(_TMP_SUFFIX):
                _unlink_quietly(self.path / name)

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
                raise _os_error("cannot truncate a failed append away from", path, e) from e
            self._tail_dirty = False
            self._active_alloc = self._active_size
        end = self._active_size + len(buf)
        if end > self._active_alloc:
            self._active_alloc = self._preallocate(self._active, self._active_alloc, end)
        try:
            _pwrite_all(self._active, buf, self._active_size)
        except OSError as e:
            # the failed range may hold part of the record: cut it off (the preallocation with it)
            err = _os_error("cannot append to", path, e)
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
                _pwrite_all(fd, memoryview(zeros)[:target - at], at)
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
        target = Path(f"{path}{_TMP_SUFFIX}") if replace else path
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
                         | (os.O_TRUNC if replace else os.O_EXCL), options.JOURNAL_FILE_MODE)
        except OSError as e:
            raise _os_error("cannot create", target, e) from e
        try:
            self._prealloc_after = 0
            alloc = max(self._preallocate(fd, 0, len(buf)), len(buf))
            _pwrite_all(fd, buf, 0)
            if replace:
                os.fdatasync(fd)
                os.rename(target, path)
        except OSError as e:
            os.close(fd)
            _unlink_quietly(target)
            raise _os_error("cannot write a new segment", target, e) from e
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
                _fsync_dir(self.path.parent)
        except OSError as e:
            raise _os_error("cannot delete the journal directory", self.path, e) from e
        finally:
            self.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}, segments={len(self._segments)}, next_offset={self._next})"


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        view = view[n:]


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        view = view[n:]
        at += n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
