"""The names ``import shmq`` gives, pinned (as httpx pins its own): adding, removing or
renaming one is a change users see, and this test is where it is decided."""

from __future__ import annotations

import subprocess
import sys
import types

import shmq

PUBLIC = [
    "AuthError", "Broker", "BrokerInfo", "ConnectionLost", "Duplicate", "Empty", "Full", "GroupExists",
    "GroupNotFound", "InstanceError", "InstanceNotFound", "InstanceReport", "InvalidArgument", "InvalidName",
    "LimitExceeded", "Message", "MessageTooLarge", "NotPrimary", "Origin", "ProtocolError", "Queue",
    "QueueConfig", "QueueExists", "QueueInfo", "QueueNotFound", "ShmqError", "StaleAck", "Status",
    "StorageError", "Timeout", "aio", "connect", "mp", "reclaim", "scan",
]


def test_shmq_exports_exactly_the_pinned_names() -> None:
    assert shmq.__all__ == PUBLIC


def test_every_exported_name_resolves_and_is_listed_by_dir() -> None:
    for name in PUBLIC:
        assert getattr(shmq, name) is not None, name
    assert set(PUBLIC) <= set(dir(shmq))
    assert isinstance(shmq.aio, types.ModuleType) and shmq.aio.__name__ == "shmq.client.aio"
    assert isinstance(shmq.__version__, str)


def test_no_other_public_name_is_in_the_namespace() -> None:
    """Once every lazy name is loaded, what the module holds without an underscore is the
    pinned names, the subpackages Python set on it as they were imported, and the typing
    helpers of its source."""
    for name in PUBLIC:
        getattr(shmq, name)
    subpackages = {n for n, v in vars(shmq).items() if isinstance(v, types.ModuleType)
                   and v.__name__ == f"shmq.{n}"}
    extra = {n for n in vars(shmq) if not n.startswith("_")} - set(PUBLIC) - subpackages
    assert extra == {"Any", "TYPE_CHECKING", "annotations"}


def test_from_shmq_import_aio_does_not_load_the_shared_memory_core() -> None:
    code = "import sys\nfrom shmq import aio\nassert aio.connect\nassert 'posix_ipc' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
