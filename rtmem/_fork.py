"""Arenas in a child made by fork().

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

Only registration (a WeakSet add per arena) costs anything before a fork.
"""

from __future__ import annotations

import os
import threading
import weakref

from .errors import BackendError

__all__ = ["HeldAtFork", "register_arena"]

_arenas = weakref.WeakSet()


def register_arena(arena) -> None:
    """Follow ``arena`` across fork() (NOTE [ Arenas after fork ])."""
    _arenas.add(arena)


class HeldAtFork:
    """Stands, in a forked child, for an arena lock held at the fork (Rules 1
    and 4 of NOTE [ Arenas after fork ]): every acquire raises."""

    __slots__ = ("_arena",)

    def __init__(self, arena: str):
        self._arena = arena

    def acquire(self, blocking=True, timeout=-1):
        raise BackendError(
            f"{self._arena} was in use when this process was forked (by another "
            f"thread, an alloc, free or transfer under way, or by the thread that "
            f"forked, if it forked from inside one), so its state in this child is "
            f"unknown and it cannot be used here (its buffers' data can still be "
            f"read). Make the arenas a forked child allocates from in the child, or "
            f"fork while no other thread uses this arena (e.g. start DataLoader "
            f"workers with persistent_workers=True before a prefetch thread), or use "
            f"the spawn or forkserver start method")

    __enter__ = acquire

    def __exit__(self, *exc):
        return False

    def release(self):
        pass

    def locked(self) -> bool:
        return True


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
    for arena in list(_arenas):
        owners = [(o, name) for o in _owners_of_locks(arena)
                  for name in ("_lock", "_acct_lock")
                  if isinstance(_own(o).get(name), _LOCK_TYPES)]
        if any(_held(getattr(o, name)) for o, name in owners):
            # not repr(arena): it reads the allocator's stats, under the held lock
            poisoned = HeldAtFork(f"this {type(arena).__name__} (0x{id(arena):x})")
            for o, name in owners:
                setattr(o, name, poisoned)


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
