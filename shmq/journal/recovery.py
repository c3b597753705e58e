"""Reading a queue's journal back: records checked one by one, torn tails cut, corruption quarantined.

:meth:`Journal.recover <shmq.journal.Journal.recover>` reads every segment file through
the methods here (a base class of ``Journal``): a record is taken only when its header
and body checksums hold; a torn tail (a write cut short) is truncated away, and
corruption is moved aside to ``<file>.corrupt-<n>``, never silently dropped.  What was
found comes back as a :class:`Recovery`.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmq import options
from shmq.journal.files import (
    CRC,
    ENTRY,
    ENTRY_SIZE,
    EXPIRES,
    F_EXPIRES,
    F_META,
    HEAD,
    HEADER_SIZE,
    MAGIC,
    MESSAGES,
    META_LEN,
    STATE,
    TMP_SUFFIX,
    os_error,
    unlink_quietly,
    write_all,
)

_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@dataclass
class Recovery:
    """What :meth:`Journal.recover` found."""

    messages: list[tuple[int, int, bytes]]  # (offset, timestamp_ns, payload), offset-sorted
    state: bytes | None  # the last complete, CRC-valid state snapshot
    next_offset: int  # one past the last message offset ever appended (0 if none)
    problems: list[str] = field(default_factory=list)  # torn tails and quarantined corruption, for humans
    metas: dict[int, bytes] = field(default_factory=dict)  # offset: metadata, of the messages that have any
    expires: dict[int, int] = field(default_factory=dict)  # offset: S_EXPIRES, of the messages put with a TTL


@dataclass
class Scan:
    """Recovery's running state across the files of one journal."""

    floor: int
    messages: list[tuple[int, int, bytes]] = field(default_factory=list)
    state: bytes | None = None
    last: int = -1  # the highest message offset seen
    problems: list[str] = field(default_factory=list)
    metas: dict[int, bytes] = field(default_factory=dict)
    expires: dict[int, int] = field(default_factory=dict)


def read_records(data: bytes, floor: int = 0, base: int = 0, strict: bool = False
                 ) -> tuple[list[tuple[Any, ...]], bytes | None, str]:
    """The records at the start of ``data`` (a segment file's bytes, or a replicated round's),
    up to its end, its zeros, or the first record that is not whole and valid: the messages
    from offset ``floor`` on, as journal items (``(offset, timestamp_ns, payload[, metadata[,
    expires_ns]])``, what :meth:`Journal.append <shmq.journal.Journal.append>` takes), the last
    state, and "" or why it stopped early (``strict``: zeros count as early)."""
    scan = Scan(floor)
    view = memoryview(data)
    pos = 0
    why = ""
    while pos < len(data) and data[pos]:
        verdict, reason, size = SegmentRecovery._check_record(data, view, pos, base, scan)
        if verdict != "ok":
            why = f"a {verdict} record at byte {pos}: {reason}"
            break
        pos += size
    if strict and not why and pos < len(data):
        why = f"zeros at byte {pos}"
    items: list[tuple[Any, ...]] = []
    for off, ts, payload in scan.messages:
        meta = scan.metas.get(off, b"")
        exp = scan.expires.get(off, 0)
        items.append((off, ts, payload, meta, exp) if exp else (off, ts, payload, meta) if meta
                     else (off, ts, payload))
    return items, scan.state, why


@dataclass
class Records:
    """Journal records checked whole (:func:`check_records`), to append as they are."""

    messages: memoryview  # the MESSAGES records, back to back
    offsets: tuple[int, int] | None  # their first and last offsets; None: no message
    state: bytes | None  # the last STATE record, whole (header and body); None: none
    state_body: bytes | None  # its body: the snapshot


