"""Shared memory is ours or refused: an object another user made first (a squatter), or
one whose mode lets others in, is never attached, read, used or removed.

The names are predictable (``/dev/shm/shmq.<uid>.default.reg``), so another local user
could create an instance's objects first (a squatter: now only root can make an object
of another uid under our names) and have the broker work inside memory they read and
write.  Every attach checks owner and mode before it reads a byte; a queue's creation
refuses a squatted name; ``shmq doctor`` lists such objects and never removes them.
``tests/core/test_second_uid.py`` runs as the other user.

Objects of another uid need root to make (CI runs as root); the widened-mode cases run
everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import posix_ipc
import pytest

import shmq
from shmq.core import check
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.segment import (
    queue_segment_name,
    registry_name,
    semaphore_names,
    semaphore_path,
    shm_path,
    unlink_semaphore,
    unlink_shm,
)
from shmq.errors import InstanceError
from tests.support.instances import objects, unique_instance
from tests.support.nobody import NOBODY, as_root


def _make_instance(name: str) -> None:
    """An instance made, and left, by another process (so this one attaches it anew)."""
    code = f"from shmq.core.colocated import ShmBroker; ShmBroker({name!r}).close()"
    subprocess.run([sys.executable, "-c", code],
                   check=True)


@pytest.fixture
def other_instance() -> Iterator[str]:
    name = unique_instance()
    _make_instance(name)
    try:
        yield name
    finally:
        path = shm_path(registry_name(name))
        if os.path.exists(path):
            os.chown(path, os.geteuid(), os.getegid())
            os.chmod(path, 0o600)
        ShmBroker(name).destroy()


def _widen(path: str) -> None:
    os.chmod(path, 0o666)


def _give_away(path: str) -> None:
    os.chown(path, NOBODY, NOBODY)


def _squatter(path: str) -> None:
    """What another user would make first, if our names were not ours alone: theirs, 0666."""
    _give_away(path)
    _widen(path)


TAKE = [_widen, pytest.param(_give_away, marks=as_root), pytest.param(_squatter, marks=as_root)]
TAKE_IDS = ["mode", "owner", "squatter"]


@pytest.mark.parametrize("take", TAKE, ids=TAKE_IDS)
def test_a_registry_that_is_not_ours_is_refused_unread(other_instance: str, take: object) -> None:
    path = shm_path(registry_name(other_instance))  # a valid registry, with its magic
    assert os.path.basename(path).startswith(f"shmq.{os.geteuid()}.{other_instance}.")
    take(path)  # type: ignore[operator]
    with pytest.raises(InstanceError, match="refused, nothing of it was read") as info:
        ShmBroker(other_instance)
    assert registry_name(other_instance) in str(info.value)
    assert ("0o666" if take is _widen else f"uid {NOBODY}") in str(info.value)


def _squat(name: str, semaphore: bool, take: object) -> str:
    if semaphore:
        posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0).close()
        path = semaphore_path(name)
    else:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=L.WORD * 64)
        shm.close_fd()
        path = shm_path(name)
    take(path)  # type: ignore[operator]
    return path


@pytest.mark.parametrize("semaphore", [False, True], ids=["segment", "semaphore"])
@pytest.mark.parametrize("take", TAKE, ids=TAKE_IDS)
def test_a_squatted_queue_name_is_refused_and_left_alone(shm_broker: ShmBroker, semaphore: bool,
                                                          take: object) -> None:
    qid = shm_broker._att.registry.w[L.R_NEXT_QUEUE_ID]  # the id the next queue gets
    inst = shm_broker.instance
    name = semaphore_names(inst, qid)[1] if semaphore else queue_segment_name(inst, qid)
    path = _squat(name, semaphore, take)
    try:
        with pytest.raises(InstanceError, match="refused"):
            shm_broker.create_queue("squatted")
        assert os.path.exists(path)  # the squatter's object stays: only its owner may remove it
        assert shm_broker.list_queues() == []  # the reservation went
        if semaphore:  # what the failed creation had made of its own is gone again
            assert not os.path.exists(shm_path(queue_segment_name(inst, qid)))
    finally:
        (unlink_semaphore if semaphore else unlink_shm)(name)
    q = shm_broker.create_queue("squatted")  # once it is gone, the name is usable (a fresh id)
    q.put(b"ok")
    assert q.get(timeout=1).payload == b"ok"


@pytest.mark.parametrize("take", TAKE, ids=TAKE_IDS)
def test_doctor_reports_objects_that_are_not_ours_and_never_removes_them(take: object) -> None:
    inst = unique_instance()
    name = queue_segment_name(inst, 3)
    path = _squat(name, False, take)
    try:
        (acted,) = shmq.reclaim(inst)  # no registry: "leftovers of a dead run", but not ours
        assert acted.foreign == [os.path.basename(path)] and acted.objects == []
        (report,) = shmq.scan(inst)
        assert report.foreign == [os.path.basename(path)] and report.objects == []
        assert "not ours" in report.reason
        assert os.path.exists(path)  # reclaim left it
    finally:
        unlink_shm(name)


@pytest.mark.parametrize("take", TAKE, ids=TAKE_IDS)
def test_an_older_versions_names_are_leftovers_removed_only_if_ours(take: object) -> None:
    """Names without the uid (``shmq.<instance>.*``, made by a version before it was added)
    are an older version's leftovers: ``shmq doctor --clean`` removes them once nobody is
    attached, those that are ours only."""
    inst = unique_instance()
    old = f"/shmq.{inst}."
    for name in (old + "reg", old + "q1"):
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=L.WORD * 64).close_fd()
    posix_ipc.Semaphore(old + "q1.ne", posix_ipc.O_CREX, mode=0o600, initial_value=0).close()
    theirs = os.path.basename(_squat(old + "q2", False, take))
    ours = {f"shmq.{inst}.reg", f"shmq.{inst}.q1", f"sem.shmq.{inst}.q1.ne"}
    try:
        (report,) = shmq.scan(inst)
        assert (report.uid, report.alive, report.foreign) == (None, False, [theirs])
        assert set(report.objects) == ours
        assert report.reason.startswith("names of an older shmq version")
        assert inst not in check.instances()  # another layout: not checked as ours
        (acted,) = shmq.reclaim(inst)
        assert acted.uid is None and set(acted.objects) == ours
        assert objects(inst) == [theirs]  # ours went; the other user's stays
    finally:
        for name in (old + "reg", old + "q1", old + "q2"):
            unlink_shm(name)
        unlink_semaphore(old + "q1.ne")
