"""shmq as a Dramatiq broker: ``ShmqBroker`` and the ``Results`` middleware's
``ShmqResultBackend`` (``pip install 'shmq[dramatiq]'``; docs/celery.md, "Dramatiq").

    >>> import dramatiq
    >>> from shmq.dramatiq import ShmqBroker
    >>> dramatiq.set_broker(ShmqBroker(url="tcp://127.0.0.1:7878"))
"""

from __future__ import annotations

from shmq.dramatiq.broker import ShmqBroker
from shmq.dramatiq.results import ShmqResultBackend

__all__ = ["ShmqBroker", "ShmqResultBackend"]
