"""Buffer views and exports: zero-copy numpy and CuPy views, the array
interfaces, DLPack, and the pinned exports behind ``pin=True`` and
``rtmem.torch.as_tensor`` (NOTE [ Pinned views ] in rtmem/buffer.py).

:class:`BufferViews` is a mixin of :class:`~rtmem.buffer.Buffer`: it reads the
buffer's state (``_check_alive``, ``_settle``, ``placement``, ``_primary``,
``residency``, ``_lock``, ``_pin``) and never changes a placement.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ._deferred import track
from ._placement import Placement, _poll_transfers
from .errors import BackendError, ResidencyError

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["BufferViews", "PinnedExport"]

_KDL_CPU, _KDL_CUDA = 1, 2


class PinnedExport:
    """Exports a buffer's memory through an array interface (``name`` is
    ``"__array_interface__"`` or ``"__cuda_array_interface__"``) and holds a pin
    on the placement it exports until the consumer drops its last reference to
    this object, which numpy and torch keep as the base of every view they make
    of it (NOTE [ Pinned views ] in rtmem/buffer.py). ``keep`` holds whatever owns the exported
    memory's Python view (e.g. the numpy array the interface came from). Made by
    :meth:`Buffer._export`, under the buffer's lock."""

    def __init__(self, buf: "Buffer", placement: Placement, name: str, interface: dict,
                 keep=None):
        track()     # __del__ may run in a garbage collection (see _unpin)
        buf._pin(placement)
        self._buf = buf
        self._placement = placement
        self._keep = keep
        setattr(self, name, interface)

    def __del__(self):
        buf = getattr(self, "_buf", None)
        if buf is not None:
            self._buf = None
            buf._unpin(self._placement)


# What ``pin=`` means for numpy() and cupy(): one text, so the two cannot drift
_PIN_DOC = """``pin=True``: the view pins the placement (NOTE [ Pinned views ]) for as
        long as it or any array derived from it lives (slices, DLPack capsules
        of it): a ``free()`` meanwhile only takes effect once the last of them
        is gone, and ``evict``/``drop_host`` of that copy are refused. For views
        kept beyond the caller's control of the buffer (optimizer state,
        parameters). ``pin=False`` (the default, cheaper): the view is valid
        until ``free()``, or ``evict``/``drop_host`` of that copy; after that
        it reads and writes whatever the arena puts there next."""


def _pin_doc(method):
    """Put :data:`_PIN_DOC` in ``method``'s docstring, at ``{pin}``."""
    if method.__doc__:      # None under python -OO
        method.__doc__ = method.__doc__.replace("{pin}", _PIN_DOC)
    return method


