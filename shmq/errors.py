"""Typed errors.  Each carries the DMS status code where one applies.

The status codes are DMS's (``docs/protocol.md``); codes from 32 up are
shmq's own.  ``code`` is stable and machine-readable, the message is for humans.
"""

from __future__ import annotations

import queue as _stdlib_queue
from enum import IntEnum


class Status(IntEnum):
    OK = 0
    QUEUE_FULL = 1
    QUEUE_NOT_FOUND = 2
    QUEUE_EXISTS = 3
    TIMEOUT = 4
    PROTOCOL_ERROR = 5
    BAD_MAGIC = 6
    VERSION_MISMATCH = 7
    PAYLOAD_TOO_LARGE = 8
    INVALID_TYPE = 9
    INTERNAL = 10
    # shmq's own
    EMPTY = 32
    STALE_ACK = 33
    INVALID_NAME = 34
    INVALID_ARGUMENT = 35
    LIMIT_EXCEEDED = 36
    GROUP_NOT_FOUND = 37
    INSTANCE_ERROR = 38
    AUTH_FAILED = 39
    DUPLICATE = 40
    STORAGE = 41
    UNAVAILABLE = 42  # the broker cannot be reached, the connection was lost, or its other end went silent
    NOT_PRIMARY = 43  # a standby (``shmq serve --replica-of``) takes no writes; the message names the primary


class ShmqError(Exception):
    """Base of every shmq error."""

    code: Status = Status.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (str(self),))


class Full(ShmqError, _stdlib_queue.Full):
    """The queue is full (capacity or bytes)."""

    code = Status.QUEUE_FULL


class Empty(ShmqError, _stdlib_queue.Empty):
    """No message is available."""

    code = Status.EMPTY


class Timeout(ShmqError, TimeoutError):
    """The operation did not complete in time."""

    code = Status.TIMEOUT


class QueueNotFound(ShmqError, KeyError):
    """No queue of that name exists."""

    code = Status.QUEUE_NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class QueueExists(ShmqError):
    """A queue of that name already exists."""

    code = Status.QUEUE_EXISTS


class GroupExists(QueueExists):
    """A consumer group of that name already exists on the queue.

    A :class:`QueueExists` (what it was before it had a class of its own, so code that
    catches that keeps working), with the same status code: the wire has one code,
    QUEUE_EXISTS, for both; a client tells them apart by the request (GROUP_JOIN, or
    GROUP_SEEK creating a group: ``shmq.protocol.group_commands``)."""


class MessageTooLarge(ShmqError, ValueError):
    """The payload is larger than the queue's max_message_size."""

    code = Status.PAYLOAD_TOO_LARGE


class StaleAck(ShmqError):
    """The lease behind this ack/nack/touch is no longer valid."""

    code = Status.STALE_ACK
    stale: list[int]  # of a batch ack: the offsets that were stale

    @classmethod
    def of_batch(cls, stale: list[int], total: int) -> StaleAck:
        """A batch ack's error: ``stale`` (offsets) of its ``total`` acks were stale."""
        err = cls(f"{len(stale)} of {total} acks were stale (offsets {stale[:10]}); the others were applied")
        err.stale = stale
        return err


class InvalidName(ShmqError, ValueError):
    """A queue, group or instance name is not allowed."""

    code = Status.INVALID_NAME


class InvalidArgument(ShmqError, ValueError):
    """An argument is out of range."""

    code = Status.INVALID_ARGUMENT


class LimitExceeded(ShmqError):
    """A documented limit (queues, groups, clients, ...) was reached."""

    code = Status.LIMIT_EXCEEDED


class GroupNotFound(ShmqError, KeyError):
    """No consumer group of that name exists on the queue."""

    code = Status.GROUP_NOT_FOUND

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InstanceError(ShmqError):
    """The instance's shared memory is missing, foreign or corrupt."""

    code = Status.INSTANCE_ERROR


class InstanceNotFound(InstanceError):
    """No instance of that name exists on this host (``shm://NAME`` with ``create=False``)."""


class ProtocolError(ShmqError):
    """A malformed frame.  ``code`` says which way: PROTOCOL_ERROR, BAD_MAGIC,
    PAYLOAD_TOO_LARGE, INVALID_TYPE or VERSION_MISMATCH."""

    code = Status.PROTOCOL_ERROR

    def __init__(self, message: str = "", code: Status | int = Status.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = Status(code)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (str(self), int(self.code)))


class AuthError(ShmqError):
    """The handshake was refused (missing or wrong token)."""

    code = Status.AUTH_FAILED


class Duplicate(ShmqError):
    """An idempotent producer already wrote this sequence (or a later one): nothing was written."""

    code = Status.DUPLICATE


class StorageError(ShmqError, OSError):
    """The journal could not be written (full disk, unwritable data dir, I/O error).
    Nothing already stored is affected; the produce was not accepted."""

    code = Status.STORAGE


class NotPrimary(ShmqError):
    """This broker is a standby (``shmq serve --replica-of``), or a primary fenced by a higher
    epoch: it takes no puts, gets or acks.  ``primary`` is the URL it follows ("" if unknown)."""

    code = Status.NOT_PRIMARY

    def __init__(self, message: str = "", primary: str = "") -> None:
        super().__init__(message)
        self.primary = primary or _primary_in(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (str(self), self.primary))


def _primary_in(message: str) -> str:
    """The primary's URL in a NOT_PRIMARY error's text ("... primary: tcp://h:p ..."), or ""."""
    at = message.find("primary: ")
    return message[at + 9:].split()[0].rstrip(";,.)") if at >= 0 else ""


class ConnectionLost(ShmqError, ConnectionError):
    """The broker cannot be reached, or the connection to it was lost."""

    code = Status.UNAVAILABLE


_BY_CODE: dict[int, type[ShmqError]] = {}
for _cls in (Full, Empty, Timeout, QueueNotFound, QueueExists, MessageTooLarge, StaleAck,
             InvalidName, InvalidArgument, LimitExceeded, GroupNotFound, InstanceError,
             ProtocolError, AuthError, Duplicate, StorageError, NotPrimary):
    _BY_CODE.setdefault(int(_cls.code), _cls)


def error_for(code: int, message: str) -> ShmqError:
    """The typed error for a status code (used by the TCP client)."""
    if code in (Status.BAD_MAGIC, Status.VERSION_MISMATCH, Status.INVALID_TYPE):
        return ProtocolError(message, code)
    cls = _BY_CODE.get(code, ShmqError)
    return cls(message)
