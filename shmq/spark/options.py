"""The options of the shmq Spark data source, checked, and the connection a reader or writer makes.

A read's and a write's options (names case-insensitive, as Spark passes them; every one
is documented in ``docs/spark.md``) become a frozen :class:`ReadOptions` /
:class:`WriteOptions`; a name close to one of ours but wrong is an error, other unknown
names are Spark's own and ignored.  Nothing here imports pyspark: ``spark.source`` and
``spark.sink`` use these, and ``spark`` re-exports them.
"""

from __future__ import annotations

import difflib
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from shmq import connect, options
from shmq.api import Broker
from shmq.errors import InstanceError, InstanceNotFound, InvalidArgument, ShmqError

DEFAULT_URL = options.DEFAULT_URL
DEFAULT_GROUP = "spark"  # the consumer group a streaming query owns, unless option "group" names one
DEFAULT_SINK_BATCH = options.MAX_BATCH  # messages per put of the sink (option "batchSize"); Spark's Arrow
# batches are as long (spark.sql.execution.arrow.maxRecordsPerBatch), so a batch is one frame
DEFAULT_WRITE_TIMEOUT = 60.0  # s a sink task waits for room in a full queue (option "writeTimeout")

_NAMES = ["url", "token", "queue", "group", "startingOffsets", "endingOffsets", "maxOffsetsPerTrigger",
          "minPartitions", "failOnDataLoss", "startingTimestamp", "batchSize", "writeTimeout"]
_READ_OPTIONS = {n.lower() for n in _NAMES[:10]}
_WRITE_OPTIONS = {"url", "token", "queue", "batchsize", "writetimeout"}


class DataLost(ShmqError):
    """Offsets a query still had to read are no longer retained (or the queue was re-created)."""


@dataclass(frozen=True)
class ReadOptions:
    url: str
    token: str | None
    queue: str
    group: str
    starting: str | int  # "earliest", "latest" or an offset
    ending: str | int
    max_per_trigger: int | None
    min_partitions: int
    fail_on_data_loss: bool
    starting_timestamp: int | None = None  # ms since the epoch: start at the first message at or after it


@dataclass(frozen=True)
class WriteOptions:
    url: str
    token: str | None
    queue: str
    batch_size: int
    write_timeout: float


def _lower(opts: Mapping[str, str], allowed: set[str]) -> dict[str, str]:
    """The options with lower-case names.  An unknown name close to one of ours is a typo and an
    error; other unknown names are ignored, since Spark adds its own (checkpointLocation, queryName)."""
    out = {str(k).lower(): v for k, v in opts.items()}
    names = {n.lower(): n for n in _NAMES}
    for key in out:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.8)
        if close:
            hint = (f"did you mean {names[close[0]]!r}?" if close[0] in allowed
                    else f"{names[close[0]]!r} is not an option of this direction (docs/spark.md)")
            raise InvalidArgument(f"unknown shmq option {key!r}: {hint}")
    return out


