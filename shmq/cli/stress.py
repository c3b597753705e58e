"""``shmq bench``: a DMS-style stress test against a running broker (or shared memory).

Producers and consumers run in their own processes; the parent shows a live
progress bar and returns the figures.  Every message is acknowledged, and the
run checks that every produced message was consumed.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from shmq import connect
from shmq.errors import Empty, QueueNotFound


def _producer(url: str, token: str | None, queue: str, n: int, size: int, batch: int,
              done: Any) -> None:
    b = connect(url, token=token)
    q = b.queue(queue)
    payload = b"x" * size
    sent = 0
    while sent < n:
        k = min(batch, n - sent)
        if k == 1:
            q.put(payload)
        else:
            q.put_many([payload] * k)
        sent += k
        with done.get_lock():
            done.value += k
    b.close()


def _consumer(url: str, token: str | None, queue: str, total: Any, got: Any, batch: int) -> None:
    b = connect(url, token=token)
    q = b.queue(queue)
    while got.value < total:
        try:
            if batch == 1:
                q.get(timeout=0.2).ack()
                k = 1
            else:
                msgs = q.get_many(batch, timeout=0.2)
                q.ack_many(msgs)
                k = len(msgs)
        except Empty:
            continue
        with got.get_lock():
            got.value += k
    b.close()


def run_stress(url: str, token: str | None, queue: str, messages: int, producers: int, consumers: int,
               size: int, batch: int, progress: bool = True) -> dict[str, Any]:
    b = connect(url, token=token)
    made = False  # a queue made for the run goes with it; one that was there stays
    try:
        b.queue(queue)
    except QueueNotFound:
        b.create_queue(queue)
        made = True
    b.close()
    ctx = mp.get_context("spawn")
    total = messages * producers
    sent, got = ctx.Value("q", 0), ctx.Value("q", 0)
    procs = [ctx.Process(target=_consumer, args=(url, token, queue, total, got, batch))
             for _ in range(consumers)]
    procs += [ctx.Process(target=_producer, args=(url, token, queue, messages, size, batch, sent))
              for _ in range(producers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    try:
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
            with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn()) as prog:
                tp = prog.add_task("produced", total=total)
                tc = prog.add_task("consumed", total=total)
                while got.value < total and any(p.is_alive() for p in procs):
                    prog.update(tp, completed=sent.value)
                    prog.update(tc, completed=got.value)
                    time.sleep(0.1)
                prog.update(tp, completed=sent.value)
                prog.update(tc, completed=got.value)
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        if made:
            with connect(url, token=token) as b:
                try:
                    b.delete_queue(queue)
                except QueueNotFound:
                    pass
    dt = time.perf_counter() - t0
    return {"messages": total, "consumed": got.value, "seconds": dt, "msgs_per_s": got.value / dt,
            "producers": producers, "consumers": consumers, "payload_bytes": size, "batch": batch,
            "lost": total - got.value if got.value < total else 0}
