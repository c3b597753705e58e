"""shmq.cli.lines: produce's input in batches, sent when full or once the input is idle."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

from shmq.cli.lines import line_batches, stream_batches
from shmq.core.colocated import ShmBroker
from tests.support.wait import wait_until


def test_an_idle_pipe_sends_what_it_has_without_waiting_for_a_full_batch_or_the_end() -> None:
    r, w = os.pipe()
    try:
        batches = line_batches(r, 100, linger=0.01)
        os.write(w, b"a\nb\n")
        assert next(batches) == [b"a", b"b"]  # the pipe is still open: idle, not at its end
        os.write(w, b"hel")
        os.write(w, b"lo\n\nlast")  # a line in two reads, an empty line, a last line without \n
        os.close(w)
        w = -1
        assert list(batches) == [[b"hello", b"", b"last"]]
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_full_batches_go_out_as_they_fill() -> None:
    r, w = os.pipe()
    data = b"".join(b"%d\n" % i for i in range(250))

    def write_all() -> None:
        os.write(w, data)
        os.close(w)

    writer = threading.Thread(target=write_all)
    writer.start()
    try:
        got = list(line_batches(r, 100, linger=5.0))  # never idle long enough: only size and end count
    finally:
        writer.join()
        os.close(r)
    assert [len(b) for b in got] == [100, 100, 50]
    assert [int(x) for b in got for x in b] == list(range(250))


def test_a_stop_ends_a_wait_on_a_quiet_pipe_after_sending_what_was_read() -> None:
    r, w = os.pipe()
    stop = threading.Event()
    try:
        os.write(w, b"x\npartial")
        batches = line_batches(r, 100, stopped=stop.is_set, linger=0.01, slice_s=0.01)
        assert next(batches) == [b"x"]
        stop.set()
        assert list(batches) == [[b"partial"]]  # nothing lost: the unfinished line is a message too
    finally:
        os.close(r)
        os.close(w)


def test_a_stream_without_a_descriptor_is_read_in_full_batches() -> None:
    got = list(stream_batches(io.BytesIO(b"1\n2\n3\n4\n5"), 2))
    assert got == [[b"1", b"2"], [b"3", b"4"], [b"5"]]


def test_produce_sends_each_line_of_a_quiet_pipe_as_it_comes(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("tail")
    p = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()", "produce", "tail",
                          "--shm", shm_broker.instance], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stdin is not None
        p.stdin.write(b"first line\n")
        p.stdin.flush()
        wait_until(lambda: q.stats()["next_offset"] == 1, timeout=30)  # with stdin still open
        out, err = p.communicate(b"second line\n", timeout=30)  # then stdin closes: the end
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out == b"produced 2 messages, offsets 0..1\n"
    assert [m.payload for m in q.read(0, 10)] == [b"first line", b"second line"]
