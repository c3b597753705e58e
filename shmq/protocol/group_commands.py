"""The group commands of both TCP clients (``shmq.client.tcp``, ``shmq.client.aio``), as
``shmq.protocol.commands``' others.

Creating (at "earliest", "latest" or a time), deleting, listing, committing and seeking
by time; a bad argument raises here, before anything is sent.  A group that exists already
is :class:`~shmq.errors.GroupExists`: the broker answers QUEUE_EXISTS, the one code the wire
has for both (``docs/protocol.md``), and a group's create is what says it is the group.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from shmq.errors import GroupExists, QueueExists
from shmq.protocol.codec import Frame, T
from shmq.protocol.commands import Handle, call
from shmq.protocol.connection import Request
from shmq.seektime import Start, When, start_ns, to_ns


def create_group(q: Handle[Any], name: str, start: Start) -> Request[None]:
    """GROUP_JOIN at "earliest" / "latest"; GROUP_SEEK (``create`` 1) at a time."""
    at = start_ns(start)
    if at is None:
        req = call(T.GROUP_JOIN, T.GROUP_JOIN_OK, queue=q.name, group=name, start=int(start == "latest"))
    else:
        req = call(T.GROUP_SEEK, T.GROUP_SEEK_OK, queue=q.name, group=name, timestamp_ns=at, create=1)
    return Request(req.encode, req.args, partial(_group_created, req.parse), req.ctx)


def _group_created(parse: Callable[[Frame, Any], None], f: Frame, ctx: Any) -> None:
    """``parse`` of the answer to a group's create, whose QUEUE_EXISTS is the group's."""
    try:
        parse(f, ctx)
    except QueueExists as e:
        raise GroupExists(str(e)) from None


def delete_group(q: Handle[Any], name: str) -> Request[None]:
    return call(T.GROUP_DELETE, T.GROUP_DELETE_OK, queue=q.name, group=name)


def groups(q: Handle[Any]) -> Request[list[str]]:
    return call(T.GROUP_LIST, T.GROUP_LIST_OK, "groups", queue=q.name)


def commit(q: Handle[Any], group: str, offset: int) -> Request[None]:
    return call(T.GROUP_COMMIT, T.GROUP_COMMIT_OK, queue=q.name, group=group, offset=offset)


def seek(q: Handle[Any], group: str, when: When) -> Request[int]:
    """GROUP_SEEK: the group moves to the first message at or after ``when``; the result is that offset."""
    return call(T.GROUP_SEEK, T.GROUP_SEEK_OK, "offset", queue=q.name, group=group,
                timestamp_ns=to_ns(when), create=0)


__all__ = ["commit", "create_group", "delete_group", "groups", "seek"]
