"""Arenas and buffers on the host backend: accounting, views, errors, threads."""

from __future__ import annotations

import collections
import pickle
import random
import sys
import threading

import numpy as np
import pytest

from _threads import collect_holding, run_on_threads
from rtmem.arena import DeviceArena, HostArena
from rtmem.backends import BACKENDS, backend_name, get_backend
from rtmem.backends.host import PAGE, HostEvent
from rtmem.buffer import KINDS
from rtmem.errors import (BackendError, DoubleFreeError, InvalidPointerError,
                          OutOfMemoryError, ResidencyError, UseAfterFreeError)


@pytest.fixture
def dev():
    arena = DeviceArena("1MiB", backend="host")
    yield arena
    arena._check_invariants()


@pytest.fixture
def host():
    arena = HostArena("1MiB", backend="host")
    yield arena
    arena._check_invariants()


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    assert backend_name() == "host" and get_backend().name == "host"
    monkeypatch.setenv("RTMEM_BACKEND", " Host ")     # case and spaces do not matter
    assert backend_name() == "host"
    monkeypatch.setenv("RTMEM_BACKEND", "tpu")
    with pytest.raises(BackendError, match="RTMEM_BACKEND"):
        backend_name()
    assert "host" in BACKENDS


def test_fill_takes_every_byte_value():
    be = get_backend("host")
    slab = be.host_slab(64)
    be.fill(slab, 0, 64, 255)
    be.fill(slab, 8, 48, 0)
    got = be.read(slab, 0, 64)
    assert (got[8:56] == 0).all() and (got[:8] == 255).all() and (got[56:] == 255).all()
    for bad in (-1, 256):
        with pytest.raises(ValueError, match="byte"):
            be.fill(slab, 0, 64, bad)


def test_alloc_by_shape_and_bytes(dev):
    a = dev.alloc(shape=(3, 4), dtype=np.float64, kind="weight")
    assert a.nbytes == 96 and a.shape == (3, 4) and a.dtype == np.float64
    b = dev.alloc(1000)
    assert b.dtype == np.uint8 and b.shape == (1000,)
    c = dev.alloc("2KiB", dtype=np.float32)
    assert c.shape == (512,)
    with pytest.raises(ValueError, match="kind"):
        dev.alloc(10, kind="activations")
    with pytest.raises(ValueError, match="multiple"):
        dev.alloc(10, dtype=np.float64)
    with pytest.raises(ValueError, match="smaller"):
        dev.alloc(15, shape=(4,), dtype=np.float32)
    exact = dev.alloc(16, shape=(4,), dtype=np.float32)     # nbytes == what it needs
    assert exact.nbytes == 16 and exact.shape == (4,)
    exact.free()
    before = dev.stats()
    # sizes are exact integers: a shape whose size overflows int64 is refused as
    # too large, never wrapped around to a small buffer
    for shape, dtype in (((2**40, 2**40), np.float32), ((2**61 + 1, 8), np.uint8)):
        with pytest.raises(OutOfMemoryError) as e:
            dev.alloc(shape=shape, dtype=dtype)
        assert e.value.requested == np.prod(shape, dtype=object) * np.dtype(dtype).itemsize
    with pytest.raises(TypeError, match="raw bytes"):
        dev.alloc(shape=(2, 3), dtype=object)
    with pytest.raises(TypeError, match="sequence of ints"):
        dev.alloc(shape=2.5)
    with pytest.raises(TypeError, match="not a numpy dtype"):
        dev.alloc(shape=(2,), dtype="foo")
    assert dev.stats() == before
    for buf in (a, b, c):
        buf.free()


