"""Which Python runs Spark's Python workers, and whether it can import what the source and
sink need (``shmq`` and ``pyarrow``): checked once by ``shmq.spark.register``.

PySpark's rule, in ``pyspark/core/context.py``: a SparkContext takes ``$PYSPARK_PYTHON``,
else ``python3`` (on PATH), as its ``pythonExec`` when it is made, and each Python function
(the data source's too, when ``register`` wraps it) is shipped with the ``pythonExec`` of that
moment.  ``spark-submit`` turns ``spark.pyspark.python`` into ``$PYSPARK_PYTHON`` for the
driver; a session made in a plain ``python job.py`` ignores that setting.  So a job run with a
virtualenv's Python, and nothing set, has workers in the system's ``python3``, which fails
the first task with ``ModuleNotFoundError: No module named 'pyarrow'``.

``check(spark)`` asks that Python, once per path, to import the two.  Local mode only (a
cluster's workers run on other hosts: docs/spark.md, "On a cluster"); nothing for Spark
Connect, which has no SparkContext here.  When it cannot, and nobody chose it (no
``$PYSPARK_PYTHON``), the workers get the Python the user meant: ``spark.pyspark.python``
if set (which PySpark ignored), else the driver's own (``sys.executable``), if that one
imports both.  Otherwise ``InvalidArgument``, in one line with the fix.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

from shmq.errors import InvalidArgument

NEEDED = ("shmq", "pyarrow")  # what a worker imports to run the source and the sink
CHECK_TIMEOUT = 120.0  # s for the check's Python to start and import them (pyarrow takes a while)
_PROBE = f"""import sys
bad = []
for n in {NEEDED!r}:
    try:
        __import__(n)
    except Exception:
        bad.append(n)
print(", ".join(bad))
sys.exit(1 if bad else 0)
"""  # what the worker's Python runs: prints the modules it cannot import

log = logging.getLogger("shmq.spark")


@functools.cache
def cannot_import(python: str) -> str:
    """What is wrong with ``python`` as a worker's Python: "" when it imports every module of
    ``NEEDED``, else why not ("cannot import pyarrow", "cannot be run: ...").  Run in this
    process's folder and environment, as a local-mode worker is.  Cached per path."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=CHECK_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except OSError as e:
        return f"cannot be run ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return ""  # slow, not known broken: the job may well run
    if done.returncode == 0:
        return ""
    bad = done.stdout.strip().splitlines()[-1:] or [", ".join(NEEDED)]
    return f"cannot import {bad[0]}"


def _where(python: str) -> str:
    """``python`` and, when it is a bare name, the file PATH finds for it."""
    found = shutil.which(python) if os.sep not in python else None
    return f"{python} ({found})" if found and found != python else python


def check(spark: Any) -> None:
    """Make sure Spark's Python workers can import shmq and pyarrow (see the module's
    docstring): when they cannot and nobody chose their Python, point them at one that can;
    else raise ``InvalidArgument`` saying which Python fails and how to set another."""
    try:
        sc = spark.sparkContext
        master, python = str(sc.master), str(sc.pythonExec)
    except Exception:  # noqa: BLE001 - Spark Connect: no SparkContext; its workers are the server's
        return
    if not master.startswith("local"):
        return  # the workers run on other hosts, in a Python this host cannot try
    wrong = cannot_import(python)
    if not wrong:
        return
    chosen = os.environ.get("PYSPARK_PYTHON")
    wanted = _conf(spark, "spark.pyspark.python")
    if not chosen:  # PySpark's default: the user meant another Python
        for other in (wanted, sys.executable):
            if other and other != python and not cannot_import(other):
                sc.pythonExec = other  # read when a Python function is wrapped: register's next
                log.info("Spark's Python workers would run %s, which %s: they run %s instead "
                         "(set PYSPARK_PYTHON to choose)", _where(python), wrong, other)
                return
    fix = sys.executable if not cannot_import(sys.executable) else "a Python with shmq[spark] installed"
    raise InvalidArgument(f"Spark's Python workers run {_where(python)}, which {wrong}: set "
                          f"PYSPARK_PYTHON={fix} before creating the SparkSession (spark-submit: "
                          "--conf spark.pyspark.python=...)")


def _conf(spark: Any, key: str) -> str:
    try:
        return str(spark.conf.get(key, None) or "")
    except Exception:  # noqa: BLE001 - a session that cannot say: as if unset
        return ""
