"""The shared-memory layout of shmq: every field, offset and size, in one place.

Read this like a C header.  Nothing else in shmq knows a byte offset; the
other modules use the names below.  All integers are native 64-bit words
(``Q``, little-endian on x86-64) at 8-byte-aligned offsets, read and written
through ``memoryview.cast("Q")``: a single aligned 8-byte store is atomic, so
a reader in another process sees either the old or the new value, never a
mix.  Every state change that must survive a SIGKILL is made visible by one
such store (the "commit"); everything a commit publishes is written first.

This module imports nothing of ours.

Registry segment  ``/shmq.<uid>.<instance>.reg``  (one per broker instance)
===========================================================================

::

    byte 0            512             576          1024
    +-----------------+---------------+------------+-----------------------+-----------------------+
    | registry header | registry lock | (reserved) | client table          | queue table           |
    | R_* words       | robust mutex  |            | max_clients x 4 words | max_queues x 32 words |
    +-----------------+---------------+------------+-----------------------+-----------------------+

Every process attached to the instance holds a shared ``flock`` on the registry's file
(inherited by forked children, released by the kernel when the last holder dies): an
instance is dead exactly when an exclusive ``flock`` on it can be taken (``reclaim``).

Queue segment  ``/shmq.<instance>.q<id>``  (one per queue, dead-letter queues included)
======================================================================================

::

    byte 0         768     832     896     960   1024
    +--------------+-------+-------+-------+-----+-------------+----------------+---------------+------------+
    | queue header | plock | clock | bells | pad | group table | producer table | slot table    | byte ring  |
    | Q_* words    |       |       | 64 B  |     | G x 32 w    | P x 4 w        | N x (5 + G) w | max_bytes  |
    +--------------+-------+-------+-------+-----+-------------+----------------+---------------+------------+

    G = max_groups, N = capacity, P = options.MAX_PRODUCERS (idempotent producers remembered).

``plock`` (producer lock) guards the producer fields (``Q_NEXT_OFFSET`` ..)
and the slots at or beyond ``Q_NEXT_OFFSET``.  ``clock`` (consumer lock)
guards the consumer fields, the group table and the lease
words of published slots.  A producer never writes a consumer field and the
reverse, so the two sides never contend with each other.

``bells`` is one byte per broker worker (``options.MAX_WORKERS``): worker ``i`` sets byte
``i`` to 1 while it has requests parked on this queue (or subscriptions to it), and
whoever makes a message available rings that worker's doorbell (``doorbell``).
Each worker writes only its own byte (no read-modify-write between processes);
the flag is a hint, never trusted for correctness (a worker also retries on a tick).

Slot of offset ``o`` is entry ``o % N``::

    word 0  S_OFFSET     the offset stored here (validates a handle)
    word 1  S_BYTEPOS    virtual byte position of the record (physical = pos % max_bytes)
    word 2  S_LENS       payload length (low 32 bits) | metadata length (high 32 bits)
    word 3  S_TIMESTAMP  producer's wall clock, ns since the epoch
    word 4  S_EXPIRES    the message's own TTL (``put(ttl=)``): wall-clock ns when it
                         expires, S_TIMESTAMP + TTL (0: none; written before the commit)
    word 5+g             lease word of group g (below)

A message put without a TTL leaves S_EXPIRES 0 (the put zeroes it with the lease
words: nothing more to write), and ``Q_EXPIRES_MAX`` (plock) stays 0 until a
message with its own TTL is put on the queue: the batch delivery paths read that one
header word and skip the S_EXPIRES column while it is 0, and the one-message path
reads the message's S_EXPIRES (one word, beside the slot head it reads anyway), so
messages without a TTL cost one word read per delivery call and nothing per message.
Otherwise ``Q_EXPIRES_MAX`` is a bound: no S_EXPIRES of a retained message is above it
(written before the commit of the put that raises it; the broker's maintenance sets it
back to 0 under plock once nothing is retained).

Producer entry (idempotent producers, guarded by plock)::

    word 0  P_KEY       64-bit hash of the producer id (0: free entry)
    word 1  P_SEQ       last sequence accepted from this producer
    word 2  P_PREV      the sequence before P_SEQ, while a put is being written
    word 3  P_COMMIT    P_SEQ counts only once Q_NEXT_OFFSET >= P_COMMIT

A put with (producer, seq) names the entry in ``Q_PENDING_PRODUCER``, then writes
P_PREV, P_COMMIT, P_SEQ, P_KEY in that order, commits ``Q_NEXT_OFFSET`` and clears
``Q_PENDING_PRODUCER``.  The next plock
holder that finds ``Q_PENDING_PRODUCER`` set knows its writer died: it keeps
P_SEQ if the commit happened (Q_NEXT_OFFSET >= P_COMMIT), else restores P_PREV.

Record in the byte ring at the physical position: ``metadata || payload``,
never split at the end of the ring (the producer pads to the start instead).

Lease word (one per message per group)::

     63                                 24 23            11 10        3 2     0
    +-------------------------------------+----------------+-----------+-------+
    |      time, ms (40 bits)             | owner (13 bits)| deliveries| state |
    +-------------------------------------+----------------+-----------+-------+

    state NEW      never delivered to this group
          LEASED   delivered; time = lease deadline (monotonic ms), owner = client slot
          READY    given back (nack, expiry, owner died); time = when it may be delivered again
          DONE     acknowledged or dead-lettered
          DEADING  being copied to the dead-letter queue by owner

    A delayed message (``put(delay=)``) is stored with every group's word READY, 0
    deliveries, time = when it is due: the only word other than NEW or DONE past a
    group's cursor.  The cursor steps over it (adding it to the READY hints) and the
    redelivery scan leases it when due, as a first delivery (deliveries 0 -> 1).  A group
    that settles it undelivered (commit, seek, a later start) stores DONE, 0 deliveries,
    time = its due time (every other DONE word has time 0), so a group created later at
    that index, or a seek back, still waits for it (``group_table.settled``, ``reopened``).

    TTL (``Q_MESSAGE_TTL_MS``): a word about to be delivered for the first time (NEW, or
    READY with 0 deliveries) whose slot's S_TIMESTAMP + TTL has passed (wall clock) is
    instead made DEADING (0 deliveries, owner: the deliverer) and dead-lettered with the
    reason "ttl_expired", or made DONE when the queue has F_TTL_DROP.  A DEADING word with
    0 deliveries past a cursor is such an expiry whose deliverer died before moving the
    cursor: ``repair`` makes it NEW again.

    A message's own TTL (S_EXPIRES) works the same way: a word about to be delivered
    for the first time whose slot has S_EXPIRES != 0 and S_EXPIRES <= the wall clock
    expires as above, so the effective TTL is the smaller of the queue's and the
    message's, both counted from the put.  The broker's maintenance expires the same
    words without a consumer, from each group's cursor on (``Delivery.sweep``).
"""

