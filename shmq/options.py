"""Every default and every limit of shmq, in one table.

Nothing else in the package hard-codes a number that a user could ask about:
the other modules import these names.  ``docs/operations.md`` renders this
table for humans; keep the two in step.
"""

from __future__ import annotations

# --- instance (one registry segment per broker instance) -------------------
DEFAULT_INSTANCE = "default"
INSTANCE_NAME_MAX = 64  # chars of [A-Za-z0-9_-]
MAX_QUEUES = 1024  # queues (dead-letter queues included) per instance
MAX_CLIENTS = 1024  # processes attached to one instance at the same time
SHM_MODE = 0o600  # every shared-memory object and semaphore

# --- queue ------------------------------------------------------------------
QUEUE_NAME_MAX = 200  # chars of [A-Za-z0-9._-], not "." or ".."
GROUP_NAME_MAX = 64  # same alphabet as queue names
DEFAULT_GROUP = "default"
DLQ_SUFFIX = ".dlq"
MAX_PRIORITIES = 10  # a queue's priority levels (create_queue(priorities=)): put(priority=) 0 .. N-1
LEVEL_SUFFIX = ".prio"  # level k >= 1 of priority queue Q is the hidden queue Q.prio<k> (level 0 is Q)
PRIORITY_SHIFT = 56  # a priority queue's offsets: level << PRIORITY_SHIFT | the offset in that level

DEFAULT_CAPACITY = 16_384  # messages held (unacknowledged by some group)
MAX_CAPACITY = 16_777_216
DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # bytes of payload (+ metadata) held; reserved at creation
MIN_MAX_BYTES = 4096
MAX_MAX_BYTES = 1 << 40
DEFAULT_MAX_MESSAGE_SIZE = 1024 * 1024
MAX_MESSAGE_SIZE = 16 * 1024 * 1024  # a message (+ metadata) fits one TCP frame (MAX_FRAME)
DEFAULT_VISIBILITY_TIMEOUT = 30.0  # seconds a delivery is leased
MAX_VISIBILITY_TIMEOUT = 12 * 3600.0
MAX_MESSAGE_TTL = 365 * 86400.0  # seconds of a queue's message_ttl, or a message's own (put(ttl=)); a year
MAX_DELAY = 7 * 86400.0  # seconds a put may delay its message (put(delay=)); a week
DEFAULT_MAX_DELIVERIES = 5  # deliveries before dead-lettering
MAX_DELIVERIES_LIMIT = 255  # the lease word keeps the count in 8 bits
DEFAULT_MAX_GROUPS = 8  # consumer groups per queue (default group included)
MAX_GROUPS_LIMIT = 64
MAX_META_SIZE = 1024  # bytes of metadata the broker adds to a message (a dead letter's origin)
MAX_HEADERS = 64  # headers of one message
MAX_HEADERS_BYTES = 8192  # bytes of one message's headers encoded (shmq.headers); they count in its size
assert MAX_HEADERS_BYTES <= 0xFFFF  # a header's key and value lengths are u16 on the wire
MAX_PRODUCERS = 256  # idempotent producers remembered per queue; the oldest is forgotten first
PRODUCER_ID_MAX = 256  # chars of an idempotent producer's id

# --- durability (see docs/operations.md "Durability") -------------------------
DURABILITY_MODES = ("memory", "interval", "always")
DEFAULT_DURABILITY = "memory"
REPLICATION_MODES = ("", "async", "sync")  # a queue's replication= ("": the broker's --replication)
DEFAULT_SYNC_INTERVAL = 1.0  # s: the longest an `interval` queue's journal goes without fsync
DATA_DIR_ENV = "SHMQ_DATA_DIR"
DEFAULT_DATA_DIR = "~/.local/share/shmq"  # $XDG_DATA_HOME/shmq when set; one sub-folder per instance
JOURNAL_ADOPT_TIMEOUT = 10.0  # s creating a journaled queue waits for the journal writer to take it on

# --- replication (see docs/operations.md "Replication") ----------------------
DEFAULT_REPLICATION = "async"  # --replication: a queue's mode when it names none
DEFAULT_SYNC_TIMEOUT = 5.0  # s a `sync` round waits for a standby's fsync before its puts fail (StorageError)
REPLICATION_HEARTBEAT = 1.0  # s between the stream's heartbeats (each end), when nothing else is sent
REPLICATION_DEAD_AFTER = 5.0  # s without a byte from the other end of a replication link: it is closed
REPLICATION_CHUNK = 16 << 20  # bytes of messages in one frame of the stream: a bigger round is split
REPLICATION_MAX_FRAME = (64 << 20) + 65536  # one frame of the stream; larger is refused before reading it
REPLICATION_SEND_BUFFER = 256 * 1024 * 1024  # bytes queued for one standby; more and it is cut (it resumes)
REPLICATION_MAX_STANDBYS = 8  # standbys one primary streams to at once
REPLICATION_ACK_INTERVAL = 0.02  # s a standby lets async rounds share one fsync (sync rounds: at once)
REPLICATION_RETRY = 0.5  # s a standby waits before it connects to its primary again
REPLICATION_STATE_FILE = "replication.json"  # in the data dir: the node's epoch and role (fsynced)

