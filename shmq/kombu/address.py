"""Which broker a kombu ``Connection`` names, as the ``shmq.connect`` URL and token it means.

The spellings (``docs/celery.md``)::

    shmq://HOST:PORT                  tcp://HOST:PORT (shmq:// alone: 127.0.0.1:7878)
    shmq://HOST:PORT?token=T          the same, presenting T (or shmq://:T@HOST:PORT)
    shmq://H1:P1,H2:P2                a primary and its standbys (shmq serve --replica-of)
    shmq+tcp://HOST:PORT              as shmq://
    shmq+tcps://HOST:PORT?ca=FILE     TLS (cert=, key=, token= as shmq.urls says)
    shmq+unix:///PATH/TO/SOCKET       the broker's Unix socket (shmq serve --unix)
    shmq+shm://INSTANCE               co-located: attach INSTANCE's shared memory, no broker hop

Without a token in the URL, the token is ``transport_options["token"]``, else what
``shmq.connect`` finds (``$SHMQ_TOKEN``, or the one a broker on this host left for this
user).  A URL's parameters are checked by ``shmq.urls``: one it does not know is an
``InvalidArgument`` at connect, naming it.

kombu keeps the first URL whole (the transport parses its own: ``can_parse_url``), but
parses the alternates of a list (``Connection([url1, url2])``, ``url1;url2``) itself when
it switches to one, keeping only the host, port, password and path: so an alternate is
read back from those fields, and its token is its password, ``transport_options`` or the
usual look-up (kombu refuses an alternate with a query).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from shmq import options
from shmq.errors import InvalidArgument

SCHEMES = ("tcp", "tcps", "unix", "shm")
PREFIX = "shmq"


def _scheme(name: str) -> str:
    """``tcp`` of ``shmq`` and ``shmq+tcp``, ``unix`` of ``shmq+unix``, ...; InvalidArgument
    for a scheme that is none of these."""
    base, plus, sub = name.partition("+")
    if base != PREFIX or (plus and sub not in SCHEMES):
        raise InvalidArgument(f"unsupported scheme {name!r}: use shmq://HOST:PORT, shmq+tcps://HOST:PORT, "
                              "shmq+unix:///PATH or shmq+shm://INSTANCE")
    return sub or "tcp"


def _split_userinfo(rest: str) -> tuple[str, str | None]:
    """``rest`` (what follows ``scheme://``) without its ``user:password@``, and the token that
    part gives (the password, else the user name), or None."""
    where, _, query = rest.partition("?")
    if "@" not in where:
        return rest, None
    userinfo, _, where = where.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = unquote(password or user) or None
    return where + (f"?{query}" if query else ""), token


def _strip_path(scheme: str, rest: str) -> str:
    """A tcp URL's ``HOST:PORT`` with kombu's virtual host (``//``, what Celery prints) let go;
    any other path is an error (a shmq broker has no virtual hosts)."""
    where, q, query = rest.partition("?")
    host, slash, path = where.partition("/")
    if slash and path.strip("/"):
        raise InvalidArgument(f"{scheme} URL with a path ({'/' + path!r}): a shmq broker has no virtual "
                              "hosts; use shmq://HOST:PORT")
    return host + q + query


def _with_default_port(where: str) -> str:
    """Each entry of a comma list as ``HOST:PORT``, port 7878 where it is left out (an empty
    one: 127.0.0.1:7878)."""
    out = []
    for entry in where.split(","):
        entry = entry or options.DEFAULT_HOST
        if "://" not in entry and (entry.endswith("]") or ":" not in entry):
            entry = f"{entry}:{options.DEFAULT_PORT}"
        out.append(entry)
    return ",".join(out)


def broker_url(client: Any) -> tuple[str, str | None]:
    """The ``shmq.connect`` URL and token (None: found as usual) of kombu Connection ``client``."""
    hostname = client.hostname or ""
    topts = client.transport_options or {}
    token: str | None = topts.get("token")
    if "://" in hostname:  # the URL as given (kombu strips "shmq+" off shmq+unix://... and the like)
        scheme_name, _, rest = hostname.partition("://")
        scheme = _scheme(scheme_name) if scheme_name.startswith(PREFIX) else scheme_name
        if scheme not in SCHEMES:
            raise InvalidArgument(f"unsupported scheme {scheme_name!r} after shmq+: use one of "
                                  f"{', '.join('shmq+' + s for s in SCHEMES)}")
        rest, user_token = _split_userinfo(rest)
        token = user_token or token
    else:  # an alternate kombu parsed into fields (or Connection(hostname=, port=, transport="shmq"))
        tcls = client.transport_cls
        scheme = _scheme(tcls) if isinstance(tcls, str) and tcls.startswith(PREFIX) else "tcp"
        token = client.password or client.userid or token
        if scheme == "unix":
            rest = "/" + (client.virtual_host or "").lstrip("/")
        elif scheme == "shm":
            rest = hostname
        else:
            rest = f"{hostname or options.DEFAULT_HOST}:{client.port or options.DEFAULT_PORT}"
    if scheme == "shm":
        instance, _, query = rest.partition("?")
        if query:
            raise InvalidArgument(f"shmq+shm://{instance} takes no parameters "
                                  f"(got ?{query.split('=')[0]}=...)")
        return f"shm://{instance.strip('/') or options.DEFAULT_INSTANCE}", None
    if scheme in ("tcp", "tcps"):
        rest = _strip_path(scheme, rest)
        where, q, query = rest.partition("?")
        rest = _with_default_port(where) + q + query
    return f"{scheme}://{rest}", token


def shown(uri: str, mask: str = "**") -> str:
    """``uri`` with its token (``?token=``, or the password) masked: what logs and banners show."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    where, q, query = rest.partition("?")
    if "@" in where:
        where = f"{mask}@{where.rpartition('@')[2]}"
    if query:
        query = "&".join(f"token={mask}" if p.startswith("token=") else p for p in query.split("&"))
    return f"{scheme}://{where}{q}{query}"