from __future__ import annotations

import struct

WORD = 8


def _magic(tag: bytes) -> int:
    return int.from_bytes(tag, "little")


REGISTRY_MAGIC = _magic(b"SHMQREG1")
QUEUE_MAGIC = _magic(b"SHMQQUE1")
LAYOUT_VERSION = 4  # 4: S_EXPIRES, Q_EXPIRES_MAX
MUTEX_SIZE = 64  # room for a pthread_mutex_t (40 B on x86-64 glibc, 48 B on aarch64)

# ---------------------------------------------------------------- registry
R_MAGIC = 0
R_VERSION = 1
R_INSTANCE_UID = 2  # random; every queue segment of the instance repeats it
R_OWNER_PID = 3
R_OWNER_START = 4  # owner's process start time, clock ticks since boot (process.start_ticks)
R_RESERVED_5 = 5
R_CREATED_NS = 6
R_MAX_QUEUES = 7
R_MAX_CLIENTS = 8
R_NEXT_QUEUE_ID = 9  # ids are never reused within an instance
R_NEXT_REAP_MS = 10  # monotonic ms of the next dead-client scan (a hint: two reapers may overlap)
R_CLIENTS_OFF = 11
R_QUEUES_OFF = 12
R_TOTAL_SIZE = 13
R_GENERATION = 14  # bumped on every queue create/delete
R_JOURNAL_PID = 15  # the journal writer process (0: none), for durable queues
R_JOURNAL_START = 16  # its start time, clock ticks since boot
R_DATA_DIR_LEN = 17
# replies dropped (``shmq.api.reply``), counted by whoever dropped one, under the registry lock:
R_REPLIES_LATE = 18  # read by a co-located requester after its request timed out
R_REPLIES_GONE = 19  # sent to a reply queue that no longer exists
R_REPLIES_FULL = 20  # sent to a full reply queue
R_DATA_DIR = 32  # byte 256 .. 511: the journal's data dir (UTF-8), so any process can find it
R_DATA_DIR_BYTES = 256
R_LOCK_OFF = 512  # byte offset of the registry lock
R_HEADER_SIZE = 1024

