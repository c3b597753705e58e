"""Broker URLs: ``tcp://HOST:PORT``, ``tcps://HOST:PORT`` (TLS) and ``unix://PATH``
(``shmq serve --unix``), each with optional query parameters:

* ``token=T``: the token to present (any scheme);
* ``ca=FILE``: ``tcps://`` only, the CA certificate(s) the broker's certificate must be
  signed by (default: the system's trust store);
* ``cert=FILE`` and ``key=FILE``: ``tcps://`` only, this client's certificate and key,
  for a broker that asks for one (``shmq serve --tls-client-ca``);
* ``insecure=1``: ``tcp://`` only, allow sending a token in clear text to a host that is
  not loopback (refused otherwise).

An unknown parameter, or one that does not apply to the scheme, is refused.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, urlencode

from shmq import options, runtime
from shmq.errors import InvalidArgument

SCHEMES = ("tcp", "tcps", "unix")
PARAMS = {"tcp": ("token", "insecure"), "tcps": ("token", "ca", "cert", "key"), "unix": ("token",)}


@dataclass(frozen=True)
class BrokerUrl:
    """A parsed broker URL.  ``host``/``port`` for tcp and tcps, ``path`` for unix."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""
    params: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.scheme == "tcps"

    @property
    def insecure(self) -> bool:
        return self.params.get("insecure") == "1"

    def without_token(self) -> str:
        """The URL as text with its ``token`` left out: what is shown in errors and logs, and
        what a handle pickles as (its token travels beside it)."""
        where = self.path if self.scheme == "unix" else (
            f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}")
        params = {k: v for k, v in self.params.items() if k != "token"}
        query = f"?{urlencode(params, quote_via=quote, safe='/')}" if params else ""
        return f"{self.scheme}://{where}{query}"


def parse_url(url: str) -> BrokerUrl:
    """Parse a ``tcp://``, ``tcps://`` or ``unix://`` URL; InvalidArgument when it is none."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise InvalidArgument(f"unsupported url {_shown(url)!r}: use tcp://HOST:PORT, tcps://HOST:PORT "
                              "or unix://PATH")
    rest, _, query = rest.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise InvalidArgument(f"bad query in url {_shown(url)!r}: expected NAME=VALUE&...") from None
    params: dict[str, str] = {}
    for k, v in pairs:
        if k not in PARAMS[scheme]:
            raise InvalidArgument(f"url parameter {k!r} is not one of {scheme}://'s: "
                                  f"{', '.join(PARAMS[scheme])}")
        if k in params:
            raise InvalidArgument(f"url parameter {k!r} is given twice")
        params[k] = v
    if "key" in params and "cert" not in params:
        raise InvalidArgument("url parameter key= needs cert= (the client certificate)")
    if params.get("insecure", "1") != "1":
        raise InvalidArgument("url parameter insecure must be 1 (or left out)")
    if scheme == "unix":
        if not rest:
            raise InvalidArgument(f"bad unix url {_shown(url)!r}: expected unix:///PATH/TO/SOCKET")
        return BrokerUrl(scheme, path=rest, params=params)
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"bad {scheme} url {_shown(url)!r}: expected {scheme}://HOST:PORT")
    if not 0 < int(port) < 65536:
        raise InvalidArgument(f"bad {scheme} url {_shown(url)!r}: port {int(port)} is not in 1..65535")
    return BrokerUrl(scheme, host.strip("[]"), int(port), params=params)


def _shown(url: str) -> str:
    """``url`` without its query (which may hold a token), for an error message."""
    return url.partition("?")[0]


def parse_tcp_url(url: str) -> tuple[str, int]:
    """HOST and PORT of a ``tcp://`` or ``tcps://`` URL (or of a bare ``HOST:PORT``)."""
    u = parse_url(url if "://" in url else f"tcp://{url}")
    if u.scheme == "unix":
        raise InvalidArgument(f"bad tcp url {_shown(url)!r}: expected tcp://HOST:PORT")
    return u.host, u.port


def unix_path(url: str) -> str | None:
    """The socket path of a ``unix://PATH`` URL (``unix:///run/shmq.sock``), None for
    any other URL."""
    if not url.startswith("unix://"):
        return None
    return parse_url(url).path


def is_loopback(host: str) -> bool:
    if host in runtime.LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_token(url: str | BrokerUrl, token: str | None) -> str:
    """The token a client presents: the one given (even ""), else the URL's ``token``, else
    ``$SHMQ_TOKEN``, else the one a local broker on that loopback port left for this user
    (``shmq.runtime``).  A Unix socket needs none from the broker's own user."""
    u = url if isinstance(url, BrokerUrl) else parse_url(url)
    if token is not None:
        return token
    if "token" in u.params:
        return u.params["token"]
    env = os.environ.get(options.TOKEN_ENV)
    if env:
        return env
    if u.scheme == "unix":
        return ""
    return runtime.token_for(u.host, u.port) or ""


def client_settings(url: str, token: str | None) -> tuple[BrokerUrl, str]:
    """The parsed URL and the token to present (``client_token``), refused before anything
    is sent when that token would cross a network in clear text: a ``tcp://`` URL to a host
    that is not loopback, with a token, needs ``tcps://`` or ``?insecure=1``."""
    u = parse_url(url)
    tok = client_token(u, token)
    if u.scheme == "tcp" and tok and not u.insecure and not is_loopback(u.host):
        raise InvalidArgument(f"{u.without_token()} would send the token in clear text to {u.host}, "
                              "which is not loopback: use tcps:// (shmq serve --tls-cert), or add "
                              "?insecure=1 to the URL if this network is trusted")
    return u, tok


__all__ = ["BrokerUrl", "client_settings", "client_token", "is_loopback", "parse_tcp_url", "parse_url",
           "unix_path"]
