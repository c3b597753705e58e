"""What a deleted durable queue leaves in the data dir: nothing.  Its journal goes (the
journal process sweeps it), and a data dir that shmq chose itself (``~/.local/share/shmq/
INSTANCE``) goes too once it is empty; one that was given stays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import shmq
from shmq.server.journaler import default_data_dir, remove_retired
from tests.support.instances import unique_instance
from tests.support.server import Server
from tests.support.wait import wait_until


def _tree(root: Path) -> list[str]:
    """Every file and folder under ``root``, relative to it (a folder removed meanwhile: not there)."""
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_remove_retired_removes_shmqs_own_folder_once_empty_and_never_a_given_one(tmp_path: Path) -> None:
    given, own = tmp_path / "given", tmp_path / "xdg" / "shmq" / "inst"
    for root in (given, own):
        (root / ".deleted-1-q").mkdir(parents=True)
        (root / ".deleted-1-q" / "00000000000000000000.log").write_bytes(b"x")
    remove_retired(given)
    assert given.is_dir() and _tree(given) == []
    (tmp_path / "xdg" / "shmq" / "other").mkdir()  # another instance's: the shmq folder stays
    remove_retired(own, own=True)
    assert not own.exists() and _tree(tmp_path / "xdg") == ["shmq", "shmq/other"]
    (tmp_path / "xdg" / "shmq" / "other" / "q-kept").mkdir()
    remove_retired(tmp_path / "xdg" / "shmq" / "other", own=True)  # a journal in it: nothing goes
    assert _tree(tmp_path / "xdg") == ["shmq", "shmq/other", "shmq/other/q-kept"]


def _create_and_delete(srv: Server, name: str) -> None:
    with shmq.connect(srv.url, token=srv.token) as b:
        b.create_queue(name, durability="always").put(b"x")
        assert Path(srv.data_dir, f"q-{name}").is_dir()
        b.delete_queue(name)


def test_deleting_the_last_durable_queue_leaves_a_given_data_dir_empty(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = Server(workers=1, data_dir=str(data))
    try:
        _create_and_delete(srv, "dq")
        wait_until(lambda: _tree(data) == [], timeout=30)  # the journal process sweeps it
        assert data.is_dir()  # given: it stays
    finally:
        assert srv.stop() == 0
    assert _tree(tmp_path) == ["data"]


def test_deleting_the_last_durable_queue_removes_shmqs_own_data_dir(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))  # the broker's default: tmp_path/shmq/INSTANCE
    monkeypatch.delenv("SHMQ_DATA_DIR", raising=False)
    inst = unique_instance()
    srv = Server(workers=1, instance=inst, data_dir=str(default_data_dir(inst)))
    try:
        _create_and_delete(srv, "dq")
        wait_until(lambda: _tree(tmp_path) == [], timeout=30)  # no empty folder of shmq's is left
        _create_and_delete(srv, "again")  # and the next durable queue makes it again
        wait_until(lambda: _tree(tmp_path) == [], timeout=30)
    finally:
        assert srv.stop() == 0
