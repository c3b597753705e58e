"""TLS for ``tcps://``: the contexts of both ends, and what a TLS failure means.

The broker (``shmq serve --tls-cert FILE --tls-key FILE [--tls-client-ca FILE]``)
serves TLS 1.2 or later on its TCP port; with a client CA it asks every client for a
certificate signed by it (mutual TLS).  A client (``tcps://HOST:PORT?ca=FILE``)
checks the broker's certificate against that CA (default: the system's trust store)
and the host name it connected to; ``&cert=FILE&key=FILE`` is its own certificate.
"""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass

from shmq.errors import ConnectionLost, InvalidArgument
from shmq.urls import BrokerUrl


@dataclass(frozen=True)
class ServerTls:
    """The broker's certificate files (paths: a worker builds its own context from them)."""

    cert: str
    key: str
    client_ca: str = ""


def _load(what: str, path: str, load: object, *args: str) -> None:
    try:
        load(*args)  # type: ignore[operator]
    except FileNotFoundError:
        raise InvalidArgument(f"{what} {path}: no such file") from None
    except PermissionError:
        raise InvalidArgument(f"{what} {path}: permission denied") from None
    except (ssl.SSLError, OSError, ValueError) as e:
        raise InvalidArgument(f"{what} {path} cannot be used: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    return str(getattr(e, "reason", None) or getattr(e, "strerror", None) or e)


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The broker's context; InvalidArgument naming the file that cannot be used."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load("--tls-cert/--tls-key", f"{tls.cert} / {tls.key}", ctx.load_cert_chain, tls.cert, tls.key)
    if tls.client_ca:
        _load("--tls-client-ca", tls.client_ca, ctx.load_verify_locations, tls.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(u: BrokerUrl) -> ssl.SSLContext:
    """A client's context for a ``tcps://`` URL; InvalidArgument naming a file that cannot
    be used.  The host name is checked (give ``server_hostname`` when wrapping)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ca = u.params.get("ca")
    if ca:
        _load("ca=", ca, ctx.load_verify_locations, ca)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    cert = u.params.get("cert")
    if cert:
        key = u.params.get("key")
        _load("cert=/key=", f"{cert} / {key or cert}", ctx.load_cert_chain, cert, *([key] if key else []))
    return ctx


def describe(e: BaseException, u: BrokerUrl) -> str:
    """What a TLS failure (an ``ssl.SSLError``) on a ``tcps://`` connection means."""
    if isinstance(e, ssl.SSLCertVerificationError):
        hint = "" if u.params.get("ca") else " (no ca= in the URL: the system's trust store was used)"
        return f"the broker's certificate was refused: {e.verify_message or _reason(e)}{hint}"
    reason = _reason(e)
    low = reason.lower()
    if "alert" in low and any(w in low for w in ("certificate", "unknown_ca", "unknown ca")):
        mine = "none was given (add &cert=FILE&key=FILE)" if not u.params.get("cert") else "it is not trusted"
        return f"the broker refused this client's certificate: {mine} ({reason})"
    if any(w in low for w in ("wrong_version", "wrong version", "record layer", "packet_length", "http")):
        return f"the broker does not speak TLS on this port: connect with tcp:// ({reason})"
    if isinstance(e, ssl.SSLEOFError) or "eof" in low:
        return f"the broker closed the connection during the TLS handshake: is it a TLS port? ({reason})"
    return f"TLS failed: {reason}"


def handshake_lost(e: ConnectionLost, u: BrokerUrl) -> ConnectionLost:
    """The error of a ``tcps://`` connection that the broker closed before answering the
    handshake, without a word: what a broker that wants client certificates does (it
    drops the connection during TLS, and with TLS 1.3 the client learns it only then)."""
    msg = str(e)
    low = msg.lower()
    # the broker's alert, a close, or -- when our request crossed its alert -- a reset
    said = "alert" in low and "certificate" in low
    if not (said or msg.endswith("closed by the broker") or "reset by peer" in low):
        return e
    given = ("its CA did not sign the one given (cert=)" if u.params.get("cert")
             else "none was given: add &cert=FILE&key=FILE to the URL")
    return ConnectionLost(f"{msg} before answering the handshake: the broker requires a client "
                          f"certificate (shmq serve --tls-client-ca) and {given}")


class TlsStream:
    """The blocking client's TLS: a socket's ``recv_into``/``sendall``/``shutdown``/``close``
    over an ``ssl.SSLObject`` on memory BIOs.

    OpenSSL does not let two threads use one connection at once, and the blocking client
    reads in one thread (blocked in recv) while another sends (a request, a heartbeat).
    So the socket I/O here is plain, and only the short calls into the TLS state hold
    ``_tls``; bytes the TLS state makes while reading (a TLS 1.3 key update's answer,
    say) wait in ``_out`` and go out, in the order they were made, ahead of the next
    send -- or at once when no send is under way."""

    def __init__(self, ctx: ssl.SSLContext, raw: socket.socket, host: str) -> None:
        self.raw = raw
        self._in = ssl.MemoryBIO()
        self._wire = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._wire, server_hostname=host)
        self._tls = threading.Lock()  # the TLS state: held only for calls that do no I/O
        self._send = threading.Lock()  # one writer of raw bytes at a time, in the order they were made
        self._out: list[bytes] = []  # bytes made by a read, not sent yet

    def handshake(self) -> None:
        """The TLS handshake (before any other thread uses the stream); ssl.SSLError,
        TimeoutError or OSError when it fails."""
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._write_wire()
                data = self.raw.recv(1 << 16)
                if not data:
                    raise ssl.SSLEOFError("EOF during the TLS handshake") from None
                self._in.write(data)
        self._write_wire()

    def _write_wire(self) -> None:
        out = self._wire.read()
        if out:
            self.raw.sendall(out)

    def recv_into(self, buf: bytearray | memoryview) -> int:
        while True:
            with self._tls:
                try:
                    got = self._obj.read(len(buf), buf)  # with a buffer: the count read into it
                    n: int | None = got if isinstance(got, int) else len(got)
                except ssl.SSLWantReadError:
                    n = None
                except ssl.SSLZeroReturnError:  # the broker's close_notify
                    n = 0
                made = self._wire.read()
                if made:
                    self._out.append(made)
            if made and self._send.acquire(blocking=False):
                try:
                    self._flush(b"")
                finally:
                    self._send.release()
            if n is not None:
                return n
            data = self.raw.recv(1 << 16)
            if not data:
                return 0
            with self._tls:
                self._in.write(data)

    def _flush(self, data: bytes) -> None:
        """Encrypt ``data`` and send it after what a read made (``_send`` is held)."""
        with self._tls:
            if data:
                self._obj.write(data)
            out = b"".join(self._out) + self._wire.read()
            self._out.clear()
        if out:
            self.raw.sendall(out)

    def sendall(self, data: bytes, flags: int = 0) -> None:  # flags (MSG_MORE): TLS writes whole records
        with self._send:
            self._flush(data)

    def pending(self) -> int:
        """Bytes decrypted already, that a read returns without touching the socket."""
        with self._tls:
            return self._obj.pending()

    def fileno(self) -> int:
        return self.raw.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self.raw.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.raw.gettimeout()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()


__all__ = ["ServerTls", "TlsStream", "client_context", "describe", "handshake_lost", "server_context"]
