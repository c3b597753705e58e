"""The Celery app of ``test_celery.py``.  Its workers run as subprocesses
(``celery -A tests.integrations.celery_app worker``) configured by the environment the test
gives them (``ENV``); the test process configures the same app with :func:`configure`.

Every run of a task leaves a file in the records folder, named
``<key>__<pid>__<random>`` and holding the time it started (``time.time()``), so that the
test sees each task's fate: how often it ran, in which process, when."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

import shmq.kombu  # noqa: F401  (registers shmq:// with kombu: before the app connects)

ENV = {"broker": "SHMQ_TEST_BROKER", "results": "SHMQ_TEST_RESULTS", "records": "SHMQ_TEST_RECORDS",
       "queue": "SHMQ_TEST_QUEUE", "solo": "SHMQ_TEST_SOLO_QUEUE"}

app = Celery("shmq_tests")


def configure(broker: str, results: str, records: str, queue: str, solo: str) -> None:
    """Point the app at ``broker``, its results at the folder ``results``, its records at
    ``records``; tasks go to ``queue``, ``solo`` to ``solo`` (which one worker consumes)."""
    os.environ[ENV["records"]] = records
    app.conf.update(
        broker_url=broker, result_backend=f"file://{results}", task_default_queue=queue,
        task_routes={"tests.integrations.celery_app.solo": {"queue": solo}},
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        result_extended=False, task_track_started=False)


if os.environ.get(ENV["broker"]):  # a worker (or the celery command line) the test started
    configure(*(os.environ[ENV[k]] for k in ("broker", "results", "records", "queue", "solo")))


def _record(key: str, **fields: Any) -> None:
    folder = Path(os.environ[ENV["records"]])
    path = folder / f"{key}__{os.getpid()}__{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"t": time.time(), **fields}, f)


@app.task
def record(key: str, x: int) -> int:
    _record(key)
    return x * 2


@app.task
def solo(key: str, x: int) -> int:
    """``record``, routed to the queue one worker alone consumes."""
    _record(key)
    return x * 2


@app.task(bind=True, max_retries=5)
def retrying(self: Any, key: str, fails: int) -> int:
    """Fails (and is retried, after 0.1 s) ``fails`` times, then returns how often it was retried."""
    _record(key, retries=self.request.retries)
    if self.request.retries < fails:
        raise self.retry(countdown=0.1)
    return int(self.request.retries)


@app.task
def hold(key: str) -> str:
    """Runs until the file ``release-<key>`` appears in the records folder (at most 60 s)."""
    _record(key)
    release = Path(os.environ[ENV["records"]]) / f"release-{key}"
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return key
