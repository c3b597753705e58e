"""The runtime folder: where a broker leaves the token its own user's clients read.

``shmq serve`` without a token makes one at start (authentication is on by default)
and writes it to ``<runtime>/tcp-<port>.token``, mode 0600, in a folder of mode 0700:
``$XDG_RUNTIME_DIR/shmq`` when that is set (and exists), else ``<tmp>/shmq-<uid>``.
A client that is given no token (no argument, no ``$SHMQ_TOKEN``) and connects to a
loopback port reads it from there, as Jupyter's clients read its server's token.
Other users cannot: neither the folder nor the file lets them in.

Nothing here is trusted that is not ours: a folder or file owned by another uid, or
open to others, is refused (writing) or ignored (reading), never used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
from pathlib import Path

from shmq.errors import InstanceError

LOOPBACK = ("127.0.0.1", "localhost", "::1", "ip6-localhost")


def runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "shmq"
    return Path(tempfile.gettempdir()) / f"shmq-{os.geteuid()}"


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _folder(create: bool) -> Path | None:
    path = runtime_dir()
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or not _ours(st):
        if create:
            raise InstanceError(f"runtime folder {path} is not ours (owner uid {st.st_uid}, mode "
                                f"0o{st.st_mode & 0o777:o}): refused; remove it or set $XDG_RUNTIME_DIR")
        return None
    return path


def token_path(port: int) -> Path:
    return runtime_dir() / f"tcp-{port}.token"


def socket_path(port: int) -> Path:
    """Where ``shmq serve --unix auto`` (its default) listens beside TCP ``port``; the
    runtime folder is made (0700) if need be."""
    folder = _folder(create=True)
    assert folder is not None
    return folder / f"tcp-{port}.sock"


def local_socket(host: str, port: int) -> str | None:
    """The Unix socket this user's broker on loopback ``host``:``port`` listens on beside
    it, if there is one: a socket file of ours in our private runtime folder (None: use TCP)."""
    if host not in LOOPBACK:
        return None
    folder = _folder(create=False)
    if folder is None:
        return None
    path = folder / f"tcp-{port}.sock"
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return str(path) if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() else None


def write_token(port: int, token: str) -> Path:
    """Write the token of the broker on ``port`` (mode 0600, atomically); its path."""
    folder = _folder(create=True)
    assert folder is not None
    path = folder / f"tcp-{port}.token"
    tmp = folder / f".tcp-{port}.token.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{token}\n{os.getpid()}\n".encode())  # the token, then whose it is
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_token(port: int, token: str) -> None:
    """Remove the token file of ``port`` if it is still this broker's."""
    path = token_path(port)
    if read_file(path) == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def read_file(path: Path) -> str | None:
    """The token in ``path`` when the file (and its folder) are ours and private; else None."""
    if _folder(create=False) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _ours(os.fstat(fd)):
            return None
        return os.read(fd, 4096).decode(errors="replace").split("\n", 1)[0].strip() or None
    finally:
        os.close(fd)


def sweep() -> list[Path]:
    """Remove what brokers that are gone (killed before they could remove their own)
    left: token files whose loopback port nobody listens on any more, and sockets
    nobody listens on.  The files removed."""
    folder = _folder(create=False)
    if folder is None:
        return []
    gone = []
    for path in [*folder.glob("tcp-*.token"), *folder.glob("tcp-*.sock")]:
        if path.suffix == ".sock":
            stale = not _unix_listening(path)
        else:
            stale = not _broker_alive(path)
        if stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                gone.append(path)
    return gone


def _broker_alive(path: Path) -> bool:
    """Is the broker that wrote this token file alive?  Its second line is its pid (a
    file without one: does anything listen on its loopback port?).  Not "does anything
    listen now": a broker restarting its only worker listens on nothing for a moment."""
    try:
        lines = path.read_text().split("\n")
    except OSError:
        return True  # unsure: keep it
    if len(lines) > 1 and lines[1].strip().isdigit():
        try:
            os.kill(int(lines[1]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    port = path.name[len("tcp-"):-len(".token")]
    return not port.isdigit() or any(_listening(host, int(port)) for host in ("127.0.0.1", "::1"))


def _unix_listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # unsure: keep it
    return True


def _listening(host: str, port: int) -> bool:
    """Does anything listen on ``host``:``port``?  (When unsure, as on a timeout: yes.)"""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except ConnectionRefusedError:
        return False
    except OSError as e:  # no IPv6 on this host, say: nothing listens there
        return e.errno not in (errno.EADDRNOTAVAIL, errno.ENETUNREACH, errno.EAFNOSUPPORT)
    return True


def token_for(host: str, port: int) -> str | None:
    """The token a local broker on a loopback ``host``:``port`` left for its own user."""
    if host not in LOOPBACK:
        return None
    return read_file(token_path(port))
