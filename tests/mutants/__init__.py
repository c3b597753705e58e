"""Mutants: plausible wrong versions of the code, one at least per README promise.

Each mutant patches shmq into a version that breaks one promise the README makes, the
way a real bug would (an ack that settles nothing, a reaper that drops leases, a full
queue that drops its oldest message, ...).  ``tests/test_mutants.py`` runs the tests
that prove the promise with the mutant applied, and asserts that they FAIL: a promise
whose mutant survives has a test that proves nothing, and gets a stronger one.

A mutant is applied in every process of the run (the brokers a test starts, their
workers, every child) by ``site/sitecustomize.py``, from ``SHMQ_MUTANT``; the runs
use ``SHMQ_PURE=1``, so the Python twins of the compiled stores are the code mutated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mutant:
    name: str
    promise: str  # the README's words it breaks
    tests: tuple[str, ...]  # the tests that must fail with it (node ids)
    patch: Callable[[], None]
    slow: bool = False  # its tests take a while, or run a storm: marked crash


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, promise: str, *tests: str, slow: bool = False
           ) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(patch: Callable[[], None]) -> Callable[[], None]:
        assert name not in MUTANTS, name
        MUTANTS[name] = Mutant(name, promise, tests, patch, slow)
        return patch
    return register


def apply(name: str) -> None:
    MUTANTS[name].patch()


def _wrap(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.attr`` by ``make(the original)``."""
    setattr(owner, attr, make(getattr(owner, attr)))


Q = "tests/core/test_queue.py::"


# ---------------------------------------------------------------- settling
@mutant("ack_settles_nothing", "an acknowledged message is never delivered again",
        Q + "test_acknowledged_message_is_never_redelivered")
def _ack_settles_nothing() -> None:
    from shmq.core.settlement import OK, Settlement
    Settlement.ack = lambda self, ref, offset, dc: OK  # type: ignore[method-assign]


@mutant("group_names_ignored", "every group sees every message; the members of one group share them",
        Q + "test_separate_groups_each_get_everything")
def _group_names_ignored() -> None:
    from shmq.core.handle import QueueHandle
    _wrap(QueueHandle, "_group_ref", lambda f: lambda self, name, create=True: f(self, "default", create))


@mutant("expiry_never_gives_back", "an expired visibility timeout gives a message back",
        Q + "test_nack_and_timeout_count_against_one_limit")
def _expiry_never_gives_back() -> None:
    from shmq.core.settlement import Settlement
    Settlement.expire = lambda self, gi, now, owner, dead: 0  # type: ignore[method-assign]


@mutant("recovery_forgets_a_nacks_delay", "on a journaled queue a nack's delay holds through recovery",
        "tests/journal/test_durability.py::test_a_nack_with_a_delay_keeps_its_due_time_through_recovery")
def _recovery_forgets_a_nacks_delay() -> None:
    from shmq.core.groups import Groups
    Groups.restore_backoffs = lambda self, groups, due: None  # type: ignore[method-assign]


@mutant("never_dead_letters", "past max_deliveries a message moves to <queue>.dlq",
        Q + "test_nack_below_limit_redelivers_at_limit_dead_letters")
def _never_dead_letters() -> None:
    from shmq.core.group_table import GroupTable

    def init(f: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *a: Any, **k: Any) -> None:
            f(self, *a, **k)
            self.give_up_at = 255
        return __init__
    _wrap(GroupTable, "__init__", init)


@mutant("ack_ignores_the_delivery",
        "an ack of a lease no longer held raises StaleAck, never settles the newer one",
        Q + "test_visibility_timeout_redelivers_and_stale_ack_is_refused")
def _ack_ignores_the_delivery() -> None:
    from shmq.core import layout as L
    from shmq.core.settlement import Settlement

    def make(f: Callable[..., int]) -> Callable[..., int]:
        def ack(self: Any, ref: int, offset: int, dc: int) -> int:  # takes the lease's own count
            word = self.w[self.sl + (offset % self.cap) * self.sw + L.S_GROUPS + (ref & L.GI_MASK)]
            return f(self, ref, offset, (word >> L.DC_SHIFT) & L.DC_MASK)
        return ack
    _wrap(Settlement, "ack", make)


