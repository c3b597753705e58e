"""Which names are allowed: queues, groups (instances are checked in ``segment``)."""

from __future__ import annotations

import re

from . import options
from .errors import InvalidName

_QUEUE_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{options.QUEUE_NAME_MAX}}}\Z")
_GROUP_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{options.GROUP_NAME_MAX}}}\Z")


def check_queue_name(name: object) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name) or name in (".", ".."):
        raise InvalidName(f"invalid queue name {name!r}: 1-{options.QUEUE_NAME_MAX} chars of "
                          "[A-Za-z0-9._-], not '.' or '..'")
    return name


def check_group_name(name: object) -> str:
    if not isinstance(name, str) or not _GROUP_RE.match(name) or name in (".", ".."):
        raise InvalidName(f"invalid group name {name!r}: 1-{options.GROUP_NAME_MAX} chars of "
                          "[A-Za-z0-9._-], not '.' or '..'")
    return name


def is_dlq_name(name: str) -> bool:
    return name.endswith(options.DLQ_SUFFIX)


def dlq_name(name: str) -> str:
    return name + options.DLQ_SUFFIX