def check_records(data: bytes, after: int = -1) -> Records:
    """Check a run of journal records (a replicated round: MESSAGES records, then at most one
    STATE record) without decoding a message: every header and body checksum, every kind,
    and offsets that strictly increase from above ``after``.  ``ValueError`` naming the first
    thing wrong; zeros or a cut record are wrong too (a round is whole records)."""
    view = memoryview(data)
    pos, first, prev, end_messages = 0, -1, after, 0
    state = state_body = None
    while pos < len(data):
        if len(data) - pos < HEADER_SIZE:
            raise ValueError(f"{len(data) - pos} bytes at byte {pos}: less than a record header")
        magic, kind, flags, reserved, body_len, count, body_crc = HEAD.unpack_from(data, pos)
        header_crc = CRC.unpack_from(data, pos + HEAD.size)[0]
        if magic != MAGIC or zlib.crc32(view[pos:pos + HEAD.size]) != header_crc:
            raise ValueError(f"a record header at byte {pos} fails its checksum")
        start, end = pos + HEADER_SIZE, pos + HEADER_SIZE + body_len
        if end > len(data) or zlib.crc32(view[start:end]) != body_crc:
            raise ValueError(f"the record at byte {pos} is cut short or fails its checksum")
        if kind == STATE and not count and not flags and not reserved:
            state, state_body = bytes(view[pos:end]), bytes(view[start:end])
        elif (kind == MESSAGES and not reserved and state is None and count
              and not flags & ~(F_META | F_EXPIRES) and flags != F_EXPIRES):
            at = start
            for _ in range(count):
                off, _, n = ENTRY.unpack_from(data, at)
                if off <= prev:
                    raise ValueError(f"offset {off} does not follow {prev}")
                prev = off
                first = off if first < 0 else first
                at += ENTRY_SIZE + n
            if at != end:
                raise ValueError(f"the message record at byte {pos} has {end - at} stray bytes")
            end_messages = end
        else:
            raise ValueError(f"a record of kind {kind} (count {count}, flags {flags}) at byte {pos} "
                             "where messages, then one state, were expected")
        pos = end
    return Records(view[:end_messages], None if first < 0 else (first, prev), state, state_body)


class SegmentRecovery:
    """The reading of segment files for ``Journal.recover``: a base class of ``Journal``."""

    name: str
    path: Path
    log: logging.Logger
    _dirfd: int

    def _scan_file(self, path: Path, base: int, scan: Scan,
                   progress: Callable[[int], None] | None = None) -> int:
        """Read one segment into ``scan``; returns the end of its last good record.
        ``progress`` is told the file's size once it is read."""
        try:
            data = path.read_bytes()
        except OSError as e:
            raise os_error("cannot read", path, e) from e
        if progress is not None:
            progress(len(data))
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
                      scan: Scan) -> tuple[str, str, int]:
        """("ok", "", size) once the record at ``pos`` is in ``scan``; ("torn"/"corrupt", why, 0);
        or ("mismatch", why, size): a checksum failed over the ``size`` bytes the record claims."""
        rest = len(data) - pos
        if rest < HEADER_SIZE:
            return "torn", f"{rest} bytes, less than a record header", 0
        magic, kind, flags, reserved, body_len, count, body_crc = HEAD.unpack_from(data, pos)
        (header_crc,) = CRC.unpack_from(data, pos + HEAD.size)
        if magic != MAGIC or zlib.crc32(view[pos:pos + HEAD.size]) != header_crc:
            return "mismatch", "bad magic" if magic != MAGIC else "header checksum mismatch", HEADER_SIZE
        if (kind not in (MESSAGES, STATE) or flags & ~(F_META | F_EXPIRES if kind == MESSAGES else 0)
                or flags == F_EXPIRES or reserved):
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
        metas: dict[int, bytes] = {}
        expires: dict[int, int] = {}
        skip = EXPIRES.size if flags & F_EXPIRES else 0  # expires_ns u64 before the metadata length
        prev = max(scan.last, base - 1)
        at = start
        for _ in range(count):
            if at + ENTRY_SIZE > end:
                return "corrupt", "message entries overrun the record", 0
            off, ts, n = ENTRY.unpack_from(data, at)
            at += ENTRY_SIZE
            if at + n > end:
                return "corrupt", "a payload overruns the record", 0
            if off <= prev:
                return "corrupt", f"offset {off} does not follow {prev}", 0
            if off >= scan.floor:
                if flags:  # F_META: [expires_ns u64,] metadata length u32, metadata, payload
                    head = skip + META_LEN.size
                    ml = META_LEN.unpack_from(data, at + skip)[0] if n >= head else n
                    if head + ml > n:
                        return "corrupt", "a message's metadata overruns its entry", 0
                    if ml:
                        metas[off] = data[at + head:at + head + ml]
                    if skip and (exp := EXPIRES.unpack_from(data, at)[0]):
                        expires[off] = exp
                    found.append((off, ts, data[at + head + ml:at + n]))
                else:
                    found.append((off, ts, data[at:at + n]))
            prev = off
            at += n
        if at != end or not count:
            return "corrupt", f"a message record of {count} messages with {end - at} stray bytes", 0
        scan.messages += found
        scan.metas.update(metas)
        scan.expires.update(expires)
        scan.last = prev
        return "ok", "", HEADER_SIZE + body_len

    def _problem(self, scan: Scan, text: str) -> None:
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
            raise os_error("cannot truncate", path, e) from e

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
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(self._dirfd)
        except OSError as e:
            raise os_error("cannot quarantine corrupt records to", target, e) from e
        self._truncate(path, pos)
        return target

    def _remove_leftover_tmp(self) -> None:
        for name in os.listdir(self.path):
            if name.endswith(TMP_SUFFIX):
                unlink_quietly(self.path / name)
