"""A queue's settings, checked: what ``create_queue`` accepts (and a config file's
declared queues are held to), each against its limit in ``shmq.options``."""

from __future__ import annotations

from typing import Any

from shmq import options
from shmq.api import QueueConfig
from shmq.errors import InvalidArgument


def check_config(limits: dict[str, Any]) -> QueueConfig:
    """A queue's settings from ``create_queue``'s keywords, each checked against its limit
    in ``options``: ``InvalidArgument`` naming the first that is out of range."""
    unknown = set(limits) - set(QueueConfig.__dataclass_fields__)
    if unknown:
        raise InvalidArgument(f"unknown queue options: {', '.join(sorted(unknown))}")
    if "max_bytes" in limits and "max_message_size" not in limits:
        limits["max_message_size"] = min(options.DEFAULT_MAX_MESSAGE_SIZE,
                                         int(limits["max_bytes"]) - options.MAX_META_SIZE)
    c = QueueConfig(**limits)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgument(what)

    need(isinstance(c.capacity, int) and 1 <= c.capacity <= options.MAX_CAPACITY,
         f"capacity must be 1..{options.MAX_CAPACITY}")
    need(isinstance(c.max_bytes, int) and options.MIN_MAX_BYTES <= c.max_bytes <= options.MAX_MAX_BYTES,
         f"max_bytes must be {options.MIN_MAX_BYTES}..{options.MAX_MAX_BYTES}")
    need(isinstance(c.max_message_size, int)
         and 0 < c.max_message_size <= min(c.max_bytes - options.MAX_META_SIZE, options.MAX_MESSAGE_SIZE),
         f"max_message_size must be 1..max_bytes - {options.MAX_META_SIZE}, and at most "
         f"{options.MAX_MESSAGE_SIZE} (every message must fit one TCP frame)")
    need(0 < c.visibility_timeout <= options.MAX_VISIBILITY_TIMEOUT,
         f"visibility_timeout must be in (0, {options.MAX_VISIBILITY_TIMEOUT}] seconds")
    need(isinstance(c.max_deliveries, int) and 1 <= c.max_deliveries <= options.MAX_DELIVERIES_LIMIT,
         f"max_deliveries must be 1..{options.MAX_DELIVERIES_LIMIT}")
    need(isinstance(c.max_groups, int) and 1 <= c.max_groups <= options.MAX_GROUPS_LIMIT,
         f"max_groups must be 1..{options.MAX_GROUPS_LIMIT}")
    need(not isinstance(c.message_ttl, bool) and isinstance(c.message_ttl, (int, float))
         and 0 <= c.message_ttl <= options.MAX_MESSAGE_TTL,
         f"message_ttl must be a number of seconds in [0, {options.MAX_MESSAGE_TTL:g}] (0: none)")
    need(isinstance(c.expired_to_dlq, bool), "expired_to_dlq must be true or false")
    need(c.replication in options.REPLICATION_MODES,
         f"replication must be one of {', '.join(m for m in options.REPLICATION_MODES if m)}, or \"\" "
         "(the broker's --replication)")
    need(not isinstance(c.priorities, bool) and isinstance(c.priorities, int)
         and 0 <= c.priorities <= options.MAX_PRIORITIES,
         f"priorities must be 0..{options.MAX_PRIORITIES} (0: none; N: put(priority=0..N-1), the highest "
         "delivered first)")
    need(c.durability in options.DURABILITY_MODES,
         f"durability must be one of {', '.join(options.DURABILITY_MODES)}")
    return c
