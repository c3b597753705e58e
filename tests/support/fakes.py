"""Stand-ins: a queue handle with no connection, and durable marks the test reaches."""

from __future__ import annotations

import threading
from typing import Any

import shmq
from shmq.core.durability import Mark
from shmq.server.core import Core


class HeldMark:
    """A stand-in for a queue's durable marks (``durability.Mark`` waits on it) and the
    event loop of ``core``'s held answers: ``mark()`` is a mark not yet reached; ``reach()``
    reaches it, waits for the held answer to be posted to the loop and runs it there."""

    name = "stand-in"
    WORD, END = 28, 5

    def __init__(self, core: Core) -> None:
        self.w = [0] * 64
        self.moved = threading.Event()
        self.posted: list[tuple[Any, ...]] = []
        self.done = threading.Event()
        core.held._post = self._post  # type: ignore[method-assign]  # (the loop's call_soon_threadsafe)

    def wait(self, word: int, end: int, deadline: float | None) -> int:
        assert self.moved.wait(10)
        return self.w[word]

    def _post(self, fn: Any, *args: Any) -> None:
        self.posted.append((fn, *args))
        self.done.set()

    def mark(self) -> Mark:
        return Mark(self, self.WORD, self.END)  # type: ignore[arg-type]

    def reach(self) -> None:
        self.w[self.WORD] = self.END
        self.moved.set()
        assert self.done.wait(10)
        fn, *args = self.posted[0]
        fn(*args)  # on the loop


class FakeHandle:
    """A queue handle as ``shmq.protocol.commands`` sees it (``commands.Handle``), with no connection
    behind it: for building requests and parsing answers in the tests."""

    name = "q"
    name_bytes = b"q"
    message_class = shmq.Message
    broker: object = object()
