"""What runs out on a host: file descriptors, shared memory, disk.

Each exhaustion becomes a typed error that names the limit and what to do about it:
:class:`LimitExceeded` for descriptors (``ulimit -n``) and a full ``/dev/shm`` (its
size), :class:`StorageError` for a full disk (the path).  :func:`exhaustion` is the one
place an ``OSError`` is read for that; the broker logs each one it answers with
(``server.handlers``), and ``shmq serve`` checks its descriptor limit at start
(:func:`raise_fd_limit`).
"""

from __future__ import annotations

import errno
import os
import resource

from shmq.errors import LimitExceeded, ShmqError, StorageError

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives (shmq.core.segment names its objects there)
FD_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE))
SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))
# posix_ipc raises a bare OSError (errno None) for these two, with its own words
_POSIX_IPC_FDS = {"maximum number of files open": errno.EMFILE,
                  "total number of open files": errno.ENFILE}


def errno_of(e: OSError) -> int | None:
    """The errno of an OSError, posix_ipc's descriptor errors (which carry none) included."""
    if e.errno is not None:
        return e.errno
    text = str(e)
    return next((n for words, n in _POSIX_IPC_FDS.items() if words in text), None)


def fd_limits() -> tuple[int, int]:
    """This process's descriptor limit: (soft, hard)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _exhausted(e: LimitExceeded) -> LimitExceeded:
    e.exhausted = True  # type: ignore[attr-defined]  # (the broker logs these: is_exhaustion)
    return e


def is_exhaustion(e: BaseException) -> bool:
    """Was ``e`` made here, for something that ran out?"""
    return bool(getattr(e, "exhausted", False))


def descriptors_exhausted(what: str, err: int = errno.EMFILE) -> LimitExceeded:
    if err == errno.ENFILE:
        return _exhausted(LimitExceeded(f"{what}: the system has no file descriptor left (ENFILE: "
                                        "fs.file-max)"))
    soft, _ = fd_limits()
    return _exhausted(LimitExceeded(f"{what}: this process holds {soft} file descriptors, its limit "
                                    f"(ulimit -n {soft}); raise the limit, or lower --max-connections"))


def shm_full(what: str) -> LimitExceeded:
    try:
        st = os.statvfs(SHM_DIR)
        size = f" ({mib(st.f_bavail * st.f_frsize)} free of {mib(st.f_blocks * st.f_frsize)})"
    except OSError:
        size = ""
    return _exhausted(LimitExceeded(f"{what}: {SHM_DIR} is full{size}; delete queues, or give "
                                    f"{SHM_DIR} more room"))


def disk_full(what: str, path: str, err: int = errno.ENOSPC) -> StorageError:
    try:
        st = os.statvfs(path)
        free = f", {mib(st.f_bavail * st.f_frsize)} free"
    except OSError:
        free = ""
    return StorageError(f"{what}: {path}: {os.strerror(err)}{free}")


def exhaustion(e: OSError, what: str, shm: bool = True, path: str = "") -> ShmqError | None:
    """The typed error for ``e`` when it says something ran out (None otherwise): descriptors
    (``LimitExceeded``); space, in ``/dev/shm`` when ``shm`` (``LimitExceeded``), else on
    the disk at ``path`` (``StorageError``).  ``what``: what was being done."""
    err = errno_of(e)
    if err in FD_ERRNOS:
        return descriptors_exhausted(what, err)
    if err in SPACE_ERRNOS:
        return shm_full(what) if shm else disk_full(what, path or getattr(e, "filename", "") or ".", err)
    return None


def raise_fd_limit(needed: int) -> tuple[int, str | None]:
    """Raise this process's soft descriptor limit to its hard one (children inherit it).
    The soft limit now, and one line to warn with when it is still below ``needed``."""
    soft, hard = fd_limits()
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft >= needed:
        return soft, None
    return soft, (f"the descriptor limit is {soft} (ulimit -n; the hard limit is {hard}), below the "
                  f"{needed} these settings can use: connections past it are refused with "
                  "LIMIT_EXCEEDED; raise it (ulimit -n, LimitNOFILE= under systemd) or lower "
                  "--max-connections")


__all__ = ["descriptors_exhausted", "disk_full", "errno_of", "exhaustion", "fd_limits", "is_exhaustion",
           "raise_fd_limit", "shm_full"]
