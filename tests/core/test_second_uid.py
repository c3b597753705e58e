"""A second local user, for real: a forked child drops root to uid 65534 and tries.

Every shared-memory object's name carries its maker's effective uid
(``shmq.<uid>.<instance>.*``), so another user's ``shm://NAME`` is an instance of its own,
beside ours, and nothing it creates can take our names.  What stands between it and ours:
our objects are 0600 and ours (it cannot open them, ``InstanceError`` says whose they
are), the broker's TCP port wants the token, and its Unix socket is 0600.  ``shmq doctor``
on either side lists the other's objects and never touches them."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import posix_ipc
import pytest

import shmq
from shmq.core.colocated import ShmBroker
from shmq.core.segment import (
    Mapping,
    describe_user,
    instance_prefix,
    objects_of,
    open_semaphore,
    queue_segment_name,
    registry_name,
    semaphore_names,
    shm_path,
    unlink_semaphore,
    unlink_shm,
)
from shmq.errors import InstanceError
from tests.support.connect import try_connect
from tests.support.instances import objects
from tests.support.nobody import NOBODY, AsNobody, as_nobody, as_root
from tests.support.server import Server

pytestmark = as_root


@pytest.fixture
def ours(instance: str) -> Iterator[ShmBroker]:
    """Our instance, with a queue ``q`` holding one message; afterwards nothing of the
    instance, of either uid, is left in /dev/shm."""
    b = ShmBroker(instance)
    b.create_queue("q").put(b"ours")
    try:
        yield b
    finally:
        b.destroy()
        assert objects(instance) == []


def _theirs(instance: str) -> list[str]:
    """The objects of ``instance`` under the other user's names."""
    return [n for n in objects(instance) if n.startswith((f"shmq.{NOBODY}.", f"sem.shmq.{NOBODY}."))]


def _try(attach: Any, *args: Any) -> str:
    try:
        attach(*args)
        return "attached"
    except InstanceError as e:
        return str(e)


def _attach_ours(instance: str, uid: int) -> dict[str, Any]:
    """As the other user: open our objects by their names, then ``shm://instance``."""
    prefix = "/" + instance_prefix(instance, uid)
    tried = {name: _try(Mapping.attach, name) for name in (prefix + "reg", prefix + "q1")}
    tried[prefix + "q1.ne"] = _try(open_semaphore, prefix + "q1.ne", False)
    b = ShmBroker(instance)  # the same name: the other user's own instance, an empty one
    try:
        return {"tried": tried, "queues": [q.name for q in b.list_queues()]}
    finally:
        b.destroy()


def test_the_other_uid_cannot_attach_ours(ours: ShmBroker) -> None:
    got = as_nobody(_attach_ours, ours.instance, os.geteuid())
    assert isinstance(got, dict), got
    assert got["queues"] == []  # shm://NAME of another user is not ours: nothing of ours seen
    for name, why in got["tried"].items():
        assert name in why and f"owned by {describe_user(os.geteuid())}" in why, why
        assert "refused" in why
    assert [m.payload for m in ours.queue("q").get_many(10, timeout=1)] == [b"ours"]  # nothing taken
    assert _theirs(ours.instance) == []


def _own_instance(instance: str) -> Generator[dict[str, Any], None, dict[str, Any]]:
    """As the other user: an instance of the same name as ours, a queue of the same name."""
    b = ShmBroker(instance)
    q = b.create_queue("q")
    q.put_many([b"theirs-1", b"theirs-2"])
    m = q.get(timeout=5)
    m.ack()
    doctor = {r.uid: (r.alive, r.foreign, r.objects) for r in shmq.scan(instance)}
    yield {"got": m.payload, "objects": objects_of(instance), "doctor": doctor,
           "reclaimed": [r.uid for r in shmq.reclaim(instance)]}
    # the parent has used ours meanwhile: what is left of this queue is its own
    left = q.get_many(10, timeout=1)
    q.ack_many(left)
    b.destroy()
    return {"left": [m.payload for m in left], "objects": objects_of(instance)}