class BufferViews:
    """The views and exports of a :class:`~rtmem.buffer.Buffer` (its base
    class; see the module docstring)."""

    __slots__ = ()

    def _view_placement(self, where):
        """The placement a view of ``where`` (None: primary) reads, after a
        completed move was settled (its failure raised: the bytes may be garbage)."""
        self._check_alive()
        # _settle returns only when it dropped nothing (it raises after undoing a
        # failed copy) and it never frees: the buffer checked alive still is.
        self._settle()
        if where is None:
            return self._primary
        p = self.placement(where)
        if p is None:
            # only a prefetch makes a device copy, only an offload a host one
            move = "prefetch" if where == "device" else "offload"
            raise ResidencyError(f"this buffer has no {where} copy (residency "
                                 f"{self.residency!r}); {move} it first",
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
            try:
                if host:
                    event.synchronize()
                    # waited here: drop the engine's keepalive of the copy's slabs
                    # now, as _settle does for a move over before the call (on a
                    # GPU the copy is usually still in flight at this point)
                    _poll_transfers(p.arena.backend)
                else:
                    p.arena.backend.current_stream().wait_event(event)
            except BackendError:
                # A CUDA failure is sticky, no event's: raised as is (the view
                # would read garbage, and the context is lost)
                if getattr(event, "error", None) is None:
                    raise
                # The copy failed (NOTE [ Host stream failures ]). Not this call's to
                # report raw: the buffer's own move is undone and raised once, with
                # what is left, by _settle; a copy that only read ``p`` (the source
                # of transfers.copy into another buffer) left its bytes intact.
                self._settle()

    @_pin_doc
    def numpy(self, where: str | None = None, *, pin: bool = False) -> np.ndarray:
        """A zero-copy numpy view (``dtype``, ``shape``) of the placement ``where``
        (default: primary). Host placements always qualify; device placements only
        on the host backend. Waits for an in-flight transfer first.

        {pin}
        """
        if pin:
            view = np.asarray(self._export(where, cuda=False))
            # the interface's descr cannot carry a structured dtype's padding
            # (numpy rebuilds it with named void fields): view it as ours, which
            # keeps the pin through .base
            return view if view.dtype == self._dtype else view.view(self._dtype)
        return self._typed(self._bytes(self._view_placement(where)))

    def _bytes(self, p: Placement) -> np.ndarray:
        """The uint8 slab slice of placement ``p`` (host-addressable ones only),
        after the copies touching it."""
        slab = p.slab
        if slab.host_array is None:
            raise ResidencyError(
                "device memory of the cuda backend is not host-addressable; use "
                "buf.cupy(), buf.to_numpy() (a copy), or offload the buffer first",
                state=self.residency, action="numpy view")
        self._wait_if_in_flight(p, host=True)
        return slab.host_array[p.offset:p.offset + self._view_nbytes()]

    def _view_nbytes(self) -> int:
        return math.prod(self._shape) * self._dtype.itemsize   # Python ints: exact

    def _typed(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(self._dtype).reshape(self._shape)

    def _export(self, where, cuda: bool, error=AttributeError) -> PinnedExport:
        """A :class:`PinnedExport` of placement ``where`` through the CUDA array
        interface (``cuda``; ``error`` as for :meth:`_cuda_dict`) or numpy's;
        placement, interface and pin are taken under the lock, so no move can
        drop the placement in between."""
        with self._lock:
            p = self._view_placement(where)
            if cuda:
                # keep: the slab's memory, which the consumer (a torch tensor, a
                # CuPy array) reads for as long as it holds the export,
                # arena.close() or not
                return PinnedExport(self, p, "__cuda_array_interface__",
                                    self._cuda_dict(p, error), keep=p.slab.owner)
            arr = self._typed(self._bytes(p))
            return PinnedExport(self, p, "__array_interface__", arr.__array_interface__,
                                keep=arr)

    def to_numpy(self) -> np.ndarray:
        """A host copy of the data (synchronous), whatever the residency."""
        # Under the lock, as _export: a move on another thread (evict, drop_host)
        # could free the placement between choosing it and reading it, and a new
        # buffer take the block: the copy had another buffer's bytes.
        with self._lock:
            p = self._view_placement(None)
            self._wait_if_in_flight(p, host=True)
            raw = p.arena.backend.read(p.slab, p.offset, self._view_nbytes())
        return self._typed(raw)

    @_pin_doc
    def cupy(self, where: str | None = None, *, pin: bool = False):
        """A zero-copy CuPy array over the placement ``where`` (default: primary):
        a device placement, or a mapped host one (its device alias). Ordered after
        an in-flight transfer on the current stream. It keeps the slab's memory
        past ``arena.close()``.

        {pin}

        Raises :class:`~rtmem.errors.ResidencyError` for a placement the GPU
        cannot address (pinned host memory that is not mapped, any buffer of the
        host backend), as :meth:`numpy` does for device memory."""
        if pin:
            # CuPy keeps the export as its memory's owner, as torch does
            # (NOTE [ Pinned views ]): the pin lives as long as any array over it
            return self._cupy_over(self._export(where, cuda=True, error=ResidencyError))
        return self._cupy_of(self._view_placement(where), error=ResidencyError)

    def _cupy_of(self, p: Placement, error=AttributeError):
        # The interface first: importing CuPy first made a host-backend buffer
        # without CuPy installed raise "the cuda backend needs CuPy".
        cai = self._cuda_dict(p, error)
        # CuPy keeps the _CudaView as its memory's owner (so do DLPack capsules
        # of the array): it holds the slab's memory past arena.close()
        return self._cupy_over(_CudaView(cai, (self, p.slab.owner)))

    @staticmethod
    def _cupy_over(source):
        """``cupy.asarray`` of an object carrying a CUDA array interface (zero-copy;
        CuPy keeps ``source`` alive as the owner of the array's memory)."""
        from .backends.cuda import import_cupy
        return import_cupy().asarray(source)

    def _cuda_dict(self, p: Placement, error=AttributeError) -> dict:
        """The CUDA array interface of placement ``p``. ``error``: what to raise
        when the GPU cannot address it: AttributeError for the attribute (so that
        hasattr and consumers falling back to other protocols work), and
        ResidencyError for :meth:`cupy` (it raised a bare AttributeError)."""
        slab = p.slab
        if slab.device_ptr is None or p.arena.backend.name != "cuda":
            # the host backend has no device to alias: no mapped arena helps there
            fix = ("use HostArena(..., mapped=True) or prefetch it"
                   if p.arena.backend.name == "cuda" else
                   "the host backend has no GPU to give it to; use numpy() or "
                   "__array_interface__, or the cuda backend on a GPU machine")
            message = ("__cuda_array_interface__ needs a device placement or a mapped "
                       "host placement on the cuda backend (this buffer is "
                       f"{self.residency!r} on the {p.arena.backend.name} backend); " + fix)
            if error is ResidencyError:
                raise ResidencyError(message, state=self.residency, action="cupy view")
            raise error(message)
        self._wait_if_in_flight(p, host=False)
        # The interface asks for a 0 pointer when the array has no elements (a
        # zero-byte block's address may be a neighbour's first byte).
        ptr = slab.device_ptr + p.offset if self._view_nbytes() else 0
        cai = self._interface((ptr, False))
        cai["stream"] = None
        return cai

    def _interface(self, data) -> dict:
        """The fields numpy's and the CUDA array interface share (version 3)."""
        return {"shape": self._shape, "typestr": self._dtype.str, "descr": self._dtype.descr,
                "data": data, "strides": None, "version": 3}

    @property
    def __array_interface__(self) -> dict:
        """NumPy's array interface over the host-addressable primary placement
        (AttributeError for cuda device memory, so consumers fall back to the
        CUDA array interface or DLPack). A structured dtype with padding comes
        back from ``np.asarray(buf)`` with the padding as named void fields (the
        interface's ``descr`` cannot say "aligned"); :meth:`numpy` gives ``dtype``."""
        p = self._view_placement(None)
        if p.slab.host_array is None:
            raise AttributeError("cuda device memory has no __array_interface__; use "
                                 "__cuda_array_interface__, DLPack or to_numpy()")
        # ``data`` is the slab slice itself (the buffer protocol), not an address:
        # numpy makes it the base of the array it builds, so the slab lives as
        # long as that array does (after arena.close() too, as numpy() views),
        # and nothing here has to remember it.
        return self._interface(self._bytes(p))

    def __array__(self, dtype=None, copy=None):
        # numpy reaches this only when __array_interface__ is absent (cuda device
        # memory); without it np.asarray(buf) made a 0-d object array.
        raise TypeError("cuda device memory is not host-addressable: np.asarray cannot "
                        "view it; use buf.to_numpy() (a copy) or buf.cupy()")

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA array interface v3 over the device placement, else the device
        alias of a mapped host placement (cuda backend only).

        ``"stream"`` is None: a copy still in flight into the buffer is ordered
        before later work on the *current* (compute) stream only, by a wait put
        there when the interface is read. A consumer that runs on another stream
        must first make that stream wait for the buffer (``rtmem.wait(buf)`` on
        it, or ``rtmem.synchronize(buf)``).

        Lifetime: the dict holds nothing. Consumers that read it keep the
        producer (numba's ``cuda.as_cuda_array`` and kernel launches, CuPy's
        ``cupy.asarray``, ``torch.as_tensor``: this Buffer), and a Buffer does not
        keep its memory past ``arena.close()`` (else any Buffer still referenced
        would keep its whole slab allocated after close). So an array made this
        way is valid only while the arena is open and the buffer not freed. For
        a view that outlives ``close()``, use :meth:`cupy`, ``__dlpack__`` or
        ``rtmem.torch.as_tensor``: they hold the slab until the view goes."""
        return self._cuda_dict(self._view_placement(None))

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
        p = self._view_placement(None)
        if p.slab.host_array is not None:
            return self._typed(self._bytes(p)).__dlpack__(**kwargs)
        return self._cupy_of(p).__dlpack__(stream=stream, **kwargs)


class _CudaView:
    """Carries one ``__cuda_array_interface__`` dict and keeps ``owner`` alive
    (the buffer, and the memory the dict points at)."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, cai, owner):
        self.__cuda_array_interface__ = cai
        self.owner = owner
