"""The primary's side of replication: the journal process streams every round to its standbys.

::

    QueueWriter (one thread per journaled queue)          Link (one per standby: 2 threads)
    ───────────────────────────────────────────           ─────────────────────────────────
    round: append records + state to the journal   ──►    publish(): the same bytes, queued as a
                                                            ROUND with the next ``seq``
           fsync the local journal                         sender: sendall() in seq order
           ``replication="sync"``: publish the              reader: ACK seq (the standby fsynced
           marks only once a standby ACKed the      ◄──       every ROUND up to it): wake the
           round (``confirmed``)                               writers of sync queues

A standby's HELLO names what its journals hold (``{queue: {created_ns, next}}``).  For each
queue the primary then decides, under that queue writer's lock (so no round slips between
the copy and the live stream):

* **resume** when the standby holds the same queue (same ``created_ns``) and its history did
  not part from ours: it is sent the messages from its ``next`` on, read from our journal
  files, and the newest state.  Messages we dropped meanwhile are settled in every group,
  so a standby never needs them: a resume never turns into a full copy for lack of backlog.
* **full copy** otherwise: a QUEUE frame with ``full`` (the standby drops what it holds of
  that name), then every message our journal holds, then the newest state.

Memory-only queues are sent as definitions only (a QUEUE frame, never a ROUND).

A ``sync`` round is confirmed once one standby that holds the queue ACKs a ``seq`` at least
the round's (and at least the seq of that standby's copy of the queue).  With no such ACK
within ``--sync-timeout`` the queue's journal error is set (``ENOLINK``): its waiting and new
produces get ``StorageError`` until a standby confirms, which publishes the marks and
clears it.  The bytes queued for a standby are bounded (``REPLICATION_SEND_BUFFER``): past
that the link is cut, and the standby resumes from its position when it reconnects.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import mmap
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from shmq import options
from shmq.errors import Status
from shmq.journal import encode_messages, encode_state, read_records
from shmq.protocol.replication import K, StreamDecoder, StreamFrame, encode


class QueueWriter(Protocol):
    """What the hub needs of a queue's journal writer (``server.journaler.QueueWriter``)."""

    q: Any  # the ServerQueue: name, meta()
    d: Any  # its Durability: created_ns, wake_writer()
    journal: Any  # its Journal: segment_files()
    lock: threading.Lock  # held over a round: the copy is made under it
    next: int  # one past the last offset journaled
    sync_replicated: bool  # its rounds wait for a standby's ACK
    unconfirmed: list[Any]  # sync rounds not yet confirmed by a standby

log = logging.getLogger("shmq.replication")


# ---------------------------------------------------------------------------- the node's state


