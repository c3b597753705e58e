"""``tcp://h1:7878,h2:7878``: one broker handle over a primary and its standbys, that fails over.

``shmq.connect`` gives a :class:`FailoverBroker` for a comma-separated list of ``tcp://``,
``tcps://`` and ``unix://`` URLs (each with its own ``?params``; a bare ``HOST:PORT`` takes
the scheme of the entry before it; the ``token`` keyword, when given, goes to every one).
It talks to the list's *primary* through a :class:`~shmq.client.tcp.TcpBroker`, and its
queue handles (:class:`FailoverQueue`) through that broker's ``TcpQueue``: the same
``api.Broker`` and ``api.Queue`` interface.

Finding the primary: the URLs are tried in their order; each is connected to and asked
``info()``; one whose ``replication`` says it is a standby (``shmq serve --replica-of``) is
closed and the next is tried; the first that is a primary (or a broker without
replication) is used.  While none is, the list is tried again after a pause (0.05 s,
doubling up to 1 s: ``options.FAILOVER_BACKOFF``, ``FAILOVER_BACKOFF_MAX``) until
``failover_timeout`` seconds (``options.FAILOVER_TIMEOUT``) have passed since the first
failure; then ``ConnectionLost`` says, for each URL, why it was not used.  A refused
token (``AuthError``) or a bad URL (``InvalidArgument``) is raised at once: waiting
cannot mend them.  Each try of a URL may take up to ``connect_timeout``, so a host that
does not answer at all can make the last round end after ``failover_timeout``.

Fail-over: a call that raises ``ConnectionLost`` (the primary died, or went silent) or
``NotPrimary`` (it is a standby now, or was fenced) closes that connection, finds the
primary again as above (within ``failover_timeout``) and is made once more on it; what it
raises then is raised.  Queue handles keep working: each re-makes its ``TcpQueue`` on
the new connection.  A call retried this way may find what its first try did, when
that try was applied before the connection went: a retried ``put``, ``put_many`` or
``put_joined`` may store its messages twice (fail-over makes a put *at-least-once*;
an idempotent producer's ``put_many(producer=, seq=)`` raises ``Duplicate`` instead);
a retried ``create_queue`` may raise ``QueueExists``, a retried ``delete_queue``
``QueueNotFound``, a retried ``create_group`` ``GroupExists`` (unless ``exist_ok``); a
retried ``purge`` counts only what the second try removed.  A blocking ``get`` retried waits its
``timeout`` again on the new primary.

Not retried: the settling of a delivery.  A message is settled (``ack``, ``nack``,
``touch``, ``dead_letter``, ``ack_many``, a ``get``'s ``ack=``) over the connection that
leased it -- ``Message.queue_handle`` is that connection's ``TcpQueue`` -- and its lease
went with that connection: settling it after a fail-over raises ``ConnectionLost`` as
is (or ``StaleAck``, for messages of several connections acked in one ``ack_many``), and
the new primary delivers the message again when it was replicated (at-least-once, as
for any lost connection).  A ``get`` or ``get_many`` that carries acks is not retried either.  A
``subscribe`` is one connection's: it ends with ``ConnectionLost``; subscribe again.

A publisher (``FailoverQueue.publisher()``: a :class:`FailoverPublisher`) is an idempotent
producer of its own: after a fail-over it sends the puts it had not seen confirmed again,
in order, and the broker stores none of them twice (its doc says what it confirms).

The asyncio client's list (``shmq.client.aio_failover``) finds and follows the primary so
too, with the helpers here (``url_list``, ``Search``, ``not_primary``).

A handle pickles as its URL list, its token and its settings, and finds the primary
again in the process that unpickles it.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, NoReturn, TypeVar

from shmq import options
from shmq.api import (
    Broker,
    BrokerInfo,
    Headers,
    Message,
    Payload,
    Queue,
    QueueInfo,
    RecordColumns,
    group_as_block,
    shares_docs,
)
from shmq.api.publisher import Publisher
from shmq.api.reply import end_requests
from shmq.client.tcp import Box, TcpBroker, TcpQueue
from shmq.errors import ConnectionLost, Duplicate, InvalidArgument, NotPrimary, ShmqError, Timeout
from shmq.joined import Joined
from shmq.protocol import commands as cmd
from shmq.protocol.connection import Request
from shmq.seektime import Start, When
from shmq.settle import Settle
from shmq.urls import client_settings, parse_url

R = TypeVar("R")
FAILS_OVER = (ConnectionLost, NotPrimary)  # a call's errors that send it to the (next) primary


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """The entries of a URL list: a comma-separated string, or a sequence of URLs (blanks
    around each are dropped).  A bare ``HOST:PORT`` takes the scheme of the entry before it
    (``tcp://h1:7878,h2:7878``), not its parameters.  ``InvalidArgument`` for an empty
    entry, or a bare one after no ``tcp://`` or ``tcps://`` entry."""
    entries, scheme = [], ""
    for entry in (u.strip() for u in (urls.split(",") if isinstance(urls, str) else urls)):
        if not entry:
            raise InvalidArgument("an empty entry in the url list: expected URL,URL,... "
                                  "(tcp://HOST:PORT, tcps://HOST:PORT or unix://PATH)")
        if "://" in entry:
            scheme = entry.partition("://")[0]
        elif scheme in ("tcp", "tcps"):
            entry = f"{scheme}://{entry}"
        else:
            raise InvalidArgument(f"{entry.partition('?')[0]!r} in the url list has no scheme, nor a "
                                  "tcp:// or tcps:// entry before it to take one from")
        entries.append(entry)
    if not entries:
        raise InvalidArgument("an empty url list")
    return entries


def url_list(urls: str | Sequence[str], token: str | None) -> tuple[list[str], list[str]]:
    """A URL list's entries as given (their tokens too: what each connection is made of) and
    as shown (``without_token``), each checked now: a bad URL, or a token it would send in
    clear, is refused before anything is connected to."""
    entries = split_urls(urls)
    for entry in entries:
        client_settings(entry, token)
    return entries, [parse_url(e).without_token() for e in entries]


def check_failover_timeout(failover_timeout: object) -> float:
    if (isinstance(failover_timeout, bool) or not isinstance(failover_timeout, (int, float))
            or not 0 <= failover_timeout < math.inf):
        raise InvalidArgument(f"failover_timeout must be a number of seconds >= 0, not {failover_timeout!r}")
    return float(failover_timeout)


def not_primary(info: BrokerInfo) -> str:
    """Why the broker whose ``info()`` this is is not a list's primary; "" when it is (a
    primary, or a broker without replication: a broker of its own)."""
    repl = info.replication or {}
    role = repl.get("role", "primary")
    if role == "primary":
        return ""
    return f"a {role}" + (f" (of {repl['primary']})" if repl.get("primary") else "")


class Search:
    """The rounds of one search for the primary through a URL list (what the blocking and the
    asyncio handles share of it): ``passed`` notes why an entry was not used; ``pause``, after
    a round that found none, is the seconds to wait before the next (``FAILOVER_BACKOFF``,
    doubling up to ``FAILOVER_BACKOFF_MAX``), or raises ``ConnectionLost`` naming each entry and
    why, once ``failover_timeout`` seconds have passed since ``since`` (the failure that
    started the search; None: from the first round's end), or when the handle is closing."""

    def __init__(self, url: str, failover_timeout: float, since: float | None) -> None:
        self.url = url
        self.failover_timeout = failover_timeout
        self.deadline = None if since is None else since + failover_timeout
        self.why: list[str] = []  # this round's
        self.next_pause = options.FAILOVER_BACKOFF

    def passed(self, shown: str, reason: str) -> None:
        self.why.append(reason if shown in reason else f"{shown}: {reason}")

    def pause(self, closing: bool) -> float:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.failover_timeout
        if now >= self.deadline or closing:
            raise ConnectionLost(f"no primary among {self.url} within {self.failover_timeout:g} s: "
                                 + "; ".join(self.why))
        pause = min(self.next_pause, self.deadline - now)
        self.next_pause = min(self.next_pause * 2, options.FAILOVER_BACKOFF_MAX)
        self.why = []
        return pause


@shares_docs(Broker)
class FailoverBroker(Broker):
    """A broker handle over a list of URLs: the primary's, failing over (see the module's doc).

    ``urls``: the list; ``token``: presented to each (default each URL's ``?token=``, else
    ``$SHMQ_TOKEN``, ...: as ``TcpBroker``); ``failover_timeout``: seconds a search for the
    primary goes on from its first failure.  The other keywords are ``TcpBroker``'s, for
    each connection.  ``url`` is the list as text (without tokens); ``primary_url`` the
    entry in use now ("" while none is)."""

    def __init__(self, urls: str | Sequence[str], token: str | None = None, *,
                 failover_timeout: float = options.FAILOVER_TIMEOUT, connect_timeout: float = 10.0,
                 client: str = "shmq-python", affinity: str = "", heartbeat: float = options.HEARTBEAT,
                 spin_us: float = options.CLIENT_SPIN_US) -> None:
        self._entries, self.urls = url_list(urls, token)  # (entries as given: with their tokens)
        self.failover_timeout = check_failover_timeout(failover_timeout)
        self._token = token
        self._settings: dict[str, Any] = {"connect_timeout": connect_timeout, "client": client,
                                          "affinity": affinity, "heartbeat": heartbeat, "spin_us": spin_us}
        self.url = ",".join(self.urls)
        self.primary_url = ""
        self._lock = threading.Lock()  # one search at a time; the others wait for its primary
        # the primary's connection and its generation (+1 each time another is made the
        # primary's), in one tuple so that a thread reads both at once; None: none now
        self._state: tuple[TcpBroker, int] | None = None
        self._generations = 0
        self._closing = False
        self._primary()

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_reconnect, (self._entries, self._token, self.failover_timeout, self._settings))

    def __repr__(self) -> str:
        return f"FailoverBroker({self.url!r}, primary={self.primary_url!r})"

    # ------------------------------------------------------------ the primary
    def _primary(self) -> tuple[TcpBroker, int]:
        """The primary's connection and its generation (searched for when there is none)."""
        state = self._state
        if state is not None:
            return state
        with self._lock:
            return self._state or self._new(None)

    def _failover(self, generation: int, since: float) -> tuple[TcpBroker, int]:
        """The call on connection ``generation`` failed at ``since``: that connection is
        closed (unless another thread did so already), and the primary searched for."""
        with self._lock:
            state = self._state
            if state is not None and state[1] == generation:
                self._state = None
                self.primary_url = ""
                state[0].close()  # (a lost connection's close only closes its socket)
            return self._state or self._new(since)

    def _new(self, since: float | None) -> tuple[TcpBroker, int]:
        """Search for the primary (the lock is held): its connection, the new state."""
        if self._closing:
            raise ConnectionLost(f"{self.url} is closed")
        b = self._find(since)
        self._generations += 1
        self._state = state = (b, self._generations)
        return state

    def _find(self, since: float | None) -> TcpBroker:
        """Try the URLs in order, again and again with a growing pause, until one is the
        primary: its connection.  ``ConnectionLost`` once ``failover_timeout`` seconds have
        passed since ``since`` (the failure that started the search; None: the first
        round's end), naming each URL and why it was not used."""
        search = Search(self.url, self.failover_timeout, since)
        while True:
            for entry, shown in zip(self._entries, self.urls, strict=True):
                b, reason = self._try(entry)
                if b is not None:
                    self.primary_url = shown
                    return b
                search.passed(shown, reason)
            time.sleep(search.pause(self._closing))

    def _try(self, entry: str) -> tuple[TcpBroker | None, str]:
        """A connection to ``entry`` when it is the primary, else None and why not."""
        try:
            b = TcpBroker(entry, self._token, **self._settings)
        except (ConnectionLost, Timeout) as e:
            return None, str(e)
        try:
            why = not_primary(b.info())
        except (*FAILS_OVER, Timeout) as e:
            b.close()
            return None, str(e)
        except BaseException:
            b.close()
            raise
        if not why:
            return b, ""
        b.close()
        return None, why

    def _run(self, op: Callable[[TcpBroker, int], R], retry: bool = True) -> R:
        """``op`` on the primary's connection (and its generation); after ``ConnectionLost``
        or ``NotPrimary``, once more on the primary found again, when ``retry``."""
        b, generation = self._primary()
        try:
            return op(b, generation)
        except FAILS_OVER as e:
            if not retry or self._closing:
                raise
            try:
                b, generation = self._failover(generation, time.monotonic())
            except ConnectionLost as lost:
                raise lost from e
        return op(b, generation)

    # ------------------------------------------------------------ Broker
    def create_queue(self, name: str, **limits: Any) -> FailoverQueue:
        """``Broker.create_queue``; retried after a fail-over, it may raise ``QueueExists``
        when the first try had created the queue."""
        return FailoverQueue(self, name, self._run(lambda b, g: (g, b.create_queue(name, **limits))))

    def queue(self, name: str) -> FailoverQueue:
        return FailoverQueue(self, name, self._run(lambda b, g: (g, b.queue(name))))

    def list_queues(self) -> list[QueueInfo]:
        return self._run(lambda b, _: b.list_queues())

    def delete_queue(self, name: str) -> None:
        self._run(lambda b, _: b.delete_queue(name))

    def info(self) -> BrokerInfo:
        """The primary's ``info()``."""
        return self._run(lambda b, _: b.info())

    def close(self, timeout: float = 5.0) -> None:
        """Delete this handle's reply queue and close the primary's connection (``TcpBroker.close``;
        ``timeout``: the seconds a broker that does not answer is waited for).  Nothing is
        retried or searched for from here on: every call raises ``ConnectionLost``."""
        if self._closing:
            return
        self._closing = True
        end_requests(self)
        with self._lock:
            state, self._state = self._state, None
            self.primary_url = ""
        if state is not None:
            state[0].close(timeout)