@mutant("full_drops_the_oldest", "a full queue refuses (Full) or waits; it never drops a message",
        Q + "test_full_queue_with_and_without_timeout")
def _full_drops_the_oldest() -> None:
    from shmq.core import layout as L
    from shmq.core.ring import Ring

    def make(f: Callable[..., int]) -> Callable[..., int]:
        def try_put(self: Any, payload: Any, ts: int, meta: bytes = b"") -> int:
            off = f(self, payload, ts, meta)
            w = self.w
            if off < 0:  # Full, and the oldest message nobody has had is settled for every group
                with self.clock:
                    for gi in range(self.max_groups):
                        g = self.groups_w + gi * L.G_WORDS
                        for o in range(w[g + L.G_CURSOR], w[L.Q_NEXT_OFFSET]):
                            lw = self.slots_w + (o % self.capacity) * self.slot_words + L.S_GROUPS + gi
                            if not w[lw]:
                                w[lw] = L.DONE
                                break
            return off
        return try_put
    _wrap(Ring, "try_put", make)


# ---------------------------------------------------------------- leases of the dead
@mutant("tcp_leases_kept", "a TCP client that disconnects or is SIGKILLed gives its leases back at once",
        "tests/server/test_server.py::test_killed_clients_leases_come_back_at_once")
def _tcp_leases_kept() -> None:
    from shmq.server.core import Core
    Core.give_back = lambda self, conn: set()  # type: ignore[method-assign]


@mutant("reap_marks_done", "a co-located process that dies gives its leases back",
        "tests/crash/test_crash.py::test_dead_consumers_leases_come_back_within_the_reap_interval")
def _reap_marks_done() -> None:
    _reaper_drops_leases()


@mutant("storm_reap_marks_done", "producers and consumers SIGKILLed at random: nothing confirmed is lost",
        "tests/crash/test_crash.py::test_sigkill_storm_loses_nothing_and_invents_nothing", slow=True)
def _storm_reap_marks_done() -> None:
    _reaper_drops_leases()


def _reaper_drops_leases() -> None:
    """A reaper that settles a dead client's leases (DONE) instead of giving them back."""
    from shmq.core import layout as L
    from shmq.core.settlement import Settlement

    def reap_owner(self: Any, dead_client: int, owner: int, now: int, dead: list[Any]) -> int:
        w, n = self.w, 0
        for gi, _name in self.active():
            g = self.gw + gi * L.G_WORDS
            lw = L.S_GROUPS + gi
            for o in range(w[g + L.G_FLOOR], w[g + L.G_CURSOR]):
                base = self.sl + (o % self.cap) * self.sw + lw
                word = w[base]
                if (word >> L.OWNER_SHIFT) & L.OWNER_MASK == dead_client and word & L.STATE_MASK == L.LEASED:
                    w[base] = L.DONE | (word & (L.DC_MASK << L.DC_SHIFT))
                    n += 1
            self.advance_floor(gi)
        return n
    Settlement.reap_owner = reap_owner  # type: ignore[method-assign]


@mutant("frozen_peers_live_for_ever", "a client that freezes loses its leases within 3 heartbeats",
        "tests/protocol/test_heartbeat.py::test_a_frozen_client_loses_its_leases_to_others_at_once",
        "tests/protocol/test_heartbeat.py::test_a_frozen_broker_ends_a_waiting_get_and_an_idle_handle")
def _frozen_peers_live_for_ever() -> None:
    from shmq import options
    options.HEARTBEAT_MISSES = 1_000_000  # type: ignore[misc]


@mutant("dead_worker_not_reaped", "a worker SIGKILLed mid-request is restarted; nothing it confirmed is lost",
        "tests/server/test_server.py::test_sigkilled_worker_is_restarted_and_nothing_is_lost")