def test_per_kind_accounting(dev):
    bufs = {k: dev.alloc(1000 * (i + 1), kind=k) for i, k in enumerate(KINDS)}
    st = dev.stats()
    for i, k in enumerate(KINDS):
        assert st.requested_by_kind[k] == 1000 * (i + 1)
        assert st.bytes_by_kind[k] == -(-1000 * (i + 1) // 256) * 256
        assert st.count_by_kind[k] == 1
    assert st.allocated_bytes == sum(st.bytes_by_kind.values())
    assert pickle.loads(pickle.dumps(st)) == st
    st.bytes_by_kind["weight"] = -1                # a snapshot: the arena is unaffected
    assert dev.stats().bytes_by_kind["weight"] > 0
    dev._check_invariants()
    bufs["weight"].free()
    assert dev.stats().bytes_by_kind["weight"] == 0
    # nor does the arena change an earlier snapshot: every dict is a copy
    w = KINDS.index("weight")
    assert st.requested_by_kind["weight"] == 1000 * (w + 1)
    assert st.count_by_kind["weight"] == 1
    for k, b in bufs.items():
        if k != "weight":
            b.free()
    assert dev.stats().allocated_bytes == 0


def test_array_interface_and_dlpack(dev, host, monkeypatch):
    torch = pytest.importorskip("torch")
    b = host.alloc(shape=(4, 5), dtype=np.float32)
    view = np.asarray(b)
    view[...] = np.arange(20, dtype=np.float32).reshape(4, 5)
    assert view.ctypes.data == host.slabs[0].ptr + b.offset
    assert b.__dlpack_device__() == (1, 0)
    t = torch.from_dlpack(b)
    assert t.shape == (4, 5) and float(t.sum()) == 190.0
    t[0, 0] = 100.0                                # zero-copy both ways
    assert b.numpy()[0, 0] == 100.0
    d = dev.alloc(shape=(8,), dtype=np.int32)
    d.numpy()[:] = 7
    assert np.asarray(d).sum() == 56 and d.to_numpy().sum() == 56
    assert not hasattr(d, "__cuda_array_interface__")   # host backend: no CAI
    # and the error says what works here, not "use a mapped arena", which has no
    # device alias on this backend either
    mapped = HostArena(4096, mapped=True, backend="host")
    m = mapped.alloc(16)
    for buf in (d, m):
        with pytest.raises(AttributeError, match="host backend has no GPU.*numpy"):
            buf.__cuda_array_interface__
        # cupy() says the same as a ResidencyError (a bare AttributeError; without
        # CuPy installed, "the cuda backend needs CuPy" for a host-backend buffer)
        with monkeypatch.context() as mp:
            mp.setitem(sys.modules, "cupy", None)
            with pytest.raises(ResidencyError, match="host backend has no GPU"):
                buf.cupy()
    m.free()
    mapped.close()
    del view, t
    b.free()
    d.free()


def test_alignment_of_buffers_and_slabs(dev):
    bufs = [dev.alloc(random.Random(i).randrange(1, 5000)) for i in range(20)]
    assert dev.slabs[0].ptr % PAGE == 0
    assert all(b.offset % 256 == 0 for b in bufs)
    assert all((dev.slabs[0].ptr + b.offset) % 256 == 0 for b in bufs)
    for b in bufs:
        b.free()


def test_host_arena_reserves_exact_request():
    request = int(20.4 * (1 << 20)) + 3          # 20.4 MiB and change
    h = HostArena(request, backend="host")
    st = h.stats()
    assert st.reserved_bytes == -(-request // 256) * 256
    assert st.reserved_bytes - request < 256
    assert h.slabs[0].nbytes == st.reserved_bytes and h.slabs[0].pinned
    m = HostArena(4096, mapped=True, backend="host")
    assert m.slabs[0].mapped and m.slabs[0].device_ptr == m.slabs[0].ptr
    h.close()
    m.close()


def test_oom_in_arena_carries_numbers(dev):
    keep = dev.alloc(900 * 1024)
    before = dev.stats()
    with pytest.raises(OutOfMemoryError) as info:
        dev.alloc(200 * 1024)
    assert info.value.requested == 200 * 1024
    assert info.value.stats.reserved_bytes == 1 << 20
    assert dev.stats() == before
    assert pickle.loads(pickle.dumps(info.value)).requested == 200 * 1024
    keep.free()


def test_alloc_refuses_a_stream_of_no_backend(dev, host):
    # A foreign stream object would key the allocator's reuse and leave a buffer
    # whose free fails (it waits on its home stream): refused, nothing allocated.
    for arena in (dev, host):
        before = arena.stats()
        for bad in ("x", 3, object(), threading.Lock()):
            with pytest.raises(TypeError, match="stream must be a stream of this arena's "
                                                "host backend"):
                arena.alloc(64, stream=bad)
        assert arena.stats() == before
        side = arena.backend.new_stream()
        for stream in (side, arena.backend.current_stream()):
            buf = arena.alloc(64, stream=stream)
            buf.free()
        arena.backend.synchronize()
        assert arena.stats().allocated_bytes == before.allocated_bytes


def test_growth_within_arena():
    a = DeviceArena(4096, max_bytes=4 * 4096, backend="host")
    bufs = [a.alloc(4096) for _ in range(4)]
    assert len(a.slabs) == 4
    with pytest.raises(OutOfMemoryError):
        a.alloc(1)
    for b in bufs:
        b.free()
    assert a.core.trim() == 3 * 4096 and len(a.slabs) == 1
    a._check_invariants()


def test_double_free_foreign_and_use_after_free(dev, host):
    b = dev.alloc(100)
    with pytest.raises(InvalidPointerError, match="foreign"):
        host.free(b)
    b.free()
    with pytest.raises(DoubleFreeError):
        b.free()
    with pytest.raises(DoubleFreeError):
        dev.free(b)
    with pytest.raises(InvalidPointerError):
        dev.free(np.zeros(3))
    for use in (lambda: b.numpy(), lambda: b.offset, lambda: np.asarray(b),
                lambda: b.__dlpack__()):
        with pytest.raises(UseAfterFreeError):
            use()
    assert b.residency == "freed" and "freed" in repr(b)


def test_debug_mode_detects_write_after_free():
    a = DeviceArena(64 * 1024, backend="host", debug=True)
    b = a.alloc(1024)
    stale = b.numpy()                              # a view kept past the free
    b.free()
    assert (stale == 0xDB).all()                   # freed memory is poisoned
    stale[10] = 1
    with pytest.raises(UseAfterFreeError) as info:
        a.alloc(1024)
    assert info.value.offset == 10
    # the refused block's own size, not the free region it merged into (64 KiB)
    assert "byte 10 of the 1024-byte block at slab 0 offset 0" in str(info.value)
    assert a.stats().allocated_bytes == 0          # the failed alloc left nothing
    c = a.alloc(1024)                              # poison restored: works again
    c.free()
    a._check_invariants()


def test_a_refused_debug_allocation_leaves_the_statistics_unchanged():
    # The lost poison refuses the allocation after the core handed out its
    # block; freeing that block plainly counted one allocation, one free and
    # its bytes in peak_bytes, though the caller got nothing.
    a = DeviceArena(64 * 1024, backend="host", debug=True)
    keep = a.alloc(512)
    b = a.alloc(1024)
    stale = b.numpy()                              # a view kept past the free
    b.free()
    stale[3] = 1
    before = a.stats()
    with pytest.raises(UseAfterFreeError):
        a.alloc(8192)                              # above the peak: it would raise it
    assert a.stats() == before
    assert (before.alloc_count, before.free_count, before.peak_bytes) == (2, 1, 1536)
    c = a.alloc(8192)                              # poison restored: counted as usual
    after = a.stats()
    assert (after.alloc_count, after.free_count, after.peak_bytes) == (3, 1, 512 + 8192)
    c.free()
    keep.free()
    a._check_invariants()


def test_views_refuse_missing_placement(dev):
    b = dev.alloc(64)
    with pytest.raises(ResidencyError, match="no host copy"):
        b.numpy("host")
    b.free()


def test_concurrent_arena_use_keeps_data_intact():
    a = DeviceArena(8 << 20, backend="host")

    def work(tid):
        rng = random.Random(tid)
        mine = []
        for _ in range(400):
            if mine and (rng.random() < 0.45 or len(mine) > 30):
                buf, val = mine.pop(rng.randrange(len(mine)))
                assert (buf.numpy() == val).all(), "buffer overwritten"
                buf.free()
            else:
                try:
                    buf = a.alloc(rng.randrange(1, 30000),
                                  kind=KINDS[tid % len(KINDS)])
                except OutOfMemoryError:
                    continue
                val = (tid * 31 + len(mine)) % 251
                buf.numpy()[:] = val
                mine.append((buf, val))
        for buf, val in mine:
            assert (buf.numpy() == val).all()
            buf.free()

    run_on_threads(work)
    st = a.stats()
    assert st.allocated_bytes == 0 and st.alloc_count == st.free_count
    assert sum(st.count_by_kind.values()) == 0
    a._check_invariants()


def test_host_events_follow_cuda_rules():
    be = get_backend("host")
    ev = HostEvent()
    assert ev.query()                              # never recorded: complete
    s = be.new_stream("t")
    gate = threading.Event()
    s.launch_host_func(gate.wait)
    ev.record(s)
    assert not ev.query()
    other = be.new_stream("u")
    other.wait_event(ev)                           # ordered after s's gate
    after = HostEvent().record(other)
    assert not after.query()
    gate.set()
    after.synchronize()
    assert ev.query() and after.query()


def test_host_stream_failure_is_reported():
    be = get_backend("host")
    s = be.new_stream("bad")

    def boom():
        raise RuntimeError("copy failed")
    s.launch_host_func(boom)
    with pytest.raises(BackendError, match="copy failed"):
        s.synchronize()


def test_the_events_a_free_records_leave_a_stream_failure_to_its_user():
    # A free orders itself behind events it records on the buffer's stream (its
    # home, or the copy stream while a copy runs), which only the allocator looks
    # at: the first of them took the failure of the work before it, and the
    # stream's synchronize() then raised nothing (NOTE [ Host stream failures ]).
    from rtmem import transfers
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    dev, host = DeviceArena("64KiB", backend=be), HostArena("64KiB", backend=be)

    def boom(what):
        def fail():
            raise RuntimeError(f"{what} failed")
        return fail
    user = be.new_stream("user")
    buf = dev.alloc(4096, stream=user)
    gate = threading.Event()
    user.launch_host_func(gate.wait)
    user.launch_host_func(boom("user work"))
    buf.free()
    gate.set()
    with pytest.raises(BackendError, match="user work failed") as err:
        user.synchronize()
    assert isinstance(err.value.__cause__, RuntimeError)
    user.synchronize()                              # reported once
    # the copy stream: work after an offload fails while its source is freed
    d2h = transfers.get_engine(be).d2h
    gate = threading.Event()
    d2h.launch_host_func(gate.wait)
    buf = dev.alloc(4096)
    transfers.offload(buf, arena=host)
    d2h.launch_host_func(boom("work on d2h"))
    buf.free()
    gate.set()
    with pytest.raises(BackendError, match="work on d2h failed"):
        transfers.get_engine(be).synchronize()
    assert dev.stats().allocated_bytes == 0 and host.stats().allocated_bytes == 0
    dev._check_invariants()


@pytest.mark.parametrize("debug", [False, True])
def test_a_free_behind_failed_unrelated_work_frees_with_and_without_debug(debug):
    # A free behind an offload still copying is gated by an event recorded after
    # the copy; unrelated work queued next on the D2H stream fails, which that
    # event covered (it reported the failure until it became a marker, which
    # reports none: NOTE [ Host stream failures ]). The
    # allocator only asks whether the work is over, but the debug PoisonAdaptor
    # synchronized the event: free() raised the unrelated failure and the buffer
    # stayed allocated, under debug alone.
    from rtmem import transfers
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    d2h = transfers.get_engine(be).d2h
    dev = DeviceArena("64KiB", backend=be, debug=debug)
    host = HostArena("64KiB", backend=be)
    gate = threading.Event()
    d2h.launch_host_func(gate.wait)                 # the copy waits behind this
    buf = dev.alloc(4096)
    buf.numpy()[:] = np.arange(4096) % 251 + 1
    transfers.offload(buf, arena=host)

    def boom():
        raise RuntimeError("unrelated work failed")
    d2h.launch_host_func(boom)
    threading.Timer(0.05, gate.set).start()
    buf.free()
    assert buf.is_freed
    assert dev.stats().allocated_bytes == 0 and host.stats().allocated_bytes == 0
    dev._check_invariants()


def test_close_releases_slabs_when_waiting_raises():
    # close() marked the arena closed and emptied its slab list, then the
    # backend's synchronize raised a stream failure: the slabs leaked.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    arena = DeviceArena("64KiB", backend=be)
    slab = arena.slabs[0]

    def boom():
        raise RuntimeError("copy failed")
    bad = be.new_stream("bad")      # the backend holds its streams weakly
    bad.launch_host_func(boom)
    with pytest.raises(BackendError, match="copy failed"):
        arena.close()
    assert slab.host_array is None and arena.slabs == ()


def test_free_waits_for_pinned_views_and_survives_a_collection_inside_the_allocator():
    # NOTE [ Pinned views ] + NOTE [ Frees from finalizers ]: the last view of a
    # freed buffer may die in a garbage collection that starts while the allocator
    # holds its lock (any Python allocation inside it can start one). Not the
    # fixture: its teardown would hang on the lock a deadlocked thread holds.
    dev = DeviceArena("1MiB", backend="host")
    buf = dev.alloc(4096)
    buf.numpy()[:] = 3
    view = buf.numpy(pin=True)
    buf.free()                                   # postponed: a view still reads it
    with pytest.raises(DoubleFreeError):
        buf.free()
    with pytest.raises(UseAfterFreeError):
        buf.numpy(pin=True)
    assert dev.stats().allocated_bytes == 4096 and (view == 3).all()

    class Cycle:
        pass
    c = Cycle()
    c.self, c.view = c, view[1:]                 # a derived view, held by a cycle only
    del c, view

    collect_holding(dev.core._lock)
    assert dev.stats().allocated_bytes == 4096   # deferred ...
    other = dev.alloc(256)                       # ... to the next allocation
    assert dev.stats().allocated_bytes == 256 and buf.is_freed
    other.free()
    # outside a collection the last view frees at once
    buf = dev.alloc(512)
    view = buf.numpy(pin=True)
    buf.free()
    del view
    assert buf.is_freed and dev.stats().allocated_bytes == 0
    dev._check_invariants()


def test_a_free_waiting_for_views_refuses_every_new_view():
    # Only pinned views were refused once free() was waiting for the last one:
    # numpy(), np.asarray, DLPack and offset still answered, and such a view
    # outlived the bytes, which the arena handed to the next allocation.
    dev = DeviceArena(4096, backend="host")
    buf = dev.alloc(4096)
    buf.numpy()[:] = 1
    pinned = buf.numpy(pin=True)
    buf.free()                                    # postponed: a pinned view lives
    for new_view in (buf.numpy, buf.to_numpy, lambda: np.asarray(buf),
                     lambda: np.from_dlpack(buf), lambda: buf.offset,
                     lambda: buf.numpy(pin=True)):
        with pytest.raises(UseAfterFreeError, match="freed .its release waits for views"):
            new_view()
    assert (pinned == 1).all()                    # the existing view still reads it
    assert buf.residency == "freed" and not buf.is_freed   # the bytes are still reserved
    del pinned                                    # the free happens now
    other = dev.alloc(4096)
    other.numpy()[:] = 7
    assert buf.is_freed and dev.stats().allocated_bytes == 4096
    with pytest.raises(UseAfterFreeError, match="was freed; allocate"):
        buf.numpy()


def test_deferred_frees_survive_a_concurrent_flush(monkeypatch):
    # flush() tested the queue, then popped: a thread that saw one deferred free
    # another thread's flush took first got IndexError out of an ordinary alloc.
    import collections

    from rtmem import _deferred
    ran = []

    class RacingQueue(collections.deque):
        def __bool__(self):
            nonempty = len(self) > 0
            if nonempty:                  # another thread's flush empties it now
                collections.deque.popleft(self)()
            return nonempty

    monkeypatch.setattr(_deferred, "queue", RacingQueue([lambda: ran.append(1)]))
    _deferred.flush()
    assert ran == [1] and not _deferred.queue


def test_a_failing_deferred_free_neither_fails_the_alloc_that_flushes_nor_blocks_others(
        monkeypatch):
    # A finalizer's queued free that raised came out of the next, unrelated
    # alloc() (which failed), and the frees queued after it stayed undone.
    import collections

    from rtmem import _deferred
    ran = []

    def broken():
        raise RuntimeError("stream gone")

    monkeypatch.setattr(_deferred, "queue",
                        collections.deque([broken, lambda: ran.append(1)]))
    dev = DeviceArena(1 << 16, backend="host")
    with pytest.warns(RuntimeWarning, match="deferred from a finalizer failed.*stream gone"):
        b = dev.alloc(256)
    assert ran == [1] and not _deferred.queue and b.nbytes == 256
    b.free()
    dev.close()


def test_host_arena_flags_must_be_booleans():
    for kwargs in (dict(pinned="no"), dict(mapped=1)):
        with pytest.raises(TypeError, match="True or False"):
            HostArena(4096, backend="host", **kwargs)


def test_arrays_from_the_array_interface_outlive_close():
    # np.asarray(buf) keeps the slab memory alive, as numpy() views do (a
    # segfault before), and only as long as the array lives: the interface hands
    # numpy the slab slice as its data, so the Buffer remembers nothing (it kept
    # every slab it was ever exported from, trimmed ones included).
    arena = DeviceArena(64 << 20, backend="host")   # big: numpy's memory is mmapped
    buf = arena.alloc(shape=(1 << 20,), dtype=np.float32)
    data = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    buf.numpy()[:] = data
    arr = np.asarray(buf)
    for _ in range(3):
        np.asarray(buf)                     # one kept slab array, not one per call
    assert arr.base is not buf and np.shares_memory(arr, buf.numpy())
    arena.close()
    import gc
    gc.collect()
    assert np.array_equal(arr, data)


def test_buffers_cannot_be_copied_or_pickled(dev):
    import copy
    buf = dev.alloc(64)
    for op in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            op(buf)
    buf.free()          # a copy would have been a second handle on the block


def test_arenas_cannot_be_copied_or_pickled(dev, host):
    # copy.copy made a second handle on the allocator, pickle failed on a
    # WeakSet's closure (AttributeError), deepcopy on a lock
    import copy
    for arena in (dev, host):
        buf = arena.alloc(64)
        for op in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=f"an arena cannot be copied or pickled "
                                                f"\\(a {type(arena).__name__} owns its"):
                op(arena)
        buf.free()
        assert arena.stats().allocated_bytes == 0


def test_repr_of_buffers_of_closed_arenas():
    arena = DeviceArena(1 << 16, backend="host")
    other = DeviceArena(1 << 16, backend="host")
    b = arena.alloc(100)
    arena.close()
    assert "offset=0" in repr(b)
    with pytest.raises(InvalidPointerError):    # not the UseAfterFreeError of repr
        other.free(b)
    other.close()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(nbytes=16, dtype=str), "no item size"),
    (dict(nbytes=16, dtype="V0"), "no item size"),
    (dict(shape=(4,), dtype="S"), "no item size"),
    (dict(shape=(4,), dtype=("f4", (3,))), "subarray"),
])
def test_unsized_and_subarray_dtypes_are_refused(dev, kwargs, fragment):
    before = dev.stats()
    with pytest.raises(TypeError, match=fragment):
        dev.alloc(**kwargs)
    assert dev.stats() == before