@shares_docs(Queue)
class FailoverQueue(Queue):
    """A queue of a :class:`FailoverBroker`: each call goes to the ``TcpQueue`` of the primary's
    connection, made again after a fail-over (what is retried: the module's doc)."""

    def __init__(self, broker: FailoverBroker, name: str, at: tuple[int, TcpQueue] | None = None) -> None:
        self.broker = broker
        self.name = name
        self._at = at  # (the connection's generation, its TcpQueue of this name)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (FailoverQueue, (self.broker, self.name))

    def __repr__(self) -> str:
        return f"FailoverQueue({self.broker.url!r}, {self.name!r})"

    def _on(self, b: TcpBroker, generation: int) -> TcpQueue:
        at = self._at
        if at is None or at[0] != generation:
            at = self._at = (generation, TcpQueue(b, self.name))
        return at[1]

    def _call(self, op: Callable[[TcpQueue], R], retry: bool = True) -> R:
        return self.broker._run(lambda b, g: op(self._on(b, g)), retry)

    def _leaser(self, msgs: Sequence[Message]) -> TcpQueue:
        """This queue on the connection that leased ``msgs``, when one did (even if it is
        gone: its leases are, too), else on the primary's (where others' are stale)."""
        conns = {getattr(m.queue_handle, "broker", None) for m in msgs}
        conn = conns.pop() if len(conns) == 1 else None
        if isinstance(conn, TcpBroker):
            return TcpQueue(conn, self.name)
        return self._call(lambda q: q, retry=False)

    def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
            headers: Headers | None = None, delay: float | None = None, ttl: float | None = None,
            priority: int = 0) -> int:
        """``Queue.put``; retried after a fail-over: at-least-once (the module's doc)."""
        return self._call(lambda q: q.put(payload, block, timeout, headers=headers, delay=delay, ttl=ttl,
                                          priority=priority))

    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None, headers: Sequence[Headers | None] | None = None,
                 delay: float | None = None, ttl: float | None = None, priority: int = 0) -> list[int]:
        """``Queue.put_many``; retried after a fail-over: at-least-once, unless ``producer``
        and ``seq`` make it idempotent (then ``Duplicate`` when the first try was stored)."""
        return self._call(lambda q: q.put_many(payloads, block, timeout, producer=producer, seq=seq,
                                               headers=headers, delay=delay, ttl=ttl, priority=priority))

    def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                   producer: str | None = None, seq: int | None = None, priority: int = 0) -> int:
        return self._call(lambda q: q.put_joined(batch, block, timeout, producer=producer, seq=seq,
                                                 priority=priority))

    def publisher(self, window: int = options.DEFAULT_PUBLISH_WINDOW, block: bool = True,
                  timeout: float | None = None) -> FailoverPublisher:
        """A :class:`FailoverPublisher`: a fail-over neither loses nor duplicates its puts."""
        return FailoverPublisher(self, window, block, timeout)

    def _publish(self, payload: Payload, block: bool, timeout: float | None, headers: Headers | None = None,
                 delay: float | None = None, ttl: float | None = None) -> tuple[TcpQueue, Any]:
        """A base ``Publisher``'s put (``publisher()`` gives a :class:`FailoverPublisher`, which
        does not use this), started on the primary's connection (once more on the next
        primary when that connection is known lost before it is sent).  It resends nothing:
        each put still unconfirmed when its connection went raises ``ConnectionLost`` (or
        ``NotPrimary``) when collected, stored or not; the puts started after go to the new
        primary."""
        return self._call(lambda q: (q, q._publish(payload, block, timeout, headers, delay, ttl)))

    def _confirm(self, token: tuple[TcpQueue, Any]) -> int:
        return token[0]._confirm(token[1])

    def _publish_many(self, payloads: Sequence[Payload], block: bool, timeout: float | None,
                      headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                      ttl: float | None = None) -> tuple[TcpQueue, Any]:
        return self._call(lambda q: (q, q._publish_many(payloads, block, timeout, headers, delay, ttl)))

    def _confirm_many(self, token: tuple[TcpQueue, Any]) -> list[int]:
        return token[0]._confirm_many(token[1])

    def get(self, block: bool = True, timeout: float | None = None, *, group: str = options.DEFAULT_GROUP,
            visibility_timeout: float | None = None, ack: Message | None = None) -> Message:
        """``Queue.get``: the message's ``queue_handle`` is the ``TcpQueue`` of the connection
        that leased it, which settles it.  Retried after a fail-over unless ``ack`` is given."""
        if block.__class__ is str:  # get("billing"): the order before group became a keyword
            raise group_as_block("get", block)
        return self._call(lambda q: q.get(block, timeout, group=group, visibility_timeout=visibility_timeout,
                                          ack=ack), retry=ack is None)

    def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                 group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                 ack: Iterable[Message] = ()) -> list[Message]:
        """``Queue.get_many``, as ``get``: retried after a fail-over unless it carries acks."""
        if block.__class__ is str:
            raise group_as_block("get_many", block)
        acks = list(ack)
        return self._call(lambda q: q.get_many(max_messages, block, timeout, group=group,
                                               visibility_timeout=visibility_timeout, ack=acks),
                          retry=not acks)

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        """``Queue.ack_many`` over the connection that leased the messages, never retried: after
        a fail-over their leases are gone (``ConnectionLost``; mixed with others, ``StaleAck``)."""
        msgs = list(messages)
        if msgs:
            self._leaser(msgs).ack_many(msgs, wait)

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        self._leaser([msg])._settle(msg, action, arg)

    def _reply_queue(self, name: str) -> FailoverQueue:
        return FailoverQueue(self.broker, name)

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        return self._call(lambda q: q.read(offset, max_messages))

    def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        return self._call(lambda q: q.read_columns(offset, max_messages))

    def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        self._call(lambda q: q.create_group(name, start, exist_ok))

    def seek(self, group: str, when: When) -> int:
        return self._call(lambda q: q.seek(group, when))

    def delete_group(self, name: str) -> None:
        self._call(lambda q: q.delete_group(name))

    def groups(self) -> list[str]:
        return self._call(lambda q: q.groups())

    def commit(self, group: str, offset: int) -> None:
        self._call(lambda q: q.commit(group, offset))

    def purge(self) -> int:
        return self._call(lambda q: q.purge())

    def stats(self) -> dict[str, Any]:
        return self._call(lambda q: q.stats())

    def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                  visibility_timeout: float | None = None) -> Generator[Message, None, None]:
        """``TcpQueue.subscribe`` on the primary's connection, that resumes on the new primary
        after a fail-over (found within ``failover_timeout``, else ``ConnectionLost``): the
        messages it delivered before were leased by the old connection, so settling one
        raises (``ConnectionLost``) and the new primary delivers it again."""
        b = self.broker
        while True:
            conn, generation = b._primary()
            try:
                yield from self._on(conn, generation).subscribe(group, credit, visibility_timeout)
                return
            except FAILS_OVER as e:
                if b._closing:
                    raise
                try:
                    b._failover(generation, time.monotonic())
                except ConnectionLost as lost:
                    raise lost from e


