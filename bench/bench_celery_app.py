"""The task and the actor that ``bench_celery.py`` runs: a no-op that leaves one byte in a
file (``BENCH_DONE``), so the bench counts what ran without a result backend.  Configured by
the environment the bench gives its workers: ``BENCH_KIND`` (celery or dramatiq),
``BENCH_BROKER`` (the broker URL), ``BENCH_QUEUE``."""

from __future__ import annotations

import os

KIND = os.environ.get("BENCH_KIND", "celery")
BROKER = os.environ.get("BENCH_BROKER", "shmq://127.0.0.1:7878")
QUEUE = os.environ.get("BENCH_QUEUE", "bench")
_fd: list[int] = []


def _done() -> None:
    if not _fd:
        _fd.append(os.open(os.environ["BENCH_DONE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
    os.write(_fd[0], b"x")


if KIND == "celery":
    from celery import Celery

    import shmq.kombu  # noqa: F401  (registers shmq:// with kombu)

    app = Celery("bench")
    app.conf.update(broker_url=BROKER, task_default_queue=QUEUE, task_acks_late=True,
                    task_ignore_result=True, broker_connection_retry_on_startup=True,
                    worker_hijack_root_logger=False)

    @app.task
    def noop() -> None:
        _done()

else:
    import dramatiq

    if BROKER.startswith("redis://"):
        from dramatiq.brokers.redis import RedisBroker
        broker: dramatiq.Broker = RedisBroker(url=BROKER)
    else:
        from shmq.dramatiq import ShmqBroker
        broker = ShmqBroker(url=BROKER)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=QUEUE, max_retries=0)
    def noop_actor() -> None:
        _done()