def test_the_other_uid_runs_its_own_instance_of_the_same_name_beside_ours(ours: ShmBroker) -> None:
    inst, me = ours.instance, os.geteuid()
    mine = objects_of(inst)
    with AsNobody(_own_instance, inst) as child:
        first = child.result()
        assert isinstance(first, dict), first
        assert first["got"] == b"theirs-1"
        assert first["objects"] == _theirs(inst) and len(first["objects"]) == 6  # reg, q1, 4 semaphores
        # its doctor sees ours as another user's: listed, never opened nor removed
        assert first["doctor"][me] == (True, mine, [])
        assert first["doctor"][NOBODY][0] is True and first["doctor"][NOBODY][1] == []
        assert first["reclaimed"] == []
        assert objects_of(inst) == mine
        # ours keeps working beside it, and none of its messages appear in ours
        q = ours.queue("q")
        q.put(b"ours-2")
        got = q.get_many(10, timeout=1)
        q.ack_many(got)
        assert [m.payload for m in got] == [b"ours", b"ours-2"]
        with pytest.raises(shmq.Empty):
            q.get(timeout=0)
        assert [i.name for i in ours.list_queues()] == ["q"]
        (theirs,) = [r for r in shmq.scan(inst) if r.uid == NOBODY]
        assert theirs.foreign == first["objects"] and theirs.objects == []
        assert f"names of {describe_user(NOBODY)}" in theirs.reason and "never touched" in theirs.reason
        assert shmq.reclaim(inst) == []  # ours is live; theirs is not ours, even for root
        assert _theirs(inst) == first["objects"]
        child.reply()
        last = child.result()
    assert last == {"left": [b"theirs-2"], "objects": []}  # it cleaned up after itself
    assert _theirs(inst) == [] and objects_of(inst) == mine


def _squat_own_names(instance: str) -> Generator[list[str], None, list[str]]:
    """As the other user: what squatted ours before the names carried the uid, 0666."""
    shm_names = [registry_name(instance), queue_segment_name(instance, 1)]
    sem_names = list(semaphore_names(instance, 1))
    for name in shm_names:
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096).close_fd()
    for name in sem_names:
        posix_ipc.Semaphore(name, posix_ipc.O_CREX).close()
    for n in objects_of(instance):
        os.chmod(shm_path(n), 0o666)
    yield objects_of(instance)
    for name in shm_names:
        unlink_shm(name)
    for name in sem_names:
        unlink_semaphore(name)
    return objects_of(instance)


def test_what_the_other_uid_makes_under_its_names_never_touches_ours(instance: str) -> None:
    with AsNobody(_squat_own_names, instance) as child:
        squatted = child.result()
        assert squatted == _theirs(instance) and len(squatted) == 6, squatted
        b = ShmBroker(instance)  # the squat did not block ours: its names are not ours
        try:
            q = b.create_queue("q")  # id 1, as the squatted segment's: a name of our own
            q.put(b"ours")
            assert q.get(timeout=1).payload == b"ours"
            assert shmq.reclaim(instance) == [] and _theirs(instance) == squatted
        finally:
            b.destroy()
        assert objects(instance) == squatted  # ours gone, theirs left to their owner
        child.reply()
        assert child.result() == []
    assert objects(instance) == []


@pytest.fixture(scope="module")
def unix_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    folder = tmp_path_factory.mktemp("sock")
    folder.chmod(0o755)  # the folder lets the other user in: only the socket's mode stops it
    path = folder / "broker.sock"
    srv = Server(workers=1, extra=["--unix", str(path)])  # a token of its own, in our runtime folder
    try:
        yield srv, f"unix://{path}"
    finally:
        assert srv.stop() == 0


def test_the_other_uid_needs_our_token_over_tcp(unix_broker: tuple[Server, str]) -> None:
    srv, _ = unix_broker
    for token in (None, "", "wrong"):  # None: it looks in its own runtime folder, finds none
        assert as_nobody(try_connect, srv.url, token) == "refused", token
    assert as_nobody(try_connect, srv.url, srv.token) == "admitted"  # the token is the key
    assert try_connect(srv.url, None) == "admitted"  # ours reads it from our runtime folder


def test_the_other_uid_cannot_open_our_unix_socket(unix_broker: tuple[Server, str]) -> None:
    srv, url = unix_broker
    path = Path(url[len("unix://"):])
    assert path.stat().st_mode & 0o777 == 0o600
    got = as_nobody(try_connect, url, srv.token)  # even with the token: the kernel says no
    assert got.startswith("ConnectionLost") and "ermission denied" in got, got
    assert try_connect(url, "") == "admitted"  # ours needs no token there