def read_state(data_dir: Path) -> dict[str, Any]:
    """The node's replication state (``replication.json`` in the data dir): ``epoch`` (1 for
    a node that was never promoted), ``role`` and, after a promote, ``forks``: each queue's
    next offset when this node's epoch began (an older node's records from there on are
    not ours, and are discarded when it rejoins)."""
    path = data_dir / options.REPLICATION_STATE_FILE
    try:
        state = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {"epoch": 1, "role": "primary", "forks": {}, "primary": ""}
    except (OSError, ValueError) as e:
        raise OSError(f"cannot read {path}: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
        raise OSError(f"{path} is not a replication state file")
    state.setdefault("forks", {})
    state.setdefault("primary", "")
    return state


def write_state(data_dir: Path, state: dict[str, Any]) -> None:
    """Replace ``replication.json`` atomically and durably (tmp file, fsync, rename, fsync dir)."""
    os.makedirs(data_dir, mode=options.JOURNAL_DIR_MODE, exist_ok=True)
    path = data_dir / options.REPLICATION_STATE_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(state, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DEFINITIONS_FILE = "memory-queues.json"  # a standby's copy of its primary's memory-only queues


def create_definitions(broker: Any, data_dir: Path) -> None:
    """A promoted standby creates its primary's memory-only queues (empty: their messages were
    never replicated), once: the file goes afterwards."""
    path = data_dir / DEFINITIONS_FILE
    try:
        metas = json.loads(path.read_bytes())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        log.error("cannot read %s: %s; the memory-only queues it defines are not created", path, e)
        return
    for meta in metas.values():
        if meta.get("is_dlq") or broker.find(meta["name"]) is not None:
            continue
        try:
            broker.create_queue(meta["name"], **meta["config"])
            log.info("queue %r (memory only) created from the primary's definition", meta["name"])
        except Exception as e:  # noqa: BLE001 - one bad definition must not stop the rest
            log.error("cannot create queue %r from its definition: %s", meta["name"], e)
    path.unlink(missing_ok=True)


class Board:
    """What the journal process tells the workers of replication (for INFO and metrics): a
    JSON object in anonymous shared memory made by the supervisor before it forks.  A
    version word around each write (odd while writing) lets a reader retry a torn read."""

    SIZE = 64 * 1024
    _HEAD = struct.Struct("<QI")  # version, length

    def __init__(self) -> None:
        self._mm = mmap.mmap(-1, self.SIZE)

    def write(self, value: dict[str, Any]) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()[:self.SIZE - self._HEAD.size]
        version = self._HEAD.unpack_from(self._mm, 0)[0]
        self._HEAD.pack_into(self._mm, 0, version + 1, 0)
        self._mm[self._HEAD.size:self._HEAD.size + len(data)] = data
        self._HEAD.pack_into(self._mm, 0, version + 2, len(data))

    def read(self) -> dict[str, Any]:
        for _ in range(100):
            version, n = self._HEAD.unpack_from(self._mm, 0)
            data = bytes(self._mm[self._HEAD.size:self._HEAD.size + n])
            if version % 2 == 0 and self._HEAD.unpack_from(self._mm, 0)[0] == version:
                try:
                    return json.loads(data) if data else {}
                except ValueError:
                    pass
        return {}


# ---------------------------------------------------------------------------- reading our journal


def journal_contents(writer: QueueWriter, floor: int) -> tuple[list[tuple[Any, ...]], bytes | None]:
    """The messages of ``writer``'s journal from offset ``floor`` on, and its newest state
    (call under ``writer.lock``: the files do not change meanwhile)."""
    items: list[tuple[Any, ...]] = []
    state = None
    for path in writer.journal.segment_files():
        more, st, _ = read_records(path.read_bytes(), floor, int(path.name[:20]))
        items += more  # (the journal writer recovered these files: a bad record cannot be here)
        state = st if st is not None else state
    return items, state


def chunks(items: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    """``items`` in runs of about ``REPLICATION_CHUNK`` bytes of payload (at least one each)."""
    run: list[tuple[Any, ...]] = []
    size = 0
    for it in items:
        n = len(it[2]) + (len(it[3]) if len(it) > 3 else 0)
        if run and size + n > options.REPLICATION_CHUNK:
            yield run
            run, size = [], 0
        run.append(it)
        size += n
    if run:
        yield run


# ---------------------------------------------------------------------------- the hub


class Hub:
    """Every standby link of this primary, and what the journal writers publish to them."""

    def __init__(self, epoch: int, node: str, token: str, forks: dict[str, int],
                 board: Board | None = None, sync_timeout: float = options.DEFAULT_SYNC_TIMEOUT,
                 data_dir: Path | None = None) -> None:
        self.epoch = epoch
        self.data_dir = data_dir  # where a fence is recorded (replication.json)
        self.fenced = 0  # the newer epoch this primary learned of: it confirms no more writes
        self.node = node
        self.token = token
        self.forks = forks
        self.board = board
        self.sync_timeout = sync_timeout
        self.lock = threading.Lock()  # the links, the seq counter, the memory queues' definitions
        self.links: list[Link] = []
        self.seq = 0
        self.writers: dict[str, QueueWriter] = {}  # by queue name
        self.definitions: dict[str, dict[str, Any]] = {}  # memory-only queues: name -> meta
        self.names: set[str] = set()  # every queue at the journal process's last look (writer or not)
        self.bytes_sent = 0  # over every link, ever (resume tests read it through INFO)

    # ------------------------------------------------------------ the writers' side
    def publish(self, writer: QueueWriter, records: bytes | bytearray, nxt: int) -> int:
        """A round of ``writer`` was appended (``records``: the bytes it appended): queue it
        for every link that holds the queue; its seq (0 when no link holds it).  Called under
        ``writer.lock``."""
        if not self.links:
            return 0
        name, created = writer.q.name, writer.d.created_ns
        with self.lock:
            takers = [ln for ln in self.links if ln.holds.get(name) is not None]
            if not takers:
                return 0
            self.seq += 1
            seq = self.seq
            frame = encode(K.ROUND, {"queue": name, "created_ns": created, "seq": seq, "next": nxt,
                                     "last": True, "ack": int(writer.sync_replicated)}, records)
            for ln in takers:
                ln.queue(frame, seq, (name, nxt))
        return seq

    def fence(self, epoch: int) -> None:
        """A node of a newer epoch exists: this primary confirms no more writes (its writers fail
        every journaled queue), now and after a restart (recorded in the data dir)."""
        if self.fenced >= epoch:
            return
        self.fenced = epoch
        log.error("a node of epoch %d exists (this primary's is %d): fenced, it confirms no more writes; "
                  "rejoin it as a standby (shmq serve --replica-of)", epoch, self.epoch)
        if self.data_dir is not None:
            try:
                write_state(self.data_dir, {**read_state(self.data_dir), "superseded_by": epoch})
            except OSError as e:
                log.error("cannot record the fence in %s: %s", self.data_dir, e)
        for w in list(self.writers.values()):
            w.d.wake_writer()

    def confirmed(self, name: str, seq: int) -> bool:
        """Has a standby that holds queue ``name`` fsynced the round ``seq``?"""
        with self.lock:
            for ln in self.links:
                since = ln.holds.get(name)
                if since is not None and ln.acked >= max(seq, since):
                    return True
        return False

    def add_writer(self, writer: QueueWriter) -> None:
        """A journaled queue's writer started: every live link gets a full copy of it."""
        with self.lock:
            self.writers[writer.q.name] = writer
            links = list(self.links)
        for ln in links:
            ln.copy_queue(writer, None)

    def remove_writer(self, writer: QueueWriter, deleted: bool) -> None:
        with self.lock:
            if self.writers.get(writer.q.name) is writer:
                del self.writers[writer.q.name]
            if deleted:
                self._drop(writer.q.name, writer.d.created_ns)

    def set_definitions(self, metas: dict[str, dict[str, Any]]) -> None:
        """The memory-only queues now: new ones are sent, gone ones dropped."""
        with self.lock:
            for name in set(self.definitions) - set(metas):
                self._drop(name, self.definitions.pop(name)["created_ns"])
            new = {n: m for n, m in metas.items() if self.definitions.get(n) != m}
            self.definitions.update(new)
            for meta in new.values():
                self._to_all(encode(K.QUEUE, {"meta": meta, "full": True, "memory": True}))

    def _drop(self, name: str, created: int) -> None:
        self._to_all(encode(K.DROP, {"queue": name, "created_ns": created}))
        for ln in self.links:
            ln.holds.pop(name, None)

    def _to_all(self, frame: bytes) -> None:
        """(under self.lock)"""
        self.seq += 1
        for ln in self.links:
            ln.queue(frame, self.seq)

    # ------------------------------------------------------------ links
    def attach(self, ln: Link) -> str:
        """Take a standby whose HELLO was read; "" or why it is refused."""
        with self.lock:
            if len(self.links) >= options.REPLICATION_MAX_STANDBYS:
                return f"this primary streams to {options.REPLICATION_MAX_STANDBYS} standbys already"
            self.links.append(ln)
            writers = list(self.writers.values())
            defs = list(self.definitions.values())
            self.seq += 1
            for meta in defs:
                ln.queue(encode(K.QUEUE, {"meta": meta, "full": True, "memory": True}), self.seq)
            ours = set(self.writers) | set(self.definitions) | self.names  # (a journal not open yet: kept)
            for name in set(ln.positions) - ours:  # queues it holds that we do not
                ln.queue(encode(K.DROP, {"queue": name, "created_ns": ln.positions[name]["created_ns"]}),
                         self.seq)
        for w in writers:
            ln.copy_queue(w, ln.positions.get(w.q.name))
        with self.lock:
            self.seq += 1
            ln.queue(encode(K.SYNCED), self.seq)
        return ""

    def detach(self, ln: Link) -> None:
        with self.lock:
            if ln in self.links:
                self.links.remove(ln)
        self.report()

    def acked(self) -> None:
        """A link's ACK moved: wake the writers of sync queues waiting for it."""
        for w in list(self.writers.values()):
            if w.unconfirmed:
                w.d.wake_writer()

    def report(self) -> None:
        """What INFO shows: role, epoch and each standby's lag."""
        if self.board is None:
            return
        with self.lock:
            standbys = [ln.describe() for ln in self.links]
        self.board.write({"role": "primary", "epoch": self.epoch, "node": self.node,
                          "standbys": standbys, "bytes_sent": self.bytes_sent, "reported_at": time.time(),
                          "superseded_by": self.fenced or None})

    def close(self) -> None:
        with self.lock:
            links = list(self.links)
        for ln in links:
            ln.close()


class Link:
    """One standby's connection: a sender thread (frames in seq order) and a reader (ACKs)."""

    def __init__(self, hub: Hub, sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        self.hub = hub
        self.sock = sock
        self.peer = peer
        self.node = str(hello.get("node", ""))
        self.epoch = int(hello.get("epoch", 0))
        self.positions: dict[str, dict[str, int]] = {
            str(n): {"created_ns": int(p["created_ns"]), "next": int(p["next"])}
            for n, p in (hello.get("queues") or {}).items()}
        self.holds: dict[str, int] = {}  # queue -> the seq of its copy on this link
        self.acked = 0  # the standby fsynced every frame up to this seq
        self.sent_seq = 0
        # ROUNDs sent and not yet ACKed: seq -> (when queued, queue, the round's next offset)
        self.queued_at: dict[int, tuple[float, str, int]] = {}
        self.acked_next: dict[str, int] = {}  # queue -> one past the last offset the standby ACKed
        self.out: collections.deque[tuple[bytes, int]] = collections.deque()
        self.out_bytes = 0
        self.sending = False  # a thread is sending now (the sender, or a writer inline): the others queue
        self.tls = isinstance(sock, ssl.SSLSocket)  # (no send without waiting there: the sender sends all)
        self.last_send = time.monotonic()
        self.sent = 0  # bytes
        self.cond = threading.Condition()
        self.closed = False
        self.last_heard = time.monotonic()

    # ------------------------------------------------------------ queuing (under hub.lock)
    def queue(self, frame: bytes, seq: int, rnd: tuple[str, int] | None = None) -> None:
        """Queue a frame; ``rnd``: a ROUND's (queue, next offset): the standby ACKs it, and its
        lag counts until then."""
        with self.cond:
            if self.closed:
                return
            self.out.append((frame, seq))
            self.out_bytes += len(frame)
            if rnd is not None:
                self.queued_at[seq] = (time.monotonic(), *rnd)
            if self.out_bytes > options.REPLICATION_SEND_BUFFER:
                log.warning("standby %s is %d bytes behind: cut (it resumes when it reconnects)",
                            self.peer, self.out_bytes)
                self.closed = True
            if self.sending or self.closed or self.tls:  # the sender thread has it (or the link ends)
                self.cond.notify()
                return
            # Nobody sends now: send here, without waiting (a thread handoff per round costs
            # more than the send); what the socket does not take goes to the sender thread.
            self.sending = True
            batch = list(self.out)
            self.out.clear()
            self.out_bytes = 0
        data = b"".join(f for f, _ in batch)
        try:
            n = self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            n = 0
        except OSError:
            n = -1
        with self.cond:
            self.sending = False
            if n < 0:
                self.closed = True  # (the sender thread notices, and closes the link)
            else:
                self._sent(data[:n], batch[-1][1] if n == len(data) else self.sent_seq)
                if n < len(data):
                    self.out.appendleft((data[n:], batch[-1][1]))
                    self.out_bytes += len(data) - n
            self.cond.notify()

    def _sent(self, data: bytes, seq: int) -> None:
        """(under self.cond)"""
        self.last_send = time.monotonic()
        self.sent += len(data)
        self.hub.bytes_sent += len(data)
        self.sent_seq = seq

    def copy_queue(self, writer: QueueWriter, position: dict[str, int] | None) -> None:
        """Send queue ``writer.q`` whole, or from the standby's ``position`` on (module docstring)."""
        hub = self.hub
        name = writer.q.name
        meta = writer.q.meta()
        with writer.lock:
            created = writer.d.created_ns
            fork = hub.forks.get(name)
            held = -1 if position is None or position["created_ns"] != created else position["next"]
            full = held < 0
            discard_from = None
            if not full and self.epoch < hub.epoch and fork is not None and held > fork:
                full, discard_from = True, fork  # it went on past where our history parted from ours
            elif held > writer.next:  # it holds offsets we lost (a crash before our fsync): not ours
                full, discard_from = True, writer.next
            floor = 0 if full else held
            self.acked_next[name] = max(floor, 0)
            items, state = journal_contents(writer, floor)
            with hub.lock:
                hub.seq += 1
                seq = hub.seq
                self.queue(encode(K.QUEUE, {"meta": meta, "full": full, "memory": False,
                                            "discard_from": discard_from}), seq)
                runs = list(chunks(items)) or [[]]
                for i, run in enumerate(runs):
                    last = i == len(runs) - 1
                    body = encode_messages(run) if run else bytearray()
                    if last and state is not None:
                        body += encode_state(state)
                    self.queue(encode(K.ROUND, {"queue": name, "created_ns": created, "seq": seq,
                                                "next": writer.next, "last": last}, body), seq,
                                (name, writer.next))
                self.holds[name] = seq
        log.info("standby %s: %s of queue %r from offset %d (%d messages)", self.peer,
                 "full copy" if full else "resume", name, floor, len(items))

    # ------------------------------------------------------------ threads
    def start(self) -> None:
        threading.Thread(target=self._send, name=f"repl-send-{self.peer}", daemon=True).start()
        threading.Thread(target=self._read, name=f"repl-read-{self.peer}", daemon=True).start()

    def _send(self) -> None:
        """The sender thread: what the writers' inline sends left, and a BEAT when the link
        has been quiet for REPLICATION_HEARTBEAT."""
        beat = encode(K.BEAT)
        try:
            while True:
                with self.cond:
                    while not self.closed and (not self.out or self.sending):
                        left = self.last_send + options.REPLICATION_HEARTBEAT - time.monotonic()
                        if left <= 0 and not self.sending:
                            break  # a beat is due
                        self.cond.wait(left if left > 0 else options.REPLICATION_HEARTBEAT)
                    if self.closed:
                        break
                    self.sending = True
                    batch = list(self.out)
                    self.out.clear()
                    self.out_bytes = 0
                try:
                    data = b"".join(f for f, _ in batch) if batch else beat
                    self.sock.sendall(data)
                finally:
                    with self.cond:
                        self.sending = False
                        self.last_send = time.monotonic()
                        if batch:
                            self._sent(data, batch[-1][1])
                        self.cond.notify()
                if time.monotonic() - self.last_heard > options.REPLICATION_DEAD_AFTER:
                    log.warning("standby %s silent for %.0f s: closed", self.peer,
                                options.REPLICATION_DEAD_AFTER)
                    break
        except OSError as e:
            log.info("standby %s: link lost (%s)", self.peer, e)
        finally:
            self.close()

    def _read(self) -> None:
        dec = StreamDecoder(max_frame=1 << 16)
        try:
            while not self.closed:
                data = self.sock.recv(65536)  # (times out after REPLICATION_DEAD_AFTER: the link ends)
                if not data:
                    break
                self.last_heard = time.monotonic()
                for f in dec.feed(data):
                    if f.kind == K.ACK:
                        seq = int(f.header.get("seq", 0))
                        if seq > self.acked:
                            self.acked = seq
                            for s in sorted(s for s in self.queued_at if s <= seq):
                                _, name, nxt = self.queued_at.pop(s)
                                self.acked_next[name] = nxt
                            self.hub.acked()
                    elif f.kind != K.BEAT:
                        log.warning("standby %s sent a %s frame: closed", self.peer, f.kind.name)
                        return
        except Exception as e:  # noqa: BLE001 - a broken link, or a bad frame: the link ends
            log.info("standby %s: link ended (%s)", self.peer, e)
        finally:
            self.close()

    def describe(self) -> dict[str, Any]:
        pending = [t for t, _, _ in list(self.queued_at.values())]
        writers = dict(self.hub.writers)
        behind = {q: writers[q].next - self.acked_next.get(q, 0) for q in list(self.holds) if q in writers}
        return {"peer": self.peer, "node": self.node, "acked_seq": self.acked, "sent_seq": self.sent_seq,
                "lag_records": sum(max(0, n) for n in behind.values()),  # messages journaled, not ACKed
                "lag_bytes": self.out_bytes, "lag_seconds": round(time.monotonic() - min(pending), 3)
                if pending else 0.0, "bytes_sent": self.sent}

    def close(self) -> None:
        with self.cond:
            if self.closed and self.sock.fileno() < 0:
                return
            self.closed = True
            self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.hub.detach(self)


# ---------------------------------------------------------------------------- the listener


def refuse(sock: socket.socket, code: Status, message: str) -> None:
    try:
        sock.sendall(encode(K.REFUSED, {"code": int(code), "message": message}))
    except OSError:
        pass
    sock.close()


def read_hello(sock: socket.socket, timeout: float) -> StreamFrame:
    sock.settimeout(timeout)
    dec = StreamDecoder(max_frame=options.JOURNAL_MAX_META_BYTES * 64)
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed before its HELLO")
        frames = dec.feed(data)
        if frames:
            return frames[0]


def serve(hub: Hub, listener: socket.socket, tls: ssl.SSLContext | None, stop: threading.Event) -> None:
    """Accept standbys on ``listener`` until ``stop`` (the journal process's thread)."""
    listener.settimeout(0.1)  # (INFO's lag is at most this old)
    while not stop.is_set():
        try:
            sock, addr = listener.accept()
        except TimeoutError:
            hub.report()
            continue
        except OSError:
            if stop.is_set():
                break
            continue
        threading.Thread(target=_greet, args=(hub, sock, f"{addr[0]}:{addr[1]}", tls), daemon=True).start()
    hub.close()


def _greet(hub: Hub, sock: socket.socket, peer: str, tls: ssl.SSLContext | None) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock.settimeout(options.TLS_HANDSHAKE_TIMEOUT)
            sock = tls.wrap_socket(sock, server_side=True)
        f = read_hello(sock, options.REPLICATION_DEAD_AFTER)
    except (OSError, ValueError, ConnectionError) as e:
        log.info("replication connection from %s dropped before its HELLO: %s", peer, e)
        sock.close()
        return
    h = f.header
    if f.kind != K.HELLO:
        return refuse(sock, Status.PROTOCOL_ERROR, f"expected HELLO, got {f.kind.name}")
    if hub.token and not hmac.compare_digest(str(h.get("token", "")).encode(), hub.token.encode()):
        log.warning("standby %s refused: wrong token", peer)
        return refuse(sock, Status.AUTH_FAILED, "wrong token for this primary's replication")
    try:
        epoch = int(h.get("epoch", 0))
        ln = Link(hub, sock, peer, h)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        return refuse(sock, Status.PROTOCOL_ERROR, f"a malformed HELLO: {e}")
    if epoch > hub.epoch:
        log.error("standby %s knows epoch %d, this primary is in epoch %d: a newer primary exists; "
                  "refused", peer, epoch, hub.epoch)
        hub.fence(epoch)
        return refuse(sock, Status.NOT_PRIMARY, f"this node's epoch {hub.epoch} is older than the "
                      f"standby's {epoch}: it was superseded (promote happened elsewhere)")
    sock.settimeout(options.REPLICATION_DEAD_AFTER)  # a silent standby, or a send that cannot go on
    try:
        sock.sendall(encode(K.WELCOME, {"epoch": hub.epoch, "node": hub.node}))
    except OSError:
        sock.close()
        return
    ln.start()  # (the copy is sent while it is made)
    why = hub.attach(ln)
    if why:
        ln.close()
        return refuse(sock, Status.LIMIT_EXCEEDED, why)
    log.info("standby %s (%s) attached in epoch %d", peer, ln.node or "unnamed", hub.epoch)
    hub.report()


__all__ = ["Board", "Hub", "Link", "read_state", "serve", "write_state"]

