"""Who is alive: process identity as (pid, start time in clock ticks since boot).

A pid alone is not an identity (pids are reused); pid plus the process's start
time is.  The start time is field 22 of ``/proc/<pid>/stat``: clock ticks since
boot, set once by the kernel, exact and monotonic, so it never moves when the
wall clock is stepped (psutil's ``create_time()`` adds the boot time, which is
derived from the wall clock, and did move).  A process is declared dead only
when that proves it: the pid does not exist, is a zombie, or belongs to a
process started at another tick.  When we cannot look (permission), it counts
as alive.
"""

from __future__ import annotations

import os

_PROC = "/proc"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of a pid, None when it does not exist."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = raw[raw.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])  # fields 3 and 22 of proc(5)


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 if it does not exist)."""
    if pid <= 0:
        return 0
    try:
        st = _stat(pid)
    except PermissionError:
        return 0
    return st[1] if st else 0


_me: tuple[int, int] | None = None


def me() -> tuple[int, int]:
    """(pid, start ticks) of this process (recomputed after fork)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, start_ticks(pid))
    return _me


def is_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        st = _stat(pid)
    except PermissionError:
        return True
    return st is not None and st[1] == start and st[0] != "Z"


def age(start: int) -> float:
    """Seconds since a process that started ``start`` clock ticks after boot started."""
    with open(f"{_PROC}/uptime", "rb") as f:
        since_boot = float(f.read().split()[0])
    return max(0.0, since_boot - start / os.sysconf("SC_CLK_TCK"))
