"""shmq: a message broker for one host, with its queues in POSIX shared memory.

    >>> import shmq
    >>> broker = shmq.connect("shm://default")          # co-located: no broker hop
    >>> q = broker.create_queue("orders")
    >>> q.put(b"order #42")
    0
    >>> msg = q.get(timeout=1.0)
    >>> msg.ack()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shmq.errors import (
    AuthError,
    ConnectionLost,
    Duplicate,
    Empty,
    Full,
    GroupExists,
    GroupNotFound,
    InstanceError,
    InstanceNotFound,
    InvalidArgument,
    InvalidName,
    LimitExceeded,
    MessageTooLarge,
    NotPrimary,
    ProtocolError,
    QueueExists,
    QueueNotFound,
    ShmqError,
    StaleAck,
    Status,
    StorageError,
    Timeout,
)

if TYPE_CHECKING:
    from shmq.api import Broker, BrokerInfo, Message, Origin, Queue, QueueConfig, QueueInfo
    from shmq.client import aio
    from shmq.core.cleanup import InstanceReport, reclaim, scan

from shmq.version import __version__ as __version__

__all__ = [
    "AuthError", "Broker", "BrokerInfo", "ConnectionLost", "Duplicate", "Empty", "Full", "GroupExists",
    "GroupNotFound", "InstanceError", "InstanceNotFound", "InstanceReport", "InvalidArgument",
    "InvalidName", "LimitExceeded", "Message", "MessageTooLarge", "NotPrimary", "Origin", "ProtocolError",
    "Queue",
    "QueueConfig", "QueueExists", "QueueInfo", "QueueNotFound", "ShmqError", "StaleAck", "Status",
    "StorageError", "Timeout", "aio", "connect", "mp", "reclaim", "scan",
]

# Loaded on first use: shmq.core.cleanup imports posix_ipc, which ``import shmq`` does not need
# (a tcp:// client never touches shared memory), and the interface classes are not needed
# by a command line that only prints its version.
_LAZY = {"InstanceReport": "core.cleanup", "reclaim": "core.cleanup", "scan": "core.cleanup",
         **dict.fromkeys(("Broker", "BrokerInfo", "Message", "Origin", "Queue", "QueueConfig", "QueueInfo"),
                         "api")}
# modules: ``from shmq import aio`` (the asyncio client) keeps working; ``shmq.mp`` (the
# drop-in for multiprocessing's queues) loads the shared-memory core only when used
_LAZY_MODULES = {"aio": "client.aio", "mp": "mp"}


def __getattr__(name: str) -> Any:
    from importlib import import_module

    if name in _LAZY_MODULES:
        value = import_module(f"{__name__}.{_LAZY_MODULES[name]}")
    elif name in _LAZY:
        value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_LAZY_MODULES})


def connect(url: str = "shm://default", token: str | None = None, **kwargs: Any) -> Broker:
    """Open a broker handle.

    ``shm://NAME`` attaches the shared memory of instance NAME on this host (``token`` is
    not needed there), the one ``shmq serve --instance NAME`` serves; ``connect()`` with no
    URL is ``shm://default``, the instance ``shmq serve`` serves by default.  **When no
    such instance exists, it is created** (``create=False``: ``InstanceNotFound`` instead),
    in /dev/shm: a registry of about 300 KiB (``shmq.<uid>.NAME.reg``), then for each queue
    made its reserved memory (``shmq.<uid>.NAME.q<N>``, about 18 MiB with the default
    limits: ``max_bytes`` and the slots, docs/operations.md) and four semaphores.  It
    outlives this process: ``broker.close()`` only detaches.  It goes with
    ``broker.destroy()`` (every queue of the instance, at once, whoever is attached),
    with ``shmq doctor --clean`` (or ``shmq.reclaim()``) once no process is attached, and,
    for the instance a broker serves, when ``shmq serve`` stops (unless ``--keep``).

    ``tcp://HOST:PORT``
    (``tcps://HOST:PORT?ca=FILE`` for TLS, or ``unix://PATH``) talks to ``shmq serve``,
    presenting ``token`` (default the URL's ``?token=``, else ``$SHMQ_TOKEN``, else the
    token a broker on this host left for this user; URL parameters: ``shmq.urls``); its other
    keywords are ``connect_timeout`` (seconds for the connect and the handshake: a
    port that is no broker fails within it), ``client`` (a name for the broker's logs),
    ``affinity`` (connections with the same affinity are served by one broker worker:
    docs/operations.md, "Which worker serves a connection") and ``spin_us`` (microseconds a
    call polls its socket for the answer before it sleeps, default ``options.CLIENT_SPIN_US``;
    0: sleep at once; ``shmq.spin``).

    A comma-separated list of such URLs (``tcp://h1:7878,h2:7878``: a primary and its
    standbys, ``shmq serve --replica-of``; each entry with its own ``?params``, a bare
    ``HOST:PORT`` taking the scheme of the entry before it, ``token`` going to each) gives
    a handle that fails over (``shmq.client.failover.FailoverBroker``), with one keyword
    more, ``failover_timeout`` (seconds, default ``options.FAILOVER_TIMEOUT``; given with
    one URL, that URL alone is such a list).  It uses the first URL that answers as the
    primary: standbys are passed over, and while no URL is the primary the list is tried
    again, backing off, until ``failover_timeout`` seconds have passed; then
    ``ConnectionLost`` names each URL and why it was not used.  A call that meets
    ``ConnectionLost`` or ``NotPrimary`` finds the primary again so and is made once more
    there, and queue handles follow it: so a retried put may store its message twice
    (at-least-once).  Settling a message leased before a fail-over is never retried: its
    lease went with the old connection, so it raises ``ConnectionLost``, and the new
    primary delivers the message again.
    """
    if "," in url:
        from shmq.client.failover import FailoverBroker
        return FailoverBroker(url, token, **kwargs)
    if url.startswith("shm://"):
        from shmq.core.colocated import ShmBroker
        return ShmBroker(url[len("shm://"):] or "default", **kwargs)
    if url.startswith(("tcp://", "tcps://", "unix://")):
        if "failover_timeout" in kwargs:  # a list of one: it finds its broker again after a restart
            from shmq.client.failover import FailoverBroker
            return FailoverBroker(url, token, **kwargs)
        from shmq.client.tcp import TcpBroker
        return TcpBroker(url, token, **kwargs)
    raise InvalidArgument(f"unsupported url {url.partition('?')[0]!r}: use shm://NAME, tcp://HOST:PORT, "
                          "tcps://HOST:PORT or unix://PATH")