# --- timing -------------------------------------------------------------------
LOCAL_SPIN_US = 50.0  # us a blocked co-located get re-reads the queue's header before it sleeps...
REPLY_SPIN_US = 100.0  # ... and a co-located requester, waiting for its reply
SPIN_CHECKS = 200  # header re-reads before a waiter for the journal sleeps (about 5.6 us on the test VM)
WAIT_SLICE = 0.05  # longest single sleep of a blocked put/get before it re-checks the header
REPLY_PREFIX = "reply."  # a reply queue's name: this and 24 hex digits (shmq.names.is_reply_name)
REPLY_CAPACITY = 1024  # messages a reply queue holds (a reply to a full one is dropped, counted)
REPLY_MAX_BYTES = 4 * 1024 * 1024  # bytes a reply queue holds (a reply: at most DEFAULT_MAX_MESSAGE_SIZE)
DEFAULT_REQUEST_TIMEOUT = 30.0  # s broker.request waits for its reply
REAP_INTERVAL = 0.25  # how often dead processes' leases are looked for (s)
TTL_SWEEP_BATCH = 1024  # lease words the broker's maintenance looks at per group and tick, expiring TTLs
DEAD_LETTER_SYNC_WAIT = 1.0  # s dead-letter copies into an `always` DLQ wait for its journal, at least
ATTACH_TIMEOUT = 2.0  # how long to wait for a half-created instance to appear
CREATION_GRACE = 10.0  # s: objects of an instance with no registry younger than this are being created

# --- server and wire protocol -----------------------------------------------------
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7878
DEFAULT_URL = f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}"  # the CLI's and the Spark connector's default
MAX_FRAME = 16 * 1024 * 1024 + 4096  # bytes of one frame's body; larger is refused before reading it
# the largest message (its headers included), with the largest metadata and queue name, in one
# PRODUCE or DELIVER frame (+ 1: a flagged PRODUCE's 0x00 before a payload without headers)
assert MAX_MESSAGE_SIZE + 1 + MAX_META_SIZE + 2 * 256 + 64 <= MAX_FRAME
MAX_CONNECTIONS = 4096  # per worker
FD_RESERVE = 64  # descriptors a broker process keeps for itself (sockets, pipes, logs, /proc reads)
JOURNAL_FDS_PER_QUEUE = 3  # the journal process's per durable queue: its folder, lock and active segment
MAX_WORKERS = 64  # worker processes of one broker (a queue's bell table has a byte per worker)
MAX_INFLIGHT_PER_CONNECTION = 10_000  # leases one connection may hold
GIVE_BACK_CHUNK = 1000  # a closed connection's leases given back per hold of a queue's consumer lock
MAX_BATCH = 10_000  # messages in one batch frame
DEFAULT_CREDIT = 100  # push-subscribe prefetch window
DEFAULT_PUBLISH_WINDOW = 256  # messages a Publisher has sent and not yet confirmed (queue.publisher())
MAX_PUBLISH_WINDOW = 10_000
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to send its handshake
CLIENT_SPIN_US = 100.0  # us a blocking TCP/Unix client polls its socket for an answer before it sleeps...
WORKER_SPIN_US = 100.0  # ...and a broker worker polls for the next request after a read (serve --spin-us)
MAX_SPIN_US = 10_000.0  # the most either may be set to (0: never poll, sleep at once)
SPIN_BACKOFF = 8  # waits that sleep at once after a poll that ran its whole window and found nothing
HEARTBEAT = 5.0  # s: each end of a TCP/Unix connection sends a HEARTBEAT this often (0: off)...
HEARTBEAT_MISSES = 3  # ...and closes it after this many intervals without a byte from the other end
TLS_HANDSHAKE_TIMEOUT = 5.0  # seconds a new TLS connection has to finish its TLS handshake (before HANDSHAKE)
AUTH_FAILURES_MAX = 10  # failed handshakes from one peer address a worker logs per window...
AUTH_FAILURE_WINDOW = 60.0  # ...of this many seconds; past it, wrong tokens are refused unlogged
WORKER_RESTART_DELAY = 0.1
WORKER_TICK = 0.05  # s: a worker retries its parked requests this often, doorbell or not
WORKER_FLAG_GRACE = 1.0  # s a worker's bell flag stays set after its last waiter (no set/clear per request)
SHUTDOWN_GRACE = 5.0  # seconds a worker has to finish requests in progress at shutdown
TOKEN_ENV = "SHMQ_TOKEN"
DEFAULT_UNIX_SOCKET = "auto"  # shmq serve --unix: tcp-PORT.sock in the runtime folder ("off": none)
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"
LOG_FORMATS = ("text", "json")
DEFAULT_LOG_FORMAT = "text"
STATUS_TIMEOUT = 2.0  # s `shmq status` waits for the broker's answer before it says "not ready"

# --- client fail-over (shmq.connect("tcp://h1:7878,h2:7878"): shmq/client/failover.py) -------------
FAILOVER_TIMEOUT = 30.0  # s a URL list is searched for a primary from the first failure (then ConnectionLost)
FAILOVER_BACKOFF = 0.05  # s between two looks through the list while none is the primary: first this,...
FAILOVER_BACKOFF_MAX = 1.0  # ...doubled each time, up to this

# --- shmq.mp (the drop-in for multiprocessing's queues: shmq/mp/__init__.py) ---------------
MP_CAPACITY = 65_536  # objects an mp.Queue(maxsize=0) holds
MP_MAX_BYTES = 16 * 1024 * 1024  # bytes of pickled objects an mp.Queue holds (max_bytes=), in /dev/shm
MP_GET_MANY = 1000  # objects one mp.Queue.get_many returns at most, by default
MP_JOIN_POLL_MIN = 0.0005  # s JoinableQueue.join first waits between two looks,...
MP_JOIN_POLL_MAX = 0.02  # ...doubled each time, up to this

# --- shmq serve's settings (server/config.py): flag > $SHMQ_<NAME> > config file > default ---
ENV_PREFIX = "SHMQ_"  # each setting's environment variable: SHMQ_PORT, SHMQ_WORKERS, ...
CONFIG_ENV = "SHMQ_CONFIG"  # the config file, when no --config is given

# --- shmq top (the live dashboard, shmq/cli/top.py) ---------------------------------
TOP_INTERVAL = 1.0  # s between two refreshes (--interval)...
TOP_MIN_INTERVAL = 0.1  # ...at least this...
TOP_MAX_INTERVAL = 3600.0  # ...and at most this
TOP_HISTORY = 20  # depth readings a queue's sparkline shows

# --- progress of a long job (a big produce, a redrive, journal recovery: shmq/progress.py) ---
PROGRESS_DELAY = 0.5  # s: a job done sooner shows no progress bar at all
PROGRESS_REFRESH = 0.1  # s between updates of a progress bar (on a terminal)
PROGRESS_INTERVAL = 2.0  # s between progress lines where stderr is not a terminal (logs, pipes)
PRODUCE_LINGER = 0.05  # s: `shmq produce` sends a part-filled batch once its input is idle this long

# --- journal (durable queues: one directory of segment files per queue, shmq/journal/__init__.py) ---
JOURNAL_SEGMENT_BYTES = 64 * 1024 * 1024  # a segment file rolls once the next record would take it past this
JOURNAL_MAX_RECORD_BYTES = 256 << 20  # one record's body: a bigger batch is split, a bigger payload refused
JOURNAL_MAX_META_BYTES = 64 * 1024  # the queue's meta.json
JOURNAL_MAX_OPEN_SEGMENTS = 64  # rolled segments left open awaiting sync(); one more and append syncs first
JOURNAL_STATE_ROLL_FACTOR = 4  # a segment holding only state snapshots rolls at max(segment, this x snapshot)
JOURNAL_PREALLOC_BYTES = 4 * 1024 * 1024  # zeros written ahead of the active segment's end (0: none)
JOURNAL_DIR_MODE = 0o700  # the data directory (when we create it) and every queue directory
JOURNAL_FILE_MODE = 0o600  # every journal file
JOURNAL_RETRY_INTERVAL = 0.5  # s between attempts while a queue's journal cannot be written
JOURNAL_DROP_INTERVAL = 1.0  # s between looks for segment files every group has passed

# --- metrics (shmq serve --metrics HOST:PORT; docs/operations.md "Metrics") ------------
METRICS_PATH = "/metrics"  # what Prometheus scrapes (any other path answers 404)
METRICS_REQUEST_TIMEOUT = 5.0  # s a scrape connection has to send its request (and finish TLS)
# histogram bucket bounds, seconds (+Inf is added): fixed, so the workers' stores are plain counts
REQUEST_LATENCY_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                           0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FSYNC_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                         0.25, 0.5, 1.0, 2.5)
