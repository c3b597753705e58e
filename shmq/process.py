"""Who is alive: process identity as (pid, start time), proven with psutil.

A pid alone is not an identity (pids are reused); pid plus the process's
start time is.  A process is declared dead only when psutil proves it: the
pid does not exist, is a zombie, or belongs to a process started at another
time.  When we cannot look (AccessDenied), it counts as alive.
"""

from __future__ import annotations

import os

import psutil


def start_ms(pid: int) -> int:
    """The process's start time, ms since the epoch (0 if it does not exist)."""
    try:
        return int(round(psutil.Process(pid).create_time() * 1000))
    except psutil.Error:
        return 0


_me: tuple[int, int] | None = None


def me() -> tuple[int, int]:
    """(pid, start_ms) of this process (recomputed after fork)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, start_ms(pid))
    return _me


def is_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if abs(int(round(proc.create_time() * 1000)) - start) > 1:
            return False  # the pid was reused
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