def _dead_worker_not_reaped() -> None:
    from shmq.core.serverqueue import ServerBroker
    ServerBroker.reap = lambda self: 0  # type: ignore[method-assign]
    ServerBroker.maintain = lambda self: None  # type: ignore[method-assign]


# ---------------------------------------------------------------- durability, input, resources
@mutant("journal_marks_what_it_never_wrote", "always: a confirmed message survives SIGKILL of the broker "
        "and the loss of its shared memory",
        "tests/journal/test_durability.py::test_kill9_the_whole_broker_while_producing[always-True]",
        slow=True)
def _journal_marks_what_it_never_wrote() -> None:
    from shmq.journal import Journal
    _wrap(Journal, "append", lambda f: lambda self, items, state: f(self, [], state))


@mutant("a_malformed_body_is_internal", "bad input gets a typed error; the connection keeps serving",
        "tests/server/test_server.py::test_bad_request_bodies_and_unknown_queues_keep_the_connection")
def _a_malformed_body_is_internal() -> None:
    from shmq.errors import ProtocolError
    from shmq.server import handlers

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def decode_produce(frame: Any) -> Any:
            try:
                return f(frame)
            except ProtocolError as e:
                raise RuntimeError(str(e)) from None
        return decode_produce
    for t, decode in handlers.DECODERS.items():  # the table the handlers' dispatch reads
        if decode is handlers.decode_produce:
            handlers.DECODERS[t] = make(decode)


@mutant("a_full_disk_keeps_what_is_settled", "a full disk is left by itself once there is room",
        "tests/server/test_exhaustion.py::test_a_full_disk_frees_what_is_settled_takes_puts_again_and_restarts",
        "tests/server/test_exhaustion.py::test_running_out_of_descriptors_is_a_typed_error_and_a_log_line",
        "tests/server/test_exhaustion.py::test_a_full_dev_shm_is_a_typed_error_naming_it", slow=True)
def _a_full_disk_keeps_what_is_settled() -> None:
    from shmq.server.journaler import QueueWriter

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def drop(self: Any) -> None:
            if not self.d.error:
                f(self)
        return drop
    _wrap(QueueWriter, "drop", make)


@mutant("dev_shm_full_is_untyped", "a full /dev/shm is a LimitExceeded naming it",
        "tests/server/test_exhaustion.py::test_a_full_dev_shm_is_a_typed_error_naming_it")
def _dev_shm_full_is_untyped() -> None:
    from shmq import resources
    resources.SPACE_ERRNOS = frozenset()  # type: ignore[misc]


# ---------------------------------------------------------------- headers, seek, delay, TTL
@mutant("dead_letters_lose_headers", "a message's headers stay with it through the dead-letter queue",
        "tests/client/test_headers.py::test_dead_letter_keeps_headers_adds_origin_and_redrive_takes_them_back",
        "tests/client/test_headers.py::test_headers_and_origins_survive_kill9_and_recovery")
def _dead_letters_lose_headers() -> None:
    from shmq.core import handle
    handle.block_of = lambda meta: b""  # type: ignore[assignment]


@mutant("seek_one_too_far", "a seek moves its group to the first message produced at or after the time",
        "tests/core/test_seek.py::test_seek_forward_skips_the_older_messages_for_that_group_only",
        "tests/core/test_seek.py::test_a_journaled_seek_survives_kill9_and_recovery")
def _seek_one_too_far() -> None:
    from shmq.core.groups import Groups
    _wrap(Groups, "offset_at", lambda f: lambda self, ts_ns: f(self, ts_ns) + 1)


@mutant("delay_dropped", "a delayed message goes to no group before it is due",
        "tests/core/test_delay.py::test_delayed_message_waits_then_goes_to_every_group",
        "tests/journal/test_durability.py::test_recovery_keeps_a_delayed_message_due_time")
