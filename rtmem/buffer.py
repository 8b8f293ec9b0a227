"""Buffers: typed views over arena blocks, with a device and a host placement.

A :class:`Buffer` is one logical tensor (an activation, a weight, ...). It has up
to two *placements*: one in a device arena and one in a host arena; the
transfers of :mod:`rtmem.transfers` move it between them and drive its
residency.

NOTE [ Residency state machine ]
``residency`` is derived, never stored:

- ``"freed"``: the buffer was freed; every use raises UseAfterFreeError.
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

Fields are guarded by the buffer's ``_lock``; arenas guard their own accounting.
"""

from __future__ import annotations

import threading

import numpy as np

from ._deferred import run_or_defer, track
from .errors import BackendError, DoubleFreeError, ResidencyError, UseAfterFreeError

__all__ = ["Buffer", "KINDS", "RESIDENCIES"]

#: What a buffer holds; arenas account bytes per kind.
KINDS = ("activation", "weight", "gradient", "optimizer-state", "workspace")
#: Values of :attr:`Buffer.residency` (NOTE [ Residency state machine ]).
RESIDENCIES = ("device", "host", "both", "in-flight", "freed")

_KDL_CPU, _KDL_CUDA = 1, 2


class Placement:
    """A block of one arena holding a buffer's bytes.

    ``event``/``stream``: the last transfer that read or wrote the block, so that
    freeing it is stream-ordered (the block is not reused before that copy ends).
    """

    __slots__ = ("arena", "block", "event", "stream")

    def __init__(self, arena, block):
        self.arena = arena
        self.block = block
        self.event = None
        self.stream = None

    @property
    def slab(self):
        """The backend slab holding the block."""
        return self.arena._slab_of(self.block)

    @property
    def offset(self) -> int:
        """Offset of the block in its slab, bytes."""
        return self.block.offset



class PinnedExport:
    """Exports a buffer's memory through an array interface (``name`` is
    ``"__array_interface__"`` or ``"__cuda_array_interface__"``) and holds a pin
    on the buffer until the consumer drops its last reference to this object,
    which numpy and torch keep as the base of every view they make of it
    (NOTE [ Pinned views ]). ``keep`` holds whatever owns the exported memory's
    Python view (e.g. the numpy array the interface came from)."""

    def __init__(self, buf: "Buffer", name: str, interface: dict, keep=None):
        track()     # __del__ may run in a garbage collection (see _unpin)
        buf._pin()
        self._buf = buf
        self._keep = keep
        setattr(self, name, interface)

    def __del__(self):
        buf = getattr(self, "_buf", None)
        if buf is not None:
            self._buf = None
            buf._unpin()

