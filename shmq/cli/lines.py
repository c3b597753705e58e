"""Lines of a file or a pipe in batches, for ``shmq produce``: a batch goes out when it is
full, or once the input has been idle for a moment, so ``tail -f log | shmq produce q``
sends each line as it comes instead of holding it until 100 more arrive.

A line is what lies between two newlines (the newline dropped; an empty line is an
empty message); the last line needs no newline.  ``stopped`` is asked whenever the
input has been idle for ``options.PRODUCE_LINGER`` or ``slice_s``, and after each read: a
true answer ends the batches (what was read, an unfinished line included, is yielded
first), so Ctrl-C ends a wait on a quiet pipe.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Iterator
from typing import BinaryIO

from shmq import options

READ_SIZE = 65536


def line_batches(fd: int, batch: int, stopped: Callable[[], bool] = lambda: False,
                 linger: float = options.PRODUCE_LINGER, slice_s: float = 0.25) -> Iterator[list[bytes]]:
    """Batches of at most ``batch`` lines read from ``fd``."""
    chunk: list[bytes] = []
    partial: list[bytes] = []  # the pieces of a line whose newline has not come yet
    while True:
        ready, _, _ = select.select([fd], [], [], linger if chunk else slice_s)
        if not ready:
            if chunk:
                yield chunk  # idle: send what we have
                chunk = []
            if stopped():
                break
            continue
        data = os.read(fd, READ_SIZE)
        if not data:
            break
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if partial:
                partial.append(data[start:end])
                chunk.append(b"".join(partial))
                partial = []
            else:
                chunk.append(data[start:end])
            start = end + 1
            if len(chunk) >= batch:
                yield chunk
                chunk = []
        if start < len(data):
            partial.append(data[start:])
        if stopped():
            break
    if partial:
        chunk.append(b"".join(partial))
    if chunk:
        yield chunk


def stream_batches(stream: BinaryIO, batch: int, stopped: Callable[[], bool] = lambda: False
                   ) -> Iterator[list[bytes]]:
    """``line_batches`` of a stream's descriptor; a stream with none (an in-memory one, as a
    test runner passes for stdin) is never idle, so it is read in full batches only."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        fd = -1
    if fd >= 0:
        yield from line_batches(fd, batch, stopped)
        return
    chunk: list[bytes] = []
    for line in stream:
        chunk.append(line[:-1] if line.endswith(b"\n") else line)
        if len(chunk) >= batch or stopped():
            yield chunk
            chunk = []
            if stopped():
                return
    if chunk:
        yield chunk