def _delay_dropped() -> None:
    from shmq.core.queue import ShmQueue

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def _put_metas(self: Any, items: Any, metas: Any, block: bool, timeout: Any, key: int, seq: Any,
                       wait_durable: bool, delay: int = 0, ttl: int = 0) -> Any:
            return f(self, items, metas, block, timeout, key, seq, wait_durable, 0, ttl)
        return _put_metas
    _wrap(ShmQueue, "_put_metas", make)


@mutant("a_new_group_forgets_a_settled_delay", "a delayed message settled early still waits in a group "
        "made later at that index",
        "tests/core/test_delay.py::test_a_group_made_at_an_index_that_settled_a_delayed_message_waits",
        "tests/core/test_delay.py::test_a_delayed_message_settled_early_keeps_its_due_time_through_recovery")
def _a_new_group_forgets_a_settled_delay() -> None:
    from shmq.core import layout as L
    from shmq.core.group_table import GroupTable

    def make(f: Callable[..., int]) -> Callable[..., int]:
        def create(self: Any, name: str, start: Any) -> int:
            gi = f(self, name, start)
            w = self.w
            for o in range(w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET]):  # delayed words made plain NEW
                b = self.sl + (o % self.cap) * self.sw + L.S_GROUPS + gi
                if w[b] & 7 == L.READY and not (w[b] >> L.DC_SHIFT) & L.DC_MASK:
                    w[b] = L.NEW
            return gi
        return create
    _wrap(GroupTable, "create", make)


@mutant("ttl_takes_a_leased_message", "a leased message is never taken from its consumer by a TTL",
        "tests/core/test_ttl.py::test_a_leased_message_is_not_taken_and_a_nacked_one_does_not_expire",
        "tests/core/test_ttl.py::test_expired_message_is_dead_lettered_with_its_headers")
def _ttl_takes_a_leased_message() -> None:
    from shmq.core import layout as L
    from shmq.core.settlement import STALE, Settlement

    def make(f: Callable[..., int]) -> Callable[..., int]:
        def ack(self: Any, ref: int, offset: int, dc: int) -> int:
            ts = self.w[self.sl + (offset % self.cap) * self.sw + L.S_TIMESTAMP]
            if self.ttl_ns and ts <= self.wall_ns() - self.ttl_ns:
                return STALE  # expired while leased: taken away
            return f(self, ref, offset, dc)
        return ack
    _wrap(Settlement, "ack", make)


@mutant("own_ttl_dropped", "a message's own ttl expires it for each group that did not get it in time",
        "tests/core/test_ttl_message.py::test_every_message_meets_its_own_fate_in_each_group",
        "tests/core/test_ttl_sweep.py::test_own_ttls_survive_kill9_and_the_loss_of_shared_memory")
def _own_ttl_dropped() -> None:
    from shmq.core.queue import ShmQueue

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def _put_metas(self: Any, items: Any, metas: Any, block: bool, timeout: Any, key: int, seq: Any,
                       wait_durable: bool, delay: int = 0, ttl: int = 0) -> Any:
            return f(self, items, metas, block, timeout, key, seq, wait_durable, delay, 0)
        return _put_metas
    _wrap(ShmQueue, "_put_metas", make)


@mutant("nobody_sweeps", "with nobody consuming, the broker expires what a delivery would, within a tick",
        "tests/core/test_ttl_sweep.py::test_maintenance_expires_up_to_the_first_live_message",
        "tests/core/test_ttl_sweep.py::test_the_broker_expires_with_nobody_consuming")
def _nobody_sweeps() -> None:
    from shmq.core.handle import QueueHandle
    QueueHandle.sweep_ttl = lambda self, budget=0: 0  # type: ignore[method-assign]


# ---------------------------------------------------------------- request/reply, seeks, memory, cleanup
@mutant("replies_to_whoever_reads", "a request gets its own answer; a late one is dropped",
        "tests/client/test_request_reply.py::test_concurrent_requests_each_get_their_own_answer",
        "tests/client/test_request_reply.py::test_timeout_and_late_reply_dropped",
        "tests/client/test_request_reply.py::test_killed_requester_reply_queue_reaped")
