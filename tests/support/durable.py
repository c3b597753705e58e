"""A journaled broker, killed and restarted."""

from __future__ import annotations

from pathlib import Path

from tests.support.instances import remove_shm, unique_instance
from tests.support.server import Server, kill_broker


class Durable:
    """A broker with a data dir, and a way to crash it (optionally 'rebooting') and restart."""

    def __init__(self, tmp_path: Path) -> None:
        self.data = str(tmp_path / "data")
        self.inst = unique_instance()
        self.srv = Server(workers=1, instance=self.inst, data_dir=self.data)

    def crash(self, reboot: bool = True) -> None:
        kill_broker(self.srv)
        if reboot:
            remove_shm(self.inst)

    def start(self) -> str:
        """Start again; what the broker logged while starting."""
        self.srv = Server(workers=1, instance=self.inst, data_dir=self.data)
        return self.srv.stderr_so_far()