def test_trim_does_the_frees_a_collection_deferred():
    # the last view of a freed buffer in a growth slab died in a collection:
    # its free waited for the next allocation, and trim() kept the slab
    arena = DeviceArena(1 << 20, max_bytes=2 << 20, backend="host")
    first, buf = arena.alloc(1 << 20), arena.alloc(1 << 20)   # buf: the growth slab
    view = buf.numpy(pin=True)
    buf.free()

    class Cycle:
        pass
    c = Cycle()
    c.self, c.view = c, view
    del c, view
    collect_holding(arena.core._lock)             # deferred (NOTE [ Frees from finalizers ])
    assert arena.stats().slabs == 2 and not buf.is_freed
    assert arena.trim() == 1 << 20 and buf.is_freed and arena.stats().slabs == 1
    first.free()
    arena._check_invariants()
    arena.close()


def test_trim_gives_growth_slabs_back():
    arena = DeviceArena(1 << 20, max_bytes=3 << 20, backend="host")
    bufs = [arena.alloc(1 << 20) for _ in range(3)]
    assert arena.stats().slabs == 3
    bufs[1].free()
    assert arena.trim() == 1 << 20 and arena.stats().slabs == 2
    for b in (bufs[0], bufs[2]):
        b.free()
    assert arena.trim() == 1 << 20 and arena.stats().reserved_bytes == 1 << 20
    arena._check_invariants()
    arena.close()