def _replies_to_whoever_reads() -> None:
    from shmq.api.reply import Requester

    def _file(self: Any, msg: Any, mine: bytes) -> None:
        self._unacked.append(msg)
        if self._waiting.get(mine, 0) is None:
            self._waiting[mine] = msg
    Requester._file = _file  # type: ignore[method-assign]


@mutant("repair_forgets_a_seek", "a seek SIGKILLed at any point is finished whole by the next holder",
        "tests/crash/test_seek_crash.py::test_a_seek_killed_anywhere_is_finished_whole")
def _repair_forgets_a_seek() -> None:
    from shmq.core import layout as L
    from shmq.core.groups import Groups

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def repair(self: Any) -> None:
            for gi in range(self.max_groups):
                self.w[self.gw + gi * L.G_WORDS + L.G_SEEK_TO] = 0
            f(self)
        return repair
    _wrap(Groups, "repair", make)


@mutant("a_deleted_queue_stays_mapped", "a deleted queue's memory goes back to the system",
        "tests/server/test_memory.py::test_fifty_deleted_queues_leave_no_memory_in_the_deleting_process",
        "tests/server/test_memory.py::test_fifty_deleted_queues_leave_no_memory_in_any_broker_process")
def _a_deleted_queue_stays_mapped() -> None:
    from shmq.core.handle import QueueHandle
    QueueHandle.release = lambda self, why="deleted": True  # type: ignore[method-assign]


@mutant("reclaim_takes_live_instances",
        "shmq doctor --clean removes the shared memory of dead instances only",
        "tests/crash/test_crash.py::test_reclaim_takes_dead_instances_and_never_live_ones",
        "tests/core/test_ownership.py")
def _reclaim_takes_live_instances() -> None:
    import contextlib

    from shmq.core import cleanup

    @contextlib.contextmanager
    def _exclusive(reg_name: str) -> Any:
        yield True  # "nobody is attached", never asked
    cleanup._exclusive = _exclusive  # type: ignore[assignment]


# ---------------------------------------------------------------- replication
R = "tests/replication/"


@mutant("sync_confirms_alone", "replication=\"sync\": a confirmed put is on a standby's disk too",
        R + "test_failover.py::test_sync_failover_loses_nothing_confirmed",
        R + "test_standby.py::test_a_sync_put_is_confirmed_only_once_a_standby_has_it",
        R + "test_partition.py::test_a_cut_link_stops_sync_confirms_and_healing_resumes_them", slow=True)
def _sync_confirms_alone() -> None:
    from shmq.server.journaler import QueueWriter

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            f(self, *args, **kwargs)
            self.sync_replicated = False  # confirmed by the local fsync alone, as async
        return init
    _wrap(QueueWriter, "__init__", make)


@mutant("lag_counts_sent_not_confirmed", "async: a fail-over loses at most the lag the primary reports",
        R + "test_failover.py::test_async_failover_loses_at_most_the_lag_reported_before_the_kill",
        slow=True)
def _lag_counts_sent_not_confirmed() -> None:
    from shmq.server.replication import Link

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def describe(self: Any) -> Any:
            d = f(self)
            d["lag_records"] = len(self.out)  # what is still queued here, not what the standby has
            return d
        return describe
    _wrap(Link, "describe", make)


@mutant("resume_copies_whole", "restarted, a standby resumes from its position",
        R + "test_standby.py::test_a_restarted_standby_resumes_from_its_position_not_from_zero")
def _resume_copies_whole() -> None:
    from shmq.server.replication import Link

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def copy_queue(self: Any, writer: Any, position: Any) -> None:
            f(self, writer, None)  # as if it held nothing
        return copy_queue
    _wrap(Link, "copy_queue", make)


@mutant("a_copy_drops_headers", "a standby holds every journaled message at the primary's offset, "
        "with its headers",
        R + "test_standby.py::test_full_copy_has_every_message_at_its_offset_with_its_headers")
def _a_copy_drops_headers() -> None:
    from shmq.server import replication

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def journal_contents(writer: Any, floor: int) -> Any:
            items, state = f(writer, floor)
            return [it[:3] for it in items], state
        return journal_contents
    _wrap(replication, "journal_contents", make)


