"""Arenas: slabs from a backend plus an allocator stack, handing out Buffers.

:class:`DeviceArena` holds device memory; :class:`HostArena` holds host memory,
pinned by default and optionally mapped (the GPU reads and writes it directly
through its device alias). Both sub-allocate with
:class:`~rtmem.allocator.BestFitAllocator`, wrapped by the adaptors given in
``adaptors=`` (and by a poisoning adaptor when ``debug=True``: the convenience
flag only builds the stack, the core never checks it).

NOTE [ Arena accounting ]
``_acct[k]`` is ``[bytes, requested, count]``: the aligned size, the requested
bytes and the number of this arena's live placements of kind ``k`` (one list
per kind: an allocation or a free updates it with one lookup). Their totals
equal the allocator's ``allocated_bytes``, ``requested_bytes`` and
``live_blocks`` (checked by ``_check_invariants``). Updated together with the
allocator call they account for, under ``self._acct_lock``, which ``stats()``
also takes: a snapshot's per-kind totals always equal its totals.
``self._lock`` guards the slab list (the allocator calls ``add_slab`` with its
own lock held, so it must be another).

The arena's slab side (the slab and event source of its allocator core) is in
rtmem/_arena_slabs.py, the stream-ordered free of its buffers in
rtmem/_arena_free.py: mixins of ``_Arena``, which keeps construction, ``alloc``,
accounting, stats and ``close``.
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass

import numpy as np

from . import _deferred, _fork
from ._arena_free import ArenaFree
from ._arena_slabs import SlabSource
from .adaptors import PoisonAdaptor, TracingAdaptor
from .allocator import DEFAULT_ALIGNMENT, AllocatorStats, BestFitAllocator
from .backends import Backend, get_backend
from .buffer import KINDS, Buffer, Placement, bad_kind
from .errors import InvalidPointerError
from .units import parse_bytes

__all__ = ["ArenaStats", "DeviceArena", "HostArena", "UNORDERED"]


class _Unordered:
    """Type of :data:`UNORDERED`, the ``stream`` of ``alloc(stream=UNORDERED)``:
    a buffer ordered with no stream, made only of bytes whose frees' work has
    completed, so any stream or the CPU may use it at once."""

    __slots__ = ()

    def __repr__(self):
        return "rtmem.UNORDERED"

    def __reduce__(self):
        return "UNORDERED"      # pickles as the one instance


#: ``alloc(stream=UNORDERED)``: a buffer ordered with no stream. Its bytes come
#: only from frees whose work has completed, so any stream, or the CPU, may use
#: it at once (what a HostArena does by default). Use it for memory that work on
#: streams rtmem does not know about will use (e.g. numba's).
UNORDERED = _Unordered()

_BYTES = np.dtype(np.uint8)
_KINDS = frozenset(KINDS)


@dataclass(frozen=True)
class ArenaStats:
    """Allocator statistics plus per-kind accounting (bytes and counts).

    Every :class:`~rtmem.allocator.AllocatorStats` field is readable directly
    (``stats.allocated_bytes``). The dicts map each of
    :data:`~rtmem.buffer.KINDS` to: ``bytes_by_kind`` aligned bytes,
    ``requested_by_kind`` requested bytes, ``count_by_kind`` live buffers.
    """

    allocator: AllocatorStats
    bytes_by_kind: dict
    requested_by_kind: dict
    count_by_kind: dict

    def __getattr__(self, name):
        # Only called for names not found normally: forward the allocator fields
        # (never dunders, so copy/pickle probing sees plain AttributeErrors).
        allocator = self.__dict__.get("allocator")
        if allocator is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(allocator, name)


def _shape(shape) -> tuple:
    """``shape`` (an int or a sequence of ints >= 0) as a tuple of ints."""
    try:
        dims = (shape,) if np.isscalar(shape) else tuple(shape)
        # operator.index(True) is 1: a bool taken as a dimension (numpy refuses
        # it, and so does alloc(True) for nbytes); asked first, as numpy < 2
        # warns when np.bool_ is used as an index
        if any(isinstance(d, (bool, np.bool_)) for d in dims):
            raise TypeError
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") \
            from None
    if any(d < 0 for d in out):
        raise ValueError(f"shape must be non-negative, got {out}")
    return out


def _plain_dtype(dtype, default) -> np.dtype:
    """``dtype`` (default ``default``) as a numpy dtype of plain bytes: buffers
    hold raw memory, so object (pointer) dtypes are refused."""
    try:
        dt = np.dtype(default if dtype is None else dtype)
    except (TypeError, ValueError) as exc:   # (np.int32, -1): numpy's bare ValueError
        raise TypeError(f"dtype {dtype!r} is not a numpy dtype ({exc})") from None
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects; arena buffers hold raw "
                        f"bytes: use a numeric dtype")
    if dt.subdtype is not None:
        base, sub = dt.subdtype
        raise TypeError(f"dtype {dt} is a subarray dtype; pass its item dtype and fold "
                        f"its shape into shape= (dtype={base}, shape=(..., "
                        f"{', '.join(map(str, sub))}))")
    if dt.itemsize == 0:
        raise TypeError(f"dtype {dt} has no item size; give a sized dtype such as "
                        f"'S16' or 'U8' (a buffer's bytes are fixed at allocation)")
    return dt


def is_arena(obj, location: str | None = None) -> bool:
    """True if ``obj`` is a DeviceArena or HostArena (of ``location``, "device" or
    "host", when given): the check every API taking an arena makes."""
    return isinstance(obj, _Arena) and (location is None or obj.location == location)


def _check_flag(name: str, flag) -> bool:
    """``flag`` as a bool; a TypeError unless it is one (debug="no" meant True)."""
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {flag!r}")
    return bool(flag)


class _Arena(SlabSource, ArenaFree):
    """Common machinery of device and host arenas (see the subclasses)."""

    location = "?"

    def __init__(self, nbytes, *, backend=None, alignment: int = DEFAULT_ALIGNMENT,
                 max_bytes=None, growth_bytes=None, adaptors=(), debug: bool = False):
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        self.debug = _check_flag("debug", debug)
        self._lock = threading.Lock()
        self._acct_lock = threading.Lock()     # NOTE [ Arena accounting ]
        self._slabs = []
        self._acct = {kind: [0, 0, 0] for kind in KINDS}    # NOTE [ Arena accounting ]
        self._closed = False
        nbytes = parse_bytes(nbytes)
        try:
            adaptors = tuple(adaptors)
        except TypeError:   # adaptors=StatisticsAdaptor was "'type' object is not iterable"
            raise TypeError(f"adaptors must be a sequence of callables upstream -> "
                            f"allocator, e.g. [StatisticsAdaptor], got {adaptors!r}") from None
        self._slab_alignment = alignment    # add_slab's (the core validates it)
        self.core = BestFitAllocator(
            nbytes, alignment=alignment,
            max_bytes=None if max_bytes is None else parse_bytes(max_bytes),
            growth_bytes=None if growth_bytes is None else parse_bytes(growth_bytes),
            slab_source=self, event_source=self._record_event, _size_name="nbytes")
        allocator = self.core
        if self.debug:
            allocator = PoisonAdaptor(allocator, fill=self._fill_block,
                                      check=self._check_block)
        for wrap in adaptors:
            allocator = wrap(allocator)
            # checked now, not at the first alloc (an "int has no attribute" there)
            if not all(callable(getattr(allocator, name, None))
                       for name in ("allocate", "deallocate", "stats")):
                raise TypeError(f"adaptor {wrap!r} returned {allocator!r}, not an allocator "
                                f"(with allocate, deallocate and stats); pass callables "
                                f"upstream -> allocator, e.g. StatisticsAdaptor")
        #: Top of the allocator stack (adaptors included); ``.upstream`` walks down.
        self.allocator = allocator
        _fork.register_arena(self)      # NOTE [ Arenas after fork ] in _fork.py

    @property
    def alignment(self) -> int:
        """Alignment of every buffer, bytes."""
        return self.core.alignment

    # ------------------------------------------------------------ buffers
    def alloc(self, nbytes: int | None = None, *, shape=None, dtype=None,
              kind: str = "activation", stream=None) -> Buffer:
        """Allocate a buffer of ``nbytes`` bytes, or of ``shape`` x ``dtype``.

        ``dtype`` defaults to uint8 (float32 when only ``shape`` is given); a
        given ``nbytes`` must cover the shape. ``kind`` is one of
        :data:`~rtmem.buffer.KINDS`. Raises
        :class:`~rtmem.errors.OutOfMemoryError` (with ``requested`` bytes and a
        stats snapshot) when the arena cannot serve it. ``stream``: the stream
        whose order covers the buffer's first use; bytes freed on it are reused
        at once (default: the compute stream for a DeviceArena; for a HostArena
        the CPU, which reuses bytes only once the GPU work before their free is
        done, since the CPU may touch a new buffer at once). :data:`UNORDERED`
        asks for that on any arena.
        """
        try:
            known = kind in _KINDS
        except TypeError:       # unhashable (a list): was a bare TypeError from `in`
            known = False
        if not known:
            raise bad_kind(kind)
        if shape is None and dtype is None and nbytes.__class__ is int and nbytes >= 0:
            # The common call, alloc(n): skip the parsing below.
            dtype, shape = _BYTES, (nbytes,)
        elif shape is None:
            if nbytes is None:
                raise ValueError("give nbytes= (bytes) or shape= (and dtype=)")
            dtype = _plain_dtype(dtype, np.uint8)
            nbytes = parse_bytes(nbytes)
            if nbytes % dtype.itemsize:
                raise ValueError(f"nbytes={nbytes} is not a multiple of the {dtype} "
                                 f"item size ({dtype.itemsize} bytes); pass shape=")
            shape = (nbytes // dtype.itemsize,)
        else:
            shape = _shape(shape)
            dtype = _plain_dtype(dtype, np.float32)
            need = math.prod(shape) * dtype.itemsize     # Python ints: no overflow
            if need == 0 or len(shape) > 32:
                # Shapes numpy cannot hold (a dimension >= 2**63 beside a 0, more
                # than 64 dimensions) passed as 0 or a few bytes, leaving a buffer
                # every view of which raised numpy's ValueError. Probing a
                # zero-element array checks them at no memory cost.
                try:
                    np.empty(shape if need == 0 else (0,) * len(shape), dtype)
                except ValueError as exc:
                    raise ValueError(f"numpy cannot view shape {shape} of {dtype} ({exc}); "
                                     f"give a shape numpy arrays can have") from None
            if nbytes is None:
                nbytes = need
            else:
                nbytes = parse_bytes(nbytes)
                if nbytes < need:
                    raise ValueError(f"nbytes={nbytes} is smaller than shape {shape} of "
                                     f"{dtype} needs ({need} bytes)")
        if stream is None:
            stream = self._default_stream()
        elif stream is UNORDERED:
            stream = None           # the core's key of bytes no stream orders
        elif not isinstance(stream, self.backend.stream_types):
            # A foreign object would key the allocator's reuse and make the
            # buffer's free fail (it records and waits on its home stream).
            raise TypeError(
                f"stream must be a stream of this arena's {self.backend.name} backend "
                f"(arena.backend.new_stream() or .current_stream()), rtmem.UNORDERED or "
                f"None, got {type(stream).__name__} {stream!r}")
        placement = self._allocate(nbytes, kind, stream)
        return Buffer(placement, nbytes, dtype, shape, kind)

    def _allocate(self, nbytes: int, kind: str, stream=None) -> Placement:
        if self._closed:
            self._check_open()
        if _deferred.queue:     # frees a garbage collection postponed (outside locks)
            _deferred.flush()
        # acquire/release in try/finally, as in the core: cheaper than ``with``
        # on a path every allocation takes
        lock = self._acct_lock
        lock.acquire()
        try:
            # again under the lock close() marks it closed under: an allocation
            # racing close() must not take a block of (or grow) released slabs
            if self._closed:
                self._check_open()
            block = self.allocator.allocate(nbytes, stream)
            acct = self._acct[kind]
            acct[0] += block.size
            acct[1] += block.requested
            acct[2] += 1
        finally:
            lock.release()
        return Placement(self, block)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidPointerError(f"{self!r} is closed; create a new arena")

    # The two halves of an arena's reuse policy (see the subclasses): this one,
    # and ArenaFree._free_after (rtmem/_arena_free.py).
    def _default_stream(self):
        """The allocation key when ``alloc`` gets no stream."""
        raise NotImplementedError

    def trim(self) -> int:
        """Give back every growth slab that is entirely free (waiting for pending
        frees first, those a garbage collection deferred included); returns the
        bytes released. The first slab is kept. 0 on a closed arena: close()
        released every slab."""
        if self._closed:
            return 0
        if _deferred.queue:     # outside the locks, as in _allocate
            _deferred.flush()
        with self._acct_lock:
            # Again under the lock, as in _allocate: a close() on another thread
            # while the deferred frees ran has released every slab already, and
            # giving back a growth slab now would shrink the closed arena's stats.
            if self._closed:
                return 0
            return self.allocator.trim()

    def stats(self) -> ArenaStats:
        """Allocator stats (top of the stack) plus per-kind bytes and counts, one
        consistent snapshot. After :meth:`close` they keep the arena's counts (its
        peak, what is still live, its slabs), for a look back, though every slab
        has been given back to the backend; a buffer freed after close (legal)
        leaves them, so take the snapshot before freeing to see what was live at
        close."""
        with self._acct_lock:
            st = self.allocator.stats()
            # Copies: the snapshot never changes with the arena.
            return ArenaStats(st, *({k: a[i] for k, a in self._acct.items()}
                                    for i in range(3)))

    def _check_invariants(self) -> None:
        """Check the allocator core and NOTE [ Arena accounting ]."""
        self.core._check_invariants()
        with self._acct_lock:
            st = self.core.stats()
            totals = [sum(column) for column in zip(*self._acct.values())]
            assert totals == [st.allocated_bytes, st.requested_bytes, st.live_blocks]
            assert len(self._slabs) == st.slabs

    def close(self) -> None:
        """Release every slab. Buffers still live become invalid, except those
        with a copy in another open arena (an offloaded buffer's host copy), which
        keep that copy (NOTE [ Residency state machine ] in rtmem/buffer.py); call
        only once all work using the arena is done (``rtmem.transfers.synchronize()``).
        Views of its buffers made before (``buf.numpy()``, ``buf.cupy()``, DLPack
        capsules, tensors of ``rtmem.torch.as_tensor``) stay valid on both
        backends: a slab goes back to the backend when the last of them goes, at
        once without any. The same holds for memory CuPy or numba allocated
        through :mod:`rtmem.integrations` (their arrays alive at close stay valid).
        So do numba device arrays already dropped whose free numba has deferred
        (its pending-deallocation queue, run at numba's own threshold): their
        slab goes back only when numba runs that queue. Call
        ``numba.cuda.current_context().deallocations.clear()`` before close()
        to give it back at once (close() does not run numba's queue for you:
        it holds other frees too, and ``cuda.defer_cleanup()`` may be on).
        Arrays other libraries make from a Buffer itself through
        ``__cuda_array_interface__`` (``cupy.asarray(buf)``, numba kernels) hold
        the Buffer, not the slab: they are valid only while the arena is open
        (:attr:`~rtmem.buffer.Buffer.__cuda_array_interface__`).
        Ends the recording of every :class:`~rtmem.adaptors.TracingAdaptor` in
        the arena's ``adaptors`` (its trace is complete on disk; frees after
        close are not recorded)."""
        # _acct_lock first, as in _allocate (which takes _lock inside it to grow)
        with self._acct_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            slabs, self._slabs = self._slabs, []
        try:
            self.backend.synchronize()
        finally:
            # Released even when waiting raised (a failed copy on a host stream):
            # the arena is closed either way, and its memory must not leak.
            for slab in slabs:
                self.backend.release(slab)
            # A trace was left in the file's write buffer: empty on disk after
            # close() (or a with-block) until the arena was collected, which a
            # live Buffer (it refers to its arena) could put off to the exit.
            self._end_recordings()

    def _adaptors(self, kind):
        """The adaptors of class ``kind`` in the arena's allocator stack, top
        first (``adaptors=`` built them above the core)."""
        layer = self.allocator
        while layer is not None and layer is not self.core:
            if isinstance(layer, kind):
                yield layer
            layer = getattr(layer, "upstream", None)

    def _end_recordings(self) -> None:
        """close() every TracingAdaptor of the stack (all of them, then the first
        failure to flush a sink is raised)."""
        failure = None
        for tracer in self._adaptors(TracingAdaptor):
            try:
                tracer.close()
            except Exception as exc:    # noqa: BLE001 - raised after the others
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        # copy.copy made a second handle on the same allocator and memory (closing
        # one freed the other's buffers' bytes), pickle failed on a WeakSet's
        # closure, deepcopy on a lock: memory this process owns cannot be carried
        raise TypeError(
            f"an arena cannot be copied or pickled (a {type(self).__name__} owns its "
            f"memory in this process); make a new {type(self).__name__} where it is "
            f"needed, and copy buffers' data with buf.to_numpy()")

    def __repr__(self) -> str:
        if isinstance(self.core._lock, _fork.HeldAtFork):   # no stats to read
            return (f"<{type(self).__name__} {self.backend.name}, unusable in this "
                    f"forked child>")
        st = self.core.stats()
        return (f"<{type(self).__name__} {self.backend.name} "
                f"{st.allocated_bytes:,}/{st.reserved_bytes:,} B>")


class DeviceArena(_Arena):
    """Device memory: slabs from the backend (cudaMalloc, or numpy on ``host``).

    Parameters
    ----------
    nbytes:
        First slab size, bytes (int or a string such as ``"2GiB"``).
    backend:
        ``"cuda"``, ``"host"``, a Backend, or None for :func:`~rtmem.backends.get_backend`.
    alignment:
        Buffer alignment, bytes (power of two, default 256). Beyond what the
        backend aligns slabs to (cudaMalloc 256 B, host memory a page), each slab
        takes one alignment more than ``reserved_bytes`` counts.
    max_bytes, growth_bytes:
        Growth by extra slabs of ``growth_bytes`` up to ``max_bytes`` total, bytes
        (ints or strings such as ``"8GiB"``). ``max_bytes`` defaults to
        ``nbytes``: no growth, whatever ``growth_bytes`` says. ``growth_bytes``
        defaults to ``nbytes``; 0 grows by exactly what a request needs, and a
        request larger than it gets a slab of its own size.
    adaptors:
        Callables ``upstream -> allocator`` applied in order (e.g.
        ``lambda up: LimitAdaptor(up, budget_bytes)``); the last one's result
        is ``arena.allocator`` (its ``upstream`` walks down to the others, e.g.
        for a :class:`~rtmem.adaptors.StatisticsAdaptor`'s figures).
    debug:
        Poison freed memory and detect writes after free (slow; for tests).
        Default False.

    Raises :class:`~rtmem.errors.UnitError` (a ``ValueError``) for a size it
    cannot read or a negative one, ``ValueError`` for ``nbytes`` 0, a slab of
    1 TiB or more, an ``alignment`` that is not a power of two or
    ``max_bytes`` below ``nbytes``, ``TypeError`` for a ``debug`` (or
    ``HostArena``'s ``pinned``/``mapped``) that is not a bool and for
    ``adaptors`` that are not callables returning allocators,
    :class:`~rtmem.errors.BackendError` for an unknown or unusable backend, and
    :class:`~rtmem.errors.OutOfMemoryError` when the backend cannot give the
    first slab (device memory, or the memlock limit of an ``mlock``ed host
    backend).
    """

    location = "device"

    def __init__(self, nbytes, *, backend=None, alignment: int = DEFAULT_ALIGNMENT,
                 max_bytes=None, growth_bytes=None, adaptors=(), debug: bool = False):
        # spelled out, not *args/**kwargs: help() and inspect.signature show them
        super().__init__(nbytes, backend=backend, alignment=alignment, max_bytes=max_bytes,
                         growth_bytes=growth_bytes, adaptors=adaptors, debug=debug)
        # backend.synchronize() retires the stream-ordered frees made before it
        # (NOTE [ Stream-ordered frees ] in _stream_order.py)
        self.backend.retire_at_synchronize(self.core)

    def _new_slab(self, nbytes):
        return self.backend.device_slab(nbytes)

    def _default_stream(self):
        # Blocks freed on the compute stream are reusable at once by later
        # allocations on it (stream order).
        return self.backend.current_stream()

    def _free_after(self, block, stream) -> None:
        # No event per free: other streams wait for a later stamp
        # (NOTE [ Stream-ordered frees ] in _stream_order.py). Not for a per-thread
        # default stream: a stamp recorded from another thread would land on
        # that thread's stream, so its frees get their event now, here.
        if getattr(stream, "thread", None) is not None:
            super()._free_after(block, stream)
        else:
            self.allocator.deallocate(block, stream=stream, ordered=True)


class HostArena(_Arena):
    """Host memory: pinned by default, ``mapped=True`` for memory the GPU can
    address directly (its buffers expose ``__cuda_array_interface__`` with the
    device alias). Mapped memory is always pinned (the GPU addresses only
    page-locked memory): ``mapped=True`` with ``pinned=False`` gives pinned,
    mapped memory (``arena.pinned`` is True). Reserves exactly ``nbytes``
    rounded up to ``alignment``: no power-of-two pools. Other parameters, their
    defaults and the errors as :class:`DeviceArena`.

    A new buffer is safe for the CPU to write at once: by default its bytes were
    freed behind GPU work that has completed (``alloc(stream=...)`` relaxes this
    for buffers that only GPU streams touch).
    """

    location = "host"

    def __init__(self, nbytes, *, pinned: bool = True, mapped: bool = False, backend=None,
                 alignment: int = DEFAULT_ALIGNMENT, max_bytes=None, growth_bytes=None,
                 adaptors=(), debug: bool = False):
        _check_flag("pinned", pinned)
        _check_flag("mapped", mapped)
        self.pinned = bool(pinned or mapped)
        self.mapped = bool(mapped)
        super().__init__(nbytes, backend=backend, alignment=alignment, max_bytes=max_bytes,
                         growth_bytes=growth_bytes, adaptors=adaptors, debug=debug)

    def _new_slab(self, nbytes):
        return self.backend.host_slab(nbytes, pinned=self.pinned, mapped=self.mapped)

    def _default_stream(self):
        # The CPU, which is not ordered with any stream: a block freed on a stream
        # comes back only once its event completed (torch's pinned-memory
        # allocator is as strict), so a new buffer can be written at once. Its
        # frees take ArenaFree._free_after's event recorded now, not a later stamp,
        # so the CPU gets the bytes back as soon as the GPU is past the free.
        return None
