"""shmq as a kombu transport, so Celery (and any kombu program) can use a shmq broker.

    import shmq.kombu                      # registers shmq:// (and shmq+tcps://, ...) with kombu
    from celery import Celery
    app = Celery("proj", broker="shmq://127.0.0.1:7878")

Importing this module adds the schemes to ``kombu.transport.TRANSPORT_ALIASES``, the table
kombu resolves a URL's scheme by; without the import, the transport can be named by its
path: ``kombu.Connection("shmq://127.0.0.1:7878", transport="shmq.kombu:Transport")``, or
Celery's ``broker_transport = "shmq.kombu:Transport"``.  URLs: ``shmq.kombu.address``;
what maps to what: ``shmq.kombu.transport`` and ``docs/celery.md``.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from shmq.kombu.address import PREFIX, SCHEMES
from shmq.kombu.transport import Channel, Transport

PATH = "shmq.kombu:Transport"
ALIASES = (PREFIX, *(f"{PREFIX}+{s}" for s in SCHEMES))  # shmq, and what kombu reads an alternate's as


def register() -> None:
    """Make the ``shmq`` schemes known to kombu (done when this module is imported)."""
    for alias in ALIASES:
        TRANSPORT_ALIASES.setdefault(alias, PATH)


register()

__all__ = ["ALIASES", "Channel", "PATH", "Transport", "register"]
