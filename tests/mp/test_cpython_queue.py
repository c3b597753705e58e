"""CPython's own tests of ``multiprocessing.Queue`` run against ``shmq.mp``.

The class ``_TestQueue`` of the interpreter's ``Lib/test/_test_multiprocessing.py`` (it
ships with CPython as ``test._test_multiprocessing``) runs as the interpreter's own suite
runs it (``ProcessesMixin``: real processes), once per start method (fork, spawn,
forkserver), with ``Queue`` and ``JoinableQueue`` swapped for ``shmq.mp``'s, and so is
``multiprocessing.Queue``/``JoinableQueue`` for the tests that call those by name.

Left out, because they test the stdlib queue's feeder thread, which ``shmq.mp`` does not
have (its ``put`` pickles and stores before it returns):

- ``test_queue_feeder_donot_stop_onexc``: an object that cannot be pickled is put and the
  feeder thread must survive it; here ``put`` raises the pickling error to its caller.
- ``test_queue_feeder_on_queue_feeder_error``: subclasses ``multiprocessing.queues.Queue``
  to hook its feeder thread's error handler; it never touches the queue under test.
"""

from __future__ import annotations

import importlib
import multiprocessing
import unittest
import unittest.mock
from typing import Any, ClassVar

from shmq import mp

_tm: Any = importlib.import_module("test._test_multiprocessing")  # CPython's own tests

FEEDER_THREAD_TESTS = ("test_queue_feeder_donot_stop_onexc", "test_queue_feeder_on_queue_feeder_error")


class _ShmqQueueTests(_tm._TestQueue, _tm.ProcessesMixin):  # type: ignore[misc]
    """``_TestQueue`` with shmq.mp's queues under one start method."""

    START_METHOD: ClassVar[str]
    Queue = staticmethod(mp.Queue)
    JoinableQueue = staticmethod(mp.JoinableQueue)

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._old_method = multiprocessing.get_start_method(allow_none=True)
        multiprocessing.set_start_method(cls.START_METHOD, force=True)

    @classmethod
    def tearDownClass(cls) -> None:
        multiprocessing.set_start_method(cls._old_method, force=True)
        super().tearDownClass()

    def setUp(self) -> None:
        # the tests that name multiprocessing.Queue / JoinableQueue get shmq.mp's too
        patches: list[Any] = [unittest.mock.patch.object(multiprocessing, "Queue", mp.Queue),
                   unittest.mock.patch.object(multiprocessing, "JoinableQueue", mp.JoinableQueue)]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)


for _name in FEEDER_THREAD_TESTS:
    setattr(_ShmqQueueTests, _name, None)  # not collected: see the module's doc


class TestQueueFork(_ShmqQueueTests, unittest.TestCase):
    START_METHOD = "fork"


class TestQueueSpawn(_ShmqQueueTests, unittest.TestCase):
    START_METHOD = "spawn"


class TestQueueForkserver(_ShmqQueueTests, unittest.TestCase):
    START_METHOD = "forkserver"


def test_every_test_of_cpythons_queue_class_runs_but_the_feeder_thread_ones() -> None:
    """What runs is CPython's class, whole: a test added to it in a later Python runs
    here too, and only the two named above are left out."""
    theirs = {n for n in dir(_tm._TestQueue) if n.startswith("test_")}
    ours = {n for n in dir(TestQueueFork) if n.startswith("test_") and callable(getattr(TestQueueFork, n))}
    assert theirs - ours == set(FEEDER_THREAD_TESTS)
    assert len(ours) >= 8
    assert TestQueueSpawn.Queue is mp.Queue and TestQueueSpawn.JoinableQueue is mp.JoinableQueue
