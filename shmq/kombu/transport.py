"""The kombu transport: kombu's virtual transport, with shmq doing what it does better.

Kept from ``kombu.transport.virtual``: channels, exchange declarations and the exchange
types (``direct``, ``topic``, ``fanout``: their ``lookup`` routes a publish).  Replaced:

* **where messages wait**: each kombu queue is a shmq queue (``naming``), its messages
  consumed by the queue's default group; a publish puts a copy into each queue its
  exchange routes it to (``codec``: the body as the payload, the rest in a header);
* **the binding table**, shared by every process through the broker (``bindings``), so
  fan-out (Celery's remote control), topics (its events) and direct replies reach queues
  bound in other processes;
* **delivery tags are shmq leases** (:class:`QoS`): ``basic_ack`` is an ack,
  ``basic_reject(requeue=True)`` a nack (delivered again, ``redelivered`` set) and
  ``requeue=False`` a dead-letter (to ``<queue>.dlq``); unsettled leases are given back
  (nacked) when the channel closes, and a consumer that dies gives its leases back at
  once (its TCP connection drops; co-located, within 0.25 s): no visibility timeout to
  wait out.  Leases are taken for ``visibility_timeout`` (default 12 h, the most shmq
  allows), so a long task is never handed to a second worker while the first runs it;
* **consuming**: no polling sleep.  ``drain_events`` leases up to the channel's prefetch
  credit (``basic_qos``: held leases + fetched-not-delivered <= prefetch_count) in one
  ``get_many``, blocking in the broker while nothing is ready; with several queues, it
  blocks on the busiest for at most ``polling_interval`` (default 0.1 s), then looks at
  the others once, without blocking.  While a consumer has no credit left, it waits for
  an ack instead (Celery acks from its pool's result thread), which wakes it at once.

kombu's event loop (``kombu.asynchronous.Hub``) is served by looking on each tick
(``register_with_event_loop``); Celery drives this transport with its blocking loop
(``implements.asynchronous`` is False: no descriptor says when a shmq queue has messages).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any
from urllib.parse import quote

from kombu.exceptions import ChannelError
from kombu.log import get_logger
from kombu.message import Message as KombuMessage
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

import shmq
from shmq import options
from shmq.api import ensure_queue
from shmq.kombu import address, codec
from shmq.kombu.bindings import Bindings
from shmq.kombu.naming import is_dead_letter_queue, queue_name
from shmq.version import __version__

logger = get_logger(__name__)

DEFAULT_BATCH = 64  # the most messages one fetch takes when prefetch does not bound it
POLL_SLICE = 0.1  # polling_interval: the longest a wait on one queue keeps the others waiting
MISS_REFRESH = 0.1  # a topic or fan-out publish that finds no queue reads the bindings again after this
# the limits of a queue that goes with its consumer (auto_delete, exclusive: Celery's reply,
# event and broadcast queues), unless queue_limits names them: a few MiB of /dev/shm each,
# not a work queue's 18 MiB
TRANSIENT_LIMITS = {"capacity": 4096, "max_bytes": 4 * 1024 * 1024}


class Leases:
    """A channel's deliveries not settled yet, by delivery tag: each is a shmq lease."""

    def __init__(self, channel: Channel, prefetch_count: int = 0) -> None:
        self.channel = channel
        self.prefetch_count = prefetch_count or 0
        self.held: dict[int, shmq.Message] = {}
        self.restored = False

    def credit(self) -> int:
        """How many more the channel may be handed (``DEFAULT_BATCH`` without a prefetch)."""
        if not self.prefetch_count:
            return DEFAULT_BATCH
        return max(self.prefetch_count - len(self.held) - self.channel.fetched, 0)

    def can_consume(self) -> bool:
        return self.credit() > 0

    def can_consume_max_estimate(self) -> int:
        return self.credit()

    def append(self, lease: shmq.Message, delivery_tag: int) -> None:
        self.held[delivery_tag] = lease

    def get(self, delivery_tag: int) -> shmq.Message:
        return self.held[delivery_tag]

    def _take(self, delivery_tag: int, multiple: bool = False) -> list[shmq.Message]:
        if multiple:
            tags = sorted(t for t in list(self.held) if t <= delivery_tag)
        else:
            tags = [delivery_tag]
        leases = [lease for t in tags if (lease := self.held.pop(t, None)) is not None]
        self.channel.credit_freed()
        return leases

    def ack(self, delivery_tag: int, multiple: bool = False) -> None:
        for lease in self._take(delivery_tag, multiple):
            lease.ack(wait=False)

    def reject(self, delivery_tag: int, requeue: bool = False) -> None:
        for lease in self._take(delivery_tag):
            if requeue:
                lease.nack()
            elif lease.queue.endswith(options.DLQ_SUFFIX):  # a dead letter rejected: AMQP drops it
                lease.ack(wait=False)
            else:
                lease.dead_letter()

    def restore_unacked(self) -> list[tuple[BaseException, shmq.Message]]:
        """Give every lease held back (a nack each: delivered again, at once)."""
        errors: list[tuple[BaseException, shmq.Message]] = []
        while self.held:
            _, lease = self.held.popitem()
            try:
                lease.nack()
            except shmq.StaleAck:
                pass  # given back already (its connection went)
            except (shmq.ShmqError, OSError) as e:
                errors.append((e, lease))
        self.channel.credit_freed()
        return errors

    def restore_unacked_once(self, stderr: Any = None) -> None:
        if not self.restored:
            self.restored = True
            self.restore_unacked()

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: a dead consumer's leases come back by themselves."""


