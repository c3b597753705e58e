"""A co-located demo: one producer and one consumer process meet in shared memory,
with no broker process at all.

    .venv/bin/python examples/colocated_demo.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import shmq


def _produce(url: str, n: int) -> None:
    q = shmq.connect(url).queue("demo")
    for i in range(n):
        q.put(f"event {i}".encode())


def main(n: int = 100_000) -> None:
    url = f"shm://demo{os.getpid()}"
    from shmq.core.colocated import ShmBroker

    broker = ShmBroker(url[len("shm://"):])
    try:
        q = broker.create_queue("demo")
        print(f"instance {url}: queue 'demo' created; producing {n} messages from a child process")
        t0 = time.perf_counter()
        p = mp.get_context("spawn").Process(target=_produce, args=(url, n))
        p.start()
        got = 0
        while got < n:
            batch = q.get_many(100, timeout=10)
            q.ack_many(batch)
            got += len(batch)
        p.join()
        dt = time.perf_counter() - t0
        print(f"consumed and acknowledged {got} messages in {dt:.2f} s ({got / dt:,.0f} msgs/s)")
        print(q.stats()["groups"]["default"])
    finally:
        broker.destroy()


if __name__ == "__main__":
    main()