@mutant("a_diverged_tail_is_kept", "an old primary that rejoins discards its diverged tail",
        R + "test_partition.py::"
        "test_an_old_primary_rejoins_discards_its_diverged_tail_and_matches_offset_by_offset",
        slow=True)
def _a_diverged_tail_is_kept() -> None:
    from shmq.server import standby

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def queue(self: Any, h: dict[str, Any]) -> None:
            if h.get("full") and h["meta"]["name"] in self.journals:
                return  # keeps what it holds, diverged tail and all
            f(self, h)
        return queue
    _wrap(standby.Follower, "_queue", make)


# ---------------------------------------------------------------- shmq.mp
MP = "tests/mp/"


@mutant("mp_get_keeps_the_object", "shmq.mp passes CPython's own tests of multiprocessing.Queue",
        MP + "test_cpython_queue.py::TestQueueSpawn::test_put")
def _mp_get_keeps_the_object() -> None:
    from shmq.mp import Queue
    Queue._joinable = True  # every get leases and nothing settles it: the object stays counted


@mutant("mp_put_under_a_plain_lock", "a shmq.mp producer SIGKILLed mid-put never stalls the others",
        MP + "test_mp.py::test_a_producer_sigkilled_mid_put_leaves_every_other_process_working", slow=True)
def _mp_put_under_a_plain_lock() -> None:
    import multiprocessing

    from shmq.mp import Queue
    lock = multiprocessing.Lock()  # the stdlib queue's design: a lock its dead holder keeps

    def make(f: Callable[..., None]) -> Callable[..., None]:
        def put(self: Any, obj: Any, block: bool = True, timeout: float | None = None) -> None:
            with lock:
                f(self, obj, block, timeout)
        return put
    _wrap(Queue, "put", make)


@mutant("mp_get_under_a_plain_lock", "a shmq.mp consumer SIGKILLed mid-get never stalls the others",
        MP + "test_mp.py::test_a_consumer_sigkilled_mid_get_never_stalls_the_others", slow=True)
def _mp_get_under_a_plain_lock() -> None:
    import multiprocessing
    import queue

    from shmq.mp import Queue
    lock = multiprocessing.Lock()  # the stdlib queue's reader lock: its dead holder keeps it

    def make(f: Callable[..., Any]) -> Callable[..., Any]:
        def get(self: Any, block: bool = True, timeout: float | None = None) -> Any:
            if not lock.acquire(block, timeout):
                raise queue.Empty
            try:
                return f(self, block, timeout)
            finally:
                lock.release()
        return get
    _wrap(Queue, "get", make)


@mutant("mp_task_settled_when_got", "a JoinableQueue task whose worker dies is delivered again",
        MP + "test_mp.py::test_a_task_whose_worker_is_sigkilled_is_done_by_another_and_join_returns")
def _mp_task_settled_when_got() -> None:
    from shmq.mp import JoinableQueue
    JoinableQueue._joinable = False  # acked as it is got: a worker that dies loses its task

    def task_done(self: Any) -> None:  # (and task_done has nothing left to settle)
        self._check_open()
    JoinableQueue.task_done = task_done  # type: ignore[method-assign]


@mutant("mp_sweep_takes_live_queues", "after a SIGKILL the next queue made reclaims it, never a live one",
        MP + "test_mp.py::test_a_sigkilled_last_user_leaves_it_to_the_next_queue_made_never_a_live_one")
def _mp_sweep_takes_live_queues() -> None:
    import os

    import shmq.mp
    from shmq.core.cleanup import _objects, reclaim_dead
    from shmq.core.colocated import ShmBroker

    def reclaim_every(prefix: str) -> list[Any]:
        acted = reclaim_dead(prefix)
        mine = f"{prefix}{os.getpid()}-"  # (only this test's own: the suite's others run beside it)
        for inst, _uid in {k for k in _objects() if k[0].startswith(mine)}:
            try:
                ShmBroker(inst, create=False).destroy()  # live or not
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        return acted
    shmq.mp.reclaim_dead = reclaim_every