# client table entry (4 words)
C_STATE = 0  # C_FREE / C_LIVE
C_PID = 1
C_START = 2  # process start time, clock ticks since boot (pid + start = identity)
C_WORDS = 4  # word 3 reserved
C_FREE = 0
C_LIVE = 1

# queue table entry (32 words)
E_STATE = 0  # E_FREE / E_CREATING / E_ACTIVE
E_QUEUE_ID = 1
E_FLAGS = 2  # F_DLQ
E_CREATED_NS = 3
E_NAME_LEN = 4
E_NAME = 5  # 26 words = 208 bytes of UTF-8 name
E_CREATOR = 31  # E_CREATING: the creating process, pid | start ticks << CREATOR_PID_BITS
E_WORDS = 32
E_NAME_BYTES = 208
E_FREE = 0
E_ACTIVE = 1
E_CREATING = 2  # name and id reserved; the segment is being made outside the registry lock
CREATOR_PID_BITS = 22  # pids are below 2**22 (Linux's pid_max limit)

# ---------------------------------------------------------------- queue
Q_MAGIC = 0
Q_VERSION = 1
Q_INSTANCE_UID = 2
Q_QUEUE_ID = 3
Q_STATE = 4  # QS_ACTIVE / QS_DELETED
Q_CAPACITY = 5
Q_MAX_BYTES = 6
Q_MAX_MESSAGE_SIZE = 7
Q_VISIBILITY_MS = 8
Q_MAX_DELIVERIES = 9
Q_MAX_GROUPS = 10
Q_MAX_CLIENTS = 11  # of the instance: owners in lease words are below it
Q_DURABILITY = 12  # index into options.DURABILITY_MODES
Q_FLAGS = 13  # F_DLQ
Q_CREATED_NS = 14
Q_GROUPS_OFF = 15
Q_PRODUCERS_OFF = 16
Q_SLOTS_OFF = 17
Q_DATA_OFF = 18
Q_TOTAL_SIZE = 19
Q_SLOT_WORDS = 20
Q_MAX_PRODUCERS = 21
Q_JOURNAL_ERRNO = 22  # journal writer: errno of its failing write (0: writing fine); producers refuse
Q_DELAY_MAX = 23  # plock: the latest due time (monotonic ms) of a delayed put (0: none); a bound
# producer side (plock)
Q_NEXT_OFFSET = 24  # the commit word of every put: offsets below it are published (= messages produced)
Q_TAIL_BYTES = 25  # virtual byte position after the last record
Q_PENDING_PRODUCER = 26  # 1 + index of the producer entry of the put being written, else 0
Q_PRODUCER_WAITERS = 27
Q_DURABLE_OFFSET = 28  # journal writer: offsets below it are on disk (NO_MARK for memory queues)
Q_PLOCK_RECOVERIES = 29  # times a producer died holding plock
Q_JOURNAL_WAITING = 30  # journal writer: 1 while it sleeps on the .j semaphore
Q_DURABLE_WAITERS = 31  # processes sleeping on the .d semaphore for a durable mark
# consumer side (clock)
Q_FREE_OFFSET = 32  # every group has settled all offsets below it; their storage is free
Q_CONSUMER_WAITERS = 33
Q_SETTLE_SEQ = 34  # bumped by every change of group state (ack, nack, commit, ...)
Q_GROUP_GEN = 35  # bumped on every group create/delete
Q_ORPHANS = 36  # a dead-letter copy failed (full DLQ): the next maintenance retries it
Q_CLOCK_RECOVERIES = 37  # times a consumer died holding clock
Q_NAME_LEN = 38
Q_DURABLE_SETTLE = 39  # journal writer: group state up to this Q_SETTLE_SEQ is on disk
Q_NAME = 40  # 26 words
# consumer side (clock), counters for the broker's metrics (server/collector.py)
Q_LEASES_REAPED = 66  # leases of dead processes given back by a reaper
Q_LEASES_RETURNED = 67  # leases of closed broker connections given back by their worker
Q_MESSAGE_TTL_MS = 68  # a message not delivered to a group within this many ms of its put expires (0: none)
Q_EXPIRES_MAX = 69  # plock: the latest S_EXPIRES of a message put with its own TTL (wall ns; 0: none)
Q_LOCK_P = 768  # byte offsets
Q_LOCK_C = 832
Q_BELLS = 896  # byte offset of the doorbell flags: one byte per worker
Q_BELLS_SIZE = 64  # bytes of the doorbell flags: worker ids are 0 .. 63 (options.MAX_WORKERS)
Q_HEADER_SIZE = 1024
QS_ACTIVE = 1
QS_DELETED = 2
F_DLQ = 1
F_TTL_DROP = 2  # Q_FLAGS: an expired message is dropped (settled DONE), not dead-lettered
F_REPL_ASYNC = 4  # Q_FLAGS: replication="async" (neither this nor F_REPL_SYNC: the broker's --replication)
F_REPL_SYNC = 8  # Q_FLAGS: replication="sync": a standby's fsync confirms a put too (server.replication)
PRIO_SHIFT = 4  # Q_FLAGS bits 4..7: the queue's priority levels (QueueConfig.priorities; 0: none)
PRIO_MASK = 0xF << PRIO_SHIFT
REPLICATION_FLAGS = {"": 0, "async": F_REPL_ASYNC, "sync": F_REPL_SYNC}  # QueueConfig.replication -> Q_FLAGS

