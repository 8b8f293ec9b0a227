"""Arenas and buffers in a child made by fork().

NOTE [ Arenas after fork ]
A child made by fork() (multiprocessing's default start method on Linux: a
DataLoader worker, a Pool) inherits every arena, but of the parent's threads
only the one that forked. A lock another thread held at that instant (a
prefetch thread inside ``alloc``, ``free`` or a transfer, as NOTE [ Host
streams after fork ] allows) stays held in the child forever, so the child's
first use of that arena hung: a worker that never returned a batch.

1. An arena with any of its locks held at the fork (its own two, or the lock
   of any allocator in its stack, core and adaptors) was in the middle of an
   update the child will never see finished: its free lists or accounting may
   be half-written. In the child, each of those locks is replaced by one that
   raises :class:`~rtmem.errors.BackendError` saying so, instead of repairing
   state nobody can check. The arena's buffers stay readable (views need no
   lock); ``alloc``, ``free``, ``stats`` and ``close`` raise. The child's
   memory is its own copy: the parent is untouched either way. The stack is
   walked through each adaptor's ``upstream``; a user's adaptor that keeps its
   upstream under another name hides the adaptors below it, never the core.
2. An arena no thread was using works in the child as in the parent.
3. The transfer engines' locks, and the backend registry's (``get_backend``),
   each guard one container operation, never a half-done update, so
   rtmem.transfers and rtmem.backends give the child fresh ones.
4. A plain Lock (the arenas' and allocators') does not say who holds it: one
   held by the thread that forked (a fork from inside an ``alloc``, e.g. from
   an adaptor) is refused like one held by another thread; the message says
   either may have held it.
5. A buffer whose lock another thread held at the fork is refused as in Rule 1
   (its placements or pending move may be half-written): in the child every
   use of it (views, moves, ``free``, ``residency``) raises BackendError, and
   ``transfers.synchronize()``, which settles the buffers moved since its last
   call, raises that once and forgets the buffer. A buffer's lock is an RLock,
   which knows its owner: one the thread that forked held is its own in the
   child too, and that buffer works there.
   Buffers are not registered like arenas (a WeakSet add on every ``alloc``
   would cost the hot path): the child checks each buffer's lock lazily, at
   its first use there. In the parent ``buf._lock`` is a plain slot; the
   child hook replaces that slot's descriptor on the class with
   :class:`_CheckedAfterFork`, which tests a lock inherited from before the
   latest fork once (under a lock of its own, so two threads of the child
   cannot mistake each other's test for a holder) and stamps the buffer with
   the fork generation; locks set in the child are stamped as they are set.

Before a fork only registration (a WeakSet add per arena) costs anything; a
forked child also pays the descriptor's check at each ``buf._lock``.
"""

from __future__ import annotations

import os
import threading
import weakref

from .errors import BackendError

__all__ = ["HeldAtFork", "buffer_busy", "check_lock_slot_after_fork", "register_arena"]

_arenas = weakref.WeakSet()

#: Forks between the first process and this one (NOTE [ Arenas after fork ],
#: Rule 5): a lock stamped with an older generation is checked at its next use.
_generation = 0
_checking = threading.Lock()    # renewed in each child: held only while checking
_checked_slots = []             # (class, lock slot, stamp slot, refusal)


def register_arena(arena) -> None:
    """Follow ``arena`` across fork() (NOTE [ Arenas after fork ])."""
    _arenas.add(arena)


class HeldAtFork:
    """Stands, in a forked child, for a lock another thread held at the fork
    (Rules 1 and 5 of NOTE [ Arenas after fork ]): every acquire raises
    :meth:`error`. ``message``: what was in use and what to do."""

    __slots__ = ("_message",)

    def __init__(self, message: str):
        self._message = message

    def error(self) -> BackendError:
        """The BackendError every use of the guarded object raises."""
        return BackendError(self._message)

    def acquire(self, blocking=True, timeout=-1):
        raise self.error()

    __enter__ = acquire

    def __exit__(self, *exc):
        return False

    def release(self):
        pass

    def locked(self) -> bool:
        return True


def _arena_busy(arena: str) -> str:
    """The refusal of an arena (``arena`` names it) in use at the fork (Rules 1
    and 4 of NOTE [ Arenas after fork ])."""
    return (f"{arena} was in use when this process was forked (by another thread, an "
            f"alloc, free or transfer under way, or by the thread that forked, if it "
            f"forked from inside one), so its state in this child is "
            f"unknown and it cannot be used here (its buffers' data can still be "
            f"read). Make the arenas a forked child allocates from in the child, or "
            f"fork while no other thread uses this arena (e.g. start DataLoader "
            f"workers with persistent_workers=True before a prefetch thread), or use "
            f"the spawn or forkserver start method")


