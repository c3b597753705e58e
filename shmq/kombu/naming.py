"""kombu's queue names as shmq's.

A shmq queue name is 1-200 chars of ``[A-Za-z0-9._-]``, begins with a letter or digit and
does not end in ``.dlq`` (``shmq.names``).  Most kombu and Celery names are such names
already (``celery``, ``celery.pidbox``, ``celeryev.<uuid>``, ``<uuid>.reply.celery.pidbox``)
and are kept as they are, so ``shmq stats celery`` shows Celery's queue.  Any other
(``celery@host.celery.pidbox``, a name with a space, one too long) becomes its allowed
characters, cut to 150, then ``-k`` and 16 hex digits of a hash of the whole name: the
same name in every process, and two names that differ stay apart.

``NAME.dlq`` is the dead-letter queue of ``NAME``: the shmq queue ``<NAME as shmq names
it>.dlq``, which the broker makes at ``NAME``'s first dead letter.  Names starting with
``RESERVED`` are the transport's own (``bindings``' queue) and are hashed too.
"""

from __future__ import annotations

import hashlib
import re

from shmq import options

RESERVED = "shmq-kombu"  # the transport's own queues' prefix
_KEPT = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{options.QUEUE_NAME_MAX - 1}}}\Z")
_BAD = re.compile(r"[^A-Za-z0-9._-]")
_SUFFIX = options.DLQ_SUFFIX


def queue_name(name: str) -> str:
    """The shmq queue that holds kombu queue ``name``'s messages."""
    if name.endswith(_SUFFIX) and len(name) > len(_SUFFIX):
        return queue_name(name[: -len(_SUFFIX)]) + _SUFFIX
    fits = len(name) + len(_SUFFIX) <= options.QUEUE_NAME_MAX  # (and so does its DLQ's)
    if _KEPT.match(name) and fits and not name.startswith(RESERVED):
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    safe = _BAD.sub("_", name)[:150].lstrip("._-")
    return f"{safe or 'q'}-k{digest}"


def is_dead_letter_queue(name: str) -> bool:
    """Does kombu queue ``name`` name a dead-letter queue (made by the broker, never by kombu)?"""
    return name.endswith(_SUFFIX) and len(name) > len(_SUFFIX)
