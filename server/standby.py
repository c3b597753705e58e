"""A standby: ``shmq serve --replica-of URL`` follows a primary until ``shmq promote``.

Two parts, in one process:

* the **follower** (a thread) connects to the primary's replication port (asked of its
  client port with an INFO), says what its journals hold (HELLO), and applies the stream
  (``shmq.protocol.replication``): each ROUND's records are appended to the queue's
  journal in this node's data dir, in the journal's own format and at the primary's
  offsets, then fsynced, then ACKed.  A lost link is tried again every
  ``REPLICATION_RETRY`` seconds, and resumes from what the journals hold;
* the **read-only server** (asyncio, on the client port) answers HANDSHAKE, INFO (the
  role, the epoch, the primary and the link's state), LIST_QUEUES, STATS and PROMOTE,
  and every other request with ``NotPrimary`` naming the primary.

A standby keeps no queue in shared memory.  PROMOTE (``shmq promote``) stops the
follower, raises the epoch (``replication.json``, fsynced) and returns: ``shmq serve`` then
goes on as a primary on the same port, rebuilding the queues from the journals
(``server.journaler.recover``) as after any restart.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shmq import options, runtime
from shmq.api import BrokerInfo
from shmq.errors import InvalidArgument, NotPrimary, ProtocolError, ShmqError, Status, error_for
from shmq.journal import Journal, JournalError, check_records, list_queues, read_records
from shmq.journal.files import retire_journal
from shmq.protocol.codec import Frame, FrameDecoder, T, decode_body, encode_frame, frame, records_field
from shmq.protocol.replication import K, StreamDecoder, StreamFrame, encode
from shmq.tls import ServerTls, client_context, server_context
from shmq.urls import BrokerUrl, client_token, parse_url
from shmq.version import __version__

from .core import SERVER_NAME
from .journaler import remove_retired
from .replication import DEFINITIONS_FILE, read_state, write_state

log = logging.getLogger("shmq.standby")


class Refused(ShmqError):
    """The primary refused this standby (its REFUSED frame): the code and message are its."""


class Follower:
    """The standby's copy of its primary's journals (see the module docstring)."""

    def __init__(self, primary: str, token: str | None, data_dir: Path, node: str) -> None:
        # --replica-of: one URL, or a list (the same list on every node: the standby follows
        # whichever of them is the primary, skipping standbys, itself included)
        self.urls = [parse_url(u.strip()) for u in primary.split(",") if u.strip()]
        if not self.urls or any(u.scheme not in ("tcp", "tcps") for u in self.urls):
            raise InvalidArgument(f"--replica-of must be tcp:// or tcps:// URLs, comma-separated, not "
                                  f"{primary!r}")
        self.tokens = {u.without_token(): client_token(u, token) for u in self.urls}
        self.url = self.urls[0]
        self.primary = self.url.without_token() if len(self.urls) == 1 else ",".join(
            u.without_token() for u in self.urls)
        self.superseded: set[str] = set()  # primaries that refused us for an older epoch: not followed
        self.token = self.tokens[self.url.without_token()]
        self.data_dir = data_dir
        self.node = node
        state = read_state(data_dir)
        if state.get("role") == "primary" and list_queues(data_dir) and state.get("epoch", 1) > 1:
            log.warning("%s was a primary in epoch %d; it now follows %s (a diverged tail is discarded)",
                        data_dir, state["epoch"], self.primary)
        self.epoch = int(state.get("epoch", 1))
        self.forks = state.get("forks", {})
        write_state(data_dir, {**state, "role": "standby", "primary": self.primary})
        self.journals: dict[str, Journal] = {}
        self.metas: dict[str, dict[str, Any]] = {}
        self.raw_states: dict[str, bytes] = {}  # each queue's latest state (its groups), as journaled
        self.definitions: dict[str, dict[str, Any]] = self._read_definitions()
        self._open_journals()
        self.stop = threading.Event()
        self.sock: socket.socket | None = None
        self.connected = False
        self.caught_up = False
        self.last_error = ""
        self.bytes_received = 0
        self.acked = 0
        self.last_heard = 0.0
        self.primary_epoch = 0
        self.complete = False  # the last link's catch-up was over (SYNCED) before the link ended
        self.discarded: list[str] = []  # lines logged for diverged tails (tests read them through INFO)
        self._drop_at: dict[str, float] = {}
        self._dirty: set[Journal] = set()  # journals written since the last fsync
        self._urgent = False  # a round since then waits for our ACK (a sync queue's)
        self.thread = threading.Thread(target=self._run, name="follower", daemon=True)

    # ------------------------------------------------------------ local journals
    def _read_definitions(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads((self.data_dir / DEFINITIONS_FILE).read_bytes()))
        except (OSError, ValueError):
            return {}

    def _write_definitions(self) -> None:
        path = self.data_dir / DEFINITIONS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(json.dumps(self.definitions).encode())
        os.replace(tmp, path)

    def _open_journals(self) -> None:
        for name in list_queues(self.data_dir):
            j = Journal(self.data_dir, name, log=log)
            meta = j.read_meta()
            if meta is None:
                j.destroy()
                continue
            rec = j.recover(floor=1 << 63)
            for p in rec.problems:
                log.error("journal of %r: %s", name, p)
            self.journals[name] = j
            self.metas[name] = meta
            if rec.state:
                self.raw_states[name] = rec.state

    def positions(self) -> dict[str, dict[str, int]]:
        """What the journals hold: {queue: {created_ns, next}} (also read by the server's thread)."""
        metas = dict(self.metas)
        return {n: {"created_ns": int(metas[n]["created_ns"]), "next": j.next_offset}
                for n, j in list(self.journals.items()) if n in metas}

    def _forget(self, name: str) -> None:
        j = self.journals.pop(name, None)
        self.metas.pop(name, None)
        self.raw_states.pop(name, None)
        if j is not None:
            j.close()
            retire_journal(str(self.data_dir), name)
            remove_retired(self.data_dir)  # (the journal process does it on a primary)

    # ------------------------------------------------------------ the link
    def start(self) -> None:
        self.thread.start()

    def halt(self) -> None:
        """Stop following (the journals stay open)."""
        self.stop.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.thread.is_alive():
            self.thread.join(10)

    @property
    def streaming(self) -> bool:
        """Is the primary alive and streaming to us now?"""
        return self.connected and time.monotonic() - self.last_heard < options.REPLICATION_DEAD_AFTER

    def close(self) -> None:
        self.halt()
        for j in self.journals.values():
            try:
                j.sync()
            except JournalError:
                pass
            j.close()
        self.journals.clear()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._follow()
            except Refused as e:
                self.last_error = str(e)
                log.error("the primary %s refused this standby: %s", self.primary, e)
            except (OSError, ShmqError, ValueError) as e:
                if not self.stop.is_set():
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.warning("replication from %s: %s; trying again in %g s", self.primary, e,
                                options.REPLICATION_RETRY)
            finally:
                self.connected = self.caught_up = False
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
            self.stop.wait(options.REPLICATION_RETRY)

    def _replication_address(self) -> tuple[str, int]:
        """Find the primary among the URLs (the first that answers as one, and has not
        refused us for an older epoch), and where it streams."""
        why = []
        for u in self.urls:
            if u.without_token() in self.superseded:
                why.append(f"{u.without_token()}: superseded (an older epoch)")
                continue
            try:
                where = self._ask(u)
            except (Refused, OSError, ShmqError) as e:
                why.append(f"{u.without_token()}: {e}")
                continue
            self.url, self.primary = u, u.without_token()
            self.token = self.tokens[self.primary]
            return where
        if len(why) == 1:
            raise Refused(why[0].split(": ", 1)[1])
        raise Refused("no primary among " + "; ".join(why))

    def _ask(self, u: BrokerUrl) -> tuple[str, int]:
        """Ask a node's client port (HANDSHAKE, INFO) whether it is a primary, and where it streams."""
        with self._open(u.host, u.port, u) as s:
            s.sendall(frame(T.HANDSHAKE, 1, token=self.tokens[u.without_token()], client="shmq-standby",
                            affinity="", heartbeat_ms=0) + frame(T.INFO, 2))
            dec = FrameDecoder()
            got: list[Frame] = []
            while len(got) < 2:
                data = s.recv(65536)
                if not data:
                    break
                got += dec.feed(data)
        for f in got:
            if f.type == T.HANDSHAKE_NACK:
                raise Refused(f"AUTH_FAILED: the primary refused this standby's handshake "
                              f"({decode_body(f.type, f.body)['reason']}): is its token the primary's?")
            if f.type == T.ERROR:
                raise error_for(f.status, decode_body(T.ERROR, f.body)["message"])
        if len(got) < 2:
            raise ConnectionError("the primary closed the connection")
        info = decode_body(T.INFO_OK, got[1].body)["info"]
        repl = info.get("replication") or {}
        if repl.get("role") == "standby":
            raise Refused(f"{u.without_token()} is a standby itself (of {repl.get('primary')}): a standby "
                          "follows a primary")
        if not repl.get("port"):
            raise Refused(f"{u.without_token()} does not stream to standbys")
        return str(repl.get("host") or u.host), int(repl["port"])

    def _open(self, host: str, port: int, u: BrokerUrl | None = None) -> socket.socket:
        u = u or self.url
        s = socket.create_connection((host, port), timeout=options.REPLICATION_DEAD_AFTER)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if u.tls:
            s = client_context(u).wrap_socket(s, server_hostname=host)
        return s

    def _follow(self) -> None:
        self.sock = s = self._open(*self._replication_address())
        s.sendall(encode(K.HELLO, {"token": self.token, "epoch": self.epoch, "node": self.node,
                                   "queues": self.positions()}))
        self.connected = True
        self.last_heard = time.monotonic()
        dec = StreamDecoder()
        last_beat = last_flush = time.monotonic()
        seq = 0  # the highest seq applied, not yet ACKed
        self._dirty = set()
        self._urgent = False
        while not self.stop.is_set():
            # A round that waits for us (a `sync` queue's) is fsynced and ACKed at once; the
            # others every REPLICATION_ACK_INTERVAL, so that many rounds share one fsync.
            wait = options.REPLICATION_HEARTBEAT if seq <= self.acked else max(
                0.0005, last_flush + options.REPLICATION_ACK_INTERVAL - time.monotonic())
            s.settimeout(wait)
            try:
                data = s.recv(1 << 20)
            except TimeoutError:
                data = None
            now = time.monotonic()
            if data == b"":
                raise ConnectionError("the primary closed the link")
            if data:
                self.last_heard = now
                self.bytes_received += len(data)
                seq = max(seq, self._apply(dec.feed(data)))
            if seq > self.acked and (self._urgent or now - last_flush >= options.REPLICATION_ACK_INTERVAL):
                for j in self._dirty:
                    j.sync()
                self._dirty.clear()
                self._urgent = False
                self.acked = seq
                s.sendall(encode(K.ACK, {"seq": seq}))
                last_beat = last_flush = now
            if now - self.last_heard > options.REPLICATION_DEAD_AFTER:
                raise ConnectionError(f"the primary was silent for {options.REPLICATION_DEAD_AFTER:g} s")
            if now - last_beat >= options.REPLICATION_HEARTBEAT:
                s.sendall(encode(K.BEAT))
                last_beat = now

    def _apply(self, frames: list[StreamFrame]) -> int:
        """Apply frames (the journals they wrote join ``_dirty``); the highest seq among them (0: none)."""
        seq = 0
        for f in frames:
            h = f.header
            if f.kind == K.WELCOME:
                self.complete = False  # a new catch-up: copies may be partial until SYNCED
                self.primary_epoch = int(h["epoch"])
                if self.primary_epoch != self.epoch:
                    self.epoch = self.primary_epoch
                    write_state(self.data_dir, {"epoch": self.epoch, "role": "standby",
                                                "primary": self.primary, "forks": {}})
                self.last_error = ""
            elif f.kind == K.REFUSED:
                if int(h.get("code", 0)) == Status.NOT_PRIMARY:  # an older epoch's primary: never again
                    self.superseded.add(self.primary)
                raise Refused(f"{Status(int(h.get('code', 10))).name}: {h.get('message', '')}")
            elif f.kind == K.QUEUE:
                self._queue(h)
            elif f.kind == K.ROUND:
                self._round(h, f.body)
                seq = max(seq, int(h["seq"]))
                self._urgent = self._urgent or bool(h.get("ack"))
            elif f.kind == K.DROP:
                name = str(h["queue"])
                if name in self.definitions and self.definitions[name]["created_ns"] == h["created_ns"]:
                    del self.definitions[name]
                    self._write_definitions()
                meta = self.metas.get(name)
                if meta is not None and meta["created_ns"] == h["created_ns"]:
                    self._forget(name)
                    log.info("queue %r was deleted on the primary: its journal here goes too", name)
            elif f.kind == K.SYNCED:
                self.caught_up = self.complete = True
                log.info("caught up with %s (epoch %d)", self.primary, self.primary_epoch)
        return seq

    def _queue(self, h: dict[str, Any]) -> None:
        meta = h["meta"]
        name = str(meta["name"])
        if h.get("memory"):
            self.definitions[name] = meta
            self._write_definitions()
            return
        if not h.get("full"):
            return
        old = self.journals.get(name)
        if old is not None:
            cut = h.get("discard_from")
            if cut is not None:
                line = (f"queue {name!r}: discarded {old.next_offset - int(cut)} records past offset {cut} "
                        f"(this node's history parted from {self.primary}'s there)")
                log.warning("%s", line)
                self.discarded.append(line)
            self._forget(name)
        j = Journal(self.data_dir, name, log=log)
        j.write_meta(meta)
        j.recover()
        self.journals[name] = j
        self.metas[name] = meta

    def _round(self, h: dict[str, Any], body: bytes) -> None:
        name = str(h["queue"])
        j = self.journals.get(name)
        meta = self.metas.get(name)
        if j is None or meta is None or meta["created_ns"] != h["created_ns"]:
            raise ProtocolError(f"a ROUND of queue {name!r} that this standby does not hold")
        try:
            rec = check_records(body)  # checksums and order: appended as they are, not encoded again
        except ValueError as e:
            raise ProtocolError(f"a replicated round of queue {name!r} is not whole journal records: "
                                f"{e}") from None
        if rec.offsets is not None and rec.offsets[0] < j.next_offset:
            # (cannot happen in one history: the copy goes again, whole)
            self._forget(name)
            raise ProtocolError(f"queue {name!r}: offset {rec.offsets[0]} arrived after "
                                f"{j.next_offset - 1}; its journal here is dropped and copied again")
        j.append_records(rec)
        self._dirty.add(j)
        if rec.state_body is None:
            return
        self.raw_states[name] = rec.state_body  # (decoded when asked: STATS, and the drop below)
        now = time.monotonic()
        if now >= self._drop_at.get(name, 0.0):
            self._drop_at[name] = now + options.JOURNAL_DROP_INTERVAL
            groups = self.state_of(name).get("groups", [])
            if groups:
                j.drop_below(min(int(g["floor"]) for g in groups))

    def state_of(self, name: str) -> dict[str, Any]:
        """The queue's latest replicated state (groups, producers), decoded; {} if none yet."""
        raw = self.raw_states.get(name)
        return json.loads(raw) if raw else {}

    def read(self, name: str, offset: int, n: int) -> list[tuple[Any, ...]] | None:
        """Up to ``n`` messages of the queue's journal from ``offset`` on (READ), as journal
        items; None when it holds no journal of that name.  Read from the files (the
        follower appends meanwhile: a record being written is not read yet)."""
        j = self.journals.get(name)
        if j is None:
            return None
        floors = [g["floor"] for g in self.state_of(name).get("groups", [])]
        offset = max(offset, min(floors, default=0))  # what every group settled is gone, as on the primary
        files = j.segment_files()
        start = max((i for i, p in enumerate(files) if int(p.name[:20]) <= offset), default=0)
        out: list[tuple[Any, ...]] = []
        for path in files[start:]:
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # dropped meanwhile (every group had passed it)
                continue
            out += read_records(data, offset, int(path.name[:20]))[0]
            if len(out) >= n:
                break
        out = out[:n]
        budget = options.MAX_FRAME - 4096 - 26 * len(out)  # a READ_OK is one frame: the reader asks again
        for i, it in enumerate(out):
            budget -= len(it[2]) + (len(it[3]) if len(it) > 3 else 0)
            if budget < 0:
                return out[:max(i, 1)]
        return out

    def stats(self, name: str) -> dict[str, Any] | None:
        """A queue's ``stats()`` as this standby knows it (its journal's end, the groups' floors
        and counters as last replicated); None when it holds no queue of that name.  Leases
        are not replicated (a promote gives them all back): ``in_flight`` is 0."""
        meta = self.metas.get(name) or self.definitions.get(name)
        if meta is None:
            return None
        j = self.journals.get(name)
        nxt = j.next_offset if j is not None else 0
        names = ("acked", "nacked", "redelivered", "dead_lettered", "expired", "created_ns", "delivered",
                 "ttl_expired")
        groups = {}
        for g in self.state_of(name).get("groups", []):
            counters = dict(zip(names, g.get("counters", []), strict=False))
            counters.pop("created_ns", None)
            groups[g["name"]] = {"floor": g["floor"], "cursor": g["cursor"], "depth": nxt - g["floor"],
                                 "in_flight": 0, **counters}
        first = min((g["floor"] for g in groups.values()), default=nxt)
        return {"name": name, "is_dlq": bool(meta.get("is_dlq")), "standby": True,
                "replicated": j is not None,
                "config": meta["config"], "created_ns": meta["created_ns"], "next_offset": nxt,
                "produced": nxt, "first_offset": first, "retained": nxt - first, "groups": groups}

    def describe(self) -> dict[str, Any]:
        return {"role": "standby", "epoch": self.epoch, "primary": self.primary, "connected": self.connected,
                "caught_up": self.caught_up, "complete": self.complete,
                "acked_seq": self.acked, "bytes_received": self.bytes_received,
                "last_contact_seconds": round(time.monotonic() - self.last_heard, 3) if self.last_heard
                else None,
                "error": self.last_error, "discarded": self.discarded,
                "queues": {n: p["next"] for n, p in self.positions().items()}}


# ---------------------------------------------------------------------------- the read-only server


class StandbyNode:
    """``shmq serve --replica-of``: the follower and the read-only server, until promoted."""

    def __init__(self, primary: str, *, instance: str, host: str, port: int, token: str, data_dir: Path,
                 tls: ServerTls | None = None, primary_token: str | None = None,
                 leave_token: bool = False) -> None:
        self.leave_token = leave_token  # a generated token: left for this user's clients (shmq.runtime)
        self.instance = instance
        self.host = host
        self.port = port
        self.token = token
        self.data_dir = data_dir
        self.tls = tls
        os.makedirs(data_dir, mode=options.JOURNAL_DIR_MODE, exist_ok=True)
        self.follower = Follower(primary, primary_token, data_dir, f"{socket.gethostname()}:{port}")
        self.started = time.monotonic()
        self.promoted: int | None = None
        self._stop: asyncio.Event

    def run(self, announce: Any = print) -> int | None:
        """Serve until SIGTERM/SIGINT (None) or a PROMOTE (the new epoch)."""
        try:
            asyncio.run(self._main(announce))
        finally:
            self.follower.close()
        return self.promoted

    async def _main(self, announce: Any) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        ctx: ssl.SSLContext | None = None if self.tls is None else server_context(self.tls)
        server = await asyncio.start_server(self._client, self.host, self.port, ssl=ctx, reuse_address=True)
        self.port = server.sockets[0].getsockname()[1]
        token_file = runtime.write_token(self.port, self.token) if self.leave_token else None
        self.follower.node = f"{socket.gethostname()}:{self.port}"
        self.follower.start()
        scheme = "tcps" if ctx is not None else "tcp"
        announce(f"shmq: instance {self.instance!r} is a standby of {self.follower.primary}, serving reads "
                 f"on {scheme}://{self.host}:{self.port}; journals in {self.data_dir}; pid {os.getpid()} "
                 "(shmq promote makes it the primary; SIGTERM stops it)")
        try:
            await self._stop.wait()
        finally:
            server.close()
            await server.wait_closed()
            if token_file is not None:
                Path(token_file).unlink(missing_ok=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        ready = False
        try:
            while not self._stop.is_set():
                data = await reader.read(65536)
                if not data:
                    break
                for f in dec.feed(data):
                    if not ready:
                        if f.type != T.HANDSHAKE:
                            raise ProtocolError("expected HANDSHAKE")
                        d = decode_body(T.HANDSHAKE, f.body)
                        if self.token and not hmac.compare_digest(d["token"].encode(), self.token.encode()):
                            writer.write(frame(T.HANDSHAKE_NACK, f.msg_id, reason="authentication failed"))
                            await writer.drain()
                            return
                        writer.write(frame(T.HANDSHAKE_ACK, f.msg_id, worker=0, max_frame=dec.max_frame,
                                           server=SERVER_NAME, heartbeat_ms=0))
                        ready = True
                        continue
                    out = self._answer(f)
                    if out:
                        writer.write(out)
                    if f.type == T.DISCONNECT:
                        await writer.drain()
                        return
                    if self.promoted is not None:
                        await writer.drain()
                        self._stop.set()
                        return
                await writer.drain()
        except (ProtocolError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def _answer(self, f: Frame) -> bytes:
        t = f.type
        try:
            if t == T.HEARTBEAT:
                return b""
            if t == T.INFO:
                about = BrokerInfo(__version__, self.instance, os.getpid(), time.monotonic() - self.started,
                                   [], replication=self.follower.describe())
                return frame(T.INFO_OK, f.msg_id, info=asdict(about))
            if t == T.LIST_QUEUES:
                metas = list(self.follower.metas.values()) + list(self.follower.definitions.values())
                return frame(T.LIST_QUEUES_OK, f.msg_id, queues=[
                    {"name": m["name"], "is_dlq": bool(m.get("is_dlq")), "config": m["config"]}
                    for m in sorted(metas, key=lambda m: m["name"])])
            if t == T.STATS:
                name = decode_body(T.STATS, f.body)["queue"]
                st = self.follower.stats(name)
                if st is None:
                    return frame(T.ERROR, f.msg_id, int(Status.QUEUE_NOT_FOUND),
                                 message=f"no queue named {name!r} on this standby")
                return frame(T.STATS_OK, f.msg_id, stats=st)
            if t == T.READ:
                d = decode_body(T.READ, f.body)
                items = self.follower.read(d["queue"], d["offset"], max(1, min(d["max"], options.MAX_BATCH)))
                if items is None:
                    return frame(T.ERROR, f.msg_id, int(Status.QUEUE_NOT_FOUND),
                                 message=f"no journal of a queue named {d['queue']!r} on this standby")
                heads = [bytes(it[3]) if len(it) > 3 else b"" for it in items]
                payloads = [bytes(it[2]) for it in items]
                return encode_frame(T.READ_OK, f.msg_id, records_field(
                    [it[0] for it in items], [0] * len(items), [it[1] for it in items],
                    [len(m) for m in heads], [len(p) for p in payloads], b"".join(
                        m + p for m, p in zip(heads, payloads, strict=True))))
            if t == T.DISCONNECT:
                return frame(T.DISCONNECT_OK, f.msg_id)
            if t == T.PROMOTE:
                force = bool(decode_body(t, f.body)["force"])
                return frame(T.PROMOTE_OK, f.msg_id, epoch=self.promote(force))
            raise NotPrimary(f"this broker is a standby (epoch {self.follower.epoch}): {T(t).name} goes to "
                             f"the primary: {self.follower.primary}", self.follower.primary)
        except ShmqError as e:
            return frame(T.ERROR, f.msg_id, int(e.code), message=str(e))

    def promote(self, force: bool = False) -> int:
        """Stop following, raise the epoch (fsynced), and let ``run`` return it."""
        fl = self.follower
        if fl.streaming and not force:
            raise InvalidArgument(f"the primary {fl.primary} is alive and streaming to this standby: stop it "
                                  "first (two primaries would take writes), or shmq promote --force")
        if not fl.complete and not force:
            raise InvalidArgument("this standby never finished copying its primary's queues since it "
                                  "started (a copy may be partial): shmq promote --force takes it as it is")
        fl.halt()
        epoch = max(fl.epoch, fl.primary_epoch) + 1
        forks = {n: p["next"] for n, p in fl.positions().items()}  # where this epoch's history begins
        fl.close()
        write_state(self.data_dir, {"epoch": epoch, "role": "primary", "primary": "", "forks": forks})
        log.warning("promoted: this node is the primary in epoch %d (it followed %s)", epoch, fl.primary)
        self.promoted = epoch
        return epoch


__all__ = ["Follower", "StandbyNode"]