def _int(o: dict[str, str], key: str, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = o.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"option {name} must be an integer, not {raw!r}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"option {name} must be between {low} and {high}, not {value}")
    return value


def _offset_spec(raw: str | None, name: str, queue: str, default: str) -> str | int:
    """``earliest`` / ``latest`` / a JSON offset ``{"<queue>": n}`` (-2: earliest, -1: latest, as Kafka)."""
    if raw is None:
        return default
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        spec = json.loads(text)
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or set(spec) != {queue} or type(spec[queue]) is not int:
        raise InvalidArgument(f"option {name} must be 'earliest', 'latest' or a JSON offset such as "
                              f'{{"{queue}": 42}} (naming this query\'s queue), not {raw!r}')
    n = spec[queue]
    if n == -2:
        return "earliest"
    if n == -1:
        return "latest"
    if n < 0:
        raise InvalidArgument(f"option {name}: offset {n} is negative (-2 means earliest, -1 latest)")
    return int(n)


def _common(o: dict[str, str]) -> tuple[str, str | None, str]:
    url = o.get("url", DEFAULT_URL)
    if not url.startswith(("tcp://", "tcps://", "unix://", "shm://")):
        raise InvalidArgument("option url must be tcp://HOST:PORT, tcps://HOST:PORT, unix://PATH or "
                              f"shm://INSTANCE, not {url.partition('?')[0]!r}")
    queue = o.get("queue")
    if not queue:
        raise InvalidArgument("option queue is required: .option('queue', 'events')")
    return url, o.get("token"), queue


MAX_MIN_PARTITIONS = 10_000


def read_options(opts: Mapping[str, str], streaming: bool, default_min_partitions: int = 1) -> ReadOptions:
    """Check a read's options (case-insensitive, as Spark passes them); minPartitions
    defaults to ``default_min_partitions`` (``register`` passes Spark's parallelism)."""
    o = _lower(opts, _READ_OPTIONS)
    url, token, queue = _common(o)
    if streaming and "endingoffsets" in o:
        raise InvalidArgument("option endingOffsets is for batch reads only")
    if not streaming and "maxoffsetspertrigger" in o:
        raise InvalidArgument("option maxOffsetsPerTrigger is for streaming reads only")
    starting = _offset_spec(o.get("startingoffsets"), "startingOffsets", queue,
                            "latest" if streaming else "earliest")
    ending = _offset_spec(o.get("endingoffsets"), "endingOffsets", queue, "latest")
    if ending == "earliest":
        raise InvalidArgument("option endingOffsets cannot be 'earliest'")
    flag = o.get("failondataloss", "true").lower()
    if flag not in ("true", "false"):
        raise InvalidArgument(f"option failOnDataLoss must be true or false, not {o['failondataloss']!r}")
    max_per_trigger = _int(o, "maxoffsetspertrigger", "maxOffsetsPerTrigger", None, 1, (1 << 63) - 1)
    starting_ts = _int(o, "startingtimestamp", "startingTimestamp", None, 0, (1 << 64) // 1_000_000 - 1)
    if starting_ts is not None and "startingoffsets" in o:
        raise InvalidArgument("give option startingOffsets or startingTimestamp, not both")
    min_partitions = _int(o, "minpartitions", "minPartitions", default_min_partitions, 1, MAX_MIN_PARTITIONS)
    assert min_partitions is not None
    return ReadOptions(url, token, queue, o.get("group", DEFAULT_GROUP), starting, ending,
                       max_per_trigger, min_partitions, flag == "true", starting_ts)


def write_options(opts: Mapping[str, str]) -> WriteOptions:
    o = _lower(opts, _WRITE_OPTIONS)
    url, token, queue = _common(o)
    batch = _int(o, "batchsize", "batchSize", DEFAULT_SINK_BATCH, 1, options.MAX_BATCH)
    assert batch is not None
    raw = o.get("writetimeout")
    try:
        timeout = DEFAULT_WRITE_TIMEOUT if raw is None else float(raw)
    except ValueError:
        raise InvalidArgument(f"option writeTimeout must be a number of seconds, not {raw!r}") from None
    if not 0 < timeout <= options.MAX_VISIBILITY_TIMEOUT:
        raise InvalidArgument(f"option writeTimeout must be in (0, {options.MAX_VISIBILITY_TIMEOUT}] s")
    return WriteOptions(url, token, queue, batch, timeout)


def broker_for(url: str, token: str | None) -> Broker:
    """A broker handle.  ``shm://`` must name an instance that exists on this host (attaching
    with ``create=False``: it would otherwise create an empty one, here, on an executor that
    is not the broker's host)."""
    if not url.startswith("shm://"):
        return connect(url, token=token)
    try:
        return connect(url, create=False)
    except InstanceNotFound:
        instance = url[len("shm://"):] or options.DEFAULT_INSTANCE
        raise InstanceError(f"no shmq instance {instance!r} on this host ({socket.gethostname()}): "
                            "shm:// works where the broker runs; use tcp://HOST:PORT elsewhere") from None