class Subscription:
    """One ``basic_consume``: the queue, its callback, and how busy it has been."""

    __slots__ = ("callback", "cancelled", "channel", "idle_until", "last_got", "name", "no_ack", "queue",
                 "tag")

    def __init__(self, channel: Channel, tag: str, queue: str, no_ack: bool, callback: Any) -> None:
        self.channel = channel
        self.tag = tag
        self.queue = queue
        self.name = queue_name(queue)
        self.no_ack = no_ack
        self.callback = callback
        self.idle_until = 0.0  # monotonic: found empty, not looked at without blocking before then
        self.last_got = 0.0
        self.cancelled = False

    def credit(self) -> int:
        return DEFAULT_BATCH if self.no_ack else self.channel.qos.credit()


class Channel(virtual.Channel):
    """A kombu channel over a shmq broker handle (its transport's)."""

    QoS = Leases  # type: ignore[assignment]
    Message = KombuMessage  # type: ignore[assignment]
    do_restore = True

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.transport = connection
        self._leases: Leases | None = None
        self._subs: dict[str, Subscription] = {}
        self._delivery_tags = itertools.count(1)
        self._declared: dict[str, dict[str, Any]] = {}  # kombu queue -> its declaration (for auto_delete)
        self.fetched = 0  # leased for this channel's consumers, not handed to them yet

    # ------------------------------------------------------------ settling
    @property
    def qos(self) -> Leases:  # type: ignore[override]
        if self._leases is None:
            self._leases = Leases(self)
        return self._leases

    def credit_freed(self) -> None:
        self.transport.wake()

    def basic_qos(self, prefetch_size: int = 0, prefetch_count: int = 0, apply_global: bool = False) -> None:
        """Prefetch: the most leases the channel holds (delivered, not settled) plus fetched."""
        self.qos.prefetch_count = prefetch_count or 0
        self.transport.wake()

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.qos.ack(delivery_tag, multiple)

    def basic_reject(self, delivery_tag: int, requeue: bool = False) -> None:
        self.qos.reject(delivery_tag, requeue)

    def basic_recover(self, requeue: bool = False) -> Any:
        if requeue:
            return self.qos.restore_unacked()
        raise NotImplementedError("shmq gives unsettled messages back to their queue: "
                                  "use basic_recover(requeue=True)")

    # ------------------------------------------------------------ messages
    def wrap(self, lease: shmq.Message, no_ack: bool, consumer_tag: str | None = None) -> KombuMessage:
        """The kombu Message of ``lease``; its delivery tag names the lease (unless ``no_ack``:
        acked already)."""
        d = codec.decode(lease.payload, lease.headers, lease.redelivered)
        tag = next(self._delivery_tags)
        d.properties["delivery_tag"] = tag
        d.delivery_info["delivery_tag"] = tag
        if consumer_tag:
            d.delivery_info["consumer_tag"] = consumer_tag
        if not no_ack:
            self.qos.append(lease, tag)
        return KombuMessage(body=d.body, channel=self, delivery_tag=tag, content_type=d.content_type,
                            content_encoding=d.content_encoding, delivery_info=d.delivery_info,
                            properties=d.properties, headers=d.headers)

    def message_to_python(self, raw_message: Any) -> Any:
        return raw_message

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str, mandatory: bool = False,
                      timeout: float | None = None, **kwargs: Any) -> None:
        """Put ``message`` into each queue ``exchange`` routes ``routing_key`` to (the
        default exchange "": the queue named ``routing_key``).  A message no queue takes is
        dropped, as AMQP drops it (``mandatory=True``: ``QueueNotFound``).  A full queue is
        waited for (``timeout`` seconds at most: then ``shmq.Full``), except by the copies a
        fan-out or topic exchange makes: such a copy is dropped for that queue, so that one
        stalled receiver (of broadcasts, of events) never stalls the publisher."""
        queues = self._lookup(exchange, routing_key)
        enc = codec.encode(message, exchange, routing_key)
        wait = not exchange or self.typeof(exchange).type == "direct"
        put = 0
        for queue in queues:
            put += self.transport.put(queue_name(queue), enc, timeout, wait)
        if not put and mandatory:
            raise shmq.QueueNotFound(f"no queue takes routing key {routing_key!r} of exchange {exchange!r}")

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> KombuMessage | None:
        h = self.transport.handle(queue_name(queue))
        if h is None:
            return None
        try:
            lease = h.get(False, visibility_timeout=self.transport.visibility_timeout)
        except shmq.Empty:
            return None
        if no_ack:
            lease.ack(wait=False)
        return self.wrap(lease, no_ack)

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any) -> str:
        tag = consumer_tag or f"shmq.ctag-{next(self._delivery_tags)}"
        sub = self._subs[tag] = Subscription(self, tag, queue, no_ack, callback)
        self.transport.subscribe(sub)
        return tag

    def basic_cancel(self, consumer_tag: str) -> None:
        sub = self._subs.pop(consumer_tag, None)
        if sub is None:
            return
        self.transport.unsubscribe(sub)
        decl = self._declared.get(sub.queue)
        gone_with_consumer = decl and (decl.get("auto_delete") or decl.get("exclusive"))
        if gone_with_consumer and not self.transport.consumes(sub.queue):
            self.queue_delete(sub.queue)

    # ------------------------------------------------------------ queues
    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """``Queue(message_ttl=, expires=, max_priority=, ...)`` as AMQP's ``x-`` arguments."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        if is_dead_letter_queue(queue):
            return  # made by the broker at its queue's first dead letter
        limits = self.transport.queue_limits(queue, kwargs.get("arguments") or {})
        if kwargs.get("auto_delete") or kwargs.get("exclusive"):
            limits = {**TRANSIENT_LIMITS, **limits}
        self._declared[queue] = kwargs
        self.transport.create(queue_name(queue), limits)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.transport.handle(queue_name(queue)) is not None

    def _size(self, queue: str) -> int:
        h = self.transport.handle(queue_name(queue))
        if h is None:
            return 0
        try:
            return int(h.stats()["groups"][options.DEFAULT_GROUP]["depth"])
        except shmq.QueueNotFound:
            return 0

    def _purge(self, queue: str) -> int:
        h = self.transport.handle(queue_name(queue))
        if h is None:
            return 0
        try:
            return h.purge()
        except shmq.QueueNotFound:
            return 0

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> int:
        """Delete ``queue`` with its messages and its bindings (every process's)."""
        if if_unused and self.transport.consumes(queue):
            return 0
        size = self._size(queue)
        if if_empty and size:
            return 0
        self.transport.bindings.unbind_queue(queue)
        self.transport.delete(queue_name(queue))
        self._declared.pop(queue, None)
        return size

    def queue_bind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                   arguments: Any = None, **kwargs: Any) -> None:
        exchange = exchange or "amq.direct"
        self.transport.bindings.bind(exchange, self.typeof(exchange).type or "direct", routing_key, queue)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        self.transport.bindings.unbind(exchange or "amq.direct", routing_key, queue)

    def redeclare(self, queue: str) -> bool:
        """Make ``queue`` again as this channel declared it (deleted under its consumer:
        by another process, or by a broker restarted without its memory queues)."""
        decl = self._declared.get(queue)
        if decl is None:
            return False
        self._new_queue(queue, **decl)
        return True

    # ------------------------------------------------------------ exchanges
    def typeof(self, exchange: str, default: str = "direct") -> Any:
        try:
            type_ = self.state.exchanges[exchange]["type"]
        except KeyError:
            type_ = self.transport.bindings.type_of(exchange) or default
        return self.exchange_types[type_]

    def get_table(self, exchange: str) -> list[tuple[str, Any, str]]:
        """The bindings of ``exchange``, every process's, as kombu's exchange types take them."""
        bindings = self.transport.bindings
        bindings.refresh()
        ex_type = self.typeof(exchange)
        return [ex_type.prepare_bind(q, exchange, key, None) for key, q in bindings.table(exchange)]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        if not exchange:
            return [routing_key]
        bindings = self.transport.bindings
        bindings.refresh()  # (before typeof: an exchange declared elsewhere has its type there)
        ex_type = self.typeof(exchange)
        found = ex_type.lookup(self.get_table(exchange), exchange, routing_key, None)
        if not found:  # bound a moment ago in another process? (a reply queue: read at once)
            bindings.refresh(0.0 if ex_type.type == "direct" else MISS_REFRESH)
            ex_type = self.typeof(exchange)
            found = ex_type.lookup(self.get_table(exchange), exchange, routing_key, None)
        return sorted(q for q in found if q)

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Cancel the consumers (deleting their auto-delete queues), give every lease held
        back, and leave the transport."""
        if self.closed:
            return
        self.closed = True
        steps: list[Callable[[], Any]] = [functools.partial(self.basic_cancel, t) for t in list(self._subs)]
        steps += [functools.partial(self.queue_delete, q) for q, d in self._declared.items()
                  if d.get("exclusive")]
        if self._leases is not None:
            steps.append(self._leases.restore_unacked_once)
        for step in steps:  # each, even when one fails (the connection may be gone: then so are its leases)
            try:
                step()
            except (shmq.ShmqError, OSError) as e:
                logger.debug("shmq: closing channel %s: %r", self.channel_id, e)
        if self.connection is not None:
            self.connection.close_channel(self)


def priorities(queue: str, arguments: dict[str, Any]) -> int:
    """The shmq priority levels of a queue declared with AMQP's ``x-max-priority`` M (1..255,
    as RabbitMQ takes it): M + 1 levels, at most ``options.MAX_PRIORITIES`` (a message's
    priority past the top level counts as the top one, as RabbitMQ counts one past M); 0
    without it."""
    m = arguments.get("x-max-priority")
    if m is None:
        return 0
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= 255:
        raise shmq.InvalidArgument(f"queue {queue!r}: x-max-priority must be an int in 1..255, not {m!r}")
    return min(m + 1, options.MAX_PRIORITIES)


class Transport(virtual.Transport):
    """``shmq://`` for kombu (``docs/celery.md``)."""

    Channel = Channel
    can_parse_url = True
    default_port = options.DEFAULT_PORT  # type: ignore[assignment]
    driver_type = "shmq"
    driver_name = "shmq"
    polling_interval = POLL_SLICE
    connection_errors = (ConnectionError, shmq.ConnectionLost, shmq.NotPrimary,  # type: ignore[assignment]
                         shmq.InstanceNotFound)
    channel_errors = (ChannelError,)
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()
    implements = virtual.Transport.implements.extend(
        asynchronous=False, exchange_type=frozenset(["direct", "topic", "fanout"]), heartbeats=False)

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        opts = client.transport_options or {}
        self.broker: shmq.Broker | None = None
        self._bindings: Bindings | None = None
        self.visibility_timeout = float(opts.get("visibility_timeout", options.MAX_VISIBILITY_TIMEOUT))
        self.batch = int(opts.get("max_batch", DEFAULT_BATCH))
        self.binding_refresh = float(opts.get("binding_refresh", 1.0))
        self.limits: dict[str, Any] = {"max_deliveries": options.MAX_DELIVERIES_LIMIT,
                                       **opts.get("queue_limits", {})}
        if "durability" in opts:
            self.limits["durability"] = opts["durability"]
        self.failover_timeout = opts.get("failover_timeout")
        self._handles: dict[str, shmq.Queue] = {}
        self._missing: dict[str, float] = {}  # queue -> until when it is taken not to exist
        self._levels: dict[str, int] = {}  # queue -> its priority levels (0: none)
        self._subs: list[Subscription] = []
        self._fetched: deque[tuple[Subscription, shmq.Message]] = deque()
        self._turn = 0
        self._credit = threading.Condition(threading.Lock())
        self._waiting = False
        self._freed = 0  # credit given back so far (acks, rejects, a new prefetch): wake's count
        self._pid = os.getpid()  # the process that connected (a forked child must not talk on it)

    # ------------------------------------------------------------ connection
    def establish_connection(self) -> Any:
        client: Any = self.client
        url, token = address.broker_url(client)
        kwargs: dict[str, Any] = {}
        if url.startswith("shm://"):
            kwargs["create"] = False  # attach an instance that exists: never make one
        else:
            kwargs.update(connect_timeout=float(client.connect_timeout or 10), client="kombu")
            if self.failover_timeout is not None and "," in url:
                kwargs["failover_timeout"] = float(self.failover_timeout)
        self._pid = os.getpid()
        self.broker = shmq.connect(url, token, **kwargs)
        durability = {"durability": self.limits["durability"]} if "durability" in self.limits else None
        self._bindings = Bindings(self.broker, self.binding_refresh, durability)
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        """Close the channels (their leases go back) and the broker handle; in a process
        forked since it connected, only let go (see ``_collect``)."""
        if os.getpid() != self._pid:
            self._collect(connection)
            return
        try:
            super().close_connection(connection)
        finally:
            broker, self.broker = self.broker, None
            self._handles.clear()
            self._missing.clear()
            if broker is not None:
                try:
                    broker.close()
                except (shmq.ShmqError, OSError):
                    pass

    def _collect(self, connection: Any) -> None:
        """kombu's clean-up after a fork (Celery's pool processes let go of the connections
        they inherit): in a forked child, drop everything without a word to the broker (a TCP
        socket is the parent's too, and the leases are the parent's); else ``close_connection``."""
        if os.getpid() == self._pid:
            self.close_connection(connection)
            return
        self.broker = self._bindings = None
        self._handles.clear()
        self._subs.clear()
        self._fetched.clear()
        for channel in self.channels:
            channel.closed = True
        self.channels.clear()

    def verify_connection(self, connection: Any) -> bool:
        return self.broker is not None

    def driver_version(self) -> str:
        return __version__

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """The URL, as ``shmq://`` spells it, its token masked unless ``include_password``."""
        url, token = address.broker_url(self.client)
        scheme, _, rest = url.partition("://")
        if token and "token=" not in rest and scheme != "shm":
            rest += f"{'&' if '?' in rest else '?'}token={quote(token, safe='')}"
        shown = f"shmq://{rest}" if scheme == "tcp" else f"shmq+{scheme}://{rest}"
        return shown if include_password else address.shown(shown, mask)

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": options.DEFAULT_HOST}

    @property
    def bindings(self) -> Bindings:
        if self._bindings is None:
            raise shmq.ConnectionLost("not connected")
        return self._bindings

    def _broker(self) -> shmq.Broker:
        if self.broker is None:
            raise shmq.ConnectionLost("the kombu connection is closed")
        return self.broker

    # ------------------------------------------------------------ queues
    def queue_limits(self, queue: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """``create_queue``'s limits for kombu queue ``queue`` declared with ``arguments``."""
        limits = dict(self.limits)
        levels = priorities(queue, arguments)
        if levels:
            limits["priorities"] = levels
        ttl = arguments.get("x-message-ttl")
        if ttl is not None:
            limits["message_ttl"] = max(float(ttl), 1.0) / 1000.0
        # AMQP drops an expired message unless the queue names a dead-letter exchange
        limits["expired_to_dlq"] = "x-dead-letter-exchange" in arguments
        if "x-delivery-limit" in arguments:
            limits["max_deliveries"] = min(max(int(arguments["x-delivery-limit"]) + 1, 1),
                                           options.MAX_DELIVERIES_LIMIT)
        return limits

    def handle(self, name: str) -> shmq.Queue | None:
        """The handle of shmq queue ``name``; None when there is no such queue (looked for
        again after ``polling_interval``: a queue bound and gone costs no round trip a put)."""
        h = self._handles.get(name)
        if h is None:
            now = monotonic()
            if self._missing.get(name, 0.0) > now:
                return None
            try:
                h = self._handles[name] = self._broker().queue(name)
                self._levels[name] = self._levels_of(name, h)
            except shmq.QueueNotFound:
                self._handles.pop(name, None)
                self._missing[name] = now + self.polling_interval
                return None
            self._missing.pop(name, None)
        return h

    def _levels_of(self, name: str, h: shmq.Queue) -> int:
        """The priority levels of queue ``name`` (0: none): a co-located handle knows them (its
        config), a TCP one asks for that queue's stats once."""
        config = getattr(h, "config", None)
        if config is not None:
            return int(config.priorities)
        return int(h.stats()["config"].get("priorities", 0))

    def create(self, name: str, limits: dict[str, Any]) -> None:
        if name not in self._handles:
            self._missing.pop(name, None)
            h = self._handles[name] = ensure_queue(self._broker(), name, limits)
            self._levels[name] = self._levels_of(name, h)

    def delete(self, name: str) -> None:
        self._handles.pop(name, None)
        self._missing.pop(name, None)
        try:
            self._broker().delete_queue(name)
        except shmq.QueueNotFound:
            pass

    def put(self, name: str, enc: codec.Encoded, timeout: float | None, wait: bool = True) -> int:
        """Put ``enc`` into shmq queue ``name``: 1, or 0 when there is no such queue, or when
        it is full and ``wait`` is False (the copy is dropped, and said so in the log)."""
        for _ in range(2):
            h = self.handle(name)
            if h is None:
                return 0
            levels = self._levels.get(name, 0)
            prio = min(enc.priority, levels - 1) if levels > 1 else 0  # (past the top: the top, as AMQP)
            try:
                h.put(enc.payload, wait, timeout if wait else None, headers=enc.headers, ttl=enc.ttl,
                      priority=prio)
                return 1
            except shmq.QueueNotFound:  # deleted since (and maybe made again): once more, afresh
                self._handles.pop(name, None)
            except shmq.Full:
                if wait:
                    raise
                logger.warning("shmq: queue %s is full: a broadcast or event copy was dropped for it", name)
                return 0
        return 0

    # ------------------------------------------------------------ consuming
    def subscribe(self, sub: Subscription) -> None:
        self._subs.append(sub)

    def unsubscribe(self, sub: Subscription) -> None:
        sub.cancelled = True
        if sub in self._subs:
            self._subs.remove(sub)
        fetched = self._fetched  # (changed in place: a hand-out under way goes on with the rest)
        mine = [lease for s, lease in fetched if s is sub]
        if mine:
            rest = [(s, lease) for s, lease in fetched if s is not sub]
            fetched.clear()
            fetched.extend(rest)
            sub.channel.fetched -= len(mine)
            if not sub.no_ack:  # fetched for it, never handed to it: back to the queue
                for lease in mine:
                    try:
                        lease.nack()
                    except (shmq.ShmqError, OSError):
                        pass

    def consumes(self, queue: str) -> bool:
        return any(s.queue == queue for s in self._subs)

    def wake(self) -> None:
        """Credit came back (an ack, maybe from another thread): wake a drain waiting for it."""
        self._freed += 1  # (before reading _waiting: a drain about to wait sees one or the other)
        if self._waiting:
            with self._credit:
                self._credit.notify_all()

    def _wait_for_credit(self, timeout: float, since: int) -> None:
        """Wait up to ``timeout`` seconds for credit to come back, unless some came back since
        ``_freed`` was ``since``."""
        with self._credit:
            self._waiting = True
            try:
                if self._freed == since:
                    self._credit.wait(timeout)
            finally:
                self._waiting = False

    def _fetch(self, sub: Subscription, block: bool, timeout: float | None) -> bool:
        """Lease what ``sub`` may take now into the fetched list; True when it got some."""
        h = self.handle(sub.name)
        if h is None:
            if not sub.channel.redeclare(sub.queue):
                sub.idle_until = monotonic() + self.polling_interval
                if block and timeout:
                    self._wait_for_credit(min(timeout, self.polling_interval), self._freed)
                return False
            h = self.handle(sub.name)
            if h is None:
                return False
        n = min(sub.credit(), self.batch)
        if n <= 0:
            return False
        try:
            leases = h.get_many(n, block, timeout, visibility_timeout=self.visibility_timeout)
        except shmq.Empty:
            return False
        except shmq.QueueNotFound:
            self._handles.pop(sub.name, None)
            return False
        if sub.no_ack:
            h.ack_many(leases, wait=False)
        sub.last_got = monotonic()
        sub.channel.fetched += len(leases)
        self._fetched.extend((sub, lease) for lease in leases)
        return True

    def _hand_out(self) -> None:
        """Hand the fetched messages to their consumers' callbacks, in order (a callback that
        raises leaves the rest for the next drain)."""
        fetched = self._fetched
        while fetched:
            sub, lease = fetched.popleft()
            sub.channel.fetched -= 1
            if sub.cancelled:
                if not sub.no_ack:
                    lease.nack()
                continue
            try:
                message = sub.channel.wrap(lease, sub.no_ack, sub.tag)
            except (ValueError, KeyError, TypeError) as e:  # not a message kombu can read: set aside
                logger.error("shmq: dead-lettering message %d of %s, which kombu cannot read: %r",
                             lease.offset, sub.name, e)
                if not sub.no_ack:
                    with contextlib.suppress(shmq.ShmqError):  # (a dead letter's own: stays leased)
                        lease.dead_letter()
                continue
            sub.callback(message)

    def _sweep(self, subs: list[Subscription], now: float, everyone: bool) -> bool:
        """Look at each consumer's queue once, without blocking, from the next in turn (those
        found empty a moment ago only when ``everyone``); True when one got messages."""
        n = len(subs)
        for i in range(n):
            sub = subs[(self._turn + i) % n]
            if not everyone and sub.idle_until > now:
                continue
            if self._fetch(sub, False, None):
                self._turn = (self._turn + i + 1) % n
                return True
            sub.idle_until = now + self.polling_interval
        return False

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """kombu's event loop (``kombu.asynchronous.Hub``): no descriptor says when a shmq
        queue has messages, so the loop looks, without blocking, on each of its ticks, and
        every ``polling_interval`` at least (a timer that bounds its wait)."""
        loop.on_tick.add(self._on_tick)
        loop.call_repeatedly(self.polling_interval, self._on_tick)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        loop.on_tick.discard(self._on_tick)

    def _on_tick(self) -> None:
        if self.broker is None:
            return
        if not self._fetched:
            subs = [s for s in self._subs if s.credit() > 0]
            self._sweep(subs, monotonic(), everyone=False)
        if self._fetched:
            self._hand_out()

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Hand at least one message to its consumer's callback, or raise ``socket.timeout``
        after ``timeout`` seconds (None: wait for ever; 0: only what is ready now)."""
        deadline = None if timeout is None else monotonic() + timeout
        now_only = timeout is not None and timeout <= 0
        while True:
            if self._fetched:
                self._hand_out()
                return
            freed = self._freed
            now = monotonic()
            subs = [s for s in self._subs if s.credit() > 0]
            starved = len(subs) < len(self._subs)  # some wait for their leases to be settled
            if len(subs) > 1 or starved or now_only:
                if self._sweep(subs, now, everyone=now_only):
                    continue
            left = 1e9 if deadline is None else deadline - now
            if left <= 0:
                raise TimeoutError()  # (socket.timeout, which kombu expects)
            if subs and not starved:  # wait in the broker, on the busiest queue
                sub = max(subs, key=lambda s: s.last_got)
                wait: float | None = min(left, self.polling_interval)
                if len(self._subs) == 1:  # nothing else to look at: as long as asked
                    wait = None if deadline is None else left
                if not self._fetch(sub, True, wait):
                    for s in subs:
                        s.idle_until = 0.0
            else:  # wait for an ack (from any thread) to give credit back, looking at the others now and then
                self._wait_for_credit(min(left, self.polling_interval), freed)
