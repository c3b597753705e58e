"""Names and files of this session's instances: every test gets its own instance name
(``t<pid>x<n>``), so tests run in parallel (pytest-xdist) without seeing each other, and the
session's end finds what any of them left in /dev/shm or in its temporary folder."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import psutil

from shmq.core.segment import parse_object_name, registry_name, shm_path

_counter = itertools.count()
SESSION_PREFIX = f"t{os.getpid()}x"

_tmp_root: list[str] = []  # this session's folder for brokers' data dirs, made on first use


def session_tmp(prefix: str) -> str:
    """A new folder for this session's temporary files: under one folder that the session
    removes at its end, so a test that stops no broker (or kills one) leaves nothing in /tmp."""
    if not _tmp_root:
        _tmp_root.append(tempfile.mkdtemp(prefix=f"shmq-{SESSION_PREFIX}-"))
    return tempfile.mkdtemp(prefix=prefix, dir=_tmp_root[0])


def remove_session_tmp() -> None:
    """Remove the folder of :func:`session_tmp` (at the session's end), if one was made."""
    if _tmp_root:
        shutil.rmtree(_tmp_root[0], ignore_errors=True)


def unique_instance() -> str:
    return f"{SESSION_PREFIX}{next(_counter)}"


def leftovers(prefix: str = SESSION_PREFIX) -> list[str]:
    """The objects in /dev/shm of every instance whose name starts with ``prefix``, of any
    uid (a test's child that became another user names its objects with that user's)."""
    return sorted(n for n in os.listdir("/dev/shm")
                  if (m := parse_object_name(n)) and m["inst"].startswith(prefix))


def objects(instance: str) -> list[str]:
    """The objects in /dev/shm of ``instance`` (that name exactly), of any uid."""
    return [n for n in leftovers(instance) if (m := parse_object_name(n)) and m["inst"] == instance]


def reg_path(instance: str) -> str:
    """The file of our ``instance``'s registry in /dev/shm."""
    return shm_path(registry_name(instance))


def remove_shm(instance: str) -> None:
    """What a reboot does to our shared memory."""
    for n in leftovers(instance):
        os.unlink(f"/dev/shm/{n}")


def mp_helper(p: psutil.Process) -> bool:
    """multiprocessing's own helpers (forkserver, resource tracker) live as long as we do."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return True
    return "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd
