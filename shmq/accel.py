"""The optional compiled accelerator: whether this process uses ``shmq._speedups``.

``shmq/_speedups.c`` (built by ``pip install``, skipped without a compiler) speeds up a
few hot primitives; each has a pure-Python twin next to its use, which the C function
matches exactly (it returns None where the twin would raise or for input it leaves to
the twin).  ``wire_records`` (shmq/_speedups_wire.c) makes a TCP client's messages from an
answer's bytes.  ``SHMQ_PURE=1`` in the environment forces the pure-Python twins, as does a
missing or broken build.  Five functions write shared memory, under the lock their caller
holds: ``put_one``, ``deliver_one`` and ``ack_one`` (the one-message put, get and ack),
``ack_run`` (``ack_many``'s usual batch) and ``settle_range`` (a commit's range), making
the same stores as their twins, in the same order, the commit last (``shmq.core.layout``), and
passing the same crash points between them (``shmq.crashpoints``); ``ext.calls()`` counts
their calls in this process.  Two more run ``deliver_one``'s and ``ack_one``'s bodies
with the consumer lock taken and let go of in the same call (``take_one``, ``ack_lock``:
a get and an ack in one call each); a lock not taken at once is left to the twin's path,
which waits for it or recovers it from a dead holder.  ``spin_wait`` only reads: a
blocked get's spin before it sleeps.
"""

from __future__ import annotations

import os
from types import ModuleType

PURE_ENV = "SHMQ_PURE"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from shmq import _speedups
    except ImportError:
        return None
    return _speedups  # type: ignore[no-any-return]


ext: ModuleType | None = _load()  # None: pure Python


def describe() -> str:
    """One line for humans: which implementation this process runs."""
    if ext is not None:
        return "compiled (shmq._speedups)"
    why = f"{PURE_ENV} is set" if os.environ.get(PURE_ENV, "") not in ("", "0") else "not built"
    return f"pure Python ({why})"
