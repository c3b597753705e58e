"""Broker URLs: ``tcp://HOST:PORT`` and ``unix://PATH`` (``shmq serve --unix``)."""

from __future__ import annotations

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


__all__ = ["parse_tcp_url", "unix_path"]
