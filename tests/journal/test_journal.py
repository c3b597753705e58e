"""The journal file layer (shmq/journal/__init__.py) on real files: framing, rolls, recovery, failures.

Corruption is made by hand (truncating files, flipping bits, writing zeros); write
failures both simulated (os.pwrite / os.ftruncate / os.fdatasync that fail) and real
(a 64 KiB tmpfs that runs out of space, a read-only tmpfs).  Segment files are
preallocated (zeros past the last record), so sizes below are the Journal's
``active_size`` (the logical end), not the file's.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmq import options
from shmq.errors import InvalidArgument, InvalidName
from shmq.journal import (
    HEADER_SIZE,
    Journal,
    JournalError,
    encode_messages,
    list_queues,
    queue_dir,
    segment_name,
)

Item = tuple[int, int, bytes]


def payload(off: int, size: int) -> bytes:
    return (off.to_bytes(8, "little") * (size // 8 + 1))[:size]


def batch(first: int, n: int, size: int = 30) -> list[Item]:
    return [(off, 1_700_000_000_000_000_000 + off, payload(off, size)) for off in range(first, first + n)]


def reopen(root: Path, name: str = "q", **kw: Any) -> Journal:
    return Journal(root, name, **kw)


def bit_flips(seg: Path, original: bytes, start: int, end: int) -> Iterator[tuple[int, bytearray]]:
    """For each position in [start, end): ``seg`` rewritten as ``original`` with one bit of
    that byte flipped, and the quarantined copies of earlier rounds removed."""
    for pos in range(start, end):
        flipped = bytearray(original)
        flipped[pos] ^= 1 << (pos % 8)
        seg.write_bytes(flipped)
        for q in seg.parent.glob("*.corrupt-*"):
            q.unlink()
        yield pos, flipped


def zeros_after(path: Path, end: int) -> bool:
    """Is everything in the file past ``end`` zero (preallocated, nothing partial)?"""
    rest = path.read_bytes()[end:]
    return rest.count(0) == len(rest)


@contextmanager
def tmpfs(path: Path, opts: str) -> Iterator[Path]:
    """A real tmpfs mounted at ``path`` (we run as root in the test container)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "shmq-test", str(path)], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, capture_output=True)


