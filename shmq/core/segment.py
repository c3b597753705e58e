"""Named POSIX shared-memory objects and semaphores: names, create, attach, unlink.

Every object name carries the effective uid of its maker and the instance name; on
Linux they appear in ``/dev/shm`` as ``shmq.<uid>.<instance>.*`` and
``sem.shmq.<uid>.<instance>.*``, so two users' instances of the same name never
meet, and one user cannot block another's by creating its names first.  The uid
is read at every call, never cached: a process that changes its uid (a forked
child that drops root) names the objects of its new uid.  Python's
``multiprocessing.resource_tracker`` never sees them: posix-ipc owns the life
cycle, and so do we (see ``reclaim``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pwd
import re
from collections.abc import Iterator
from typing import NoReturn

import posix_ipc

from shmq import options
from shmq.errors import InstanceError, InvalidName
from shmq.resources import SHM_DIR, exhaustion, shm_full
from shmq.text import shown

PREFIX = "shmq."
_INSTANCE_RE = re.compile(rf"[A-Za-z0-9_-]{{1,{options.INSTANCE_NAME_MAX}}}\Z")


def check_instance_name(name: str) -> str:
    if not isinstance(name, str) or not _INSTANCE_RE.match(name):
        raise InvalidName(
            f"invalid instance name {shown(name)}: 1-{options.INSTANCE_NAME_MAX} chars of [A-Za-z0-9_-]")
    return name


# A name in /dev/shm: ``[sem.]shmq.<uid>.<instance>.<what>``; ``uid`` is absent from the
# names of versions before it was added (``shmq.<instance>.<what>``).  An instance name
# has no dot, so the count of dots tells the two forms apart: none matches both.
OBJECT_NAME = re.compile(
    r"^(?P<sem>sem\.)?shmq\.(?:(?P<uid>\d+)\.)?(?P<inst>[A-Za-z0-9_-]+)\."
    r"(?:(?P<reg>reg)(?:\.tmp(?P<tmppid>\d+)\.[0-9a-f]+)?|q(?P<qid>\d+)(?:\.(?:ne|nf|j|d))?)$")


def parse_object_name(name: str) -> re.Match[str] | None:
    """The parts of an object's name in /dev/shm (``sem``, ``uid``: None for the names of
    an older version, ``inst``, ``reg``, ``tmppid``, ``qid``); None for a name not of shmq."""
    return OBJECT_NAME.match(name)


def instance_prefix(instance: str, uid: int | None = None) -> str:
    """How the names of ``instance``'s objects start in /dev/shm (``shmq.<uid>.<instance>.``):
    of our effective uid, read now, unless ``uid`` is given."""
    return f"{PREFIX}{os.geteuid() if uid is None else uid}.{instance}."


def objects_of(instance: str) -> list[str]:
    """The names in /dev/shm of our objects (segments and semaphores) of ``instance``."""
    prefix = instance_prefix(instance)
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith((prefix, "sem." + prefix)))


def registry_name(instance: str) -> str:
    return f"/{instance_prefix(instance)}reg"


def queue_segment_name(instance: str, queue_id: int) -> str:
    return f"/{instance_prefix(instance)}q{queue_id}"


def queue_id_of(instance: str, name: str) -> int | None:
    """The queue id of one of our queue segments' name in /dev/shm
    (``shmq.<uid>.<instance>.q<id>``)."""
    prefix = f"{instance_prefix(instance)}q"
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def semaphore_names(instance: str, queue_id: int) -> tuple[str, str, str, str]:
    """The semaphore names of a queue: not_empty, not_full, journal (wakes the journal
    writer) and durable (wakes those waiting for a durable mark)."""
    base = queue_segment_name(instance, queue_id)
    return base + ".ne", base + ".nf", base + ".j", base + ".d"


# Mappings are made and let go of with libc's mmap, so that a segment's mmap object holds
# no descriptor of it (Python's dups the file's, which keeps a deleted queue's memory
# alive, and costs one descriptor per queue) and so that its memory can be handed back
# while pointers into it stay valid (``Mapping.vacate``).
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux's (not in the mmap module)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Linux's; in the module from 3.12)
_ZEROS = mmap.MAP_PRIVATE | _MAP_NORESERVE  # private zero pages, none reserved until written
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: the page tables filled in, writable, nothing written


def _map_over(mm: mmap.mmap, address: int, fd: int) -> None:
    """Map ``fd`` (shared), or fresh zero pages (``fd`` -1), over ``mm``'s whole range."""
    flags = mmap.MAP_SHARED if fd >= 0 else _ZEROS | mmap.MAP_ANONYMOUS
    if _mmap(address, len(mm), _PROT_RW, flags | _MAP_FIXED, fd, 0) != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")