# group table entry (32 words)
G_STATE = 0  # GS_FREE / GS_ACTIVE
G_CURSOR = 1  # next offset never delivered to this group
G_FLOOR = 2  # every offset below it is DONE for this group
G_REDELIVER = 3  # hint, never below the truth: number of READY words in [floor, cursor)
G_NEXT_READY = 4  # hint: earliest time a READY word may be delivered
G_NEXT_EXPIRY = 5  # lower bound of the LEASED deadlines
G_READY_LO = 6  # hint, never above the truth: lowest offset that may be READY
G_ACKED = 7
G_NACKED = 8
G_REDELIVERED = 9
G_DEAD_LETTERED = 10
G_EXPIRED = 11
G_CREATED_NS = 12
G_NAME_LEN = 13
G_NAME = 14  # 8 words = 64 bytes
G_SERIAL = 22  # Q_GROUP_GEN when this group was created, 0 while free: see group_ref
G_DELIVERED = 23  # first deliveries (G_REDELIVERED counts the others)
G_TTL_EXPIRED = 24  # messages whose TTL (Q_MESSAGE_TTL_MS) passed before this group's first delivery
G_SEEK_TO = 25  # 1 + the offset a seek in progress moves the group to (0: none); ``repair`` finishes it
G_WORDS = 32
GS_FREE = 0
GS_ACTIVE = 1