SENDS = 2  # a FailoverPublisher's put is sent at most this often: once, and once after a fail-over


class _Put:
    """A FailoverPublisher's put: its request (made at its first send, an idempotent batch of
    the publisher's producer id and this put's seq, sent again as it is), the connection it
    went to last and the box its answer comes to there, and that answer once taken from a
    connection gone since."""

    __slots__ = ("payloads", "headers", "delay", "ttl", "seq", "req", "conn", "generation", "box",
                 "sends", "outcome")

    def __init__(self, payloads: Sequence[Payload], headers: Sequence[Headers | None] | None,
                 delay: float | None, ttl: float | None, seq: int) -> None:
        self.payloads, self.headers, self.delay, self.ttl, self.seq = payloads, headers, delay, ttl, seq
        self.req: Request[list[int]] | None = None
        self.conn: TcpBroker | None = None
        self.generation = 0  # of the connection it was sent on last (0: none yet)
        self.box: Box | None = None
        self.sends = 0
        self.outcome: list[int] | ShmqError | None = None  # its answer, taken apart; None: not taken

    def send(self, q: TcpQueue, generation: int, producer: str, block: bool, timeout: float | None) -> None:
        """Send it over ``q``'s connection (a bad argument raises at its first send, before anything is)."""
        if self.req is None:
            req = cmd.put_many(q, self.payloads, block, timeout, producer, self.seq, self.headers, self.delay,
                               self.ttl)
            assert isinstance(req, Request)  # (a batch that is not empty is one request)
            self.req = req
        self.box = q.broker._begin(self.req)
        self.conn, self.generation, self.outcome = q.broker, generation, None
        self.sends += 1

    def take(self) -> None:
        """Take its answer from a connection gone since it was sent (closed: nothing waited for):
        the one that came before it went, else the ``ConnectionLost`` of its going."""
        assert self.conn is not None and self.req is not None and self.box is not None
        try:
            self.outcome = self.conn._finish(self.req, self.box)
        except ShmqError as e:
            self.outcome = e

    def result(self) -> list[int]:
        """Its offsets, or the error of its answer (waited for, when not taken already)."""
        outcome = self.outcome
        if outcome is None:
            assert self.conn is not None and self.req is not None and self.box is not None
            return self.conn._finish(self.req, self.box)
        if isinstance(outcome, ShmqError):
            raise outcome
        return outcome