def buffer_busy(buffer: str) -> str:
    """The refusal of a buffer (``buffer`` names it) that another thread was
    using at the fork (Rule 5 of NOTE [ Arenas after fork ])."""
    return (f"{buffer} was in use by another thread (a move, view or free under "
            f"way) when this process was forked, so its state in this child is "
            f"unknown and it cannot be used here (the parent's copy is intact). "
            f"Allocate the buffers a forked child uses in the child, or fork while "
            f"no other thread uses them (e.g. start DataLoader workers with "
            f"persistent_workers=True before a prefetch thread), or use the spawn or "
            f"forkserver start method")


def check_lock_slot_after_fork(cls, lock: str, stamp: str, refusal) -> None:
    """Have a forked child check ``cls``'s ``lock`` slot (a Lock or RLock) at
    each instance's first use there (Rule 5 of NOTE [ Arenas after fork ]).
    ``stamp``: a spare slot of ``cls`` for the fork generation the lock was
    checked in; ``refusal(obj)``: the message of the BackendError that uses of
    an instance whose lock was held raise (made without taking the lock)."""
    _checked_slots.append((cls, lock, stamp, refusal))


class _CheckedAfterFork:
    """The descriptor of a lock slot in a forked child (Rule 5 of NOTE
    [ Arenas after fork ]): reads the lock through the slot's own descriptor,
    after checking it once per fork generation."""

    __slots__ = ("_lock", "_stamp", "_refusal")

    def __init__(self, lock, stamp, refusal):
        # the slots' own member descriptors, which read and write the storage
        self._lock, self._stamp, self._refusal = lock, stamp, refusal

    def _checked(self, obj) -> bool:
        try:
            return self._stamp.__get__(obj) == _generation
        except AttributeError:      # never stamped: made before the first fork
            return False

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if self._checked(obj):
            return self._lock.__get__(obj)
        with _checking:
            lock = self._lock.__get__(obj)
            if not self._checked(obj):      # not by another thread meanwhile
                # A HeldAtFork from an earlier fork stays; a lock the thread
                # that forked holds (an RLock) passes: it owns it here too.
                if isinstance(lock, _LOCK_TYPES) and _held(lock):
                    lock = HeldAtFork(self._refusal(obj))
                    self._lock.__set__(obj, lock)
                self._stamp.__set__(obj, _generation)
            return lock

    def __set__(self, obj, value):
        self._lock.__set__(obj, value)
        self._stamp.__set__(obj, _generation)


def _held(lock) -> bool:
    """Whether ``lock`` (a Lock or RLock) was held at the fork by another thread
    (a Lock: or by the thread that forked, Rule 4)."""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def _own(obj) -> dict:
    """``obj``'s own attributes (none for a user's adaptor with __slots__)."""
    return getattr(obj, "__dict__", None) or {}


def _owners_of_locks(arena):
    """The arena and every allocator of its stack (core and adaptors)."""
    yield arena
    core = _own(arena).get("core")
    allocator = arena.allocator
    while allocator is not None:
        yield allocator
        if allocator is core:
            return
        # its own attributes only: an adaptor forwards unknown ones to its upstream
        allocator = _own(allocator).get("upstream")
    # A user's adaptor that keeps its upstream under another name ends the walk
    # above: the core, whose lock every alloc and free takes, is checked anyway.
    if core is not None:
        yield core


def _after_fork_in_child() -> None:
    global _generation, _checking
    _generation += 1
    _checking = threading.Lock()
    for cls, lock, stamp, refusal in _checked_slots:
        if not isinstance(cls.__dict__[lock], _CheckedAfterFork):    # a first fork
            setattr(cls, lock, _CheckedAfterFork(cls.__dict__[lock], cls.__dict__[stamp],
                                                 refusal))
    for arena in list(_arenas):
        owners = [(o, name) for o in _owners_of_locks(arena)
                  for name in ("_lock", "_acct_lock")
                  if isinstance(_own(o).get(name), _LOCK_TYPES)]
        if any(_held(getattr(o, name)) for o, name in owners):
            # not repr(arena): it reads the allocator's stats, under the held lock
            poisoned = HeldAtFork(_arena_busy(f"this {type(arena).__name__} "
                                              f"(0x{id(arena):x})"))
            for o, name in owners:
                setattr(o, name, poisoned)


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
