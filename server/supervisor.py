"""The supervisor: owns the instance, starts and watches the workers, reaps leases.

It creates (or safely re-attaches) the instance's shared memory, starts N
worker processes before it starts anything else (no threads here, so forking
is safe), restarts a worker that dies, and runs the lease reaper: expired
visibility timeouts, and leases of dead processes (workers and co-located
clients alike) come back within ``REAP_INTERVAL``.

Durable queues: before anything else the supervisor rebuilds, from the data
dir, every journaled queue whose shared memory is gone; then it starts the
journal process (``journaler``), restarted like a worker if it dies.

One instance has one broker: before it changes anything the supervisor takes the
instance's broker lock (``brokerlock``: a kernel lock that dies with the supervisor,
not with its children).  A second ``shmq serve`` on a served instance is refused
with one line naming the live broker, and exits 1 having touched nothing.  A
supervisor that was SIGKILLed leaves its lock free at once: the next ``shmq serve``
takes the instance over (its memory-only queues included).

SIGTERM / SIGINT: the workers stop accepting, finish the requests in progress,
give their leases back and exit; the journal process writes a last round for
every journaled queue; then the supervisor removes the instance's shared memory
(memory-only queues end with the broker; journaled ones come back from the data
dir on the next start), lets go of the lock and exits 0.

Crash points (``shmq.crashpoints``, for tests): an armed point kills one generation
of processes; a worker or journal process restarted after a death starts disarmed,
so a test sees the recovery rather than a crash loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing as mp
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from shmq import crashpoints, options, runtime
from shmq.core.serverqueue import ServerBroker
from shmq.errors import InvalidArgument, ShmqError
from shmq.resources import raise_fd_limit
from shmq.server.config import Effective, QueueDecl
from shmq.spin import check_spin_us
from shmq.text import plural
from shmq.tls import ServerTls, server_context

from . import declarations, logs
from . import replication as replication_mod
from .brokerlock import AlreadyServed, claim
from .journaler import check_data_dir, data_dir_for, journal_main, recover
from .metrics import is_loopback, listen, metrics_main, parse_address
from .placement import Counts
from .scoreboard import Scoreboard
from .worker import WorkerSettings, reuseport_socket, worker_main

LOOPBACK = runtime.LOOPBACK
log = logging.getLogger("shmq.supervisor")


def _child(role: str, log_setup: tuple[str, str], main: Any, *args: Any, close: Any = None) -> None:
    """A forked worker or journal process: its own log lines first, then its work.  ``close``:
    a socket inherited that is not this process's to hold (the replication listener, which
    is the journal process's)."""
    if close is not None:
        close.close()
    logs.setup(role, *log_setup)
    main(*args)


