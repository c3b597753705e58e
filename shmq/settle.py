"""How a delivery is settled: one name per action, shared by every layer that settles.

``Queue._settle(msg, action, arg)`` takes one (``api``), the shared-memory core applies
it (``group``), and the TCP clients turn it into a request (``tcp``, ``aio``).  This
module imports nothing, so the lightest client can use it.
"""

from __future__ import annotations

from enum import IntEnum


class Settle(IntEnum):
    ACK = 0  # done with: never delivered again
    NACK = 1  # give it back, deliverable again after a delay (dead-lettered past max_deliveries)
    TOUCH = 2  # extend (or shorten) the lease
    DEAD = 3  # to the dead-letter queue now