# ------------------------------------------------------------------- round trips
def test_round_trip(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q")
    assert j.next_offset == 0
    items: list[tuple[int, int, Any]] = [(0, 5, b"a"), (1, 6, b""), (2, 7, memoryview(b"xyz")),
                                         (3, 2**64 - 1, bytearray(b"\x00\xff"))]
    j.append_messages(items)
    j.append_state(b"group-state")
    assert j.next_offset == 4
    j.sync()
    j.close()

    j = reopen(tmp_path)
    with pytest.raises(JournalError, match="recover"):
        j.append_messages(batch(4, 1))
    with pytest.raises(JournalError, match="recover"):
        j.next_offset  # noqa: B018
    r = j.recover()
    assert r.messages == [(0, 5, b"a"), (1, 6, b""), (2, 7, b"xyz"), (3, 2**64 - 1, b"\x00\xff")]
    assert r.state == b"group-state"
    assert r.next_offset == j.next_offset == 4
    assert r.problems == []
    assert j.recover() == r  # a second scan finds the same and changes nothing
    j.close()


def test_many_batches_and_floor(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q", segment_bytes=4096)
    written: list[Item] = []
    off = 0
    for i in range(300):
        b = batch(off, 1 + i % 7, size=i % 50)
        j.append_messages(b)
        written += b
        off += len(b) + i % 3  # gaps are allowed, offsets only have to increase
        if i % 25 == 0:
            j.append_state(f"state {i}".encode())
    j.sync()
    j.close()
    j = reopen(tmp_path, segment_bytes=4096)
    r = j.recover()
    assert r.messages == written and r.state == b"state 275" and r.problems == []
    assert r.next_offset == written[-1][0] + 1
    j.close()
    j = reopen(tmp_path, segment_bytes=4096)
    floor = written[len(written) // 2][0]
    assert j.recover(floor=floor).messages == [m for m in written if m[0] >= floor]
    j.close()


def test_reopen_continues_appending(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q", segment_bytes=300)
    j.append_messages(batch(0, 5))
    j.sync()
    j.close()
    j = reopen(tmp_path, segment_bytes=300)
    assert j.recover().next_offset == 5
    with pytest.raises(InvalidArgument):
        j.append_messages(batch(4, 1))  # below next_offset
    j.append_messages(batch(5, 5))  # rolls: 274 + 274 bytes would be over 300
    j.append_messages(batch(10, 1))  # rolls again
    j.sync()
    assert [p.name for p in j.segment_files()] == [segment_name(0), segment_name(5), segment_name(10)]
    j.close()
    j = reopen(tmp_path, segment_bytes=300)
    assert j.recover().messages == batch(0, 11)
    j.close()


def test_offsets_must_increase_and_bad_items_write_nothing(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages(batch(10, 2))
    seg = j.segment_files()[0]
    size, logical = seg.stat().st_size, j.active_size
    bad: list[Any] = [
        [(12, 0, b"a"), (12, 0, b"b")],  # equal offsets in a batch
        [(13, 0, b"a"), (12, 0, b"b")],  # decreasing in a batch
        [(11, 0, b"a")],  # not above the last call's
        [(-1, 0, b"a")],
        [(2**64, 0, b"a")],
        [(12, -1, b"a")],
        [(12, 0, "text")],
        [(12, 0)],
        [(12.0, 0, b"a")],
        [(12, 0, memoryview(b"abcdefgh").cast("I"))],  # not 1-byte items
    ]
    for items in bad:
        with pytest.raises(InvalidArgument):  # a ValueError
            j.append_messages(items)
        assert seg.stat().st_size == size and j.active_size == logical and j.next_offset == 12
    j.append_messages([])  # nothing to do
    j.append_messages(batch(12, 1))
    with pytest.raises(InvalidArgument):
        j.append_state("not bytes")  # type: ignore[arg-type]
    j.sync()
    j.close()


def test_big_batch_is_split_and_big_payload_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "JOURNAL_MAX_RECORD_BYTES", 200)
    items = batch(0, 20, size=40)  # 60 bytes an entry: 3 a record
    buf = encode_messages(items)
    assert len(buf) == 7 * HEADER_SIZE + 20 * 60
    j = Journal(tmp_path, "q")
    j.append_messages(items)
    with pytest.raises(InvalidArgument, match="record limit"):
        j.append_messages([(20, 0, bytes(181))])
    with pytest.raises(InvalidArgument, match="record limit"):
        j.append_state(bytes(201))
    j.sync()
    j.close()
    j = reopen(tmp_path)
    assert j.recover().messages == items
    j.close()


# ----------------------------------------------------------- segments and state
def test_roll_drop_below_and_the_state_survives(tmp_path: Path) -> None:
    seg_bytes = 500
    j = Journal(tmp_path, "q", segment_bytes=seg_bytes)
    j.append_state(b"the only snapshot")
    for first in range(0, 60, 4):
        j.append_messages(batch(first, 4))
    j.sync()
    files = j.segment_files()
    bases = [int(p.name[:20]) for p in files]
    assert len(files) > 4 and bases == sorted(bases) and bases[0] == 0
    for p in files:
        assert p.stat().st_size <= seg_bytes
    assert j.drop_below(bases[2]) == 2  # the two oldest hold only offsets < bases[2]
    assert j.drop_below(bases[2]) == 0
    assert j.drop_below(bases[3] - 1) == 0  # segment 2 still holds bases[3] - 1
    assert [int(p.name[:20]) for p in j.segment_files()] == bases[2:]
    assert j.drop_below(10**9) == len(bases) - 3  # never the active segment
    assert j.segment_files() == [files[-1]]
    j.close()
    j = reopen(tmp_path, segment_bytes=seg_bytes)
    r = j.recover()
    assert r.state == b"the only snapshot"  # copied into each new segment
    assert r.messages == [m for m in batch(0, 60) if m[0] >= bases[-1]]
    assert r.next_offset == 60 and r.problems == []
    j.close()


def test_snapshots_alone_stay_bounded(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q", segment_bytes=1000)
    for i in range(200):
        j.append_state(i.to_bytes(4, "little") * 25)
        files = j.segment_files()
        assert len(files) == 1 and files[0].name == segment_name(0)
        assert files[0].stat().st_size <= 1000
    j.append_messages(batch(0, 2))  # into the snapshot-only segment, whatever its size
    for i in range(200, 230):
        j.append_state(i.to_bytes(4, "little") * 25)  # now rolls to a segment named next_offset
    assert [p.name for p in j.segment_files()] == [segment_name(0), segment_name(2)]
    assert j.segment_files()[-1].stat().st_size <= 1000
    # a snapshot bigger than the segment size: the file is bounded by a few snapshots
    for i in range(20):
        j.append_state(bytes([i]) * 3000)
        size = j.segment_files()[-1].stat().st_size
        assert size <= options.JOURNAL_STATE_ROLL_FACTOR * (3000 + HEADER_SIZE)
    j.sync()
    j.close()
    j = reopen(tmp_path, segment_bytes=1000)
    r = j.recover()
    assert r.state == bytes([19]) * 3000 and r.messages == batch(0, 2) and r.next_offset == 2
    assert not list(tmp_path.glob("q-q/*.tmp"))
    j.close()


# ----------------------------------------------------------------- torn tails
def _three_files(root: Path, last: str) -> tuple[list[Item], bytes | None, int, int]:
    """Two segments; the last record of the second is a message batch or a snapshot.

    Returns the messages and state before that record, and the record's span in the file."""
    j = Journal(root, "q", segment_bytes=400)
    j.append_state(b"s1")
    j.append_messages(batch(0, 3))
    j.append_messages(batch(3, 3))
    j.append_messages(batch(6, 3))  # rolls: the second segment starts with a copy of s1
    assert len(j.segment_files()) == 2
    j.append_state(b"s2")
    start = j.active_size
    if last == "messages":
        j.append_messages(batch(9, 3))
    else:
        j.append_state(b"s3" * 20)
    end = j.active_size
    assert j.segment_files()[-1].stat().st_size == 400  # preallocated up to segment_bytes
    j.sync()
    j.close()
    return batch(0, 9), b"s2", start, end


@pytest.mark.parametrize("last", ["messages", "state"])
@pytest.mark.parametrize("how", ["cut", "zeros"])
def test_torn_tail_at_every_byte(tmp_path: Path, last: str, how: str) -> None:
    """The last record cut at every byte: the file truncated there ("cut"), or, as a crash
    leaves a preallocated file, everything from there on still zeros ("zeros")."""
    before, state, start, end = _three_files(tmp_path, last)
    seg = tmp_path / "q-q" / segment_name(6)
    original = seg.read_bytes()
    assert len(original) == 400 and zeros_after(seg, end)  # preallocated up to segment_bytes
    torn_seen = 0
    for cut in range(start, end):
        torn = original[:cut] + (bytes(len(original) - cut) if how == "zeros" else b"")
        seg.write_bytes(torn)
        intact = torn[:end] == original[:end]  # the record's own last bytes were zeros
        j = reopen(tmp_path)
        r = j.recover()
        if intact:
            assert r.messages == before + (batch(9, 3) if last == "messages" else []), cut
            assert r.state == (state if last == "messages" else b"s3" * 20)
        else:
            assert r.messages == before and r.state == state, cut
        torn_found = cut > start and not intact
        torn_seen += torn_found
        assert len(r.problems) == torn_found and (not torn_found or "torn tail" in r.problems[0])
        # a torn record is truncated away; zeros after the last good record are kept
        assert seg.stat().st_size == (start if torn_found else len(torn))
        assert j.active_size == (end if intact else start)
        assert not list(seg.parent.glob("*.corrupt-*"))
        nxt = r.next_offset
        assert nxt == (12 if intact and last == "messages" else 9)
        j.append_messages(batch(nxt, 1))  # appends continue after the last good record
        j.close()
        j = reopen(tmp_path)
        assert j.recover().messages == [m for m in before + batch(9, 3) if m[0] < nxt] + batch(nxt, 1)
        j.close()
    assert torn_seen > (end - start) // 2


def test_zero_tail_is_the_preallocated_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Zeros after the last record, however many, are no problem: silent, and kept for appends."""
    before, _, _, end = _three_files(tmp_path, "messages")
    seg = tmp_path / "q-q" / segment_name(6)
    with seg.open("ab") as f:
        f.write(bytes(4096))  # more zeros than the preallocation: still the normal end
    size = seg.stat().st_size
    caplog.clear()
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == before + batch(9, 3) and r.problems == [] and not caplog.records
    assert seg.stat().st_size == size and j.active_size == end and not list(seg.parent.glob("*.corrupt-*"))
    j.close()


def test_bit_flip_in_the_last_record_is_corrupt_not_torn(tmp_path: Path) -> None:
    """A checksum failure is torn only when zeros start inside the record: a flipped bit in
    a last record that ends in data, with preallocated zeros after it, is quarantined."""
    before, state, start, end = _three_files(tmp_path, "state")  # the last record ends in b"3"
    seg = tmp_path / "q-q" / segment_name(6)
    original = seg.read_bytes()
    assert len(original) > end and zeros_after(seg, end)
    for pos, flipped in bit_flips(seg, original, start, end):
        j = reopen(tmp_path)
        r = j.recover()
        assert r.messages == before and r.state == state, pos
        assert len(r.problems) == 1 and "corrupt record" in r.problems[0], (pos, r.problems)
        assert seg.read_bytes() == original[:start]
        assert (seg.parent / f"{seg.name}.corrupt-1").read_bytes() == flipped[start:end]  # no zeros
        j.close()


# ----------------------------------------------------------------- preallocation
def test_preallocation_runs_ahead_and_survives_recovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    chunk = 4096
    monkeypatch.setattr(options, "JOURNAL_PREALLOC_BYTES", chunk)
    j = Journal(tmp_path, "q", segment_bytes=1 << 20)
    written: list[Item] = []
    sizes = set()
    for first in range(0, 300, 3):
        b = batch(first, 3, size=100)
        j.append(b, b"state %d" % first)
        written += b
        seg = j.segment_files()[0]
        size = seg.stat().st_size
        assert j.active_size <= size <= j.active_size + chunk and zeros_after(seg, j.active_size)
        sizes.add(size)
    assert len(j.segment_files()) == 1
    assert 1 < len(sizes) <= j.active_size // chunk + 1  # the file grew a chunk at a time
    end = j.active_size
    j.sync()
    j.close()
    assert size > end  # zeros past the last record, as a crash or a stop leaves them

    caplog.clear()
    j = reopen(tmp_path, segment_bytes=1 << 20)
    r = j.recover()
    assert r.messages == written and r.state == b"state 297" and r.problems == [] and not caplog.records
    assert j.active_size == end and seg.stat().st_size == size  # the preallocation is kept
    more = batch(300, 1, size=10)
    j.append(more, b"after")  # goes into the preallocated zeros: the file does not grow
    assert j.active_size > end and seg.stat().st_size == size
    j.sync()
    j.close()
    j = reopen(tmp_path, segment_bytes=1 << 20)
    r = j.recover()
    assert r.messages == written + more and r.state == b"after" and r.problems == []
    j.close()


def test_preallocation_stops_at_the_segment_size_and_can_be_off(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path / "a", "q", segment_bytes=1000)  # the default chunk is far bigger
    j.append_messages(batch(0, 2))
    assert j.segment_files()[0].stat().st_size == 1000
    j.append_messages(batch(2, 20))  # a record bigger than the segment: a file of its own, no zeros
    assert j.segment_files()[-1].stat().st_size == j.active_size > 1000
    j.close()
    monkeypatch.setattr(options, "JOURNAL_PREALLOC_BYTES", 0)
    j = Journal(tmp_path / "b", "q")
    for first in range(0, 30, 3):
        j.append(batch(first, 3), b"s")
        assert j.segment_files()[0].stat().st_size == j.active_size
    j.close()


def test_failed_preallocation_falls_back_to_the_record(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The zeros cannot be written (half of them, then ENOSPC): the file is cut back, the record
    is written as if there were no preallocation, and the next chunk's worth of appends do not
    try again."""
    chunk = 4096
    monkeypatch.setattr(options, "JOURNAL_PREALLOC_BYTES", chunk)
    j = Journal(tmp_path, "q", segment_bytes=1 << 20)
    fail = FailingWrite(zeros=True)
    monkeypatch.setattr(os, "pwrite", fail)
    j.append_messages(batch(0, 3))  # a new segment: its preallocation fails
    seg = j.segment_files()[0]
    assert not fail.armed and seg.stat().st_size == j.active_size
    first_end = j.active_size
    n = 3
    while j.active_size < first_end + chunk:  # no new attempt for a chunk's worth
        assert seg.stat().st_size == j.active_size
        j.append_messages(batch(n, 3))
        n += 3
    assert seg.stat().st_size == j.active_size + chunk  # then it preallocates again
    fail.armed = True
    while fail.armed:  # an extension of the active segment fails
        j.append_messages(batch(n, 3))
        n += 3
    assert seg.stat().st_size == j.active_size and zeros_after(seg, j.active_size)
    j.sync()
    j.close()
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == batch(0, n) and r.problems == []
    j.close()


class ZeroWrites:
    """os.pwrite that keeps how each write of zeros ended: its errno, or 0."""

    def __init__(self) -> None:
        self.real = os.pwrite
        self.ends: list[int] = []

    def __call__(self, fd: int, data: Any, at: int) -> int:
        zeros = bytes(data).count(0) == len(data)
        try:
            n = self.real(fd, data, at)
        except OSError as e:
            self.ends += [e.errno or -1] if zeros else []
            raise
        self.ends += [0] if zeros else []
        return n


def test_preallocation_on_a_full_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "JOURNAL_PREALLOC_BYTES", 1 << 20)
    spy = ZeroWrites()
    monkeypatch.setattr(os, "pwrite", spy)
    with tmpfs(tmp_path / "mnt", "size=64k,mode=0700") as mnt:
        # 1 MiB of zeros would not leave as much free: not even tried, the file holds its records
        j = Journal(mnt / "data", "small", segment_bytes=8 << 20)
        j.append_messages(batch(0, 3, size=700))
        assert j.segment_files()[0].stat().st_size == j.active_size and spy.ends == []
        j.close()

        real = os.fstatvfs

        def roomy(fd: int) -> os.statvfs_result:  # as if the space went between the look and the write
            f = real(fd)
            return os.statvfs_result((f.f_bsize, f.f_frsize, 1 << 30, 1 << 30, 1 << 30, f.f_files,
                                      f.f_ffree, f.f_favail, f.f_flag, f.f_namemax))

        monkeypatch.setattr(os, "fstatvfs", roomy)
        free = os.statvfs(mnt).f_bavail
        j = Journal(mnt / "data", "q", segment_bytes=8 << 20)
        j.append_messages(batch(0, 3, size=700))  # the zeros hit a real ENOSPC; the record does not
        seg = j.segment_files()[0]
        assert spy.ends and spy.ends[-1] == errno.ENOSPC
        assert seg.stat().st_size == j.active_size
        assert free - os.statvfs(mnt).f_bavail <= 2  # the zeros' space was given back
        written = batch(0, 3, size=700)
        with pytest.raises(JournalError) as e:
            for first in range(3, 10**6, 3):
                b = batch(first, 3, size=700)
                j.append_messages(b)
                written += b
        assert e.value.errno == errno.ENOSPC and j.next_offset == len(written) > 3
        j.sync()
        j.close()
        j = reopen(mnt / "data", segment_bytes=8 << 20)
        r = j.recover()
        assert r.messages == written and r.problems == []
        j.close()


# ----------------------------------------------------------------- corruption
@pytest.mark.parametrize("kind", ["messages", "state"])
def test_bit_flip_anywhere_in_a_record_is_quarantined(tmp_path: Path, kind: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """First segment: s1, r1, r2, r3.  A bit flipped in r2 quarantines r2 and r3 only."""
    j = Journal(tmp_path, "q", segment_bytes=700)
    j.append_state(b"s1")
    j.append_messages(batch(0, 2))
    r2_start = j.active_size
    if kind == "messages":
        j.append_messages(batch(2, 3))
    else:
        j.append_state(b"s2" * 30)
    r2_end = j.active_size
    j.append_messages(batch(5, 1))
    j.append_messages(batch(6, 8))  # a second segment, starting with a copy of the latest snapshot
    j.append_messages(batch(14, 2))
    j.sync()
    j.close()
    first, second = tmp_path / "q-q" / segment_name(0), tmp_path / "q-q" / segment_name(6)
    assert sorted(p.name for p in first.parent.glob("*.log")) == [first.name, second.name]
    original = first.read_bytes()
    assert len(original) == 700 and zeros_after(first, r2_end + 24 + 20 + 30)  # preallocated
    expected_state = b"s2" * 30 if kind == "state" else b"s1"  # the copy in the second segment
    assert r2_end - r2_start > 24
    for pos, flipped in bit_flips(first, original, r2_start, r2_end):
        caplog.clear()
        j = reopen(tmp_path)
        r = j.recover()
        assert r.messages == batch(0, 2) + batch(6, 10), pos  # earlier records and later segments intact
        assert r.state == expected_state and r.next_offset == 16
        assert len(r.problems) == 1 and "corrupt" in r.problems[0]
        assert any(rec.levelname == "ERROR" for rec in caplog.records)
        assert first.read_bytes() == original[:r2_start]
        # the quarantined copy is everything from r2 on, less the preallocated zeros at the end
        assert (first.parent / f"{first.name}.corrupt-1").read_bytes() == flipped[r2_start:].rstrip(b"\0")
        assert j.recover().problems == []  # the quarantine is done once
        j.close()


def test_impossible_length_is_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages(batch(0, 1))
    j.append_messages(batch(1, 1, size=5000))
    j.sync()
    j.close()
    monkeypatch.setattr(options, "JOURNAL_MAX_RECORD_BYTES", 4096)  # now the second record cannot be
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == batch(0, 1) and "impossible body length" in r.problems[0]
    j.close()


def test_corrupt_files_get_numbered_quarantines(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages(batch(0, 1))
    end = j.active_size
    j.sync()
    j.close()
    seg = tmp_path / "q-q" / segment_name(0)
    for n in (1, 2):
        with seg.open("r+b") as f:
            f.seek(end)  # right after the last record, over the preallocated zeros (if any)
            f.write(b"garbage that is no record at all")
        j = reopen(tmp_path)
        r = j.recover()
        assert r.messages == batch(0, 1) and "bad magic" in r.problems[0]
        assert (seg.parent / f"{seg.name}.corrupt-{n}").exists()
        j.close()


# ---------------------------------------------------------------- write failures
class FailingWrite:
    """os.pwrite that writes half of what it is given, then raises ENOSPC (once): the write
    of a record, or with ``zeros`` the write of the zeros that preallocate."""

    def __init__(self, zeros: bool = False) -> None:
        self.real = os.pwrite
        self.zeros = zeros
        self.armed = True

    def __call__(self, fd: int, data: Any, at: int) -> int:
        view = memoryview(data)
        if not self.armed or (bytes(view).count(0) == len(view)) != self.zeros:
            return self.real(fd, data, at)
        self.armed = False
        self.real(fd, view[:len(view) // 2], at)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("roll", [False, True])
def test_failed_write_is_truncated_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, roll: bool) -> None:
    j = Journal(tmp_path, "q", segment_bytes=300 if roll else 1 << 20)
    j.append_messages(batch(0, 4))
    j.append_state(b"s")
    files = j.segment_files()
    size, logical = files[-1].stat().st_size, j.active_size
    assert size > logical  # preallocated
    fail = FailingWrite()
    monkeypatch.setattr(os, "pwrite", fail)
    with pytest.raises(JournalError) as e:
        j.append_messages(batch(4, 4))
    assert not fail.armed and e.value.errno == errno.ENOSPC
    assert "ENOSPC" in str(e.value) and str(tmp_path) in str(e.value)
    assert j.segment_files() == files and j.active_size == logical  # as before the call
    # nothing of the failed record is left: the file is cut back to the last complete record
    # (a new segment that failed is removed, the old one keeps its preallocation)
    assert files[-1].stat().st_size == (size if roll else logical) and zeros_after(files[-1], logical)
    assert sorted(files[0].parent.glob("*.log")) == files and j.next_offset == 4
    j.append_messages(batch(4, 4))  # space is back
    assert len(j.segment_files()) == len(files) + roll
    j.sync()
    j.close()
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == batch(0, 8) and r.state == b"s" and r.problems == []
    j.close()


def test_append_writes_messages_and_state_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, "q")
    j.append(batch(0, 2), b"s0")
    seg = j.segment_files()[0]
    size = j.active_size
    monkeypatch.setattr(os, "pwrite", FailingWrite())
    with pytest.raises(JournalError, match="ENOSPC"):
        j.append(batch(2, 2), b"s1")
    assert seg.stat().st_size == size == j.active_size and j.next_offset == 2  # neither messages nor state
    monkeypatch.undo()
    j.append(batch(2, 2), b"s1")
    j.append(state=b"s2")
    j.append(batch(4, 1))
    j.append()  # nothing
    j.sync()
    j.close()
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == batch(0, 5) and r.state == b"s2" and r.problems == []
    j.close()


def test_failed_truncate_is_retried_before_the_next_append(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages(batch(0, 2))
    seg = j.segment_files()[0]
    size = j.active_size
    real_ftruncate = os.ftruncate

    def eio(fd: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwrite", FailingWrite())
    monkeypatch.setattr(os, "ftruncate", eio)
    with pytest.raises(JournalError, match="truncating it back .* failed too"):
        j.append_messages(batch(2, 4))
    assert not zeros_after(seg, size)  # half a record is left for now
    with pytest.raises(JournalError, match="EIO"):
        j.append_messages(batch(2, 4))  # refuses to write after a partial record
    monkeypatch.setattr(os, "ftruncate", real_ftruncate)
    j.append_messages(batch(2, 4))
    j.sync()
    j.close()
    j = reopen(tmp_path)
    r = j.recover()
    assert r.messages == batch(0, 6) and r.problems == []
    j.close()


def test_failed_fsync_makes_the_journal_unusable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages(batch(0, 2))

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(JournalError, match="EIO") as e:
        j.sync()
    assert e.value.errno == errno.EIO and j.failed
    monkeypatch.undo()
    for call in (lambda: j.append_messages(batch(2, 1)), j.sync, lambda: j.append_state(b"x")):
        with pytest.raises(JournalError, match="reopen"):
            call()
    j.close()
    j = reopen(tmp_path)
    assert j.recover().messages == batch(0, 2)
    j.close()


@pytest.mark.parametrize("segment_bytes", [1 << 20, 5000])
def test_real_full_filesystem(tmp_path: Path, segment_bytes: int) -> None:
    with tmpfs(tmp_path / "mnt", "size=64k,mode=0700") as mnt:
        filler = mnt / "filler"
        filler.write_bytes(bytes(16384))
        j = Journal(mnt / "data", "q", segment_bytes=segment_bytes)
        written: list[Item] = []
        with pytest.raises(JournalError) as e:
            for first in range(0, 10**6, 3):
                b = batch(first, 3, size=700)
                j.append_messages(b)
                written += b
        assert e.value.errno == errno.ENOSPC and "ENOSPC" in str(e.value)
        assert written and j.next_offset == len(written)
        j.sync()
        j.close()
        j = reopen(mnt / "data", segment_bytes=segment_bytes)
        r = j.recover()
        assert r.messages == written and r.problems == []  # no partial record was left behind
        filler.unlink()
        more = batch(len(written), 3, size=700)
        j.append_messages(more)
        j.sync()
        j.close()
        j = reopen(mnt / "data", segment_bytes=segment_bytes)
        r = j.recover()
        assert r.messages == written + more and r.problems == []
        j.close()


def test_unwritable_data_dir(tmp_path: Path) -> None:
    plain = tmp_path / "a-file"
    plain.write_bytes(b"")
    with pytest.raises(JournalError, match="ENOTDIR") as e:
        Journal(plain / "data", "q")
    assert str(plain) in str(e.value)
    with pytest.raises(JournalError, match="no journal for queue"):
        Journal(tmp_path / "empty", "q", create=False)
    with tmpfs(tmp_path / "ro", "size=64k,ro") as ro, pytest.raises(JournalError, match="EROFS"):
        Journal(ro / "data", "q")
    with tmpfs(tmp_path / "rw", "size=64k") as rw:
        j = Journal(rw, "q")
        j.append_messages(batch(0, 1))
        j.sync()
        j.close()
        subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True, capture_output=True)
        with pytest.raises(JournalError, match="EROFS"):
            Journal(rw, "q")


# ------------------------------------------------------- names, modes, metadata
def test_names_cannot_escape_the_data_dir(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for bad in ["..", ".", "a/b", "../x", "/abs", "", "x" * 201, "a\0b", "caf\u00e9", None]:
        with pytest.raises(InvalidName):
            queue_dir(root, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidName):
            Journal(root, bad)  # type: ignore[arg-type]
    odd = ["..a", ".hidden", "...", "-", "x" * 200, "orders.dlq"]
    for name in odd:
        path = queue_dir(root, name)
        assert path.parent == root.absolute() and path.name == f"q-{name}"
        Journal(root, name).close()
    assert sorted(os.listdir(root)) == sorted(f"q-{n}" for n in odd)
    assert list_queues(root) == sorted(odd)
    assert os.listdir(tmp_path) == ["data"]


def test_modes(tmp_path: Path) -> None:
    old = os.umask(0)  # so nothing below relies on the umask
    try:
        j = Journal(tmp_path / "data", "q")
        j.write_meta({"capacity": 4})
        j.append_messages(batch(0, 1))
        j.sync()
        j.close()
        with (tmp_path / "data" / "q-q" / segment_name(0)).open("ab") as f:
            f.write(b"junk" * 10)
        j = reopen(tmp_path / "data")
        assert j.recover().problems
        j.close()
    finally:
        os.umask(old)
    for path in [tmp_path / "data", *(tmp_path / "data").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert len(list((tmp_path / "data").rglob("*"))) == 5  # q-q, lock, meta.json, a segment, a quarantine


def test_meta_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, "q")
    assert j.read_meta() is None
    j.write_meta({"capacity": 16, "durability": "always"})
    tmp = tmp_path / "q-q" / "meta.json.tmp"
    tmp.write_bytes(b'{"capacity": 99, "half-writ')  # a crash while writing the next one
    assert j.read_meta() == {"capacity": 16, "durability": "always"}
    for bad in [{"x": object()}, {"x": float("nan")}, ["not", "a", "dict"], {"x": "y" * 70_000}]:
        with pytest.raises(InvalidArgument):
            j.write_meta(bad)  # type: ignore[arg-type]

    def enospc(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "rename", enospc)
    with pytest.raises(JournalError, match="ENOSPC"):
        j.write_meta({"capacity": 32})
    monkeypatch.undo()
    assert j.read_meta() == {"capacity": 16, "durability": "always"} and not tmp.exists()
    j.write_meta({"capacity": 32})
    assert j.read_meta() == {"capacity": 32}
    (tmp_path / "q-q" / "meta.json").write_bytes(b"{not json")
    with pytest.raises(JournalError, match="not valid JSON"):
        j.read_meta()
    tmp.write_bytes(b"leftover")
    j.recover()  # removes leftover tmp files
    assert not tmp.exists()
    j.close()


def test_one_journal_per_directory_and_destroy(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q")
    with pytest.raises(JournalError, match="in use"):
        Journal(tmp_path, "q")
    j.append_messages(batch(0, 1))
    j.write_meta({"a": 1})
    j.destroy()
    assert not (tmp_path / "q-q").exists() and list_queues(tmp_path) == []
    j.close()  # idempotent
    with pytest.raises(JournalError, match="closed"):
        j.sync()
    with pytest.raises(InvalidArgument):
        Journal(tmp_path, "q", segment_bytes=0)


# --------------------------------------------------------------- the property
Op = tuple[str, int, list[int]]  # ("m", gap, payload sizes) or ("s", snapshot size, [])


@st.composite
def journal_runs(draw: st.DrawFn) -> tuple[int, list[Op], float, bool]:
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("m"), st.integers(0, 3), st.lists(st.integers(0, 120), min_size=1, max_size=6)),
        st.tuples(st.just("s"), st.integers(0, 150), st.just([]))), min_size=1, max_size=30))
    return draw(st.integers(24, 1500)), ops, draw(st.floats(0, 1)), draw(st.booleans())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(journal_runs())
def test_recovery_after_truncation_is_a_prefix(run: tuple[int, list[Op], float, bool]) -> None:
    """Random batches and snapshots, random segment size, the journal cut at a random byte
    (the files after it gone): recovery gives exactly the calls that ended before the cut.

    The cut truncates the file, or (``zero_fill``, what a crash leaves in a preallocated file)
    turns everything after it into zeros, keeping the size: then a record whose own bytes
    after the cut were zeros anyway is intact, so the cut really is at the next non-zero byte."""
    segment_bytes, ops, where, zero_fill = run
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        j = Journal(root, "p", segment_bytes=segment_bytes)
        written: list[Item] = []
        ends: list[tuple[int, int, int, bytes | None]] = []  # (inode, logical end) after each call, n, state
        state: bytes | None = None
        off = 0
        for kind, n, sizes in ops:
            if kind == "m":
                off += n  # a gap of n before the batch
                b = [(off + i, off * 7 + i, payload(off + i, size)) for i, size in enumerate(sizes)]
                j.append_messages(b)
                written += b
                off += len(b)
            else:
                state = payload(n, n)
                j.append_state(state)
            seg = j.segment_files()[-1]
            assert seg.stat().st_size >= j.active_size and zeros_after(seg, j.active_size)
            ends.append((seg.stat().st_ino, j.active_size, len(written), state if kind == "s" else None))
        j.sync()
        j.close()

        files = sorted(root.glob("q-p/*.log"))
        starts, total = {}, 0
        for f in files:
            starts[f.stat().st_ino] = total
            total += f.stat().st_size
        cut = int(where * total)
        pos = 0
        for f in files:
            size = f.stat().st_size
            if pos + size <= cut:
                pos += size
            elif pos <= cut:
                data = f.read_bytes()
                if zero_fill:
                    f.write_bytes(data[:cut - pos] + bytes(size - (cut - pos)))
                    rest = data[cut - pos:]
                    cut += len(rest) - len(rest.lstrip(b"\0"))  # bytes that did not change
                else:
                    os.truncate(f, cut - pos)
                pos = cut + 1
            else:
                f.unlink()
        # a snapshot-only segment replaced by a newer one took its calls' records with it
        done = [e for e in ends if e[0] in starts and starts[e[0]] + e[1] <= cut]
        want_n = done[-1][2] if done else 0
        want_state = next((e[3] for e in reversed(done) if e[3] is not None), None)

        j = Journal(root, "p", segment_bytes=segment_bytes)
        r = j.recover()
        assert r.messages == written[:want_n]
        assert r.state == want_state
        assert len(r.problems) <= 1 and not list(root.glob("q-p/*.corrupt-*"))
        bases = [int(f.name[:20]) for f in root.glob("q-p/*.log")]
        assert r.next_offset == max([written[want_n - 1][0] + 1 if want_n else 0, *bases])
        more = (r.next_offset, 1, b"after")
        j.append_messages([more])
        j.close()
        j = Journal(root, "p", segment_bytes=segment_bytes)
        assert j.recover().messages == written[:want_n] + [more]
        j.close()
