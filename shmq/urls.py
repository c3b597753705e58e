"""Broker URLs: ``tcp://HOST:PORT`` and ``unix://PATH`` (``shmq serve --unix``)."""

from __future__ import annotations

import os

from . import options, runtime
from .errors import InvalidArgument


def parse_tcp_url(url: str) -> tuple[str, int]:
    rest = url[len("tcp://"):] if url.startswith("tcp://") else url
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"bad tcp url {url!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def unix_path(url: str) -> str | None:
    """The socket path of a ``unix://PATH`` URL (``unix:///run/shmq.sock``), None for
    any other URL."""
    if not url.startswith("unix://"):
        return None
    path = url[len("unix://"):]
    if not path:
        raise InvalidArgument(f"bad unix url {url!r}: expected unix:///PATH/TO/SOCKET")
    return path


def client_token(url: str, token: str | None) -> str:
    """The token a client presents: the one given (even ""), else ``$SHMQ_TOKEN``, else
    the one a local broker on that loopback port left for this user (``shmq.runtime``).
    A Unix socket needs none from the broker's own user."""
    if token is not None:
        return token
    env = os.environ.get(options.TOKEN_ENV)
    if env:
        return env
    if unix_path(url) is not None:
        return ""
    return runtime.token_for(*parse_tcp_url(url)) or ""


__all__ = ["client_token", "parse_tcp_url", "unix_path"]
