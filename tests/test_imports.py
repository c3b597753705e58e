"""What ``import shmq`` loads: the package stays light (no posix_ipc until shared memory is
used), and the names it loads lazily are still there."""

from __future__ import annotations

import subprocess
import sys

import pytest

import shmq


@pytest.mark.parametrize("module", ["shmq", "shmq.client.tcp", "shmq.client.aio",
                                    "shmq.protocol.commands", "shmq.protocol.connection"])
def test_the_package_and_the_tcp_clients_do_not_load_posix_ipc(module: str) -> None:
    code = f"import {module}, sys; assert 'posix_ipc' not in sys.modules, 'import {module} loaded posix_ipc'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_names_are_the_cleanup_functions() -> None:
    from shmq.core import cleanup

    assert shmq.reclaim is cleanup.reclaim and callable(shmq.reclaim)
    assert shmq.scan is cleanup.scan
    assert shmq.InstanceReport is cleanup.InstanceReport
    assert {"reclaim", "scan", "InstanceReport"} <= set(shmq.__all__) <= set(dir(shmq))


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        shmq.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("shmq.no_such_name did not raise AttributeError")
