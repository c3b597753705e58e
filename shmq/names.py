"""Which names are allowed: queues, groups (instances are checked in ``segment``).

A queue that exists is reached by any name of the alphabet (``check_queue_name``); a new
one's name must also begin with a letter or digit (never ``-``: a command line would
read it as an option) and must not end in ``.dlq``, which names dead-letter queues, nor
in ``.prio1`` .. ``.prio9``, which name the levels of a priority queue
(``check_new_queue_name``; the broker makes those itself).  Error messages show a long
name cut short (``text.shown``).
"""

from __future__ import annotations

import re
import secrets

from shmq import options
from shmq.errors import InvalidName
from shmq.text import shown

_QUEUE_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{options.QUEUE_NAME_MAX}}}\Z")
_GROUP_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{options.GROUP_NAME_MAX}}}\Z")


def check_queue_name(name: object) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name) or name in (".", ".."):
        raise InvalidName(f"invalid queue name {shown(name)}: 1-{options.QUEUE_NAME_MAX} chars of "
                          "[A-Za-z0-9._-], not '.' or '..'")
    return name


def check_new_queue_name(name: object, dead_letter: bool = False) -> str:
    """The name of a queue about to be created: ``check_queue_name``, a letter or digit
    first, and ``.dlq`` at the end exactly when ``dead_letter`` (a dead-letter queue
    made ahead of its first dead letter, to size it; never the DLQ of a DLQ)."""
    check_queue_name(name)
    assert isinstance(name, str)
    if not name[0].isalnum():  # the alphabet is ASCII
        raise InvalidName(f"invalid queue name {shown(name)}: a new queue's name begins with a letter "
                          "or a digit")
    if dead_letter and (not is_dlq_name(name) or is_dlq_name(source_name(name))):
        raise InvalidName(f"invalid dead-letter queue name {shown(name)}: the name of a queue followed "
                          f"by {options.DLQ_SUFFIX} (and not itself a dead-letter queue's)")
    if level_of(name)[1]:
        raise InvalidName(f"invalid queue name {shown(name)}: names ending in {options.LEVEL_SUFFIX}1 .. "
                          f"{options.LEVEL_SUFFIX}9 hold the levels of a priority queue, made with it")
    if not dead_letter and is_dlq_name(name):
        raise InvalidName(f"invalid queue name {shown(name)}: names ending in {options.DLQ_SUFFIX} are "
                          f"dead-letter queues, made by the broker when {shown(source_name(name))} first "
                          "dead-letters a message")
    return name


_REPLY_RE = re.compile(rf"{re.escape(options.REPLY_PREFIX)}[0-9a-f]{{24}}\Z")


def new_reply_name() -> str:
    """A fresh reply queue's name: ``reply.`` and 24 random hex digits (``shmq.api.reply``)."""
    return f"{options.REPLY_PREFIX}{secrets.token_hex(12)}"


def is_reply_name(name: str) -> bool:
    """Does ``name`` name a reply queue?  Such a queue goes when the process that created it
    dies (the reaper) or, over TCP, when the connection that created it closes."""
    return bool(_REPLY_RE.match(name))


def check_group_name(name: object) -> str:
    if not isinstance(name, str) or not _GROUP_RE.match(name) or name in (".", ".."):
        raise InvalidName(f"invalid group name {shown(name)}: 1-{options.GROUP_NAME_MAX} chars of "
                          "[A-Za-z0-9._-], not '.' or '..'")
    return name


def is_dlq_name(name: str) -> bool:
    return name.endswith(options.DLQ_SUFFIX)


def dlq_name(name: str) -> str:
    return name + options.DLQ_SUFFIX


_LEVEL_RE = re.compile(rf"(.+){re.escape(options.LEVEL_SUFFIX)}([1-9])\Z")


def level_name(name: str, level: int) -> str:
    """The queue that holds level ``level`` of priority queue ``name``: ``name`` itself for
    level 0, else the hidden ``<name>.prio<level>``."""
    return f"{name}{options.LEVEL_SUFFIX}{level}" if level else name


def level_of(name: str) -> tuple[str, int]:
    """(the priority queue, the level) that queue ``name`` holds: ``(name, 0)`` for any queue
    that is no hidden level (``jobs.prio3`` is level 3 of ``jobs``)."""
    m = _LEVEL_RE.match(name)
    return (m[1], int(m[2])) if m else (name, 0)


def source_name(name: str) -> str:
    """The queue whose dead letters go to ``name`` (``orders`` of ``orders.dlq``)."""
    return name[: -len(options.DLQ_SUFFIX)] if is_dlq_name(name) else name
