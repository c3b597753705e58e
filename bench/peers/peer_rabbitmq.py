"""RabbitMQ: Debian's rabbitmq-server, started here by hand, not as the system's service: its own
node name, AMQP and distribution ports on 127.0.0.1, its own epmd (started first, on a port of its
own, and stopped after), its data and logs in a temp dir, no plugins; pika's BlockingConnection.

Work queue: the producer publishes to the default exchange, with publisher confirms (pika waits
for each confirm: a confirmed put) or without; batches: one AMQP transaction per batch
(``tx.commit`` waited for).  The consumer is a push consumer (``basic.consume``, prefetch
``PREFETCH``) that acks each message with ``basic.ack`` (batches: one ``basic.ack`` with
``multiple``); AMQP 0-9-1 has no answer to an ack, so no ack can be waited for.  Classic queues
are transient (non-durable queue, transient messages: memory); quorum queues are durable and
write every message to their Raft log, fsync'd before the confirm."""

from __future__ import annotations

import os
import shutil
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import common

import peers
from peers import Go, Ready, Variant

try:
    import pika  # type: ignore[import-untyped,import-not-found]
except ImportError:  # reported by available()
    pika = None

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # Debian's, without the wrapper that switches user
PREFETCH = 100
CLASSIC_CONFIRM, CLASSIC, QUORUM_CONFIRM, QUORUM = ("classic, confirms", "classic, no confirms",
                                                    "quorum, confirms", "quorum, no confirms")
_CONSUME = (f"push consumer (basic.consume, prefetch {PREFETCH}), basic.ack each (AMQP has no answer to "
            "wait for)")


def server_binary() -> str | None:
    if os.access(SERVER, os.X_OK):
        return SERVER
    return shutil.which("rabbitmq-server")


def _params(port: int) -> Any:
    return pika.ConnectionParameters("127.0.0.1", port, heartbeat=0, blocked_connection_timeout=None)


def _consume(ready: Ready, port: int, queue: str, n: int, batch: int) -> tuple[int, bytes]:
    conn = pika.BlockingConnection(_params(port))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=max(PREFETCH, 2 * batch))
        ready()
        got = 0
        body = b""
        ack = ch.basic_ack
        for method, _props, data in ch.consume(queue):
            body = data
            got += 1
            if batch == 1:
                ack(method.delivery_tag)
            elif got % batch == 0 or got == n:
                ack(method.delivery_tag, multiple=True)
            if got == n:
                break
        ch.cancel()
        return got, body
    finally:
        conn.close()


