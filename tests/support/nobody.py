"""Another local user: a forked child that drops root to uid and gid ``NOBODY``."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Generator
from multiprocessing.connection import Connection
from typing import Any

import pytest

NOBODY = 65534  # the second uid (and gid) the tests become: a forked child drops root to it
importlib.import_module("encodings.idna")  # a TCP connect imports it; a child of another uid can't
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid needs root (CI is root)")


def _nobody_main(conn: Connection, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        got = target(*args)
        if not isinstance(got, Generator):
            conn.send(got)
            return
        try:
            step = next(got)
            while True:  # each value it yields goes to the parent; the parent's reply is sent in
                conn.send(step)
                step = got.send(conn.recv())
        except StopIteration as done:
            conn.send(done.value)  # and what it returns, at the end
    except Exception as e:  # noqa: BLE001 - the parent reports it
        conn.send(f"raised {type(e).__name__}: {e}")


class AsNobody:
    """``target(*args)`` in a forked child that became uid and gid ``NOBODY``.  Its return
    value comes back through a pipe (``result``); so does each value a generator yields,
    and ``reply`` resumes it (with a value) until it returns.  An exception comes back as
    ``"raised Type: message"``."""

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_nobody_main, args=(theirs, target, args))
        self.proc.start()
        theirs.close()

    def result(self, timeout: float = 60) -> Any:
        assert self._conn.poll(timeout), "the child of another uid did not answer in time"
        return self._conn.recv()

    def reply(self, value: Any = None) -> None:
        self._conn.send(value)

    def close(self) -> int | None:
        """Wait for the child (killed if it hangs); its exit code."""
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()
        return self.proc.exitcode

    def __enter__(self) -> AsNobody:
        return self

    def __exit__(self, *exc: object) -> None:
        code = self.close()
        assert exc[0] is not None or code == 0, f"the child of another uid exited with {code}"


def as_nobody(target: Callable[..., Any], *args: Any) -> Any:
    """What ``target(*args)`` returns (or ``"raised Type: message"``) run as ``NOBODY``."""
    with AsNobody(target, *args) as child:
        return child.result()
