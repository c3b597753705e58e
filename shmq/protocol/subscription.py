"""One push subscription as its client sees it (``Feed``), for both TCP clients.

The SUBSCRIBE request, then each frame of the subscription: its answer first, then the
pushed leases, made into messages; and what gives back the leases received and never
handed out when it ends.  The frames are ``shmq.protocol.commands``' (the one place client
commands are written).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Generic

from shmq.protocol.codec import Frame, T
from shmq.protocol.commands import (
    LEASES,
    Batch,
    Handle,
    M,
    call,
    give_back,
    pushed_messages,
    pushed_records,
    visibility_ms,
)


class Feed(Generic[M]):
    """One subscription as its client sees it: the SUBSCRIBE (``request``), then each frame
    of the subscription filed with ``take`` -- its answer first, then pushed leases, made
    messages in ``ready`` (received, not handed out yet; the driver hands them out with
    ``ready.popleft()``, telling the connection each time: ``handed_out``).

    ``refused``: the broker answered the SUBSCRIBE with an error (it made no
    subscription: there is nothing to unsubscribe)."""

    __slots__ = ("q", "group", "credit", "request", "ready", "subscribed", "refused")

    def __init__(self, q: Handle[M], group: str, credit: int, visibility_timeout: float | None) -> None:
        self.q = q
        self.group = group
        self.credit = credit
        self.request = call(T.SUBSCRIBE, T.SUBSCRIBE_OK, queue=q.name, group=group, credit=credit,
                            visibility_ms=visibility_ms(visibility_timeout))
        self.ready: deque[M] = deque()
        self.subscribed = False
        self.refused = False

    def take(self, f: Frame | BaseException) -> None:
        """File a frame of the subscription; an ERROR (or the error the driver failed the
        subscription's waiter with, on a lost connection) raises."""
        if isinstance(f, BaseException):
            raise f
        if self.subscribed:
            self.ready.extend(pushed_messages(self.q, self.group, f))
            return
        if f.type == T.ERROR:
            self.refused = True
        self.request.parse(f, self.request.ctx)  # SUBSCRIBE_OK, or raises
        self.subscribed = True

    def leftovers(self, frames: Iterable[Frame | BaseException]) -> Batch[None]:
        """What gives back the leases received and not handed out: those ``ready``, and
        those of ``frames`` (what was still waiting once the broker answered UNSUBSCRIBE)."""
        leases = [(m.offset, m.deliveries) for m in self.ready]
        self.ready.clear()
        for f in frames:
            if isinstance(f, Frame) and f.type in LEASES:
                leases += zip(*pushed_records(f)[:2], strict=True)
        return give_back(self.q.name, self.group, leases)


__all__ = ["Feed"]
