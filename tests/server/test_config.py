"""``shmq serve``'s settings (server/config.py): the config file, the environment, the flags and
their precedence, ``--print-config``, queue declarations, and ``shmq status``.

``--print-config`` runs in-process (typer's CliRunner): it starts nothing.  Real brokers
are started only for what needs one: declared queues, the start and stop lines, status."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

import shmq
from shmq import options
from shmq.cli.app import app
from shmq.core.colocated import ShmBroker
from shmq.server import config as cfg
from tests.support.instances import objects, unique_instance
from tests.support.paths import ROOT
from tests.support.server import Server

runner = CliRunner()
NO_ENV: dict[str, str | None] = {s.env: None for s in (*cfg.SETTINGS,)}
NO_ENV[options.CONFIG_ENV] = None


def _invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    """``shmq ARGS`` in-process, with no $SHMQ_<NAME> but those given."""
    return runner.invoke(app, list(args), env={**NO_ENV, **(env or {})})


def _printed(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = _invoke("serve", "--print-config", "--json", *args, env=env)
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _write(tmp_path: Path, text: str, name: str = "shmq.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- precedence
def test_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _write(tmp_path, 'port = 1111\nworkers = 3\nheartbeat = 2\nlog_level = "debug"\n')
    got = _printed("--config", path, "--port", "3333",
                   env={"SHMQ_PORT": "2222", "SHMQ_WORKERS": "4"})["settings"]
    assert got["port"] == {"value": 3333, "source": "flag --port"}  # flag over env and file
    assert got["workers"] == {"value": 4, "source": "env SHMQ_WORKERS"}  # env over file
    assert got["heartbeat"] == {"value": 2.0, "source": f"file {path}"}  # file over default
    assert got["log_level"] == {"value": "debug", "source": f"file {path}"}
    assert got["host"] == {"value": options.DEFAULT_HOST, "source": "default"}
    # the same, as text: one line per setting, its value and where it came from
    text = _invoke("serve", "--print-config", "--config", path, "--port", "3333",
                   env={"SHMQ_PORT": "2222", "SHMQ_WORKERS": "4"}).stdout
    assert re.search(r"^port += 3333 +# flag --port$", text, re.M), text
    assert re.search(r"^workers += 4 +# env SHMQ_WORKERS$", text, re.M), text
    assert re.search(rf"^heartbeat += 2\.0 +# file {re.escape(path)}$", text, re.M), text
    assert re.search(r'^host += "127\.0\.0\.1" +# default$', text, re.M), text


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = 1111\n")
    got = _printed(env={options.CONFIG_ENV: path})
    assert got["config"] == path and got["settings"]["port"]["value"] == 1111


def test_a_flag_turns_off_what_the_file_turns_on(tmp_path: Path) -> None:
    path = _write(tmp_path, "keep = true\nno_auth = true\n")
    got = _printed("--config", path, "--no-keep")["settings"]
    assert got["keep"] == {"value": False, "source": "flag --no-keep"}
    assert got["no_auth"] == {"value": True, "source": f"file {path}"}
    assert _printed("--config", path, env={"SHMQ_NO_AUTH": "0"})["settings"]["no_auth"]["value"] is False


def test_the_token_is_never_printed(tmp_path: Path) -> None:
    secret = "s3cret-never-shown"
    for as_json in (["--json"], []):
        out = _invoke("serve", "--print-config", *as_json, env={"SHMQ_TOKEN": secret})
        assert out.exit_code == 0 and secret not in out.output and "(set)" in out.output, out.output
    # a token file in the file and a token in the environment: the stronger source wins
    path = _write(tmp_path, 'token_file = "tok"\n')
    got = _printed("--config", path, env={"SHMQ_TOKEN": secret})["settings"]
    assert got["token"]["value"] == "(set)"
    assert got["token_file"]["value"] == "" and "unused" in got["token_file"]["note"]
    assert _printed("--config", path)["settings"]["token_file"]["value"] == str(tmp_path / "tok")


def test_paths_in_the_file_are_relative_to_its_folder(tmp_path: Path) -> None:
    path = _write(tmp_path, 'data_dir = "data"\ntls_cert = "/abs/c.pem"\nunix = "off"\n')
    got = _printed("--config", path)["settings"]
    assert got["data_dir"]["value"] == str(tmp_path / "data")
    assert got["tls_cert"]["value"] == "/abs/c.pem" and got["unix"]["value"] == "off"


# ---------------------------------------------------------------- bad files
def _refused(tmp_path: Path, text: str | None, *args: str) -> str:
    """The one error line of a config that is refused (exit 2, nothing started)."""
    path = _write(tmp_path, text) if text is not None else str(tmp_path / "missing.toml")
    out = _invoke("serve", "--config", path, *args)
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.output
    return out.stderr.strip().replace(path, "PATH")


def test_an_unknown_key_names_the_nearest_one(tmp_path: Path) -> None:
    assert _refused(tmp_path, "wokers = 4\n") == \
        "error: unknown key 'wokers' in PATH; did you mean 'workers'?"
    assert _refused(tmp_path, "[queues.orders]\ncapcity = 4\n") == \
        "error: unknown key 'capcity' in [queues.orders] of PATH; did you mean 'capacity'?"


def test_a_value_of_the_wrong_type_names_key_type_and_file(tmp_path: Path) -> None:
    assert _refused(tmp_path, 'port = "7878"\n') == "error: 'port' in PATH must be an integer, not str '7878'"
    assert "'workers' in PATH must be an integer, not bool" in _refused(tmp_path, "workers = true\n")
    assert "'keep' in PATH must be true or false" in _refused(tmp_path, "keep = 1\n")
    assert "'log_level' in PATH must be one of debug, info" in _refused(tmp_path, 'log_level = "loud"\n')
    assert "'durability' of [queues.q] in PATH must be a string" in _refused(
        tmp_path, "[queues.q]\ndurability = 1\n")
    assert "[queues.q] in PATH: capacity must be 1.." in _refused(tmp_path, "[queues.q]\ncapacity = 0\n")
    assert "invalid queue name" in _refused(tmp_path, '[queues."a b"]\n')
    assert "invalid group name" in _refused(tmp_path, '[queues.q]\ngroups = ["a b"]\n')


def test_a_token_in_the_file_is_refused(tmp_path: Path) -> None:
    line = _refused(tmp_path, 'token = "hunter2"\n')
    assert "'token' is not read from a config file" in line and "token_file" in line
    assert "hunter2" not in line


def test_a_missing_or_broken_file_is_one_line(tmp_path: Path) -> None:
    assert _refused(tmp_path, None) == "error: cannot read the config file PATH: No such file or directory"
    assert _refused(tmp_path, "port = \n") == \
        "error: PATH is not valid TOML: Invalid value (at line 1, column 8)"
    assert "not valid TOML" in _refused(tmp_path, "port = \n", "--print-config")  # it reads it too


def test_json_goes_with_print_config() -> None:
    out = _invoke("serve", "--json")
    assert out.exit_code == 2 and "--json goes with --print-config" in out.stderr


# ---------------------------------------------------------------- one table for all
def _serve_params() -> dict[str, Any]:
    import typer.main
    group: Any = typer.main.get_command(app)
    return {p.name: p for p in group.commands["serve"].params}


def test_the_table_is_the_serve_command() -> None:
    params = _serve_params()
    for s in cfg.SETTINGS:
        p = params[s.name]
        assert (p.default, p.envvar) == (s.default, s.env), s.name
        assert s.flag in p.opts and p.help == s.help, s.name
    assert set(params) - {s.name for s in cfg.SETTINGS} == {"config_file", "print_config", "as_json"}
    assert all(p.help for p in params.values())  # every option says what it is
    envs = cfg.SETTING["token"].env, cfg.SETTING["data_dir"].env
    assert envs == (options.TOKEN_ENV, options.DATA_DIR_ENV)  # the old names keep working


def test_the_help_shows_true_defaults() -> None:
    out = runner.invoke(app, ["serve", "--help"], env={**NO_ENV, "COLUMNS": "200"})
    assert out.exit_code == 0
    text = out.stdout[out.stdout.index("│ --workers"):]
    block = text[:text.index("│ --instance")]  # the --workers option, however it wraps
    assert "[default: (CPU count)]" in block and "[default: 0]" not in block, block


def test_the_sample_config_is_valid_and_names_every_key() -> None:
    sample = ROOT / "examples" / "shmq.toml"
    file = cfg.load(str(sample))
    text = sample.read_text()
    for s in cfg.SETTINGS:
        if s.in_file:
            assert re.search(rf"^(# )?{s.name} = ", text, re.M), f"examples/shmq.toml does not show {s.name}"
    assert {q.name for q in file.queues} == {"payments", "events"}
    payments = next(q for q in file.queues if q.name == "payments")
    assert payments.limits["durability"] == "always" and payments.groups == ("billing", "audit")


def test_the_sample_config_shares_nothing_with_the_quick_start() -> None:
    """The sample's queues come back at every start of its instance (a durable one from its
    journal): it has an instance (so a data dir) of its own, and no queue of the README's
    quick start (``shmq create orders`` there would fail with QUEUE_EXISTS)."""
    file = cfg.load(str(ROOT / "examples" / "shmq.toml"))
    assert file.settings["instance"] not in ("", options.DEFAULT_INSTANCE)
    assert "data_dir" not in file.settings  # so: the instance's own, ~/.local/share/shmq/example
    created = set(re.findall(r"shmq create ([\w.-]+)", (ROOT / "README.md").read_text()))
    assert created and not created & {q.name for q in file.queues}, created


def test_the_docs_name_every_key_and_variable() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc[doc.index("## Config file"):]
    for s in cfg.SETTINGS:
        assert f"`{s.name}`" in section and s.env in section, s.name
    for key in cfg.QUEUE_KEYS:
        assert f"`{key}`" in section, key


# ---------------------------------------------------------------- declared queues
def _declare(tmp_path: Path, capacity: int, name: str = "decl.toml") -> str:
    return _write(tmp_path, f"""
