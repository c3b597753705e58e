"""One logging set-up for the broker's processes: every line on stderr names the process's
role and pid, as text or as JSON (``shmq serve --log-format``)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.support.server import Server
from tests.support.wait import wait_until

pytestmark = pytest.mark.crash  # it SIGKILLs a worker


def _kill_a_worker_and_read(srv: Server) -> str:
    """SIGKILL one worker; the broker's stderr once it has said so."""
    os.kill(srv.workers()[0].pid, signal.SIGKILL)
    err: list[str] = []

    def said() -> bool:
        err.append(srv.stderr_so_far())
        return "restarting" in "".join(err)

    wait_until(said, timeout=10)
    return "".join(err)


def test_text_lines_name_the_role_and_pid() -> None:
    srv = Server(workers=1)
    try:
        out = _kill_a_worker_and_read(srv)
        line = next(x for x in out.splitlines() if "restarting" in x)
        assert re.fullmatch(rf"shmq supervisor\[{srv.proc.pid}\] WARNING: worker 0 \(pid \d+\) exited "
                            "with -9; restarting", line), line
    finally:
        assert srv.stop() == 0


def test_json_lines_are_one_object_each() -> None:
    srv = Server(workers=1, extra=["--log-format", "json", "--log-level", "debug"])
    try:
        out = _kill_a_worker_and_read(srv)
        records = [json.loads(x) for x in out.splitlines() if x.strip()]
        (restart,) = [r for r in records if "restarting" in r["message"]]
        assert (restart["role"], restart["pid"], restart["level"]) == ("supervisor", srv.proc.pid, "WARNING")
        assert re.fullmatch(r"worker 0 \(pid \d+\) exited with -9; restarting", restart["message"])
        assert all({"time", "level", "role", "pid", "logger", "message"} <= r.keys() for r in records)
    finally:
        assert srv.stop() == 0


def test_a_bad_log_option_is_refused() -> None:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                          "--log-format", "xml"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--log-format" in out.stderr
