"""Buffers: typed views over arena blocks, with a device and a host placement.

A :class:`Buffer` is one logical tensor (an activation, a weight, ...). It has up
to two *placements*: one in a device arena and one in a host arena; the
transfers of :mod:`rtmem.transfers` move it between them and drive its
residency.

NOTE [ Residency state machine ]
``residency`` is derived, never stored:

- ``"freed"``: the buffer was freed; every use raises UseAfterFreeError. That
  includes a buffer whose free waits for pinned views (NOTE [ Pinned views ]):
  its bytes stay reserved, but it is unusable (``is_freed`` turns True once
  they are released); and one with no copy left in an open arena (closed
  arenas, below), which ``free()`` still cleans up (``is_freed`` then True).
- ``"in-flight"``: a prefetch (H2D) or offload (D2H) has been enqueued and its
  event has not completed.
- otherwise from the placements: ``"device"`` (device only), ``"host"`` (host
  only) or ``"both"``.

Legal moves (anything else raises ResidencyError naming the state and the fix):

1. ``offload``: device -> in-flight -> both. Refused when a host copy exists or a
   transfer is in flight.
2. ``prefetch``: host -> in-flight -> both. Refused when a device copy exists or
   an H2D copy is in flight; allowed while the D2H copy that made the host copy is
   still running (the H2D copy waits for it on its stream).
3. ``evict`` (drop the device copy): both -> host, or during an offload (the
   device block is freed when the copy completes: stream-ordered free). Refused
   when it is the only copy (``free()`` discards a buffer's data on purpose).
4. ``drop_host``: both -> device. Refused during a transfer or for the only
   copy.

``evict`` and ``drop_host`` are also refused while pinned views (NOTE [ Pinned
views ]) read the copy they would drop.

Closed arenas: ``close()`` releases an arena's memory, so a placement there
holds nothing. A buffer that also has a placement in an open arena keeps it:
the closed one is dropped at the buffer's next use (``residency`` included),
so an offloaded buffer whose device arena was closed is ``"host"`` and can be
read and prefetched into another arena. A copy in a closed arena counts as
no copy in ``residency``, also one kept for its pinned views: a buffer with
no other copy is ``"freed"``. A buffer whose only copy was in a
closed arena (or whose copy there is pinned by views) raises
UseAfterFreeError at every use but ``free()``; the message says which: with
pinned views of the closed copy and an intact copy elsewhere, that dropping
the views makes the buffer usable again (the views keep the memory they read,
on both backends, but it is no longer the buffer's: the copy is not detached
under them, so nothing written through them is lost silently).

A copy that fails (NOTE [ Host stream failures ] in backends/host.py) is raised
once, as BackendError, by ``rtmem.transfers.synchronize()`` (NOTE [ Copy failures
at synchronize ] in transfers.py) or by the next call that looks at the buffer
(a move, ``wait``/``synchronize(buf)``, a view), whichever comes first;
``residency`` and ``repr`` keep it for that call. The placement the copy wrote
is released when another copy holds valid bytes, else kept and reported as not
valid. A move chained on one that
failed (a prefetch issued during the offload that made its source) fails with
it, and both placements count as written by a failed copy.

Fields are guarded by the buffer's ``_lock``; arenas guard their own accounting.
"""

from __future__ import annotations

import _thread

import numpy as np

from . import _fork
from ._buffer_views import BufferViews
from ._deferred import run_or_defer
from ._placement import Placement, _in_closed, _in_open, _Move, _poll_transfers
from .errors import BackendError, DoubleFreeError, UseAfterFreeError

__all__ = ["Buffer", "KINDS", "RESIDENCIES"]
# Placement and _Move (rtmem._placement) stay importable from here: the arena,
# the transfers and tests take them from this module.

#: What a buffer holds; arenas account bytes per kind.
KINDS = ("activation", "weight", "gradient", "optimizer-state", "workspace")


def bad_kind(kind) -> ValueError:
    """The error for a ``kind`` not in :data:`KINDS` (callers test membership
    themselves: the arena does it on every allocation)."""
    return ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")


#: Values of :attr:`Buffer.residency` (NOTE [ Residency state machine ]).
RESIDENCIES = ("device", "host", "both", "in-flight", "freed")