def _map_file(fd: int, size: int) -> tuple[mmap.mmap, int]:
    """``size`` bytes of ``fd`` mapped shared, as an mmap object that holds no descriptor
    (an anonymous placeholder, then the file mapped over it); and its address."""
    mm = mmap.mmap(-1, size, flags=_ZEROS)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # (no export kept: the mapping can be closed)
    try:
        _map_over(mm, address, fd)
    except BaseException:
        mm.close()
        raise
    return mm, address


class Mapping:
    """One shared-memory object mapped into this process."""

    __slots__ = ("name", "mm", "words", "size", "fd", "address", "vacated")

    def __init__(self, name: str, mm: mmap.mmap, address: int, fd: int = -1) -> None:
        self.name = name
        self.mm = mm
        self.address = address
        self.size = len(mm)
        self.words = memoryview(mm).cast("Q")
        self.fd = fd  # the object's file, kept open when asked for (``hold``): -1 otherwise
        self.vacated = False

    @classmethod
    def create(cls, name: str, size: int, hold: bool = False) -> Mapping:
        """Create a new object (fails if it exists), sized and zero-filled.  ``hold``: keep
        its file descriptor open (``fd``) until ``close``."""
        with typed(f"cannot create shared memory {name}"):
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=options.SHM_MODE, size=size)
        try:
            try:  # reserve the pages now: a full /dev/shm is an error here, never a SIGBUS later
                os.posix_fallocate(shm.fd, 0, size)
            except OSError:
                raise shm_full(f"cannot reserve {size:,} bytes of shared memory for {name}") from None
            with typed(f"cannot map shared memory {name}"):
                mm, address = _map_file(shm.fd, size)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        if hold:
            return cls(name, mm, address, _cloexec(shm.fd))
        shm.close_fd()
        return cls(name, mm, address)

    @classmethod
    def attach(cls, name: str, hold: bool = False) -> Mapping:
        try:
            with typed(f"cannot open shared memory {name}"):
                shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(name) from None
        except posix_ipc.PermissionsError:  # another user's, closed to us: say whose
            _refuse_unopenable(name, shm_path(name))
        try:
            check_owned(name, os.fstat(shm.fd))  # before anything of it is read
            if shm.size == 0:
                raise InstanceError(f"shared memory {name} is empty (creation in progress or crashed)")
            with typed(f"cannot map shared memory {name}"):
                mm, address = _map_file(shm.fd, shm.size)
        except BaseException:
            shm.close_fd()
            raise
        if hold:
            return cls(name, mm, address, _cloexec(shm.fd))
        shm.close_fd()
        return cls(name, mm, address)

    def populate(self) -> bool:
        """Fill in this process's page tables for the whole object now (its pages were
        reserved at creation), so that no put or get pays a page fault later: on a VM a
        fault costs microseconds, and a fresh queue's first pass through its byte ring
        met one at each page.  False where the kernel cannot (before Linux 5.14); the
        pages then fault in as they are first touched, as before."""
        if self.vacated:
            return False
        return _madvise(self.address, self.size, _MADV_POPULATE_WRITE) == 0

    def rename(self, name: str) -> None:
        """After ``link_into_place``: map the object again through its final ``name`` (the
        same file), so that the process's maps name the live object, not the temporary
        name, which is gone."""
        fd = os.open(shm_path(name), os.O_RDWR | os.O_CLOEXEC)
        try:
            if self.fd < 0 or os.fstat(fd).st_ino == os.fstat(self.fd).st_ino:
                _map_over(self.mm, self.address, fd)
        finally:
            os.close(fd)
        self.name = name

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def vacate(self) -> None:
        """Let go of the object's memory in this process now (its queue was deleted, or its
        broker handle closed), whoever still holds a view of it: the range is remapped
        to private zero pages, so every pointer and view into it stays valid and reads
        zeros (a queue in state 0, which is not active), and the object's memory is the
        kernel's again once no process maps it.  The range itself goes with ``close`` or
        when the mmap object is collected."""
        if not self.vacated:
            if not self.mm.closed:  # (closed: unmapped already)
                _map_over(self.mm, self.address, -1)
            self.vacated = True
        self.close_fd()

    def close(self) -> None:
        self.close_fd()
        self.words.release()
        try:
            self.mm.close()
        except BufferError:  # a view of it is still held; the GC unmaps it later
            pass


