"""The files of a queue's journal: where they are, what they are called, how a record is encoded.

A queue's directory ``<root>/q-<name>/`` holds ``meta.json``, a ``lock`` file and segment
files named by their first offset; a segment is a run of records (drawn in ``journal``'s
docstring and in ``docs/architecture.md``, "Journal file format").  Here: the names, the
record encoders (:func:`encode_messages`, :func:`encode_state`), the journal's error and
the small write helpers.  No state: the :class:`~shmq.journal.Journal` object is in
``journal``, reading records back in ``journal.recovery``.
"""

from __future__ import annotations

import errno as _errno
import os
import re
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shmq import options
from shmq.errors import InvalidArgument, InvalidName, ShmqError, Status
from shmq.names import check_queue_name

MAGIC = b"SQJ1"
MESSAGES = 1
STATE = 2
HEAD = struct.Struct("<4sBBHIII")  # magic, type, flags, reserved, body length, count, body crc
CRC = struct.Struct("<I")  # the header's own crc, over the 20 bytes before it
HEADER_SIZE = HEAD.size + CRC.size  # 24
ENTRY = struct.Struct("<QQI")  # offset, timestamp_ns, payload length
ENTRY_SIZE = ENTRY.size  # 20
F_META = 1  # MESSAGES flag: each entry's data is ``meta length u32, metadata, payload``
F_EXPIRES = 2  # MESSAGES flag (with F_META): each entry's data starts with ``expires_ns u64`` (0: none)
META_LEN = struct.Struct("<I")
EXPIRES = struct.Struct("<Q")
_BLANK_HEADER = bytes(HEADER_SIZE)

QUEUE_DIR_PREFIX = "q-"
META_FILE = "meta.json"
LOCK_FILE = "lock"
SEGMENT_RE = re.compile(r"(\d{20})\.log\Z")
TMP_SUFFIX = ".tmp"


class JournalError(ShmqError):
    """The journal could not be read or written (the message names the errno and the path)."""

    code = Status.INTERNAL

    def __init__(self, message: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (str(self), self.errno))


def os_error(what: str, path: object, e: OSError) -> JournalError:
    name = _errno.errorcode.get(e.errno or 0, type(e).__name__)
    return JournalError(f"{what} {path}: {name} ({e.strerror or e})", e.errno)


def queue_dir(root: Path | str, queue_name: str) -> Path:
    """The directory of one queue's journal: ``<root>/q-<name>``, never outside ``root``."""
    check_queue_name(queue_name)
    base = Path(os.path.abspath(root))
    path = base / f"{QUEUE_DIR_PREFIX}{queue_name}"
    if Path(os.path.normpath(path)).parent != base:  # the prefix makes ".", ".." and "a/b" impossible
        raise InvalidName(f"queue name {queue_name!r} would leave the data directory")
    return path


def retire_journal(data_dir: str, name: str) -> None:
    """Move a deleted queue's journal out of the way, atomically: recovery never brings it
    back, and its writer (which notices the deletion and stops) writes on into the moved
    directory.  The journal process removes retired journals (``.deleted-*``)."""
    path = queue_dir(data_dir, name)
    try:
        os.rename(path, path.parent / f".deleted-{time.time_ns()}-{name}")
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass



def journal_bytes(root: Path | str, queue_name: str) -> int:
    """The size of a queue's segment files (what its recovery reads)."""
    path = queue_dir(root, queue_name)
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if SEGMENT_RE.match(e.name))
    except OSError:
        return 0


def list_queues(root: Path | str) -> list[str]:
    """The names of the queues that have a journal directory under ``root`` (sorted)."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise os_error("cannot list the data directory", root, e) from e
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


def _seal(buf: bytearray, start: int, kind: int, count: int, flags: int = 0) -> None:
    """Fill in the header of the record that starts at ``buf[start]`` and runs to the end of ``buf``."""
    body_len = len(buf) - start - HEADER_SIZE
    crc = zlib.crc32(memoryview(buf)[start + HEADER_SIZE:])
    HEAD.pack_into(buf, start, MAGIC, kind, flags, 0, body_len, count, crc)
    CRC.pack_into(buf, start + HEAD.size, zlib.crc32(memoryview(buf)[start:start + HEAD.size]))


def encode_messages(items: Sequence[tuple[Any, ...]], after: int = -1,
                    max_body: int | None = None) -> bytearray:
    """MESSAGES records for a batch: one, or several if the batch's body is over ``max_body``.

    An item is ``(offset, timestamp_ns, payload)``, or ``(offset, timestamp_ns, payload,
    metadata)`` (headers, a dead letter's origin): a record holding one of those has the
    flag ``F_META``, and each of its entries' data is ``metadata length u32, metadata,
    payload`` (a record without is byte for byte what it was before metadata was journaled).
    An item ``(offset, timestamp_ns, payload, metadata, expires_ns)`` (a message's own TTL,
    ``layout.S_EXPIRES``; 0: none) makes its record ``F_META | F_EXPIRES``: each entry's
    data then starts with ``expires_ns u64``.
    Offsets must be above ``after`` and strictly increase; anything wrong raises
    :class:`InvalidArgument` before a byte is written anywhere.
    """
    if any(len(it) > 3 for it in items):
        timed = any(len(it) > 4 and it[4] for it in items)
        items = [(it[0], it[1], (EXPIRES.pack(it[4] if len(it) > 4 else 0) if timed else b"")
                  + META_LEN.pack(len(it[3]) if len(it) > 3 else 0)
                  + (bytes(it[3]) if len(it) > 3 else b"") + bytes(it[2])) for it in items]
        return _encode_parts(items, after, max_body, F_META | (F_EXPIRES if timed else 0))
    return _encode_parts(items, after, max_body, 0)


def _encode_parts(items: Sequence[tuple[Any, ...]], after: int, max_body: int | None, flags: int
                  ) -> bytearray:
    limit = options.JOURNAL_MAX_RECORD_BYTES if max_body is None else max_body
    buf = _encode_record(items, after, flags)
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
            out += _encode_record(items[first:i], after, flags)
            after, first, size = items[i - 1][0], i, 0
        size += n
    out += _encode_record(items[first:], after, flags)
    return out


def _encode_record(items: Sequence[tuple[Any, ...]], after: int, flags: int = 0) -> bytearray:
    """One MESSAGES record, whatever its size.  The hot loop: keep it short."""
    buf = bytearray(_BLANK_HEADER)
    prev = after
    payload_bytes = 0
    pack = ENTRY.pack
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
    _seal(buf, 0, MESSAGES, len(items), flags)
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


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        view = view[n:]


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        view = view[n:]
        at += n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