def test_trim_after_close_releases_nothing_and_keeps_working():
    # close() empties the slab list; trim() then tried to remove an empty growth
    # slab from it again and raised a bare ValueError (list.remove) after the
    # allocator had already forgotten the slab.
    arena = DeviceArena(4096, max_bytes=16384, growth_bytes=4096, backend="host")
    keep, grown = arena.alloc(4096), arena.alloc(4096)      # grown: in a growth slab
    grown.free()
    arena.close()
    assert arena.trim() == 0 and arena.trim() == 0
    # the slab-source hook takes a trim of the allocator itself after close:
    # close() gave every slab back already, so it releases nothing again
    arena.allocator.trim()
    assert arena.slabs == ()
    keep.free()                                 # freeing stays legal after close
    assert keep.residency == "freed" and arena.stats().allocated_bytes == 0


def _close_while_paused_in_deferred_frees(monkeypatch, arena, call):
    """Run ``call()`` on another thread, paused in the deferred frees it runs first
    (before taking the arena's lock), close the arena meanwhile, then let it go on;
    returns ``[what call() returned or raised]``."""
    from rtmem import _deferred
    entered, go = threading.Event(), threading.Event()

    def paused_free():
        entered.set()
        go.wait(5)
    monkeypatch.setattr(_deferred, "queue", collections.deque([paused_free]))
    outcome = []

    def run():
        try:
            outcome.append(call())
        except Exception as e:      # the caller asserts what it should be
            outcome.append(e)
    t = threading.Thread(target=run)
    t.start()
    assert entered.wait(5)
    arena.close()
    go.set()
    t.join(5)
    return outcome


