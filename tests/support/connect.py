"""Connecting, typed by transport, and the one-message round trips the auth tests make."""

from __future__ import annotations

from typing import Any

import shmq
from shmq.client.tcp import TcpBroker
from shmq.core.colocated import ShmBroker


def connect_shm(url: str, **kwargs: Any) -> ShmBroker:
    """``shmq.connect`` for a ``shm://`` URL, typed as the broker it returns there, for a
    test that looks at the shared-memory handle's own parts (``reap``, ``_ring``, ...)."""
    b = shmq.connect(url, **kwargs)
    assert isinstance(b, ShmBroker), b
    return b


def connect_tcp(url: str, token: str | None = None, **kwargs: Any) -> TcpBroker:
    """``shmq.connect`` for a ``tcp://`` URL, typed as the broker it returns there, for a
    test that looks at the TCP handle's own parts (``worker``, ``subscribe``, ...)."""
    b = shmq.connect(url, token, **kwargs)
    assert isinstance(b, TcpBroker), b
    return b


def try_connect(url: str, token: str | None) -> str:
    """Connect and list the queues: ``"admitted"``, ``"refused"`` (``AuthError``), or the error."""
    try:
        with shmq.connect(url, token=token, connect_timeout=5) as b:
            b.list_queues()
        return "admitted"
    except shmq.AuthError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - the caller reports it
        return f"{type(e).__name__}: {e}"


async def aio_round_trip(url: str, token: str, name: str) -> None:
    """One message through a new queue ``name`` with the asyncio client, and the queue gone."""
    from shmq.client import aio
    b = await aio.connect(url, token=token)
    try:
        q = await b.create_queue(name)
        assert await q.put(b"hello") == 0
        m = await q.get(timeout=5)
        assert m.payload == b"hello"
        await m.ack()
        await b.delete_queue(name)
    finally:
        await b.close()