@contextlib.contextmanager
def typed(what: str) -> Iterator[None]:
    """Descriptors or /dev/shm run out inside: the typed error (``resources.exhaustion``)."""
    try:
        yield
    except OSError as e:
        err = exhaustion(e, what)
        if err is None:
            raise
        raise err from None


def _cloexec(fd: int) -> int:
    """A descriptor kept open must not leak into programs this process execs (a forked
    child still shares it: that child is attached too)."""
    os.set_inheritable(fd, False)
    return fd


def unlink_shm(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def open_semaphore(name: str, create: bool) -> posix_ipc.Semaphore:
    """Create a new semaphore (``create``: it must not exist), or open one of ours
    (``InstanceError`` for one another user made or could open)."""
    if create:
        with typed(f"cannot create semaphore {name}"):
            return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=options.SHM_MODE, initial_value=0)
    try:
        st = os.stat(semaphore_path(name))
    except FileNotFoundError:
        pass  # posix_ipc raises ExistentialError below, as callers expect
    else:
        check_owned(name, st)
    try:
        with typed(f"cannot open semaphore {name}"):
            return posix_ipc.Semaphore(name)
    except posix_ipc.PermissionsError:  # made another user's since the stat
        _refuse_unopenable(name, semaphore_path(name))


def open_semaphores(names: tuple[str, ...]) -> list[posix_ipc.Semaphore]:
    """Open existing semaphores, all or none: when one is missing (ExistentialError), those
    opened already are closed again."""
    sems: list[posix_ipc.Semaphore] = []
    try:
        for name in names:
            sems.append(open_semaphore(name, create=False))
    except BaseException:
        for sem in sems:
            sem.close()
        raise
    return sems


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def semaphore_path(name: str) -> str:
    """Where Linux keeps a named semaphore: ``/dev/shm/sem.<name>``."""
    return os.path.join(SHM_DIR, "sem." + name.lstrip("/"))


def describe_user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def not_ours(st: os.stat_result) -> str | None:
    """Why an object with this status is not ours to use, None when it is: every object
    of ours is owned by our effective uid and open to nobody else (``SHM_MODE``)."""
    if st.st_uid != os.geteuid():
        return f"owned by {describe_user(st.st_uid)}, not by {describe_user(os.geteuid())}"
    if st.st_mode & 0o077:
        return f"mode 0o{st.st_mode & 0o777:o}: open to other users (ours are 0o{options.SHM_MODE:o})"
    return None


def check_owned(name: str, st: os.stat_result) -> None:
    """Refuse an object that is not ours (another user made it first, or widened its mode):
    whoever wrote it could read and write what we put there."""
    why = not_ours(st)
    if why is not None:
        raise InstanceError(f"shared memory object {name} is {why}: refused, nothing of it was read "
                            "(`shmq doctor` lists such objects; their owner or root must remove them)")


def _refuse_unopenable(name: str, path: str) -> NoReturn:
    """The ``InstanceError`` for an object we may not even open: whose it is, if we can tell."""
    try:
        check_owned(name, os.stat(path))
    except FileNotFoundError:
        pass
    raise InstanceError(f"shared memory object {name}: permission denied, refused "
                        "(`shmq doctor` lists objects that are not ours)")


def unlink_ours(name: str, semaphore: bool, refuse: bool = False) -> None:
    """Remove ``name`` if it is ours (a creation that failed undoes only what it made).
    One that is not ours stays (only its owner may remove it); ``refuse``: raise
    ``InstanceError`` for it (a squatted name must not be created over)."""
    try:
        st = os.stat(semaphore_path(name) if semaphore else shm_path(name))
    except FileNotFoundError:
        return
    if refuse:
        check_owned(name, st)
    elif not_ours(st) is not None:
        return
    if semaphore:
        unlink_semaphore(name)
    else:
        unlink_shm(name)


def clear_leftover(name: str, semaphore: bool) -> None:
    """Before creating ``name`` under an id that is fresh: remove an object of ours left by
    a dead earlier run; refuse one that is not ours."""
    unlink_ours(name, semaphore, refuse=True)


def link_into_place(tmp_name: str, final_name: str) -> bool:
    """Atomically publish a fully initialised object under its final name.

    Returns False when the final name already exists (someone else won).
    """
    try:
        os.link(shm_path(tmp_name), shm_path(final_name))
        return True
    except FileExistsError:
        return False
