"""Every client speaks the interface: ``shmq.api.Queue``'s and ``shmq.api.Broker``'s public
methods have, on each implementation (``tcp://``, a list of URLs that fails over, asyncio -- one
URL or a list -- and ``shm://``), the same parameters: the same names, in the same order, of the
same kinds, with the same defaults.  The asyncio client's are coroutines.

What an implementation adds or leaves out is listed below, each with its reason, so a new
difference fails here until it is listed; and an entry that no longer differs fails too,
so the lists stay true."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from shmq import api
from shmq.client.aio import AsyncBroker, AsyncMessage, AsyncQueue
from shmq.client.aio_failover import AsyncFailoverBroker, AsyncFailoverQueue
from shmq.client.failover import FailoverBroker, FailoverQueue
from shmq.client.tcp import TcpBroker, TcpQueue
from shmq.core.colocated import ShmBroker
from shmq.core.priority import PriorityQueue
from shmq.core.queue import ShmQueue

QUEUES = [TcpQueue, FailoverQueue, AsyncQueue, AsyncFailoverQueue, ShmQueue, PriorityQueue]
BROKERS = [TcpBroker, FailoverBroker, AsyncBroker, AsyncFailoverBroker, ShmBroker]

# optional parameters an implementation adds to an interface method (none may be required)
EXTRAS: dict[tuple[type, str], set[str]] = {
    # the broker's worker puts without waiting for the journal, and holds its answer instead
    (ShmQueue, "put"): {"wait_durable"},
    (ShmQueue, "put_many"): {"wait_durable"},
    (ShmQueue, "put_joined"): {"wait_durable"},
    (PriorityQueue, "put"): {"wait_durable"},  # (a priority queue's, in shared memory)
    (PriorityQueue, "put_many"): {"wait_durable"},
    (PriorityQueue, "put_joined"): {"wait_durable"},
    # the time a broker that does not answer the DISCONNECT is waited for
    (TcpBroker, "close"): {"timeout"},
    (FailoverBroker, "close"): {"timeout"},
    (AsyncBroker, "close"): {"timeout"},
    (AsyncFailoverBroker, "close"): {"timeout"},
    # makes ``<queue>.dlq`` at once (only in shared memory: a broker makes it at the first dead letter)
    (ShmBroker, "create_queue"): {"dead_letter"},
}
# interface methods an implementation does not have
ABSENT: set[tuple[type, str]] = {
    (AsyncQueue, "publisher"),  # asyncio pipelines by itself: ``await q.put`` in tasks, or put_many
    (AsyncFailoverQueue, "publisher"),
}
# the asyncio client's methods that are not coroutines, and what they are instead
NOT_COROUTINES: dict[tuple[type, str], Callable[[Any], bool]] = {
    (AsyncQueue, "iter_columns"): inspect.isasyncgenfunction,  # ``async for``
    (AsyncBroker, "queue"): inspect.isfunction,  # a handle, made without a round trip
    (AsyncFailoverQueue, "iter_columns"): inspect.isasyncgenfunction,
    (AsyncFailoverBroker, "queue"): inspect.isfunction,
}


def public(iface: type) -> list[str]:
    """The interface's public methods (its underscore methods are the clients' own business)."""
    return sorted(n for n, v in vars(iface).items() if not n.startswith("_") and inspect.isfunction(v))


def cases(iface: type, impls: list[type]) -> list[Any]:
    return [pytest.param(iface, impl, name, id=f"{impl.__name__}.{name}")
            for impl in impls for name in public(iface)]


def parameters(f: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(f).parameters.values())


def shape(p: inspect.Parameter) -> tuple[str, inspect._ParameterKind, Any]:
    return p.name, p.kind, p.default


@pytest.mark.parametrize(("iface", "impl", "name"), cases(api.Queue, QUEUES) + cases(api.Broker, BROKERS))
def test_each_implementation_takes_the_interfaces_parameters(iface: type, impl: type, name: str) -> None:
    if (impl, name) in ABSENT:
        assert not hasattr(impl, name), f"{impl.__name__}.{name} exists now: take it off ABSENT"
        return
    assert hasattr(impl, name), f"{impl.__name__} has no {name} of {iface.__name__}'s"
    want = parameters(getattr(iface, name))
    got = parameters(getattr(impl, name))
    extra = [p for p in got if p.name not in {w.name for w in want}]
    assert {p.name for p in extra} == EXTRAS.get((impl, name), set()), (
        f"{impl.__name__}.{name} adds {[p.name for p in extra]}: {inspect.signature(getattr(impl, name))}")
    for p in extra:
        assert p.default is not p.empty or p.kind == p.VAR_KEYWORD, f"{impl.__name__}.{name} needs {p.name}"
        assert p.kind == p.KEYWORD_ONLY or got.index(p) >= len(want), (
            f"{impl.__name__}.{name}'s {p.name} moves the interface's positional parameters")
    assert [shape(p) for p in got if p not in extra] == [shape(p) for p in want], (
        f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} is not "
        f"{iface.__name__}.{name}{inspect.signature(getattr(iface, name))}")


ASYNC_CASES = (cases(api.Queue, [AsyncQueue, AsyncFailoverQueue])
               + cases(api.Broker, [AsyncBroker, AsyncFailoverBroker]))


@pytest.mark.parametrize(("iface", "impl", "name"), ASYNC_CASES)
def test_the_asyncio_clients_methods_are_coroutines(iface: type, impl: type, name: str) -> None:
    f = getattr(impl, name, None)
    if f is None:
        assert (impl, name) in ABSENT
        return
    if (impl, name) in NOT_COROUTINES:
        assert not inspect.iscoroutinefunction(f), f"{impl.__name__}.{name} is a coroutine now: take it off"
        assert NOT_COROUTINES[impl, name](f), f"{impl.__name__}.{name} is not what NOT_COROUTINES says"
    else:
        assert inspect.iscoroutinefunction(f), f"{impl.__name__}.{name} is not a coroutine function"


def test_each_listed_difference_is_still_there() -> None:
    """An entry of EXTRAS names only parameters the implementation has and the interface has not."""
    for (impl, name), extra in EXTRAS.items():
        iface = api.Queue if impl in QUEUES else api.Broker
        mine = {p.name for p in parameters(getattr(impl, name))}
        theirs = {p.name for p in parameters(getattr(iface, name))}
        assert extra <= mine - theirs, f"{impl.__name__}.{name}: {extra - (mine - theirs)} no longer differ"


# The declaration itself: the stdlib's shape (``queue.Queue``'s ``put(item, block, timeout)`` /
# ``get(block, timeout)``, ``put_nowait`` / ``get_nowait``), every other parameter a keyword.
# Each client is held to ``shmq.api.Queue`` above, so this table holds for every one of them.
P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
DECLARED: dict[str, list[tuple[str, inspect._ParameterKind, Any]]] = {
    "put": [("payload", P, inspect.Parameter.empty), ("block", P, True), ("timeout", P, None),
            ("headers", K, None), ("delay", K, None), ("ttl", K, None), ("priority", K, 0)],
    "put_many": [("payloads", P, inspect.Parameter.empty), ("block", P, True), ("timeout", P, None),
                 ("producer", K, None), ("seq", K, None), ("headers", K, None), ("delay", K, None),
                 ("ttl", K, None), ("priority", K, 0)],
    "put_nowait": [("payload", P, inspect.Parameter.empty), ("headers", K, None), ("delay", K, None),
                   ("ttl", K, None), ("priority", K, 0)],
    "get": [("block", P, True), ("timeout", P, None), ("group", K, "default"),
            ("visibility_timeout", K, None), ("ack", K, None)],
    "get_many": [("max_messages", P, inspect.Parameter.empty), ("block", P, True), ("timeout", P, None),
                 ("group", K, "default"), ("visibility_timeout", K, None), ("ack", K, ())],
    "get_nowait": [("group", K, "default"), ("visibility_timeout", K, None), ("ack", K, None)],
    "create_group": [("name", P, inspect.Parameter.empty), ("start", P, "earliest"), ("exist_ok", P, False)],
}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_interface_has_the_stdlibs_shape(name: str) -> None:
    got = [shape(p) for p in parameters(getattr(api.Queue, name))][1:]  # (self)
    assert got == DECLARED[name], f"Queue.{name}{inspect.signature(getattr(api.Queue, name))}"


MESSAGES = [api.Message, AsyncMessage]


def documented(cls: type) -> list[str]:
    """The public methods and properties of ``cls``, its bases' included (but ``object``'s and
    ``tuple``'s: a message is a tuple underneath)."""
    return sorted(n for n in dir(cls) if not n.startswith("_") and not hasattr(tuple, n)
                  and (callable(getattr(cls, n)) or isinstance(inspect.getattr_static(cls, n), property))
                  and not isinstance(inspect.getattr_static(cls, n), (str, type)))