class Buffer(BufferViews):
    """A typed, shaped view of ``nbytes`` bytes living in one or two arenas.

    Attributes: ``nbytes`` (bytes requested), ``dtype``, ``shape``, ``kind`` (one
    of :data:`KINDS`), ``residency`` (one of :data:`RESIDENCIES`), ``arena`` and
    ``offset`` (of the primary placement: the device one when present, else the
    host one). Create buffers with ``arena.alloc(...)``, never directly.

    Freeing is explicit (``buf.free()`` / ``arena.free(buf)``): dropping the last
    reference does not free, because zero-copy views (numpy, DLPack tensors) do
    not keep the Buffer object alive and must stay valid until the free.
    """

    __slots__ = ("_nbytes", "_dtype", "_shape", "_kind", "_device", "_host", "_pending",
                 "_failed", "_freed", "_lock", "device_arena", "host_arena",
                 "_free_requested", "_fork_stamp", "__weakref__")

    def __init__(self, placement: Placement, nbytes: int, dtype: np.dtype, shape: tuple,
                 kind: str):
        # The arena validated and normalized every argument (an int, a numpy
        # dtype, a tuple of ints): this runs on every allocation.
        self._nbytes = nbytes
        self._dtype = dtype
        self._shape = shape
        self._kind = kind
        self._pending = None        # the _Move in flight (or completed, not yet settled)
        self._failed = None         # a failed move's BackendError not yet raised
        self._freed = False
        # _thread's RLock: threading.RLock is a Python function returning it,
        # a frame per allocation
        self._lock = _thread.RLock()
        # device_arena / host_arena: where prefetch / offload put it by default.
        arena = placement.arena
        if arena.location == "device":
            self._device, self._host = placement, None
            self.device_arena, self.host_arena = arena, None
        else:
            self._device, self._host = None, placement
            self.device_arena, self.host_arena = None, arena
        # NOTE [ Pinned views ]: zero-copy views made by rtmem.torch.as_tensor,
        # numpy(pin=True) and cupy(pin=True) pin the placement they read (their
        # PinnedExport does, kept by every array derived from the view); a free
        # requested while pinned happens when the last view dies, so the arena
        # never hands the bytes out while a view still reads them.
        # Meanwhile the buffer counts as freed: new views and moves are refused.
        self._free_requested = False

    # Read-only: the arena accounts bytes per kind, and views trust shape and dtype
    # to stay inside the block (numpy users write ``a.shape = ...`` to reshape).
    @property
    def nbytes(self) -> int:
        """Bytes requested (the block may be larger: alignment)."""
        return self._nbytes

    @property
    def dtype(self) -> np.dtype:
        """Element type of the views."""
        return self._dtype

    @property
    def shape(self) -> tuple:
        """Shape of the views (a tuple of ints)."""
        return self._shape

    @property
    def kind(self) -> str:
        """What the buffer holds, one of :data:`KINDS`."""
        return self._kind

    # -------------------------------------------------------------- state
    def _check_alive(self) -> None:
        if self._freed or self._free_requested:
            # A free waiting for views (NOTE [ Pinned views ]) counts as done: a view
            # or a move made now would outlive the bytes, which the arena hands out
            # again as soon as the last existing view dies.
            waits = " (its release waits for views of it still alive)" \
                if self._free_requested else ""
            raise UseAfterFreeError(
                f"this {self.kind} buffer ({self.nbytes:,} bytes) was freed{waits}; "
                f"allocate a new buffer instead of keeping references to freed ones")
        if self._forget_closed():
            raise UseAfterFreeError(self._closed_message())

    def _closed_message(self) -> str:
        """Why a buffer with a placement in a closed arena is unusable, and what
        to do: "close an arena only after its buffers are done with" was all it
        said, also when the buffer's other copy was intact and only views of the
        closed copy (pinned, NOTE [ Pinned views ]) kept it out of reach."""
        p = next(p for p in (self._device, self._host) if _in_closed(p))
        side = p.arena.location
        other = self._host if side == "device" else self._device
        text = (f"the {side} arena of this {self.kind} buffer ({self.nbytes:,} bytes) "
                f"was closed, which released its memory")
        if p.pins and _in_open(other):
            return (f"{text}, and {p.pins} pinned view(s) of its {side} copy there "
                    f"(numpy(pin=True), cupy(pin=True), rtmem.torch.as_tensor) are still "
                    f"alive: they keep that memory, which is no longer the buffer's (what "
                    f"is written through them is lost). Its {other.arena.location} copy is intact: "
                    f"drop those views (del them) and the buffer is usable again from it")
        if p.pins:
            return (f"{text}; its data is left only in {p.pins} pinned view(s) of it "
                    f"(numpy(pin=True), cupy(pin=True), rtmem.torch.as_tensor), which keep "
                    f"that memory until they go: copy out what you need from them, drop "
                    f"them and free() the buffer. Offload or copy out (to_numpy()) what you need "
                    f"before closing an arena")
        return (f"{text}; its data was only there and is gone: free() the buffer. "
                f"Offload or copy out (to_numpy()) what you need before closing an arena")

    def _forget_closed(self) -> bool:
        """Detach the placements in closed arenas when the buffer has one in an
        open arena (NOTE [ Residency state machine ], closed arenas); True if a
        placement in a closed arena is left (the only copy, or a pinned one).

        An offloaded buffer whose device arena was closed kept its device
        placement, and every use of the buffer refused it: the host copy, intact
        in an open arena, could be neither read nor prefetched again, nor even
        evicted to."""
        with self._lock:
            closed = [side for side, p in (("device", self._device), ("host", self._host))
                      if _in_closed(p)]
            if not closed:
                return False
            # close() waited for every copy first, so a move still in flight
            # involves neither arena; one that completed is settled before its
            # placements change (a failed one is undone and kept for reporting)
            if len(closed) == 1 and not self._settle(report=False):
                side = closed[0]
                other = self._host if side == "device" else self._device
                p = self._device if side == "device" else self._host
                # pinned views of it hold memory the arena gave up: kept, and reported,
                # so the pins stay on attached placements (see _pins)
                if _in_open(other) and not p.pins:
                    self._drop(side)      # legal after close, as free() is
                    return False
            return _in_closed(self._device) or _in_closed(self._host)

    def _settle(self, report: bool = True) -> bool:
        """Clear a completed pending move; True if one is still in flight. A
        failed move is undone and its BackendError raised, once: now when
        ``report``, else by the next call that reports.

        Under the buffer's lock: ``wait``/``synchronize`` call it without holding
        it, and an unlocked read-then-clear could erase a move another thread
        had just started (its residency checks would then pass illegal moves)."""
        failed = None
        with self._lock:
            move = self._pending
            if move is not None:
                if not move.event.query():
                    return True
                self._pending = None
                error = getattr(move.event, "error", None)  # host streams report it here
                if error is not None:
                    self._failed = self._undo_failed_move(move, error)
            if report and self._failed is not None:
                failed, self._failed = self._failed, None
            placement = self._device or self._host
        if move is not None and placement is not None:
            # The engine keeps the copy's slabs alive until it polls; only
            # transfers.synchronize/wait polled, so arenas dropped after a copy
            # waited here (numpy(), to_numpy(), residency) kept their slabs
            # until some unrelated later copy (NOTE [ Keeping memory alive
            # during copies ] in rtmem.transfers).
            _poll_transfers(placement.arena.backend)
        if failed is not None:
            raise failed
        return False

    def _undo_failed_move(self, move: _Move, error) -> BackendError:
        """A move's copy failed (NOTE [ Host stream failures ]). The placements
        written by failed copies (this one's, and its prior move's when the
        failure came from there) hold garbage: they are released when another
        copy holds valid bytes, else the first is kept (pinned ones always are)
        and reported as not valid. Returns the error to raise."""
        garbage = [move.side]
        prior = move.prior
        if prior is not None and prior.side != move.side \
                and getattr(prior.event, "error", None) is not None:
            garbage.append(prior.side)
        places = {"device": self._device, "host": self._host}
        valid = [s for s, p in places.items() if p is not None and s not in garbage]
        kept = []
        for side in garbage:
            p = places[side]
            if p is None:
                continue
            if p.pins or not (valid or kept):
                kept.append(side)
            else:
                self._drop(side)
        what = "H2D" if move.side == "device" else "D2H"
        failed = BackendError(
            f"the {what} copy into the {move.side} side of this {self.kind} buffer "
            f"({self.nbytes:,} bytes) failed: {error!r}; "
            + (f"the bytes of its {' and '.join(kept)} copy are not valid; write them "
               "again (copy into it, or through a view)" if kept else
               f"that copy was dropped and the buffer keeps its {valid[0]} copy; retry "
               "the move"))
        # raised later, by whichever call settles the move: chained to the copy's
        # own exception here, as event.synchronize() chains it (it had no cause)
        failed.__cause__ = error
        return failed

    def _drop(self, side: str) -> None:
        """Release the ``side`` placement (stream-ordered) and detach it. Under
        the buffer's lock; the caller checked that it may go."""
        p = self._device if side == "device" else self._host
        p.arena._release(p, self._kind)
        if side == "device":
            self._device = None
        else:
            self._host = None

    @property
    def residency(self) -> str:
        """Where the data is: see NOTE [ Residency state machine ]."""
        with self._lock:
            if self._freed or self._free_requested:
                return "freed"
            # a failed move is undone and kept for the next call that reports
            if self._settle(report=False):
                return "in-flight"
            # A copy in a closed arena is no copy: also one kept attached for
            # its pinned views (_forget_closed), which reported "both".
            self._forget_closed()
            device, host = _in_open(self._device), _in_open(self._host)
            if device and host:
                return "both"
            if not (device or host):
                return "freed"      # the data is gone: every use but free() raises
            return "device" if device else "host"

    @property
    def primary(self) -> Placement:
        """The device placement when present, else the host one."""
        self._check_alive()
        return self._primary

    @property
    def _primary(self) -> Placement | None:
        # no liveness check: free() and repr() use it on closed arenas
        return self._device if self._device is not None else self._host

    @property
    def arena(self):
        """Arena of the primary placement."""
        return self.primary.arena

    @property
    def offset(self) -> int:
        """Offset of the primary placement in its slab, bytes."""
        return self.primary.block.offset

    @property
    def is_freed(self) -> bool:
        """True once the buffer has been freed."""
        return self._freed

    def placement(self, where: str) -> Placement | None:
        """The ``"device"`` or ``"host"`` placement, or None."""
        self._check_alive()
        if where not in ("device", "host"):
            raise ValueError(f"where must be 'device' or 'host', got {where!r}")
        return self._device if where == "device" else self._host

    def free(self) -> None:
        """Free every placement (stream-ordered); the buffer becomes unusable.

        Freeing twice raises :class:`~rtmem.errors.DoubleFreeError`. While
        zero-copy tensors view the buffer (NOTE [ Pinned views ]) the bytes stay
        reserved and are released when the last view is garbage collected; the
        buffer is unusable at once (new views raise UseAfterFreeError).
        """
        if self._freed or self._free_requested:
            raise DoubleFreeError(f"{self!r} was already freed; free each buffer once")
        self._home_arena.free(self)

    @property
    def _home_arena(self):
        """The arena :meth:`free` goes through: :attr:`arena` without the liveness
        check, since freeing stays legal after the arena was closed."""
        return self._primary.arena

    @property
    def _pins(self) -> int:
        """Pinned views of the buffer. Summed rather than counted apart, so the
        two cannot disagree: a placement is never detached while pinned (moves,
        undone copies and ``free`` all refuse or wait), so the attached ones hold
        every pin. Read under the buffer's lock."""
        d, h = self._device, self._host
        return (d.pins if d else 0) + (h.pins if h else 0)

    def _pin(self, placement: Placement) -> None:
        with self._lock:
            self._check_alive()
            placement.pins += 1

    def _unpin(self, placement: Placement) -> None:
        with self._lock:
            placement.pins -= 1
            release = self._pins == 0 and self._free_requested and not self._freed
        if release:
            # The last view's finalizer may run inside a garbage collection:
            # NOTE [ Frees from finalizers ] in rtmem/_deferred.py.
            run_or_defer(self._free_after_views)

    def _free_after_views(self) -> None:
        """The free that ``free()`` postponed until the last view died."""
        with self._lock:    # held through the free: no window where it looks live
            if self._freed or not self._free_requested or self._pins:
                return
            self._free_requested = False
            self._home_arena.free(self)

    def __reduce__(self):
        # A copy would be a second handle on the same blocks: freeing both would
        # free whatever the arena had handed out in between. Pickling cannot carry
        # arena memory either.
        raise TypeError(
            "a Buffer cannot be copied or pickled (it is a handle on arena memory); "
            "pass the Buffer itself, or copy its data with buf.to_numpy()")

    def __repr__(self) -> str:
        if isinstance(self._lock, _fork.HeldAtFork):    # no state to read
            return (f"<Buffer {self.kind} {self.shape} {self.dtype} {self.nbytes:,} B, "
                    f"unusable in this forked child>")
        state = self.residency
        # No liveness check: repr must work in error messages about freed buffers
        # and buffers of closed arenas.
        p = self._primary
        where = "" if self._freed or p is None else f" offset={p.block.offset}"
        return (f"<Buffer {self.kind} {self.shape} {self.dtype} {self.nbytes:,} B "
                f"{state}{where}>")


# ``_fork_stamp``: unset until a forked child checks the lock (NOTE [ Arenas
# after fork ] in _fork.py, Rule 5); nothing happens here before a fork.
_fork.check_lock_slot_after_fork(
    Buffer, "_lock", "_fork_stamp",
    lambda buf: _fork.buffer_busy(f"this {buf.kind} buffer ({buf.nbytes:,} bytes)"))