def test_an_allocation_racing_close_is_refused_and_grows_nothing(monkeypatch):
    # _allocate checked for a closed arena before taking its lock: an allocation
    # paused between that check and the lock (here in the deferred frees it runs
    # first) while another thread closed the arena then took a block of a
    # released slab, or grew a slab nobody would release.
    arena = DeviceArena(4096, max_bytes=16384, growth_bytes=4096, backend="host")
    arena.alloc(4096)                                  # the next one must grow
    outcome = _close_while_paused_in_deferred_frees(monkeypatch, arena,
                                                    lambda: arena.alloc(1024))
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidPointerError), outcome
    assert "is closed" in str(outcome[0]) and arena.slabs == ()


def test_alloc_refuses_unhashable_kinds_bool_shapes_and_bad_dtype_tuples(dev):
    before = dev.stats()
    with pytest.raises(ValueError, match="kind must be one of"):
        dev.alloc(10, kind=["weight"])          # was "unhashable type: 'list'"
    for shape in (True, (True, 2), (2, np.True_)):  # bools, as alloc(True) for nbytes
        with pytest.raises(TypeError, match="shape must be"):
            dev.alloc(shape=shape, dtype=np.uint8)
    with pytest.raises(TypeError, match="not a numpy dtype"):
        dev.alloc(shape=(2,), dtype=(np.int32, -1))  # numpy's bare ValueError
    assert dev.stats() == before
    dev.alloc(10, kind=np.str_("weight")).free()


@pytest.mark.parametrize("shape", [(0, 2 ** 62), (2 ** 63, 0), (1,) * 70])
def test_shapes_numpy_cannot_view_are_refused_at_alloc(dev, shape):
    # They passed as 0 or 4 bytes, and every view of the buffer raised numpy's error.
    before = dev.stats()
    with pytest.raises(ValueError, match="numpy cannot view shape"):
        dev.alloc(shape=shape, dtype=np.float32)
    assert dev.stats() == before
    buf = dev.alloc(shape=(0, 2 ** 40), dtype=np.float32)
    assert np.asarray(buf).shape == (0, 2 ** 40)
    buf.free()