[queues.orders]
capacity = {capacity}
durability = "interval"
groups = ["billing"]

[queues.scratch]
max_deliveries = 7
""", name)


def test_declared_queues_are_created_then_checked(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = Server(workers=1, data_dir=str(data), extra=["--config", _declare(tmp_path, 1000)])
    try:
        assert f"supervisor pid {srv.proc.pid} (SIGTERM stops it)" in srv.start_line, srv.start_line
        with shmq.connect(srv.url) as b:
            orders = b.queue("orders").stats()
            assert orders["config"]["capacity"] == 1000 and orders["config"]["durability"] == "interval"
            assert set(orders["groups"]) == {"default", "billing"}
            assert b.queue("scratch").stats()["config"]["max_deliveries"] == 7
            b.queue("orders").put(b"kept")
    finally:
        assert srv.stop() == 0
    assert srv.stdout_at_stop.strip() == (f"shmq: stopped (pid {srv.proc.pid}): 1 memory queue removed; "
                                          f"1 durable queue kept in {data.resolve()}")
    # the same file again: `orders` comes back from its journal (rebuilt with more room than
    # declared, to hold what it had) and passes the check; `scratch` is made again
    again = Server(workers=1, instance=srv.instance, data_dir=str(data),
                   extra=["--config", _declare(tmp_path, 1000)])
    try:
        with shmq.connect(again.url) as b:
            assert b.queue("orders").get(group="billing", timeout=5).payload == b"kept"
            assert b.queue("orders").stats()["config"]["capacity"] > 1000  # the rebuild's room
            assert b.queue("scratch").stats()["config"]["max_deliveries"] == 7
    finally:
        assert again.stop() == 0
    # another capacity: refused, naming the queue, the setting and both values
    bad = _declare(tmp_path, 500, "bad.toml")
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                          "--workers", "1", "--instance", srv.instance, "--data-dir", str(data),
                          "--config", bad], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "", out
    assert (f"error: queue 'orders' exists with other settings: capacity = 1000 where {bad} says 500 "
            "(change the file, or delete the queue) (QUEUE_EXISTS)") in out.stderr, out.stderr
    assert not objects(srv.instance)  # nothing left running or mapped; the journal stays
    assert (data / "q-orders").is_dir()


def test_a_queue_that_differs_refuses_the_start(tmp_path: Path, instance: str) -> None:
    b = ShmBroker(instance)
    b.create_queue("scratch", max_deliveries=3)  # made before the broker, with other settings
    b.close()
    path = _write(tmp_path, "[queues.scratch]\nmax_deliveries = 7\ncapacity = 16384\n")
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                          "--workers", "1", "--instance", instance, "--data-dir", str(tmp_path / "d"),
                          "--config", path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "", out
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == (f"error: queue 'scratch' exists with other settings: max_deliveries = 3 where "
                         f"{path} says 7 (change the file, or delete the queue) (QUEUE_EXISTS)"), out.stderr
    b = ShmBroker(instance)  # the queue is as it was: nothing was changed to match
    assert b.queue("scratch").config.max_deliveries == 3
    b.close()


# ---------------------------------------------------------------- shmq status
def test_status_ready(server: Server) -> None:
    out = _invoke("status", "--url", server.url)
    assert (out.exit_code, out.stdout) == (0, "ready\nprimary, epoch 1, 0 standbys\n"), out.output
    out = _invoke("status", "--url", server.url, "--json")
    got = json.loads(out.stdout)
    assert out.exit_code == 0 and (got["ready"], got["reason"], got["replication"]["role"]) == (
        True, None, "primary"), out.output
    out = _invoke("status", "--shm", server.instance)
    assert (out.exit_code, out.stdout) == (0, "ready\n"), out.output


def test_status_not_ready() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        out = _invoke("status", "--url", f"tcp://127.0.0.1:{port}")
        assert out.exit_code == 1 and out.stdout.startswith("not ready: cannot connect"), out.output
        out = _invoke("status", "--url", f"tcp://127.0.0.1:{port}", "--json")
    got = json.loads(out.stdout)
    assert out.exit_code == 1 and got["ready"] is False and got["reason"].startswith("cannot connect")
    assert got["replication"] is None
    name = unique_instance()
    out = _invoke("status", "--shm", name)
    assert (out.exit_code, out.stdout) == (1, f"not ready: no broker serves instance {name!r}\n")
    assert not objects(name)  # asking created nothing


def test_status_gives_up_at_its_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # connects, then never answers the handshake
        t0 = time.monotonic()
        out = _invoke("status", "--url", f"tcp://127.0.0.1:{s.getsockname()[1]}", "--timeout", "0.3")
        took = time.monotonic() - t0
    assert (out.exit_code, out.stdout) == (1, "not ready: no answer within 0.3 s\n"), out.output
    assert took < 2


def test_status_of_a_broker_that_is_gone() -> None:
    srv = Server(workers=1)
    url, instance = srv.url, srv.instance
    assert srv.stop() == 0
    assert _invoke("status", "--url", url).exit_code == 1
    assert _invoke("status", "--shm", instance).stdout.startswith("not ready")
    assert not objects(instance)  # asking attached nothing, so made nothing


def test_the_stop_line_names_no_data_dir_when_nothing_is_durable() -> None:
    srv = Server(workers=1)
    try:
        with shmq.connect(srv.url) as b:
            b.create_queue("scratch").put(b"gone at stop")
    finally:
        assert srv.stop() == 0
    assert srv.stdout_at_stop.strip() == (f"shmq: stopped (pid {srv.proc.pid}): 1 memory queue removed "
                                          "with 1 unacknowledged message")


def test_a_port_in_use_is_one_plain_line() -> None:
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port",
                              str(port), "--instance", unique_instance(), "--unix", "off", "--no-auth"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr == (f"error: port {port} on 127.0.0.1 is in use by another process "
                          "(--port 0 picks a free one)\n"), out.stderr