def exclusive_port(host: str, port: int) -> int:
    """The port (a free one for 0), checked to be unused by anyone: OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"port {port} on {host} is in use by another process "
                                       "(--port 0 picks a free one)") from None
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
        return int(s.getsockname()[1])


def unix_listener(path: str) -> socket.socket:
    """A listening Unix-domain socket at ``path``, mode 0600 (only our uid may connect;
    a peer of another uid, let in by a wider mode, must present the token).  A socket
    file left by a dead broker is replaced; one a live broker listens on is refused."""
    if os.path.exists(path):
        st = os.stat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket of ours: not replaced")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # stale: nobody listens
            else:
                raise OSError(errno.EADDRINUSE, f"{path}: another broker listens there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(4096)
    sock.setblocking(False)
    return sock


class Supervisor:
    def __init__(self, instance: str = options.DEFAULT_INSTANCE, host: str = options.DEFAULT_HOST,
                 port: int = options.DEFAULT_PORT, workers: int = 0, token: str = "",
                 max_connections: int = options.MAX_CONNECTIONS, keep: bool = False,
                 data_dir: str | None = None, sync_interval: float = options.DEFAULT_SYNC_INTERVAL,
                 segment_bytes: int = options.JOURNAL_SEGMENT_BYTES, log_level: str = logs.DEFAULT_LEVEL,
                 log_format: str = logs.DEFAULT_FORMAT, unix: str | None = None,
                 no_auth: bool = False, tls: ServerTls | None = None, *,
                 heartbeat: float = options.HEARTBEAT, queues: Sequence[QueueDecl] = (),
                 metrics: str | None = None, spin_us: float = options.WORKER_SPIN_US,
                 replication: str = options.DEFAULT_REPLICATION, replication_port: int = 0,
                 sync_timeout: float = options.DEFAULT_SYNC_TIMEOUT, replication_announce: str = "") -> None:
        if tls is not None:
            server_context(tls)  # a file that cannot be used is named now, before any worker starts
        self.tls = tls
        if host not in LOOPBACK and not token:
            raise InvalidArgument(f"binding {host} (not loopback) needs an auth token: "
                                  f"${options.TOKEN_ENV} or --token-file" + (
                                      " (--no-auth is for loopback only)" if no_auth else ""))
        # Authentication is on by default: without a token, one is made now and left for
        # this user's clients in the runtime folder (shmq.runtime); --no-auth opts out.
        self.generated = not token and not no_auth
        if self.generated:
            token = secrets.token_urlsafe(32)
        self.token_file: str | None = None
        # --metrics HOST:PORT: an endpoint served by a process of its own (server.metrics)
        self.metrics = parse_address(metrics) if metrics else None
        if self.metrics and not is_loopback(self.metrics[0]) and not token:
            raise InvalidArgument(f"--metrics on {self.metrics[0]} (not loopback) needs the broker's token "
                                  "for its scrapers; --no-auth is for loopback only")
        self.metrics_sock: socket.socket | None = None
        self.metrics_proc: Any = None
        if log_level not in logs.LEVELS or log_format not in logs.FORMATS:
            raise InvalidArgument(f"--log-level must be one of {', '.join(logs.LEVELS)} and --log-format "
                                  f"one of {', '.join(logs.FORMATS)}")
        self.log = (log_level, log_format)
        self.instance = instance
        self.host = host
        self.port = port
        self.n = workers or min(mp.cpu_count(), options.MAX_WORKERS)
        if not 0 < self.n <= options.MAX_WORKERS:
            raise InvalidArgument(f"--workers must be between 1 and {options.MAX_WORKERS}")
        self.token = token
        # a Unix-domain socket beside the TCP port: "auto" is tcp-<port>.sock in the runtime folder
        self.unix = unix if unix in (None, "auto") else os.path.abspath(unix)
        self.unix_sock: socket.socket | None = None
        self.max_connections = max_connections
        if not 0 <= heartbeat <= 3600:
            raise InvalidArgument("--heartbeat must be in [0, 3600] seconds (0: none)")
        self.heartbeat = heartbeat
        self.spin_us = check_spin_us(spin_us, "--spin-us")
        self.keep = keep
        if not 0 < sync_interval <= 3600:
            raise InvalidArgument("sync interval must be in (0, 3600] seconds")
        self.data_dir = data_dir_for(instance, data_dir)
        self.sync_interval = sync_interval
        self.segment_bytes = segment_bytes
        self.queues = tuple(queues)  # declared in the config file: checked, else created, at start
        self.journal: Any = None
        self.counts = Counts(self.n)  # connections per worker, shared with the workers we fork
        self.board = Scoreboard(self.n) if self.metrics else None  # what only one process knows
        if replication not in ("async", "sync"):
            raise InvalidArgument("--replication must be async or sync")
        if not 0 <= replication_port <= 65535:
            raise InvalidArgument("--replication-port must be 0..65535 (0: any free port)")
        if not 0 < sync_timeout <= 3600:
            raise InvalidArgument("--sync-timeout must be in (0, 3600] seconds")
        self.replication = replication
        self.announce = parse_address(replication_announce, "--replication-announce") \
            if replication_announce else None
        self.replication_port = replication_port
        self.sync_timeout = sync_timeout
        self.repl_board = replication_mod.Board()  # what the journal process tells the workers' INFO
        self.repl_sock: socket.socket | None = None
        self.repl_port = 0  # its port, once bound
        self.repl: tuple[Any, ...] | None = None
        self.epoch = 1  # read from the data dir at start (server.replication.read_state)
        self.forks: dict[str, int] = {}
        self.ctx = mp.get_context("fork")
        self.procs: dict[int, Any] = {}
        self._stop = False

    @classmethod
    def from_settings(cls, eff: Effective, token: str) -> Supervisor:
        """The broker of ``shmq serve``'s settings (``shmq.server.config``); ``token``: the one in effect
        (``token`` or the first line of ``token_file``)."""
        v = eff.values
        if (v["tls_cert"] or v["tls_client_ca"]) and not (v["tls_cert"] and v["tls_key"]):
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
        tls = ServerTls(v["tls_cert"], v["tls_key"], v["tls_client_ca"]) if v["tls_cert"] else None
        return cls(v["instance"], v["host"], v["port"], v["workers"], token, v["max_connections"], v["keep"],
                   v["data_dir"] or None, v["sync_interval"], v["journal_segment_bytes"], v["log_level"],
                   v["log_format"], None if v["unix"] in ("", "off") else v["unix"], v["no_auth"], tls,
                   heartbeat=v["heartbeat"], queues=eff.queues, metrics=v["metrics"] or None,
                   spin_us=v["spin_us"], replication=v["replication"], replication_port=v["replication_port"],
                   sync_timeout=v["sync_timeout"], replication_announce=v["replication_announce"])

    def worker_settings(self, i: int) -> WorkerSettings:
        """What worker ``i`` is started with."""
        return WorkerSettings(instance=self.instance, host=self.host, port=self.port, worker_id=i,
                              token=self.token, max_connections=self.max_connections, counts=self.counts,
                              unix_sock=self.unix_sock, tls=self.tls, heartbeat=self.heartbeat,
                              board=self.board, spin_us=self.spin_us, replication=self._replication_info)

    def _replication_info(self) -> dict[str, Any]:
        """INFO's ``replication`` (read in a worker: the journal process writes the board)."""
        port = self.repl_port or None  # (a worker closed its copy of the socket: the number is kept)
        host = ""  # (the host of the URL the standby used)
        if self.announce is not None:
            host, port = self.announce
        return {"role": "primary", "epoch": self.epoch, "standbys": [], **self.repl_board.read(),
                "host": host, "port": port}

    def _start(self, i: int) -> None:
        ready = self.ctx.Event()
        p = self.ctx.Process(target=_child, name=f"shmq-worker-{i}", daemon=False,
                             args=(f"worker-{i}", self.log, worker_main, self.worker_settings(i), ready),
                             kwargs={"close": self.repl_sock})
        p.start()
        self.procs[i] = (p, ready)

    def _start_journal(self) -> None:
        ready = self.ctx.Event()
        p = self.ctx.Process(target=_child, name="shmq-journal", daemon=False,
                             args=("journal", self.log, journal_main, self.instance, str(self.data_dir),
                                   self.sync_interval, self.segment_bytes, ready, self.board, self.repl))
        p.start()
        if not ready.wait(30):
            raise ShmqError("the journal process did not start")
        self.journal = p

    def _open_replication(self) -> None:
        """The replication listener (``server.replication``), served by the journal process."""
        self.repl_sock = listen(self.host, self.replication_port, "--replication-port")
        self.repl_port = self.repl_sock.getsockname()[1]
        tls = None if self.tls is None else server_context(self.tls)
        node = f"{socket.gethostname()}:{self.port}"
        hub = replication_mod.Hub(self.epoch, node, self.token, self.forks, self.repl_board,
                                  self.sync_timeout, self.data_dir)
        self.repl = (self.repl_sock, hub, tls, self.replication)

    def _start_metrics(self) -> None:
        """The metrics process (``server.metrics``): serves the socket bound at start.  Off
        loopback it wants the token, and speaks TLS when the broker does."""
        assert self.metrics is not None and self.metrics_sock is not None
        open_ = is_loopback(self.metrics[0])
        tls = None if open_ or self.tls is None else server_context(self.tls)
        ready = self.ctx.Event()
        p = self.ctx.Process(target=_child, name="shmq-metrics", daemon=False,
                             args=("metrics", self.log, metrics_main, self.instance, self.metrics_sock,
                                   "" if open_ else self.token, tls, self.board, self.counts, ready,
                                   self._replication_info), kwargs={"close": self.repl_sock})
        p.start()
        if not ready.wait(30):
            raise ShmqError("the metrics process did not start")
        self.metrics_proc = p

    def _metrics_url(self) -> str:
        assert self.metrics is not None and self.metrics_sock is not None
        host, port = self.metrics[0], self.metrics_sock.getsockname()[1]
        scheme = "https" if self.tls is not None and not is_loopback(host) else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{options.METRICS_PATH}"

    def serve(self, announce: Any = print) -> int:
        """Run the broker until SIGTERM / SIGINT; the exit status (1: the instance is served
        by another broker already, and nothing was changed)."""
        logs.setup("supervisor", *self.log)
        if self.tls is None and self.host not in LOOPBACK:
            log.warning("listening on %s without TLS: tokens and messages cross the network in clear "
                        "text (shmq serve --tls-cert FILE --tls-key FILE)", self.host)
        # A stop asked for during start-up is honoured once the workers are up.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # The broker lock first: until it is ours, the instance may be another broker's,
        # and nothing of it may be taken over, rebuilt or removed.
        try:
            broker, lock = claim(self.instance)
        except AlreadyServed as e:
            print(f"shmq: {e}", file=sys.stderr)
            return 1
        reg = broker.registry
        reg.take_ownership()  # (also how a refused newcomer learns our pid)
        # every process we fork inherits the limit: a worker's connections, the journal's files
        per_process = max(self.max_connections, options.MAX_QUEUES * options.JOURNAL_FDS_PER_QUEUE)
        _, short = raise_fd_limit(per_process + options.FD_RESERVE)
        if short:
            log.warning("%s", short)
        # queues that outlived a crashed broker: a failed start leaves them for the next one
        inherited = bool(reg.queues())
        probe = None
        try:
            # Refuse a port someone already listens on (a plain bind fails even against
            # SO_REUSEPORT sockets, so we never join another broker's port group), then
            # reserve it with SO_REUSEPORT for our workers.
            self.port = exclusive_port(self.host, self.port)
            probe = reuseport_socket(self.host, self.port)
            if self.metrics is not None:  # a bad address or a port in use: an error before anything runs
                self.metrics_sock = listen(*self.metrics)
                if self.tls is None and not is_loopback(self.metrics[0]):
                    log.warning("metrics on %s without TLS: the token crosses the network in clear text",
                                self.metrics[0])
            runtime.sweep()  # what brokers killed before they could clean up left in the runtime folder
            if self.unix == "auto":
                self.unix = str(runtime.socket_path(self.port))
            if self.unix:  # one listening socket, inherited by every worker: each accepts on it
                self.unix_sock = unix_listener(self.unix)
            check_data_dir(self.data_dir)  # (a clear error for a data dir that cannot be used, first)
            state = replication_mod.read_state(self.data_dir)
            if state.get("role") == "standby":
                raise InvalidArgument(
                    f"{self.data_dir} is a standby's (of {state.get('primary') or '?'}, epoch "
                    f"{state['epoch']}): start it with --replica-of, or promote it (shmq promote) before it "
                    "serves as a primary")
            if int(state.get("superseded_by", 0)) > int(state["epoch"]):
                raise InvalidArgument(
                    f"{self.data_dir} was the primary in epoch {state['epoch']}, and a node of epoch "
                    f"{state['superseded_by']} exists: rejoin it as a standby (shmq serve --replica-of "
                    "THE-NEW-PRIMARY); it discards what the new primary lacks")
            self.epoch = int(state["epoch"])
            self.forks = {str(k): int(v) for k, v in state.get("forks", {}).items()}
            # queues whose shared memory is gone (a reboot, a stop) come back from their journals
            for line in recover(broker, self.data_dir):
                log.info("%s", line)
            replication_mod.create_definitions(broker, self.data_dir)  # a promoted standby's memory queues
            declarations.check(broker, self.queues, self.data_dir)  # the recovered ones too
            self._open_replication()
            self._start_journal()
            declarations.create(broker, self.queues)  # before any worker accepts a client
            for i in range(self.n):
                self._start(i)
            for p, ready in self.procs.values():
                if not ready.wait(30):
                    raise ShmqError(f"worker {p.name} did not start")
            if self.metrics is not None:
                self._start_metrics()
            if self.generated:  # once the workers listen: a sweep elsewhere sees this broker alive
                self.token_file = str(runtime.write_token(self.port, self.token))
        except BaseException:
            self._shutdown()
            self._close_unix()
            self._close_replication()
            self._close_metrics()
            self._remove_token()
            if probe is not None:
                probe.close()
            if self.keep or inherited:
                broker.close()
            else:
                broker.destroy()
            lock.release()
            raise
        unix = f" and unix://{self.unix}" if self.unix else ""
        scheme = "tcp" if self.tls is None else "tcps"
        mtls = " (client certificates required)" if self.tls is not None and self.tls.client_ca else ""
        auth = (f"; token for this user's clients in {self.token_file}" if self.token_file
                else "" if self.token else "; NO AUTHENTICATION (--no-auth)")
        metrics = (f"; metrics on {self._metrics_url()} (pid {self.metrics_proc.pid})"
                   if self.metrics_proc is not None else "")
        repl = f"; standbys connect to port {self.repl_port} (epoch {self.epoch})" if self.repl_port else ""
        announce(f"shmq: instance {self.instance!r} listening on {scheme}://{self.host}:{self.port}{mtls}"
                 f"{unix} with {plural(self.n, 'worker')}; journal in {self.data_dir} "
                 f"(writer pid {self.journal.pid}){repl}{metrics}{auth}; supervisor pid {os.getpid()} "
                 "(SIGTERM stops it)")
        sys.stdout.flush()
        try:
            self._watch(broker)
        finally:
            self._shutdown()
            self._close_unix()
            self._close_replication()
            self._close_metrics()
            self._remove_token()
            probe.close()
            what = self._survivors(broker)
            if self.keep:
                broker.close()
            else:
                broker.destroy()
            lock.release()  # after the removal: a newcomer must not attach what we remove
        announce(f"shmq: stopped (pid {os.getpid()}): {what}")
        sys.stdout.flush()
        return 0

    def _survivors(self, broker: ServerBroker) -> str:
        """What stopping removes and what it keeps, in words (the workers are gone)."""
        try:
            infos = broker.list_queues()
        except ShmqError as e:
            return f"queues unknown ({e})"
        if not infos:
            return "no queues"
        if self.keep:
            return f"{plural(len(infos), 'queue')} kept in shared memory (--keep)"
        durable = sum(1 for i in infos if i.config.durability != "memory")
        held = 0  # the messages that go with the memory queues
        for i in infos:
            q = broker.find(i.name) if i.config.durability == "memory" else None
            if q is not None:
                try:
                    held += int(q.stats()["retained"])
                except ShmqError:
                    pass
        removed = f"{plural(len(infos) - durable, 'memory queue')} removed" + (
            f" with {plural(held, 'unacknowledged message')}" if held else "")
        if not durable:
            return removed
        return f"{removed}; {plural(durable, 'durable queue')} kept in {self.data_dir}"

    def _remove_token(self) -> None:
        if self.token_file is not None:
            runtime.remove_token(self.port, self.token)
            self.token_file = None

    def _close_unix(self) -> None:
        """Close the Unix socket and remove its file (the workers are gone)."""
        if self.unix_sock is not None:
            self.unix_sock.close()
            self.unix_sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix)  # type: ignore[arg-type]

    def _close_replication(self) -> None:
        if self.repl_sock is not None:
            self.repl_sock.close()
            self.repl_sock = None

    def _close_metrics(self) -> None:
        if self.metrics_sock is not None:
            self.metrics_sock.close()
            self.metrics_sock = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop = True

    def _watch(self, broker: ServerBroker) -> None:
        next_maint = 0.0
        while not self._stop:
            sentinels = {p.sentinel: i for i, (p, _) in self.procs.items()}
            if self.journal is not None:
                sentinels[self.journal.sentinel] = -1
            if self.metrics_proc is not None:
                sentinels[self.metrics_proc.sentinel] = -2
            for s in wait(list(sentinels), timeout=0.05):
                i = sentinels[s]  # type: ignore[index]
                crashpoints.disarm()  # its replacement (forked from us) starts disarmed
                if i == -2:
                    self.metrics_proc.join()
                    if not self._stop:
                        log.warning("the metrics process exited with %s; restarting",
                                    self.metrics_proc.exitcode)
                        self._start_metrics()
                    continue
                if self.board is not None and not self._stop:
                    self.board.restarted(i)  # (-1: the journal process)
                if i == -1:
                    self.journal.join()
                    if not self._stop:
                        log.warning("the journal process exited with %s; restarting", self.journal.exitcode)
                        self._start_journal()
                    continue
                p, _ = self.procs.pop(i)
                p.join()
                if self._stop:
                    continue
                log.warning("worker %d (pid %d) exited with %s; restarting", i, p.pid, p.exitcode)
                broker.reap()  # its connections' leases come back now
                self._start(i)
            now = time.monotonic()
            if now >= next_maint:
                next_maint = now + options.REAP_INTERVAL
                try:
                    broker.maintain()  # the lease reaper
                except Exception as e:  # noqa: BLE001 - the supervisor must outlive any one queue
                    log.error("maintenance failed: %r", e, exc_info=e)

    def _shutdown(self) -> None:
        m, self.metrics_proc = self.metrics_proc, None
        if m is not None and m.is_alive():
            m.terminate()
            m.join(options.SHUTDOWN_GRACE)
            if m.is_alive():
                m.kill()
                m.join()
        for p, _ in self.procs.values():
            if p.is_alive():
                p.terminate()  # SIGTERM: graceful in the worker
        deadline = time.monotonic() + options.SHUTDOWN_GRACE + 1
        for p, _ in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self.procs.clear()
        # the workers are gone: a last journal round for every queue, then the writer ends
        j, self.journal = self.journal, None
        if j is not None and j.is_alive():
            j.terminate()
            j.join(options.SHUTDOWN_GRACE + 5)
            if j.is_alive():
                j.kill()
                j.join()
