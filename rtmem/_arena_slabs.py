"""The slab side of an arena: the slab and event source its allocator core calls.

:class:`SlabSource` is a mixin of :class:`rtmem.arena._Arena` (the
``slab_source=`` and ``event_source=`` of its
:class:`~rtmem.allocator.BestFitAllocator`): it takes slabs from the backend,
aligned to the arena's alignment, gives fully free ones back, and poisons and
checks blocks for the debug :class:`~rtmem.adaptors.PoisonAdaptor`. It reads
the arena's ``backend``, ``debug``, ``core``, ``_slab_alignment``, ``_closed``
and the slab list ``_slabs``, guarded by ``_lock`` (NOTE [ Arena accounting ]
in rtmem/arena.py); the subclasses define ``_new_slab``.
"""

from __future__ import annotations

import numpy as np

from .adaptors import PoisonAdaptor

__all__ = ["SlabSource"]


def _misaligned(slab, align: int) -> bool:
    return any(p is not None and p % align for p in (slab.ptr, slab.device_ptr))


def _sub_slab(slab, shift: int, nbytes: int):
    """The ``nbytes`` bytes of ``slab`` from ``shift`` on, as a slab of their own
    (the same owner keeps the memory alive, and releasing either frees it)."""
    from .backends import Slab
    return Slab(slab.backend, nbytes, slab.ptr + shift, location=slab.location,
                device_ptr=None if slab.device_ptr is None else slab.device_ptr + shift,
                host_array=None if slab.host_array is None else
                slab.host_array[shift:shift + nbytes],
                pinned=slab.pinned, mapped=slab.mapped, owner=slab.owner)


class SlabSource:
    """Slab-source and event-source hooks of an arena (see the module docstring)."""

    def _new_slab(self, nbytes):
        raise NotImplementedError

    def add_slab(self, nbytes: int):
        """Slab-source hook of the allocator core: a new backend slab."""
        slab = self._new_slab(nbytes)
        align = self._slab_alignment
        if _misaligned(slab, align):
            # Offsets are multiples of the alignment relative to the slab, and the
            # backend aligns slabs less than an alignment may ask (host slabs to a
            # page, cudaMalloc to 256 B): buffers came out misaligned. Take one
            # alignment more and use the aligned part (those bytes are not in
            # reserved_bytes).
            self.backend.release(slab)
            wide = self._new_slab(nbytes + align)
            slab = _sub_slab(wide, (-wide.ptr) % align, nbytes)
            if _misaligned(slab, align):    # a mapped alias aligned unlike its host side
                self.backend.release(wide)
                raise ValueError(f"alignment={align} B: the {self.backend.name} backend's "
                                 f"device alias 0x{wide.device_ptr:x} of host memory "
                                 f"0x{wide.ptr:x} is aligned differently; use an "
                                 f"alignment <= 256 B")
        if self.debug:
            self.backend.fill(slab, 0, nbytes, PoisonAdaptor.POISON)
        with self._lock:
            self._slabs.append(slab)
        return slab

    def release_slab(self, slab) -> None:
        """Slab-source hook: give a fully free slab back to the backend."""
        with self._lock:
            if self._closed:    # close() gave every slab back already
                return
            self._slabs.remove(slab)
        self.backend.release(slab)

    def _record_event(self, stream):
        """Event-source hook of the allocator core: an event recorded on ``stream``
        (a marker: it must not take a failure that the stream's user is to see)."""
        return self.backend.marker(stream)

    def _slab_of(self, block):
        return self.core.slab_handle(block.slab)

    def _fill_block(self, block, value):
        # After close() the slabs are released: a free (legal then) has nothing
        # to poison, and filling wrote into a released slab (a TypeError on the
        # host backend, a memset of freed device memory on cuda). Called under
        # _acct_lock (frees, allocations), which close() marks closed under.
        if self._closed:
            return
        self.backend.fill(self._slab_of(block), block.offset, block.size, value)

    def _check_block(self, block, value) -> int:
        data = self.backend.read(self._slab_of(block), block.offset, block.size)
        bad = np.flatnonzero(data != value)
        return int(bad[0]) if bad.size else -1

    @property
    def slabs(self) -> tuple:
        """The backend slabs this arena owns."""
        with self._lock:
            return tuple(self._slabs)