@pytest.mark.parametrize("cls", [api.Queue, api.Broker, *QUEUES, *BROKERS, *MESSAGES],
                         ids=lambda c: c.__name__)
def test_every_public_method_says_what_it_does(cls: type) -> None:
    """``help(q.put)`` explains the call on every client: a method with no docstring of its own
    shows the interface's (``inspect.getdoc`` follows the bases; the asyncio classes, which
    have none, take the interface's: ``shmq.api.shares_docs``)."""
    missing = [n for n in documented(cls) if not (inspect.getdoc(getattr(cls, n)) or "").strip()]
    assert missing == [], f"{cls.__name__}: no docstring for {missing}"


@pytest.mark.parametrize("cls", QUEUES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ["get", "get_many", "put", "put_nowait", "get_nowait", "create_group"])
def test_the_main_calls_explain_their_arguments_and_errors(cls: type, name: str) -> None:
    doc = inspect.getdoc(getattr(cls, name)) or ""
    if name.endswith("nowait"):
        assert ("Empty" if name.startswith("get") else "Full") in doc
        return
    for word in {"get": ["block", "timeout", "group", "Empty"], "get_many": ["max_messages", "Empty"],
                 "put": ["block", "timeout", "Full", "MessageTooLarge"],
                 "create_group": ["exist_ok", "GroupExists", "earliest", "latest"]}[name]:
        assert word in doc, f"{cls.__name__}.{name}'s docstring does not mention {word}"
