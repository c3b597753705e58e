"""The client end of a connection to a worker's ``Core`` held in memory: bytes in, frames out."""

from __future__ import annotations

import itertools
from typing import Any

from shmq.protocol.codec import Frame, FrameDecoder, T, decode_body, frame
from shmq.server import handlers
from shmq.server.connection import ServerConnection
from shmq.server.core import Core


class Peer:
    """The client end of one in-memory connection."""

    def __init__(self, core: Core, token: str = "", handshake: bool = True) -> None:
        self.core = core
        self.sent: list[bytes] = []  # what the server wrote to the "socket"
        self.conn: ServerConnection = core.connection(sink=self.sent.append)
        self._dec = FrameDecoder()
        self._ids = itertools.count(1)
        if handshake:
            f = self.call(T.HANDSHAKE, token=token, client="test", affinity="", heartbeat_ms=0)
            assert f.type == T.HANDSHAKE_ACK, f

    def feed(self, data: bytes) -> None:
        handlers.receive(self.core, self.conn, data)

    def send(self, type_: int, **fields: Any) -> int:
        msg_id = next(self._ids)
        self.feed(frame(type_, msg_id, **fields))
        return msg_id

    def frames(self) -> list[Frame]:
        """What the server sent since the last call."""
        data, self.sent[:] = b"".join(self.sent), []
        return self._dec.feed(data)

    def call(self, type_: int, **fields: Any) -> Frame:
        """A request and its one reply (nothing else may arrive meanwhile)."""
        msg_id = self.send(type_, **fields)
        got = self.frames()
        assert [f.msg_id for f in got] == [msg_id], got
        return got[0]

    def ok(self, type_: int, reply: T, **fields: Any) -> dict[str, Any]:
        f = self.call(type_, **fields)
        assert f.type == reply, error_of(f)
        return decode_body(reply, f.body)


def error_of(f: Frame) -> str:
    """An ERROR frame's body, for an assertion's message; another frame's type."""
    return str(decode_body(T.ERROR, f.body)) if f.type == T.ERROR else f"type 0x{f.type:02x}"


def status_of(f: Frame) -> int:
    """The status of ``f``, which must be an ERROR frame."""
    assert f.type == T.ERROR, f
    return f.status