class Buffer:
    """A typed, shaped view of ``nbytes`` bytes living in one or two arenas.

    Attributes: ``nbytes`` (bytes requested), ``dtype``, ``shape``, ``kind`` (one
    of :data:`KINDS`), ``residency`` (one of :data:`RESIDENCIES`), ``arena`` and
    ``offset`` (of the primary placement: the device one when present, else the
    host one). Create buffers with ``arena.alloc(...)``, never directly.

    Freeing is explicit (``buf.free()`` / ``arena.free(buf)``): dropping the last
    reference does not free, because zero-copy views (numpy, DLPack tensors) do
    not keep the Buffer object alive and must stay valid until the free.
    """

    __slots__ = ("nbytes", "dtype", "shape", "kind", "_device", "_host", "_pending",
                 "_freed", "_lock", "device_arena", "host_arena", "_pins", "_free_requested",
                 "_exports", "__weakref__")

    def __init__(self, placement: Placement, nbytes: int, dtype: np.dtype, shape: tuple,
                 kind: str):
        # The arena validated and normalized every argument (an int, a numpy
        # dtype, a tuple of ints): this runs on every allocation.
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self._pending = None        # (event, "h2d"|"d2h", stream) of the last move
        self._freed = False
        self._lock = threading.RLock()
        # device_arena / host_arena: where prefetch / offload put it by default.
        arena = placement.arena
        if arena.location == "device":
            self._device, self._host = placement, None
            self.device_arena, self.host_arena = arena, None
        else:
            self._device, self._host = None, placement
            self.device_arena, self.host_arena = None, arena
        # NOTE [ Pinned views ]: zero-copy tensors made by rtmem.torch.as_tensor pin
        # the buffer; a free requested while pinned happens when the last view dies,
        # so the arena never hands the bytes out while a tensor still reads them.
        self._pins = 0
        self._free_requested = False
        self._exports = None        # slab arrays behind __array_interface__ exports

    # -------------------------------------------------------------- state
    def _check_alive(self) -> None:
        if self._freed:
            raise UseAfterFreeError(
                f"this {self.kind} buffer ({self.nbytes:,} bytes) was freed; allocate "
                f"a new buffer instead of keeping references to freed ones")
        for p in (self._device, self._host):
            if p is not None and p.arena._closed:
                raise UseAfterFreeError(
                    f"the {p.arena.location} arena of this {self.kind} buffer "
                    f"({self.nbytes:,} bytes) was closed, which released its memory; "
                    f"close an arena only after its buffers are done with")

    def _settle(self, report: bool = True) -> bool:
        """Clear a completed pending move; True if one is still in flight. A
        failed move is undone, and raised as BackendError when ``report``.

        Under the buffer's lock: ``wait``/``synchronize`` call it without holding
        it, and an unlocked read-then-clear could erase a move another thread
        had just started (its residency checks would then pass illegal moves)."""
        with self._lock:
            pending = self._pending
            if pending is None:
                return False
            if not pending[0].query():
                return True
            self._pending = None
            error = getattr(pending[0], "error", None)   # host streams report it here
            if error is not None:
                self._undo_failed_move(pending, error, report)
            return False

    def _undo_failed_move(self, pending, error, report: bool) -> None:
        """A move's copy failed (NOTE [ Host stream failures ]): the placement it
        made holds garbage, so it is released and the buffer keeps the copy it
        had; the error is raised once, here, when ``report``."""
        _, direction, _, made = pending
        side = "device" if direction == "h2d" else "host"
        if made:
            p = self._device if direction == "h2d" else self._host
            p.arena._release(p, self.kind)
            if direction == "h2d":
                self._device = None
            else:
                self._host = None
        if not report:
            return
        raise BackendError(
            f"the {direction.upper()} copy into the {side} side of this {self.kind} buffer "
            f"({self.nbytes:,} bytes) failed: {error!r}; "
            + ("that copy was dropped and the buffer keeps its other copy; retry the move"
               if made else "the buffer's bytes are not valid; copy into it again"))

    @property
    def residency(self) -> str:
        """Where the data is: see NOTE [ Residency state machine ]."""
        with self._lock:
            if self._freed:
                return "freed"
            # a failed move is undone, not raised: the state below is consistent
            if self._settle(report=False):
                return "in-flight"
            if self._device is not None and self._host is not None:
                return "both"
            return "device" if self._device is not None else "host"

    @property
    def primary(self) -> Placement:
        """The device placement when present, else the host one."""
        self._check_alive()
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
        reserved and are released when the last view is garbage collected.
        """
        if self._freed or self._free_requested:
            raise DoubleFreeError(f"{self!r} was already freed; free each buffer once")
        self._home_arena.free(self)

    @property
    def _home_arena(self):
        """The arena :meth:`free` goes through: :attr:`arena` without the liveness
        check, since freeing stays legal after the arena was closed."""
        return (self._device if self._device is not None else self._host).arena

    def _pin(self) -> None:
        with self._lock:
            self._check_alive()
            if self._free_requested:
                raise UseAfterFreeError(f"{self!r} was freed (its release waits for "
                                        "existing views); do not make new views of it")
            self._pins += 1

    def _unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            release = self._pins == 0 and self._free_requested and not self._freed
        if release:
            # The last view's finalizer may run inside a garbage collection:
            # NOTE [ Frees from finalizers ] in rtmem/_deferred.py.
            run_or_defer(self._free_after_views)

    def _free_after_views(self) -> None:
        """The free that ``free()`` postponed until the last view died."""
        with self._lock:
            if self._freed or not self._free_requested or self._pins:
                return
            self._free_requested = False
            arena = self._home_arena
        arena.free(self)

    # ------------------------------------------------------------ views
    def _view_placement(self, where):
        self._check_alive()
        if where is None:
            return self.primary
        p = self.placement(where)
        if p is None:
            raise ResidencyError(f"this buffer has no {where} copy (residency "
                                 f"{self.residency!r}); prefetch or offload it first",
                                 state=self.residency, action=f"view {where}")
        return p

    def _wait_if_in_flight(self, p: Placement, host: bool) -> None:
        """Order a view of placement ``p`` after the copies touching it: host
        views block until they are done; device views only order the compute
        stream after them. ``p.event`` is the last copy that read or wrote ``p``
        (it implies the earlier ones): the buffer's own move, which involves
        both placements, or a ``transfers.copy`` reading ``p`` as its source,
        which a write through the view must not overtake."""
        event = p.event
        if event is not None and not event.query():
            if host:
                event.synchronize()
            else:
                p.arena.backend.current_stream().wait_event(event)

    def numpy(self, where: str | None = None, *, pin: bool = False) -> np.ndarray:
        """A zero-copy numpy view (``dtype``, ``shape``) of the placement ``where``
        (default: primary). Host placements always qualify; device placements only
        on the host backend. Waits for an in-flight transfer first.

        ``pin=True``: the view pins the buffer (NOTE [ Pinned views ]) for as long
        as it or any array derived from it lives, so a ``free()`` meanwhile only
        takes effect once the last of them is gone. For views kept beyond the
        caller's control of the buffer (optimizer state, parameters).
        """
        if pin:
            arr = self.numpy(where)
            return np.asarray(PinnedExport(self, "__array_interface__",
                                           arr.__array_interface__, keep=arr))
        p = self._view_placement(where)
        slab = p.slab
        if slab.host_array is None:
            raise ResidencyError(
                "device memory of the cuda backend is not host-addressable; use "
                "buf.cupy(), buf.to_numpy() (a copy), or offload the buffer first",
                state=self.residency, action="numpy view")
        self._wait_if_in_flight(p, host=True)
        count = int(np.prod(self.shape, dtype=np.int64))
        raw = slab.host_array[p.offset:p.offset + count * self.dtype.itemsize]
        return raw.view(self.dtype).reshape(self.shape)

    def to_numpy(self) -> np.ndarray:
        """A host copy of the data (synchronous), whatever the residency."""
        p = self._view_placement(None)
        self._wait_if_in_flight(p, host=True)
        count = int(np.prod(self.shape, dtype=np.int64))
        raw = p.arena.backend.read(p.slab, p.offset, count * self.dtype.itemsize)
        return raw.view(self.dtype).reshape(self.shape)

    def cupy(self, where: str | None = None):
        """A zero-copy CuPy array over the device placement (or a mapped host one)."""
        from .backends.cuda import import_cupy
        cp = import_cupy()
        return cp.asarray(_CudaView(self._cuda_interface(where), self))

    def _cuda_interface(self, where=None) -> dict:
        p = self._device if where is None and self._device is not None else \
            self._view_placement(where or "host")
        slab = p.slab
        if slab.device_ptr is None or p.arena.backend.name != "cuda":
            raise AttributeError(
                "__cuda_array_interface__ needs a device placement or a mapped host "
                "placement on the cuda backend (this buffer is "
                f"{self.residency!r} on the {p.arena.backend.name} backend); "
                "use HostArena(..., mapped=True) or prefetch it")
        self._wait_if_in_flight(p, host=False)
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                "data": (slab.device_ptr + p.offset, False), "strides": None,
                "version": 3, "stream": None}

    @property
    def __array_interface__(self) -> dict:
        """NumPy's array interface over the host-addressable primary placement
        (AttributeError for cuda device memory, so consumers fall back to the
        CUDA array interface or DLPack)."""
        self._check_alive()
        slab_array = self.primary.slab.host_array
        if slab_array is None:
            raise AttributeError("cuda device memory has no __array_interface__; use "
                                 "__cuda_array_interface__, DLPack or to_numpy()")
        interface = self.numpy().__array_interface__
        # numpy makes this Buffer the base of the array it builds from the dict, not
        # a view of the slab, so the Buffer keeps the slab array alive: on the host
        # backend the memory then outlives arena.close() as numpy() views do.
        with self._lock:
            if self._exports is None:
                self._exports = {}
            self._exports[id(slab_array)] = slab_array
        return interface

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA array interface v3 over the device placement, else the device
        alias of a mapped host placement (cuda backend only).

        ``"stream"`` is None: a copy still in flight into the buffer is ordered
        before later work on the *current* (compute) stream only, by a wait put
        there when the interface is read. A consumer that runs on another stream
        must first make that stream wait for the buffer (``rtmem.wait(buf)`` on
        it, or ``rtmem.synchronize(buf)``)."""
        return self._cuda_interface()

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device) for cuda device memory, else (kDLCPU, 0)."""
        p = self.primary
        if p.arena.location == "device" and p.arena.backend.name == "cuda":
            return (_KDL_CUDA, p.arena.backend.device_id)
        return (_KDL_CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack capsule: numpy's for host-addressable memory, CuPy's for device
        memory of the cuda backend (zero-copy either way)."""
        kwargs = {k: v for k, v in (("max_version", max_version), ("dl_device", dl_device),
                                    ("copy", copy)) if v is not None}
        p = self.primary
        if p.slab.host_array is not None:
            return self.numpy().__dlpack__(**kwargs)
        arr = self.cupy()
        return arr.__dlpack__(stream=stream, **kwargs)

    def __reduce__(self):
        # A copy would be a second handle on the same blocks: freeing both would
        # free whatever the arena had handed out in between. Pickling cannot carry
        # arena memory either.
        raise TypeError(
            "a Buffer cannot be copied or pickled (it is a handle on arena memory); "
            "pass the Buffer itself, or copy its data with buf.to_numpy()")

    def __repr__(self) -> str:
        state = self.residency
        # No liveness check: repr must work in error messages about freed buffers
        # and buffers of closed arenas.
        p = self._device if self._device is not None else self._host
        where = "" if self._freed or p is None else f" offset={p.block.offset}"
        return (f"<Buffer {self.kind} {self.shape} {self.dtype} {self.nbytes:,} B "
                f"{state}{where}>")


class _CudaView:
    """Carries one ``__cuda_array_interface__`` dict and keeps its buffer alive."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, cai, owner):
        self.__cuda_array_interface__ = cai
        self.owner = owner