class FailoverPublisher(Publisher):
    """A :class:`~shmq.api.publisher.Publisher` of a :class:`FailoverQueue` whose puts a fail-over
    neither loses nor duplicates: each is sent again, when its confirmation was lost, under an
    idempotent producer, so the broker keeps one copy.

    The publisher is a producer of its own: ``producer`` is ``pub-`` and a random hex id, and
    each ``put`` (or ``put_many``: one atomic batch) goes as ``put_many(..., producer=,
    seq=)`` with the next ``seq`` (1, 2, 3, ... in the order of the calls).  When collecting
    a confirmation meets ``ConnectionLost`` or ``NotPrimary``, the primary is found again (the
    handle's search: within ``failover_timeout``, else that ``ConnectionLost`` is raised), and
    every put not yet confirmed is sent there again, in its order and with its ``seq``: one
    whose answer had come before its connection went keeps it, the others are re-sent
    (``resent`` counts their messages).  The same happens before a new put is started, when
    the handle failed over meanwhile (another call of it met the failure), so that the puts
    reach the new primary in their order.  A re-sent put answered ``Duplicate`` had been
    stored before the fail-over (on the broker that is the primary now): it counts as
    confirmed, in ``confirmed`` and in ``duplicates``, and its offset is not known:
    ``last_offset`` stays at the latest offset known (it is not moved by such a put).

    What is stored is what a confirmed put means for the queue's replication: a put the old
    primary confirmed before it died, not replicated yet (``replication="async"``), is not on
    the new primary and is not sent again (it was confirmed); use ``replication="sync"`` for
    every confirmed put to survive.  A put is sent at most twice, as a fail-over handle's
    call is retried once: one whose re-sent copy meets a second fail-over (or whose search
    for the primary failed) raises ``ConnectionLost`` (or ``NotPrimary``) when collected,
    stored or not.  A put that failed otherwise (``Full`` after ``timeout``, ...) on the old
    primary, while a later one was stored, cannot be told from a stored one when its answer
    was lost with the connection: its re-sent copy is answered ``Duplicate`` (with
    ``block=True`` and no ``timeout`` a put does not fail so).  A ``Duplicate`` answered to a
    first send (another producer with this id) is raised as an error.  One thread at a time,
    as a Publisher; other threads may use the handle meanwhile.  It is a ``Publisher`` with
    its own state (the base class's is left unused).
    """

    def __init__(self, queue: FailoverQueue, window: int = options.DEFAULT_PUBLISH_WINDOW,
                 block: bool = True, timeout: float | None = None) -> None:
        super().__init__(queue, window, block, timeout)  # (checks window; sets the public counts)
        self._fq = queue
        self._put_block, self._put_timeout = block, timeout
        self.producer = f"pub-{uuid.uuid4().hex}"
        self._seq = 0  # the latest put's
        # (number of the first message, messages, the put), oldest first; _count: their messages
        self._puts: deque[tuple[int, int, _Put]] = deque()
        self._count = 0
        self.resent = 0  # messages sent again after a fail-over
        self.duplicates = 0  # messages confirmed by a Duplicate: stored before a fail-over, offsets unknown

    @property
    def pending(self) -> int:
        """Messages started and not yet confirmed."""
        return self._count

    def put(self, payload: Payload, headers: Headers | None = None, *, delay: float | None = None,
            ttl: float | None = None) -> None:
        """``Publisher.put``: one message, one idempotent batch."""
        while self._count >= self.window:
            self._confirm_oldest()
        self._start([payload], None if headers is None else [headers], delay, ttl)

    def put_many(self, payloads: Sequence[Payload], headers: Sequence[Headers | None] | None = None, *,
                 delay: float | None = None, ttl: float | None = None) -> None:
        """``Publisher.put_many``: one atomic idempotent batch (one ``seq``)."""
        n = len(payloads)
        if not n:
            return
        while self._puts and self._count + n > self.window:
            self._confirm_oldest()
        self._start(list(payloads), headers, delay, ttl)

    def flush(self) -> None:
        """Wait until every put so far is confirmed, sending again what a fail-over left
        unconfirmed (raises the first error met; call again to go on collecting the rest)."""
        while self._puts:
            self._confirm_oldest()

    def _start(self, payloads: Sequence[Payload], headers: Sequence[Headers | None] | None,
               delay: float | None, ttl: float | None) -> None:
        self._seq += 1  # (one that fails to start leaves a gap: the broker only needs them to grow)
        put = _Put(payloads, headers, delay, ttl, self._seq)
        self._send(put)
        self._puts.append((self.sent, len(payloads), put))
        self._count += len(payloads)
        self.sent += len(payloads)

    def _send(self, new: _Put | None = None) -> None:
        """Send ``new`` on the primary's connection, after what is pending there to be re-sent
        (``_resend``); once more on the primary found again when that connection is lost."""
        broker = self._fq.broker
        for last in (False, True):
            b, generation = broker._primary()
            try:
                self._resend(b, generation)
                if new is not None:
                    new.send(self._fq._on(b, generation), generation, self.producer, self._put_block,
                             self._put_timeout)
                return
            except FAILS_OVER as e:
                if last or broker._closing:
                    raise
                self._fail_over(generation, e)

    def _resend(self, b: TcpBroker, generation: int) -> None:
        """Send on ``b`` (connection ``generation``) again, in order, every pending put sent
        on a connection gone since whose answer did not come (or was ``ConnectionLost`` or
        ``NotPrimary``), unless it was sent twice already."""
        for _, n, put in self._puts:
            if put.generation == generation:
                continue
            if put.outcome is None:
                put.take()
            if isinstance(put.outcome, FAILS_OVER) and put.sends < SENDS:
                put.send(self._fq._on(b, generation), generation, self.producer, self._put_block,
                         self._put_timeout)
                self.resent += n

    def _fail_over(self, generation: int, cause: ShmqError) -> None:
        """The connection ``generation`` failed: find the primary again.  When none is found,
        each put that waits to be re-sent is given up: it raises that ``ConnectionLost``."""
        broker = self._fq.broker
        try:
            broker._failover(generation, time.monotonic())
        except ConnectionLost as lost:
            state = broker._state
            for _, _, put in self._puts:
                if state is None or put.generation != state[1]:
                    if put.outcome is None:
                        put.take()
                    if isinstance(put.outcome, FAILS_OVER):
                        put.outcome, put.sends = lost, SENDS
            raise lost from cause

    def _confirm_oldest(self) -> None:
        """Collect the oldest put's confirmation, or raise its error; after a fail-over, send it
        and the others again (and return: the caller's loop collects it again)."""
        index, n, put = self._puts[0]
        try:
            offsets: list[int] | None = put.result()
        except FAILS_OVER as e:
            if put.sends < SENDS and not self._fq.broker._closing:
                put.outcome = e
                try:
                    self._fail_over(put.generation, e)
                    self._send()
                    return
                except FAILS_OVER as again:
                    e = again
            self._failed(e, index, n)
        except Duplicate as e:
            if put.sends < SENDS:
                self._failed(e, index, n)
            offsets = None  # stored before the fail-over
        except ShmqError as e:
            self._failed(e, index, n)
        self._puts.popleft()
        self._count -= n
        self.confirmed += n
        if offsets:
            self.last_offset = offsets[-1]
        else:
            self.duplicates += n

    def _failed(self, e: ShmqError, index: int, n: int) -> NoReturn:
        self._puts.popleft()
        self._count -= n
        self.failed += n
        e.index = index  # type: ignore[attr-defined]
        raise e

    def __enter__(self) -> FailoverPublisher:
        return self

    def __repr__(self) -> str:
        return (f"FailoverPublisher({self.queue.name!r}, window={self.window}, sent={self.sent}, "
                f"confirmed={self.confirmed}, failed={self.failed}, resent={self.resent}, "
                f"duplicates={self.duplicates})")


def _reconnect(entries: list[str], token: str | None, failover_timeout: float,
               settings: dict[str, Any]) -> FailoverBroker:
    return FailoverBroker(entries, token, failover_timeout=failover_timeout, **settings)


__all__ = ["FailoverBroker", "FailoverPublisher", "FailoverQueue", "Search", "check_failover_timeout",
           "not_primary", "split_urls", "url_list"]