def test_adaptors_must_be_callables_returning_allocators():
    from rtmem.adaptors import StatisticsAdaptor
    with pytest.raises(TypeError, match="sequence of callables"):
        HostArena(4096, backend="host", adaptors=StatisticsAdaptor)   # not iterable
    with pytest.raises(TypeError, match="not an allocator"):
        HostArena(4096, backend="host", adaptors=[lambda up: None])
    a = HostArena(4096, backend="host", adaptors=(StatisticsAdaptor,))
    a.alloc(10).free()
    assert a.allocator.statistics().total_count == 1


def test_an_alignment_beyond_the_backends_is_honoured():
    # Offsets are aligned relative to the slab: a slab at an address the backend
    # aligned less than `alignment` gave buffers at misaligned addresses.
    from rtmem.backends import Slab
    from rtmem.backends.host import HostBackend

    class Shifted(HostBackend):         # slabs 2 KiB past a page boundary
        def device_slab(self, nbytes):
            s = super().device_slab(nbytes + 2048)
            return Slab(self, nbytes, s.ptr + 2048, location="device",
                        device_ptr=s.ptr + 2048, host_array=s.host_array[2048:],
                        owner=s.owner)
    for align in (2048, 4096, 1 << 16):
        arena = DeviceArena(1 << 16, backend=Shifted(), alignment=align,
                            max_bytes=1 << 18, growth_bytes=1 << 16)
        bufs = [arena.alloc(shape=(10000,), dtype=np.float32) for _ in range(2)]  # grows
        assert len(arena.slabs) == 2
        assert all((b.primary.slab.ptr + b.offset) % align == 0 for b in bufs)
        assert all(b.numpy().ctypes.data % align == 0 for b in bufs)
        data = [np.random.default_rng(i).standard_normal(10000, np.float32) for i in (1, 2)]
        for b, d in zip(bufs, data):
            b.numpy()[:] = d
        for b, d in zip(bufs, data):
            assert np.array_equal(b.to_numpy(), d)
        assert arena.stats().reserved_bytes == 1 << 17
        arena._check_invariants()
        arena.close()
    with HostArena(1 << 16, alignment=1 << 14) as host:    # beyond a page
        assert all(host.alloc(100).numpy().ctypes.data % (1 << 14) == 0 for _ in range(4))


@pytest.mark.parametrize("cls", [DeviceArena, HostArena])
def test_debug_must_be_a_bool_as_pinned_and_mapped_are(cls):
    # bool("no") is True: a debug arena (poisoning, slow) was made silently
    with pytest.raises(TypeError, match="debug must be True or False, got 'no'"):
        cls(4096, debug="no")
    assert cls(4096, debug=np.bool_(True)).debug is True


@pytest.mark.parametrize("cls", [DeviceArena, HostArena])
def test_a_debug_arena_frees_its_buffers_after_close(cls):
    # Freeing stays legal after close(); in debug mode the poisoning adaptor
    # filled the block in a slab close() had released: a raw TypeError on the
    # host backend (a memset of freed memory on cuda), and the buffer could
    # never be freed.
    arena = cls(4096, backend="host", debug=True)
    b = arena.alloc(100)
    arena.close()
    b.free()
    assert b.is_freed and arena.stats().allocated_bytes == 0


def test_numpy_bools_are_refused_as_sizes_as_python_bools_are(dev):
    # parse_bytes refused True but took np.True_ through float(): alloc(np.True_)
    # allocated 1 byte, a bool taken as a size.
    from rtmem.errors import UnitError
    for flag in (True, np.True_, np.False_, np.array(True)):
        with pytest.raises(UnitError):
            dev.alloc(flag)
    assert dev.stats().alloc_count == 0


def test_a_pinned_view_of_a_padded_structured_dtype_has_the_buffers_dtype():
    # numpy rebuilt the dtype from the interface's descr, padding as a named
    # void field: the pinned view's dtype differed and copies between views failed
    dt = np.dtype([("a", "u1"), ("b", "<f4")], align=True)
    dev = DeviceArena(1 << 16, backend="host")
    b = dev.alloc(shape=(4,), dtype=dt)
    plain, pinned = b.numpy(), b.numpy(pin=True)
    assert plain.dtype == pinned.dtype == dt
    pinned["b"] = [1.5, 2.5, 3.5, 4.5]
    plain[:] = pinned                      # refused between the two dtypes before
    assert plain["b"].tolist() == [1.5, 2.5, 3.5, 4.5]
    del plain, pinned
    b.free()
    dev.close()


def test_short_lived_streams_do_not_outlive_their_frees():
    # A pending free held its stream, and so the stream's worker thread, until
    # every pending free of the arena was retired at once, which never happens
    # while another stream has work in flight: one thread leaked per stream
    # made for a batch, allocated on, freed on and dropped.
    import gc
    import time
    import weakref
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    arena = DeviceArena("1MiB", backend=be)
    busy, gate = be.new_stream("busy"), threading.Event()
    busy.launch_host_func(gate.wait)               # in flight for the whole loop
    arena.free(arena.alloc(4096, stream=busy))     # pending behind that work
    gc.collect()
    threads = threading.active_count()
    refs = []
    for i in range(40):
        s = be.new_stream(f"batch{i}")
        arena.free(arena.alloc(1024, stream=s))
        refs.append(weakref.ref(s))
        del s
    deadline = time.monotonic() + 10               # the last events complete
    while time.monotonic() < deadline:
        arena.stats()                              # polls the pending frees
        gc.collect()
        if all(r() is None for r in refs) and threading.active_count() <= threads:
            break
        time.sleep(0.01)
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} dropped streams are still referenced"
    assert threading.active_count() <= threads
    assert arena.stats().pending_bytes == 4096     # busy's free still waits
    gate.set()
    arena._check_invariants()
    arena.close()


