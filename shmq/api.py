"""The interface every transport implements: Broker, Queue, Message.

``shm://`` (``shmq.shm``) implements it over shared memory; ``tcp://``
implements the same methods over the wire protocol.  Tests run one suite
against both.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from . import options

Payload = bytes | bytearray | memoryview | str


@dataclass(frozen=True)
class QueueConfig:
    """The limits a queue is created with (``create_queue`` keyword arguments)."""

    capacity: int = options.DEFAULT_CAPACITY
    max_bytes: int = options.DEFAULT_MAX_BYTES
    max_message_size: int = options.DEFAULT_MAX_MESSAGE_SIZE
    visibility_timeout: float = options.DEFAULT_VISIBILITY_TIMEOUT
    max_deliveries: int = options.DEFAULT_MAX_DELIVERIES
    max_groups: int = options.DEFAULT_MAX_GROUPS
    durability: str = options.DEFAULT_DURABILITY


@dataclass(frozen=True)
class QueueInfo:
    name: str
    is_dlq: bool
    config: QueueConfig


@dataclass(frozen=True)
class Origin:
    """Where a dead-lettered message came from."""

    queue: str
    offset: int
    group: str
    reason: str
    deliveries: int


class Message(tuple):  # type: ignore[type-arg]
    """One delivered (or read) message.

    ``ack()``, ``nack(delay)``, ``touch()`` and ``dead_letter()`` settle the
    delivery.  They are valid while this delivery's lease is held, and raise
    ``StaleAck`` once it is not (settled already, or it expired and the message
    was taken back).  A message from ``read()`` is not a lease.

    A tuple underneath, so that building one costs little on the hot path:
    ``(queue handle, group index, group, offset, deliveries, payload, meta, timestamp_ns)``.
    """

    __slots__ = ()

    _q = property(itemgetter(0))
    _gi = property(itemgetter(1))
    group = property(itemgetter(2), doc="the group it was delivered to (None for read())")
    offset = property(itemgetter(3), doc="the message's 64-bit offset in its queue")
    deliveries = property(itemgetter(4), doc="1 on first delivery, +1 on each redelivery")
    payload = property(itemgetter(5), doc="bytes")
    meta = property(itemgetter(6), doc="metadata bytes (dead-letter origin)")
    timestamp_ns = property(itemgetter(7), doc="producer's wall clock, ns since the epoch")

    @property
    def queue(self) -> str:
        return str(self[0].name)

    @property
    def timestamp(self) -> float:
        """Producer's wall-clock time, seconds since the epoch."""
        return self[7] / 1e9

    @property
    def redelivered(self) -> bool:
        return self[4] > 1

    @property
    def text(self) -> str:
        return bytes(self[5]).decode()

    @property
    def origin(self) -> Origin | None:
        """For a message in a dead-letter queue: where it came from."""
        if not self[6]:
            return None
        d = json.loads(self[6])
        return Origin(d["queue"], d["offset"], d["group"], d["reason"], d["deliveries"])

    def ack(self) -> None:
        self[0]._ack(self)

    def nack(self, delay: float = 0.0) -> None:
        """Give the message back; it is delivered again after ``delay`` seconds."""
        self[0]._settle(self, 1, delay)

    def touch(self, visibility_timeout: float | None = None) -> None:
        """Extend the lease by the visibility timeout (or the given seconds) from now."""
        self[0]._settle(self, 2, visibility_timeout)

    def dead_letter(self) -> None:
        """Send the message to the dead-letter queue now."""
        self[0]._settle(self, 3, 0.0)

    def __repr__(self) -> str:
        return (f"Message(queue={self.queue!r}, offset={self[3]}, group={self[2]!r}, "
                f"deliveries={self[4]}, payload={bytes(self[5][:32])!r})")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class Queue(ABC):
    name: str

    @abstractmethod
    def put(self, payload: Payload, block: bool = True, timeout: float | None = None) -> int: ...

    @abstractmethod
    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None) -> list[int]:
        """Append a batch atomically; with ``producer`` and ``seq``, at most once per
        (producer, seq): a sequence not above the last one written raises ``Duplicate``."""

    @abstractmethod
    def get(self, group: str = options.DEFAULT_GROUP, block: bool = True, timeout: float | None = None,
            visibility_timeout: float | None = None) -> Message: ...

    @abstractmethod
    def get_many(self, max_messages: int, group: str = options.DEFAULT_GROUP, block: bool = True,
                 timeout: float | None = None, visibility_timeout: float | None = None) -> list[Message]: ...

    @abstractmethod
    def ack_many(self, messages: Iterable[Message]) -> None: ...

    @abstractmethod
    def read(self, offset: int, max_messages: int = 1) -> list[Message]: ...

    @abstractmethod
    def create_group(self, name: str, start: str = "earliest") -> None: ...

    @abstractmethod
    def delete_group(self, name: str) -> None: ...

    @abstractmethod
    def groups(self) -> list[str]: ...

    @abstractmethod
    def commit(self, group: str, offset: int) -> None: ...

    @abstractmethod
    def purge(self) -> int: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def _settle(self, msg: Message, action: int, arg: float | None) -> None: ...

    def _ack(self, msg: Message) -> None:
        self._settle(msg, 0, 0.0)


class Broker(ABC):
    url: str

    @abstractmethod
    def create_queue(self, name: str, **limits: Any) -> Queue: ...

    @abstractmethod
    def queue(self, name: str) -> Queue: ...

    @abstractmethod
    def list_queues(self) -> list[QueueInfo]: ...

    @abstractmethod
    def delete_queue(self, name: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