def _produce(go: Go, port: int, queue: str, n: int, size: int, batch: int, confirms: bool,
             persistent: bool) -> None:
    conn = pika.BlockingConnection(_params(port))
    try:
        ch = conn.channel()
        props = pika.BasicProperties(delivery_mode=2 if persistent else 1)
        payload = b"x" * size
        publish = ch.basic_publish
        if batch == 1:
            if confirms:
                ch.confirm_delivery()  # each basic_publish now waits for its confirm
            go()
            for _ in range(n):
                publish("", queue, payload, props)
            return
        if confirms:
            ch.tx_select()  # a batch is one transaction: tx_commit waits for the broker
        go()
        for _ in range(n // batch):
            for _ in range(batch):
                publish("", queue, payload, props)
            if confirms:
                ch.tx_commit()
    finally:
        conn.close()


def _consuming(conn: Any, queue: str) -> tuple[Any, Iterator[Any]]:
    """A channel of ``conn`` with publisher confirms, consuming ``queue`` (prefetch
    PREFETCH), and its deliveries: a ping-pong side's."""
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_qos(prefetch_count=PREFETCH)
    return ch, ch.consume(queue)


def _pong(ready: Ready, port: int, queues: tuple[str, str], total: int) -> None:
    conn = pika.BlockingConnection(_params(port))
    try:
        ch, deliveries = _consuming(conn, queues[0])
        ready()
        for _ in range(total):
            method, _props, body = next(deliveries)
            ch.basic_publish("", queues[1], body)
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    finally:
        conn.close()


def _ping(go: Go, port: int, queues: tuple[str, str], size: int, total: int) -> array[int]:
    conn = pika.BlockingConnection(_params(port))
    try:
        ch, deliveries = _consuming(conn, queues[1])
        payload = b"p" * size
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        go()
        for i in range(total):
            t0 = clock()
            ch.basic_publish("", queues[0], payload)
            method, _props, _body = next(deliveries)
            lat[i] = clock() - t0
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
        return lat
    finally:
        conn.close()


class RabbitPeer(peers.Peer):
    name = "RabbitMQ"
    summary = ("Debian's rabbitmq-server on 127.0.0.1, its own node, ports, epmd and temp data dir, no "
               "plugins; pika's BlockingConnection, which handles each frame in Python")
    work_queue_variants = (
        Variant(CLASSIC_CONFIRM, "classic queue, transient (memory); publisher confirms, each waited; "
                f"{_CONSUME}", "tcp", acks="not waited"),
        Variant(CLASSIC, f"classic queue, transient (memory); no confirms; {_CONSUME}", "tcp",
                acks="not waited", puts="not confirmed"),
        Variant(QUORUM_CONFIRM, "quorum queue (Raft log on disk, fsync'd before the confirm), persistent "
                f"messages; publisher confirms, each waited; {_CONSUME}", "tcp", durability="disk, fsync",
                acks="not waited"),
        Variant(QUORUM, f"quorum queue, persistent messages; no confirms; {_CONSUME}", "tcp",
                durability="disk, fsync", acks="not waited", puts="not confirmed"),
    )
    ping_variants = (
        Variant("classic, confirms", "two transient classic queues (ping, pong): A publishes on ping "
                "(confirm waited) and consumes pong, B consumes ping, publishes pong (confirm waited), acks "
                "ping; A acks after its timing", "tcp", acks="not waited"),
    )
    batch_variants = (CLASSIC_CONFIRM, QUORUM_CONFIRM)  # a transaction per batch instead of a confirm each
    size_variants = (CLASSIC_CONFIRM,)

    def __init__(self) -> None:
        super().__init__()
        self.port = 0
        self.server_version = "?"

    def available(self) -> str | None:
        if pika is None:
            return "pika is not installed (pip install pika, or make bench)"
        if server_binary() is None:
            return "no rabbitmq-server (apt-get install rabbitmq-server, or make bench as root)"
        if shutil.which("epmd") is None:
            return "no epmd (it comes with rabbitmq-server's Erlang)"
        return None

    def version(self) -> str:
        return f"rabbitmq-server {self.server_version}, pika {peers.dist_version('pika')}"

    @contextmanager
    def server(self) -> Iterator[None]:
        with peers.temp_dir("rabbitmq") as tmp:
            started: tuple[peers.Daemon, peers.Daemon] | str = ""
            for _ in range(3):  # a free port may be taken between probing and binding
                started = self._start(tmp)
                if not isinstance(started, str):
                    break
            if isinstance(started, str):
                raise peers.SetupError(f"rabbitmq-server did not start: {started}")
            epmd, rabbit = started
            try:
                yield
            finally:
                rabbit.stop()
                epmd.stop()
                self.notes += rabbit.notes + epmd.notes

    def _start(self, tmp: str) -> tuple[peers.Daemon, peers.Daemon] | str:
        """epmd, then the broker; or why not (then nothing is left running)."""
        epmd_port, node_port, dist_port = peers.free_port(), peers.free_port(), peers.free_port()
        epmd_bin = shutil.which("epmd")
        assert epmd_bin is not None
        epmd = peers.Daemon("epmd", [epmd_bin, "-d", "-port", str(epmd_port), "-address", "127.0.0.1"],
                            os.path.join(tmp, f"epmd-{epmd_port}.log"))
        try:
            epmd.start(rb"epmd running")
        except peers.SetupError as e:
            return str(e)
        node = f"shmqbench{os.getpid()}_{node_port}"
        base = os.path.join(tmp, node)
        os.makedirs(base)
        with open(os.path.join(base, "enabled_plugins"), "w") as f:
            f.write("[].\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "HOME": base,  # its Erlang cookie goes here, not in ours
            "RABBITMQ_NODENAME": f"{node}@localhost", "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(node_port), "RABBITMQ_DIST_PORT": str(dist_port),
            "ERL_EPMD_PORT": str(epmd_port), "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": os.path.join(base, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(base, "log"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(base, "rabbitmq-env.conf"),  # none: not /etc's
            "RABBITMQ_CONFIG_FILE": os.path.join(base, "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": os.path.join(base, "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(base, "enabled_plugins"),
            "RABBITMQ_PID_FILE": os.path.join(base, "pid"),
        })
        binary = server_binary()
        assert binary is not None
        rabbit = peers.Daemon("rabbitmq-server", [binary], os.path.join(tmp, f"rabbitmq-{node_port}.log"),
                              env=env, cwd=base)
        try:
            rabbit.start(rb"Starting broker\.\.\. completed")
            conn = pika.BlockingConnection(_params(node_port))
            version = conn._impl.server_properties.get("version", b"?")
            conn.close()
        except (peers.SetupError, pika.exceptions.AMQPError, OSError) as e:
            rabbit.stop()
            epmd.stop()
            return str(e)
        self.port = node_port
        self.server_version = version.decode() if isinstance(version, bytes) else str(version)
        return epmd, rabbit

    def _admin(self, fn: Any) -> None:
        conn = pika.BlockingConnection(_params(self.port))
        try:
            fn(conn.channel())
        finally:
            conn.close()

    def _declare(self, queue: str, quorum: bool) -> None:
        args = {"x-queue-type": "quorum"} if quorum else None
        self._admin(lambda ch: ch.queue_declare(queue, durable=quorum, arguments=args))

    def _delete(self, *queues: str) -> None:
        def delete(ch: Any) -> None:
            for q in queues:
                ch.queue_delete(q)

        self._admin(delete)

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        v = self.variant(variant)
        quorum = variant.startswith("quorum")
        queue = f"wq{next(self._ids)}"
        self._declare(queue, quorum)
        try:
            return peers.throughput(_consume, _produce, (self.port, queue, n, batch),
                                    (self.port, queue, n, size, batch, v.puts == "confirmed", quorum),
                                    n, size, self.timeout)
        finally:
            self._delete(queue)

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        k = next(self._ids)
        queues = (f"ping{k}", f"pong{k}")
        for q in queues:
            self._declare(q, False)
        total = n + common.PING_WARMUP
        try:
            return peers.ping_pong(_pong, _ping, (self.port, queues, total), (self.port, queues, size, total),
                                   total, self.timeout)
        finally:
            self._delete(*queues)


PEER = RabbitPeer()