@pytest.mark.parametrize("cls", [DeviceArena, HostArena])
def test_slab_size_errors_name_the_arenas_own_argument(cls):
    # the allocator core's name leaked: "initial_bytes must be > 0 ... lower
    # initial_bytes", an argument the arenas do not take (a TypeError if passed)
    with pytest.raises(ValueError, match=r"^nbytes must be > 0 bytes, got 0") as info:
        cls(0)
    assert "initial_bytes" not in str(info.value)
    with pytest.raises(ValueError, match=r"below nbytes \(4096 B\); raise max_bytes or "
                                         r"lower nbytes$"):
        cls(4096, max_bytes=1024)


@pytest.mark.parametrize("cls", [DeviceArena, HostArena])
def test_allocator_calls_and_their_per_kind_counts_are_one_step_under_the_stats_lock(cls):
    # NOTE [ Arena accounting ]: an allocation or free and the per-kind counts it
    # changes are one step under _acct_lock, which stats() takes. Without the
    # lock a snapshot taken by another thread meanwhile saw allocated_bytes
    # moved and bytes_by_kind not yet (per-kind totals disagreeing with it).
    # Probed at the allocator, whichever free path is taken (the compute
    # stream's, one gated on a side stream's event).
    from rtmem.adaptors import AllocatorAdaptor
    seen = []

    class Probe(AllocatorAdaptor):
        def allocate(self, nbytes, stream=None):
            block = self.upstream.allocate(nbytes, stream)
            seen.append(("allocate", arena._acct_lock.locked()))
            return block

        def deallocate(self, block, **kw):
            self.upstream.deallocate(block, **kw)
            seen.append(("deallocate", arena._acct_lock.locked()))
    arena = cls(1 << 16, backend="host", adaptors=[Probe])
    arena.alloc(1000, kind="weight").free()
    side = arena.backend.new_stream("side")
    arena.alloc(1000, kind="gradient", stream=side).free()
    assert seen == [("allocate", True), ("deallocate", True)] * 2
    side.synchronize()
    arena._check_invariants()
    arena.close()


def test_a_trim_racing_close_raises_nothing_and_releases_nothing(monkeypatch):
    # trim() checks for a closed arena before taking its lock: a close() on
    # another thread in between (here while trim runs the deferred frees)
    # emptied the slab list, and the allocator giving the empty growth slab back
    # then raised list.remove's bare ValueError out of trim(). Without that
    # raise it returned 4096 and shrank the closed arena's stats: a closed
    # arena's trim() is 0, and its stats keep its slabs.
    arena = DeviceArena(4096, max_bytes=16384, growth_bytes=4096, backend="host")
    keep = arena.alloc(4096)
    arena.alloc(4096).free()                    # an empty growth slab to give back
    reserved = arena.stats().reserved_bytes
    outcome = _close_while_paused_in_deferred_frees(monkeypatch, arena, arena.trim)
    assert outcome == [0] and arena.stats().reserved_bytes == reserved == 8192, outcome
    assert arena.slabs == ()
    keep.free()                                 # freeing stays legal after close
    assert arena.stats().allocated_bytes == 0


@pytest.mark.parametrize("cls", [DeviceArena, HostArena])
def test_a_free_waiting_for_views_holds_in_either_arena_and_refuses_a_second_free(cls):
    # A pinned view of a host placement holds a free as one of a device
    # placement does (Buffer._pins counts both). And buf.free() refuses a second
    # free while the first waits for the views: arena.free(buf) must too, not
    # take it silently as a new postponed free.
    arena = cls(4096, backend="host")
    buf = arena.alloc(1024)
    view = buf.numpy(pin=True)
    arena.free(buf)                             # postponed: the view lives
    assert not buf.is_freed and arena.stats().allocated_bytes == 1024
    with pytest.raises(DoubleFreeError, match="already freed"):
        arena.free(buf)
    assert not buf.is_freed and arena.stats().allocated_bytes == 1024
    del view                                    # the postponed free happens now
    assert buf.is_freed and arena.stats().allocated_bytes == 0
    arena._check_invariants()
    arena.close()


def test_a_free_on_the_host_backends_compute_stream_is_everyones_at_once(dev):
    # The host backend's compute stream is synchronous: when free() returns,
    # the work that used the block is done, so the block is ready for every
    # stream and the CPU at once. Freed in stream order on it instead, it was
    # pending there and another stream got other bytes until a stamp.
    from rtmem.arena import UNORDERED
    side = dev.backend.new_stream("side")
    for stream in (UNORDERED, side):
        b = dev.alloc(4096)
        offset = b.offset
        b.free()
        assert dev.stats().pending_bytes == 0
        other = dev.alloc(4096, stream=stream)
        assert other.offset == offset
        other.free()            # (on side: pending behind an event on side)
    side.synchronize()


def test_frees_from_finalizers_are_skipped_at_interpreter_exit(monkeypatch):
    # NOTE [ Frees from finalizers ]: at interpreter exit the last view of a
    # buffer may die after the CUDA context is gone; its free is not run (the
    # process releases everything anyway), nor queued.
    import types

    from rtmem import _deferred
    monkeypatch.setattr(_deferred, "queue", collections.deque())
    ran = []
    monkeypatch.setattr(_deferred, "sys", types.SimpleNamespace(is_finalizing=lambda: True))
    _deferred.run_or_defer(lambda: ran.append(1))
    assert ran == [] and not _deferred.queue
    monkeypatch.setattr(_deferred, "sys", types.SimpleNamespace(is_finalizing=lambda: False))
    _deferred.run_or_defer(lambda: ran.append(1))
    assert ran == [1]


