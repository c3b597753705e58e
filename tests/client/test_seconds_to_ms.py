"""One seconds-to-ms conversion for every client command (``shmq.protocol.commands.seconds_to_ms``):
a bad duration -- negative, NaN, infinite, too large, not a number -- is the same
InvalidArgument, with the same message, from the blocking TCP client and the asyncio one,
raised before anything is sent."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from functools import partial
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.client import aio
from shmq.protocol.codec import WAIT_FOREVER
from shmq.protocol.commands import nack_delay_ms, seconds_to_ms, timeout_ms, visibility_ms
from tests.support.server import Server


class NoNumber:
    """Something that is no number, whose repr is the same in every process (a test id)."""

    def __repr__(self) -> str:
        return "NoNumber()"


TOO_LARGE = options.MAX_VISIBILITY_TIMEOUT + 1
NOT_NUMBERS = ["1", b"1", True, [1], NoNumber()]
BAD_ANY = [-1, -0.001, math.nan, -math.inf, math.inf, *NOT_NUMBERS]  # bad for every duration
BAD_BOUNDED = [*BAD_ANY, TOO_LARGE]  # ... and too large where there is a most

# what each command does with a duration ``v``: (its name, the call, the bad values it is given)
Op = Callable[[Any, Any, Any], Any]
OPS: list[tuple[str, Op, list[Any]]] = [
    ("put timeout", lambda q, lease, v: q.put(b"x", timeout=v), BAD_ANY),
    ("put_many timeout", lambda q, lease, v: q.put_many([b"x"], timeout=v), BAD_ANY),
    ("get timeout", lambda q, lease, v: q.get(timeout=v), BAD_ANY),
    ("get visibility_timeout", lambda q, lease, v: q.get(timeout=0.01, visibility_timeout=v), BAD_BOUNDED),
    ("get_many timeout", lambda q, lease, v: q.get_many(5, timeout=v), BAD_ANY),
    ("get_many visibility_timeout", lambda q, lease, v: q.get_many(5, timeout=0.01, visibility_timeout=v),
     BAD_BOUNDED),
    ("subscribe visibility_timeout", lambda q, lease, v: q.subscribe(visibility_timeout=v), BAD_BOUNDED),
    ("nack delay", lambda q, lease, v: lease.nack(v), BAD_BOUNDED),
    ("touch visibility_timeout", lambda q, lease, v: lease.touch(v), BAD_BOUNDED),
]
CASES = [(name, op, v) for name, op, bad in OPS for v in bad]
Outcome = tuple[type[BaseException], str] | None  # the error a call raised (its class and message)


def _outcome(result: Any) -> Any:
    """A blocking call's outcome: a subscription's first message asked for."""
    return next(result) if inspect.isgenerator(result) else result


async def _outcome_async(result: Any) -> Any:
    if inspect.isasyncgen(result):
        return await anext(result)
    return await result if inspect.isawaitable(result) else result


def _blocking(op: Op, q: Any, lease: Any, v: Any) -> Any:
    return _outcome(op(q, lease, v))


def _error(call: Callable[[], Any]) -> Outcome:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - whatever it is, it is compared
        return type(e), str(e)
    return None


def test_both_tcp_clients_raise_the_same_error_for_each_bad_duration(server: Server) -> None:
    b = shmq.connect(server.url)
    q = b.create_queue("seconds")
    try:
        q.put(b"to lease")
        lease = q.get(timeout=5)  # for nack and touch: nothing is sent for a bad duration
        blocking = [_error(partial(_blocking, op, q, lease, v)) for _, op, v in CASES]
        lease.ack()  # still ours: no bad duration touched it

        async def main() -> list[Outcome]:
            async with await aio.connect(server.url) as ab:
                aq = ab.queue("seconds")
                await aq.put(b"to lease")
                alease = await aq.get(timeout=5)
                out: list[Outcome] = []
                for _, op, v in CASES:
                    try:
                        await _outcome_async(op(aq, alease, v))
                    except Exception as e:  # noqa: BLE001 - whatever it is, it is compared
                        out.append((type(e), str(e)))
                    else:
                        out.append(None)
                await alease.ack()
                return out

        asyncio_ = asyncio.run(asyncio.wait_for(main(), 15))
    finally:
        b.delete_queue("seconds")
        b.close()
    for (name, _, v), tcp_err, aio_err in zip(CASES, blocking, asyncio_, strict=True):
        assert tcp_err is not None and tcp_err[0] is shmq.InvalidArgument, (name, v, tcp_err)
        assert aio_err == tcp_err, (name, v, tcp_err, aio_err)


@pytest.mark.parametrize("value", BAD_BOUNDED, ids=repr)
def test_seconds_to_ms_refuses_what_is_no_duration(value: Any) -> None:
    with pytest.raises(shmq.InvalidArgument, match="^delay must be"):
        seconds_to_ms(value, "delay", options.MAX_VISIBILITY_TIMEOUT)
    if value is not TOO_LARGE:
        with pytest.raises(shmq.InvalidArgument, match="^timeout must be"):
            seconds_to_ms(value, "timeout")


def test_seconds_to_ms_of_good_durations() -> None:
    assert seconds_to_ms(1.5, "timeout") == 1500
    assert seconds_to_ms(0, "timeout") == 0
    assert seconds_to_ms(0.0019, "timeout") == 1  # truncated, as before
    assert seconds_to_ms(1e12, "timeout") == WAIT_FOREVER - 1  # the longest wait the wire carries
    assert seconds_to_ms(Fraction(1, 4), "timeout") == 250  # type: ignore[arg-type]
    assert seconds_to_ms(Decimal("0.25"), "timeout") == 250  # type: ignore[arg-type]
    assert seconds_to_ms(options.MAX_VISIBILITY_TIMEOUT, "delay", options.MAX_VISIBILITY_TIMEOUT) == \
        options.MAX_VISIBILITY_TIMEOUT * 1000
    assert timeout_ms(False, -1) == 0  # not waiting: the timeout is not looked at
    assert timeout_ms(True, None) == WAIT_FOREVER
    assert visibility_ms(None) == 0 and visibility_ms(0) == 1 and visibility_ms(2) == 2000
    assert nack_delay_ms(0) == 0


def test_the_error_names_the_argument_and_the_value() -> None:
    with pytest.raises(shmq.InvalidArgument) as e:
        timeout_ms(True, -1)
    assert str(e.value) == "timeout must be a finite number of seconds >= 0, not -1"
    with pytest.raises(shmq.InvalidArgument) as e:
        visibility_ms(math.nan)
    assert str(e.value) == f"visibility_timeout must be between 0 and {options.MAX_VISIBILITY_TIMEOUT:g} " \
                           "seconds, not nan"
    with pytest.raises(shmq.InvalidArgument) as e:
        nack_delay_ms("1")  # type: ignore[arg-type]
    assert str(e.value) == "delay must be a number of seconds, not str"