@mutant("mp_last_user_leaves_it", "a queue is removed when the last process using it lets go",
        MP + "test_mp.py::test_a_queue_is_removed_when_its_last_user_lets_go")
def _mp_last_user_leaves_it() -> None:
    import shmq.mp
    shmq.mp.reclaim = lambda instance=None, dry_run=False: []


# ---------------------------------------------------------------- the kombu transport (Celery)
@mutant("kombu_ack_settles_nothing", "under acks_late an acked Celery task never runs again",
        "tests/integrations/test_celery.py::"
        "test_a_worker_killed_mid_task_has_it_run_again_by_the_other_within_a_second", slow=True)
def _kombu_ack_settles_nothing() -> None:
    from shmq.kombu.transport import Leases

    def ack(self: Any, delivery_tag: int, multiple: bool = False) -> None:
        self._take(delivery_tag, multiple)  # forgotten here, never acked at the broker
    Leases.ack = ack  # type: ignore[method-assign]


# ---------------------------------------------------------------- priorities
P = "tests/core/test_priority.py::"


@mutant("priority_lowest_first", "a priority queue delivers the highest priority ready first, FIFO "
        "within one",
        P + "test_the_highest_priority_ready_goes_first_fifo_within_one[shm]",
        P + "test_the_highest_priority_ready_goes_first_fifo_within_one[tcp]")
def _priority_lowest_first() -> None:
    from shmq.core.priority import PriorityQueue
    from shmq.core.serverqueue import ServerPriorityQueue

    def bottom_up(init: Callable[..., None]) -> Callable[..., None]:
        def patched(self: Any, *a: Any) -> None:
            init(self, *a)
            self._top_down = self._top_down[::-1]  # the levels looked at from the lowest up
        return patched
    _wrap(PriorityQueue, "__init__", bottom_up)
    _wrap(ServerPriorityQueue, "__init__", bottom_up)


@mutant("priority_lease_lost_with_level", "a priority queue keeps every guarantee of a queue: a killed "
        "consumer's message comes back",
        P + "test_a_killed_consumer_gives_its_high_message_back_at_once[tcp]")
def _priority_lease_lost_with_level() -> None:
    from shmq.core.serverqueue import ServerPriorityQueue
    ServerPriorityQueue.give_back = lambda self, ref, offsets, deliveries: 0  # type: ignore[method-assign]


# ---------------------------------------------------------------- a co-located get's wait
W = "tests/core/test_waiting.py::"


@mutant("page_tables_left_to_faults", "each process fills in its page tables for a queue when it opens "
        "it, so a fresh queue's first messages pay no page faults",
        W + "test_a_handle_fills_in_its_page_tables_so_a_first_pass_takes_no_fault")
def _page_tables_left_to_faults() -> None:
    from shmq.core.segment import Mapping
    Mapping.populate = lambda self: False  # type: ignore[method-assign]


@mutant("spin_blind_to_given_back", "a co-located get that finds nothing watches the queue before it "
        "sleeps (a message published or given back ends the watch)",
        W + "test_a_message_given_back_ends_a_spin_as_a_new_one_does[pure]",
        W + "test_a_get_with_a_lease_expiry_due_does_not_spin[pure]", slow=True)
def _spin_blind_to_given_back() -> None:
    import time

    from shmq.core.consumer import Consuming
    from shmq.core.layout import G_CURSOR, G_WORDS

    def spin(self: Any, gi: int, now: int) -> bool:  # new offsets only: no redelivery, no expiry
        w, tw = self.words, self.consumer_groups.tail_word
        cursor = self.ring.groups_w + gi * G_WORDS + G_CURSOR
        end = time.perf_counter_ns() + self._spin
        while w[tw] <= w[cursor]:
            if time.perf_counter_ns() >= end:
                return False
        return True
    Consuming._spin_wait = spin  # type: ignore[method-assign]