# producer entry (4 words)
P_KEY = 0
P_SEQ = 1
P_PREV = 2
P_COMMIT = 3
P_WORDS = 4

NO_MARK = (1 << 64) - 1  # Q_DURABLE_OFFSET / Q_DURABLE_SETTLE of a memory-only queue

# slot entry
S_OFFSET = 0
S_BYTEPOS = 1
S_LENS = 2
S_TIMESTAMP = 3
S_EXPIRES = 4
S_GROUPS = 5
S_FIXED_WORDS = 5  # the words before the lease words
LEN_PAYLOAD_MASK = 0xFFFFFFFF  # S_LENS: the payload length is the low 32 bits
LEN_META_SHIFT = 32  # S_LENS: the metadata length is the high 32 bits

SLOT_HEAD = struct.Struct("4Q")  # S_OFFSET .. S_TIMESTAMP in one pack/unpack (S_EXPIRES is not in it)

# lease word
NEW = 0
LEASED = 1
READY = 2
DONE = 3
DEADING = 4
STATE_MASK = 0x7
DC_SHIFT = 3
DC_MASK = 0xFF
OWNER_SHIFT = 11
OWNER_MASK = 0x1FFF
TIME_SHIFT = 24
TIME_MASK = (1 << 40) - 1
MAX_OWNER = OWNER_MASK  # client slots are 0 .. MAX_OWNER - 1; MAX_OWNER means "nobody"
NO_OWNER = OWNER_MASK
STATE_DC_MASK = (1 << OWNER_SHIFT) - 1  # state and deliveries: a lease word less its owner and time
UNTIMED_MASK = (1 << TIME_SHIFT) - 1  # state, deliveries and owner: a lease word less its time
LEASED_ONCE = LEASED | (1 << DC_SHIFT)  # LEASED with one delivery: a first delivery's word (add owner, time)


GI_BITS = 6  # group indexes are 0 .. options.MAX_GROUPS_LIMIT - 1
GI_MASK = (1 << GI_BITS) - 1


def group_ref(gi: int, serial: int) -> int:
    """What a Message holds for its group: the index and the incarnation (G_SERIAL).
    A group deleted and created again at the same index has a new serial, so a lease
    of the old one never settles a delivery of the new one."""
    return gi | (serial << GI_BITS)


def lease_word(state: int, deliveries: int, owner: int, time_ms: int) -> int:
    return state | (deliveries << DC_SHIFT) | (owner << OWNER_SHIFT) | ((time_ms & TIME_MASK) << TIME_SHIFT)


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def registry_size(max_queues: int, max_clients: int) -> tuple[int, int, int]:
    """(clients_off, queues_off, total) of a registry segment."""
    clients_off = R_HEADER_SIZE
    queues_off = _align(clients_off + max_clients * C_WORDS * WORD)
    total = _align(queues_off + max_queues * E_WORDS * WORD, 4096)
    return clients_off, queues_off, total


def queue_size(capacity: int, max_bytes: int, max_groups: int, max_producers: int) -> dict[str, int]:
    """Byte offsets of a queue segment's regions, and its total size."""
    groups_off = Q_HEADER_SIZE
    producers_off = _align(groups_off + max_groups * G_WORDS * WORD)
    slots_off = _align(producers_off + max_producers * P_WORDS * WORD)
    slot_words = S_FIXED_WORDS + max_groups
    data_off = _align(slots_off + capacity * slot_words * WORD, 4096)
    total = _align(data_off + max_bytes, 4096)
    return {"groups_off": groups_off, "producers_off": producers_off, "slots_off": slots_off,
            "data_off": data_off, "total": total, "slot_words": slot_words}