def test_mapped_implies_pinned_and_pinned_alone_maps_nothing():
    # HostArena: mapped memory is page-locked (cudaHostAllocMapped), so
    # mapped=True pins whatever pinned= says; a pinned arena has no device alias
    for kwargs, pinned, mapped in ((dict(), True, False), (dict(pinned=False), False, False),
                                   (dict(pinned=False, mapped=True), True, True)):
        with HostArena(4096, backend="host", **kwargs) as h:
            assert (h.pinned, h.mapped) == (pinned, mapped), kwargs
            slab = h.slabs[0]
            assert (slab.pinned, slab.mapped, slab.device_ptr is not None) == \
                (pinned, mapped, mapped), kwargs


def test_a_misaligned_slab_is_given_back_and_a_misaligned_device_alias_is_refused():
    # add_slab releases a slab the backend aligned less than the arena's
    # alignment before taking a wider one, and refuses a mapped slab whose
    # device alias is aligned unlike its host side (its buffers' device
    # addresses would be misaligned), giving that slab back too.
    from rtmem.backends import Slab
    from rtmem.backends.host import HostBackend

    class Skewed(HostBackend):
        def __init__(self):
            super().__init__()
            self.made, self.released = [], []

        def device_slab(self, nbytes):          # 2 KiB past a page boundary
            s = super().device_slab(nbytes + 2048)
            self.made.append(nbytes)
            return Slab(self, nbytes, s.ptr + 2048, location="device",
                        device_ptr=s.ptr + 2048, host_array=s.host_array[2048:],
                        owner=s.owner)

        def host_slab(self, nbytes, *, pinned=True, mapped=False):
            s = super().host_slab(nbytes, pinned=pinned, mapped=mapped)
            self.made.append(nbytes)            # page-aligned, its alias 128 B past
            return Slab(self, nbytes, s.ptr, location="host", device_ptr=s.ptr + 128,
                        host_array=s.host_array, pinned=True, mapped=True, owner=s.owner)

        def release(self, slab):
            self.released.append(slab.nbytes)
            super().release(slab)

    backend = Skewed()
    arena = DeviceArena(4096, backend=backend, alignment=4096)
    assert backend.made == [4096, 8192] and backend.released == [4096]
    assert arena.slabs[0].ptr % 4096 == 0
    arena.close()
    assert backend.released == [4096, 4096]     # and the aligned part at close
    backend = Skewed()
    with pytest.raises(ValueError, match="device alias .* is aligned differently"):
        HostArena(4096, backend=backend, mapped=True)
    assert backend.made == [4096, 4352] and backend.released == [4096, 4352]


def _locked_kib():
    """This process's locked memory, KiB (Linux: VmLck of /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/self/status VmLck here (not Linux)")


def test_a_host_backend_with_mlock_locks_its_pinned_slabs_while_they_live():
    # DESIGN §2: the host backend's pinned memory is a numpy slab, "optionally
    # mlocked"; there was no way to ask for it ("pinned" only recorded intent).
    import gc

    import os

    from rtmem.backends.host import HostBackend
    before = _locked_kib()                     # skips off Linux
    import resource
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < 256 * 1024:
        pytest.skip(f"memlock limit {soft} B (ulimit -l) is below the 96 KiB this locks")
    be = HostBackend(mlock=True)
    arena = HostArena("64KiB", backend=be)                 # pinned by default
    mapped = HostArena("32KiB", mapped=True, backend=be)
    assert _locked_kib() - before == 96
    plain = HostArena("64KiB", pinned=False, backend=be)  # pageable: not locked
    dev = DeviceArena("64KiB", backend=be)                  # "device" memory: not locked
    assert _locked_kib() - before == 96
    buf = arena.alloc(1000)
    buf.numpy()[:] = 7
    assert (buf.to_numpy() == 7).all()
    buf.free()
    arena.close()
    assert _locked_kib() - before == 32
    del mapped                                              # no close(): collected
    gc.collect()
    assert _locked_kib() == before
    plain.close(), dev.close()
    assert be.describe()["mlock"] is True


def test_host_mlock_failures_and_switches_are_errors_that_say_what_to_do(monkeypatch):
    import errno

    from rtmem.backends import host as host_backend
    be = host_backend.HostBackend(mlock=True)
    monkeypatch.setattr(host_backend, "_mlock", lambda ptr, nbytes: errno.ENOMEM)
    with pytest.raises(OutOfMemoryError, match=r"memlock limit \(ulimit -l\).*RTMEM_HOST_MLOCK=0"
                       ) as info:
        HostArena("64KiB", backend=be)
    assert info.value.requested == 64 * 1024
    # an arena that grows keeps its state when the locked growth slab is refused
    arena = HostArena("4KiB", max_bytes="64KiB", backend=host_backend.HostBackend())
    arena.backend.mlock = True
    first = arena.alloc(4096)
    before = arena.stats()
    with pytest.raises(OutOfMemoryError, match="could not lock a pinned host slab of 8,192"):
        arena.alloc(8192)
    assert arena.stats() == before and arena.stats().slabs == 1
    first.free()
    arena.close()
    # off by default; RTMEM_HOST_MLOCK switches it for backends made after it is set
    monkeypatch.delenv("RTMEM_HOST_MLOCK", raising=False)
    assert host_backend.HostBackend().mlock is False
    monkeypatch.setenv("RTMEM_HOST_MLOCK", "1")
    assert host_backend.HostBackend().mlock is True
    monkeypatch.setenv("RTMEM_HOST_MLOCK", "0")
    assert host_backend.HostBackend().mlock is False
    monkeypatch.setenv("RTMEM_HOST_MLOCK", "maybe")
    with pytest.raises(BackendError, match="RTMEM_HOST_MLOCK='maybe' is not a switch"):
        host_backend.HostBackend()
    with pytest.raises(TypeError, match="mlock must be True, False or None"):
        host_backend.HostBackend(mlock=1)
