"""A TCP proxy for tests that cuts a link and heals it (as a network partition would).

``cut()`` stops moving bytes in both directions without closing anything: each end's
sends fill the kernel's buffers and then block, and it reads nothing, as across a
blackholed route.  ``heal()`` moves them again, what was held first.  ``drop()`` closes
every connection (what was held is lost), and new ones are accepted all along.
"""

from __future__ import annotations

import socket
import threading


class CutProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.moved = 0  # bytes passed on, both ways
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            with self.lock:
                self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self.flowing.wait()
                data = src.recv(65536)
                if not data:
                    break
                self.flowing.wait()  # (a cut while this was read: held until healed, or dropped)
                dst.sendall(data)
                self.moved += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    def drop(self) -> None:
        """Close every connection now (bytes held by a cut are lost), and let new ones flow."""
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.flowing.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        self.drop()
