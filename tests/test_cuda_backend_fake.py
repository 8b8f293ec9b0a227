"""The cuda backend's Python logic on CPU, through a fake CuPy (tests/_fake_cupy.py).

The fake keeps device memory at addresses the host cannot dereference, gives
mapped host memory a device alias (equal to the host pointer, or deliberately
different), runs every stream on its own thread and checks the bounds of every
copy, so these tests fail when rtmem passes the wrong pointer, offset, size,
flags, stream or argument order to CuPy, or orders work wrongly. The fake is
installed in ``sys.modules`` by a fixture (undone afterwards) together with fresh
backend / transfer-engine caches, so nothing leaks into other tests.
"""

from __future__ import annotations

import ast
import gc
import pathlib
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import _fake_cupy
from _threads import collect_holding
from rtmem import transfers as T
from rtmem.arena import DeviceArena, HostArena
from rtmem.errors import (BackendError, DoubleFreeError, OutOfMemoryError, ResidencyError,
                          UseAfterFreeError)

ALIAS = 1 << 40            # a device alias of mapped memory != its host pointer


@pytest.fixture(params=[0, ALIAS], ids=["alias=host", "alias!=host"])
def fake(request, monkeypatch):
    import rtmem.backends as backends
    fc = _fake_cupy.build(device=1, device_count=2, device_bytes=64 << 20,
                          host_bytes=64 << 20, alias_offset=request.param)
    for name, module in fc.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_cuda_ok", None)
    monkeypatch.setattr(T, "_engines", {})
    monkeypatch.delenv("RTMEM_BACKEND", raising=False)
    yield fc
    try:
        fc.synchronize_all()
        assert not fc.async_errors, fc.async_errors
    finally:
        fc.shutdown()


@pytest.fixture
def backend(fake):
    import rtmem.backends as backends
    from rtmem.backends.cuda import CudaBackend
    b = backends._instances["cuda"] = CudaBackend()   # also what get_backend() returns
    return b


def _device_view(fake, buf):
    """What a GPU kernel sees of ``buf`` (through its CUDA array interface)."""
    cai = buf.__cuda_array_interface__
    raw = fake.host_view(cai["data"][0], buf.nbytes)
    return raw.view(buf.dtype).reshape(buf.shape)


# ---------------------------------------------------------------- selection
def test_selection_and_doctor_see_the_fake_gpu(fake, monkeypatch):
    from rtmem import backends, doctor
    from rtmem.backends.cuda import CudaBackend
    assert backends.cuda_available() and backends.backend_name() == "cuda"
    b = backends.get_backend()
    assert isinstance(b, CudaBackend) and b is backends.get_backend("cuda")
    assert b.device_id == 1
    report = doctor.collect()
    dev = report["cuda"]["devices"]
    assert report["gpu_usable"] and len(dev) == 2
    assert dev[0]["name"] == "Fake H200" and dev[0]["compute_capability"] == "9.0"
    assert dev[0]["can_map_host_memory"] and dev[0]["total_bytes"] == 64 << 20
    assert "gpu 1            Fake H200" in "\n".join(doctor._lines(report))


def test_no_device_is_a_backend_error(fake):
    from rtmem.backends.cuda import CudaBackend
    fake.device_count = 0
    with pytest.raises(BackendError, match="no CUDA device"):
        CudaBackend()

    def broken():
        raise _fake_cupy.CUDARuntimeError(101)
    fake.modules["cupy.cuda.runtime"].getDeviceCount = broken
    with pytest.raises(BackendError, match="no usable CUDA device"):
        CudaBackend()


# -------------------------------------------------------------------- slabs
def test_slabs_use_the_right_calls_and_are_freed(fake, backend):
    rt = fake.modules["cupy.cuda.runtime"]
    d = DeviceArena(1 << 20, backend=backend)
    p = HostArena(1 << 20, backend=backend)
    m = HostArena(1 << 20, mapped=True, backend=backend)
    u = HostArena(1 << 20, pinned=False, backend=backend)
    assert fake.calls_named("malloc") == [(1 << 20,)]
    assert fake.calls_named("hostAlloc") == [(1 << 20, rt.hostAllocPortable),
                                             (1 << 20, rt.hostAllocPortable
                                              | rt.hostAllocMapped)]
    ds, ps, ms, us = d.slabs[0], p.slabs[0], m.slabs[0], u.slabs[0]
    assert ds.location == "device" and ds.host_array is None and ds.device_ptr == ds.ptr
    assert ds.ptr >= _fake_cupy.DEVICE_BASE          # a device address
    assert ps.pinned and not ps.mapped and ps.device_ptr is None
    assert ms.mapped and ms.device_ptr == rt.pointerGetAttributes(ms.ptr).devicePointer
    assert ms.device_ptr == ms.ptr + fake.alias_offset
    assert not us.pinned and us.host_array is not None
    # the host views are the allocations' bytes
    ps.host_array[:4] = [1, 2, 3, 4]
    assert list(fake.host_view(ps.ptr, 4)) == [1, 2, 3, 4]
    ms.host_array[8] = 9
    assert fake.host_view(ms.device_ptr + 8, 1)[0] == 9
    for a in (d, p, m, u):
        a.close()
    assert fake.live == {}                           # every slab given back once
    assert len(fake.calls_named("free")) == 1 and len(fake.calls_named("freeHost")) == 2


@pytest.mark.parametrize("kw", [{"mapped": True}, {}], ids=["mapped", "pinned"])
def test_host_arena_reuses_completed_frees_before_carving_free_space(fake, backend, kw):
    # A host buffer's free is gated by an event on the compute stream. Once that
    # event had completed the block still sat in the pending index until an
    # allocation missed, so the next allocation carved the free tail instead
    # (offset 256, not 0) and a pending block never merged with its ready
    # neighbours: after a few small cycles the arena, entirely free and
    # synchronized, could not hold four quarters of itself.
    rng = np.random.default_rng()
    quarter = 256 * int(rng.integers(2, 6))
    arena = HostArena(4 * quarter, backend=backend, **kw)
    for _ in range(int(rng.integers(1, 4))):
        buf = arena.alloc(256)
        assert buf.placement("host").offset == 0     # the completed free's bytes
        buf.free()
        backend.synchronize()
    bufs = [arena.alloc(quarter) for _ in range(4)]
    assert sorted(b.placement("host").offset for b in bufs) == \
        [i * quarter for i in range(4)]
    for b in bufs:
        b.free()
    arena.close()


def _alloc_stream(backend, which):
    from rtmem import UNORDERED
    return {"compute": backend.current_stream, "other": backend.new_stream,
            "unordered": lambda: UNORDERED}[which]()


@pytest.mark.parametrize("which", ["compute", "other", "unordered"])
def test_device_arena_carves_free_bytes_away_from_a_pending_free(fake, backend, which):
    # A DeviceArena's frees on the compute stream are stamped lazily and stay
    # pending after a synchronize rtmem does not see (CuPy's or torch's); a
    # pending block merges with no free neighbour, and best fit carved the head
    # of the free bytes right after it, walling it in: the arena, every buffer
    # freed and the device synchronized, could not hold four quarters of
    # itself. Now the tail is carved, and the free head merges with the
    # pending block once it retires.
    rng = np.random.default_rng()
    quarter = 256 * int(rng.integers(2, 6))
    arena = DeviceArena(4 * quarter, backend=backend)
    stream = _alloc_stream(backend, which)
    cupy_sync = fake.modules["cupy.cuda.runtime"].deviceSynchronize
    small = 256 * int(rng.integers(1, quarter // 256))
    for _ in range(int(rng.integers(1, 4))):
        buf = arena.alloc(small)
        assert buf.placement("device").offset == 0
        buf.free()
        cupy_sync()
    bufs = [arena.alloc(quarter, stream=stream) for _ in range(4)]
    assert sorted(b.placement("device").offset for b in bufs) == \
        [i * quarter for i in range(4)]
    arena.allocator._check_invariants()
    for b in bufs:
        b.free()
    cupy_sync()
    whole = arena.alloc(4 * quarter, stream=stream)
    assert whole.placement("device").offset == 0
    whole.free()
    arena.close()


def test_device_arena_synchronize_retires_stream_ordered_frees(fake, backend):
    # backend.synchronize() left a DeviceArena's stream-ordered frees pending (no
    # event until a lazy stamp), each merged with no neighbour pending on another
    # stream: after "free everything, synchronize", refills of random sizes on
    # two streams took pieces of those blocks and fragmented the arena until an
    # allocation failed (OutOfMemoryError). Now synchronize() retires them.
    rng = np.random.default_rng()
    quarter = 256 * int(rng.integers(2, 6))
    units = 4 * quarter // 256
    arena = DeviceArena(4 * quarter, backend=backend)
    streams = [backend.current_stream(), backend.new_stream()]
    bufs = [arena.alloc(quarter, stream=streams[i % 2]) for i in range(4)]
    for _ in range(int(rng.integers(2, 5))):
        for b in bufs:
            b.free()
        backend.synchronize()
        st = arena.allocator.stats()
        assert (st.pending_bytes, st.largest_free_bytes) == (0, 4 * quarter)
        k = int(rng.integers(1, min(units, 6)))
        cuts = np.sort(rng.choice(np.arange(1, units), k, replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [units]])) * 256
        rng.shuffle(sizes)
        bufs = [arena.alloc(int(s), stream=streams[int(rng.integers(2))]) for s in sizes]
        arena.allocator._check_invariants()
    for b in bufs:
        b.free()
    arena.close()


def test_dropped_arenas_give_their_slabs_back(fake, backend):
    # _CudaAlloc had no finalizer: an arena dropped without close() kept its
    # cudaMalloc / cudaHostAlloc slabs until the process ended.
    for _ in range(3):
        d = DeviceArena(8 << 20, backend=backend)
        h = HostArena(4 << 20, mapped=True, backend=backend)
        d.alloc(1000).free()
        del d, h
        gc.collect()
        assert fake.live == {}
    # A numpy view of pinned memory keeps the allocation alive, arena or not.
    h = HostArena(1 << 16, backend=backend)
    buf = h.alloc(shape=(16,), dtype=np.float32)
    view = buf.numpy()[2:]
    view[:] = np.arange(14, dtype=np.float32) + 0.5
    del h, buf
    gc.collect()
    assert len(fake.live) == 1 and view[3] == 3.5
    del view
    gc.collect()
    assert fake.live == {}
    assert len(fake.calls_named("freeHost")) == 4 and len(fake.calls_named("free")) == 3


def test_arenas_dropped_after_synchronizing_a_copy_give_their_slabs_back(fake, backend):
    # The engine kept the slabs of a completed copy until the next copy polled
    # it: arenas dropped after synchronize(buf) / synchronize(event) held their
    # GPU and pinned memory meanwhile (a new arena of that size could not fit).
    for by_event in (False, True):
        d = DeviceArena(1 << 20, backend=backend)
        h = HostArena(1 << 20, backend=backend)
        b = d.alloc(4096)
        event = T.offload(b, arena=h)
        T.synchronize(event if by_event else b)
        b.free()
        del d, h, b, event
        gc.collect()
        assert fake.live == {}


def test_empty_or_negative_slabs_are_refused_as_on_the_host_backend(fake, backend):
    # The host backend refused them; cuda asked cudaMalloc for 0 bytes (a slab
    # at the null pointer) or passed -1 on (an OverflowError inside CuPy).
    from rtmem.backends import get_backend
    for be in (get_backend("host"), backend):
        for n in (0, -1):
            with pytest.raises(ValueError, match="slab size must be > 0"):
                be.device_slab(n)
            for pinned in (True, False):
                with pytest.raises(ValueError, match="slab size must be > 0"):
                    be.host_slab(n, pinned=pinned)
    assert not fake.calls_named("malloc") and not fake.calls_named("hostAlloc")


def test_mapped_host_slabs_are_pinned_on_both_backends(fake, backend):
    # cudaHostAlloc(Mapped) memory is page-locked whatever pinned= says; the
    # host backend's twin must say so too
    from rtmem.backends import get_backend
    for be in (get_backend("host"), backend):
        slab = be.host_slab(4096, pinned=False, mapped=True)
        assert slab.pinned and slab.mapped and slab.device_ptr is not None
        be.release(slab)


def test_spans_outside_a_slab_are_refused_by_both_backends(fake, backend):
    # The host backend sliced a bad span short (a negative size copied nearly the
    # whole slab; a span past the end copied less, or failed later on the copy
    # thread); cuda passed it to CUDA, and memset kept the low byte of 300.
    from rtmem.backends import get_backend
    for be in (get_backend("host"), backend):
        d = DeviceArena(1 << 12, backend=be)
        h = HostArena(1 << 12, backend=be)
        ds, hs = d.slabs[0], h.slabs[0]
        stream = be.new_stream("span")
        for dst_off, src_off, n in ((0, 0, -5), (0, 4000, 100), (4000, 0, 100), (-1, 0, 1)):
            with pytest.raises(ValueError, match="do not fit"):
                be.copy_async(ds, dst_off, hs, src_off, n, stream)
        for slab in (ds, hs):
            with pytest.raises(ValueError, match="do not fit"):
                be.fill(slab, 4090, 10, 1)
            with pytest.raises(ValueError, match="do not fit"):
                be.read(slab, 0, 5000)
            with pytest.raises(ValueError, match="byte"):
                be.fill(slab, 0, 10, 300)
        stream.synchronize()                        # nothing bad was enqueued
        hs.host_array[:] = 7
        be.copy_async(ds, 4000, hs, 0, 96, stream)  # a span that fits, to the last byte
        stream.synchronize()
        assert (be.read(ds, 4000, 96) == 7).all()
        d.close()
        h.close()
    assert not fake.calls_named("memsetAsync")


def test_numpy_views_of_pinned_memory_outlive_arena_close(fake, backend):
    # close() called cudaFreeHost under live numpy views (valid after close() on
    # the host backend): reading one read freed pinned memory (a segfault).
    for mapped in (False, True):
        h = HostArena(1 << 16, mapped=mapped, backend=backend)
        ptr = h.slabs[0].ptr
        buf = h.alloc(shape=(16,), dtype=np.float32)
        view = buf.numpy()[2:]
        view[:] = 1.5
        h.close()
        assert ptr in fake.live                     # the view still holds it
        assert (view == 1.5).all()
        del view
        gc.collect()
        assert ptr not in fake.live                 # freed with the last view
    h = HostArena(1 << 16, backend=backend)         # no view: freed by close() itself
    h.alloc(64).numpy()[:] = 1
    h.close()
    assert fake.live == {}
    assert len(fake.calls_named("freeHost")) == 3


class _Capsule:
    """A DLPack capsule taken earlier, for np.from_dlpack to read later."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


def test_device_views_outlive_arena_close(fake, backend):
    # close() cudaFree'd each device slab explicitly, under live views of its
    # buffers: the CUDA-array-interface export torch.as_tensor wraps (pinned), a
    # CuPy array, a DLPack capsule. They then pointed at freed GPU memory (the
    # fake's FREED bytes), where numpy views of host memory stay valid after close().
    def read_export(b):
        export = b._export(None, cuda=True)
        ptr = export.__cuda_array_interface__["data"][0]
        return export, lambda: fake.host_view(ptr, b.nbytes).view(np.float32).copy()

    def read_cupy(b):
        arr = b.cupy()
        return arr, arr.get

    def read_dlpack(b):
        capsule = _Capsule(b.__dlpack__())
        return capsule, lambda: np.from_dlpack(capsule).view(np.float32).copy()

    rng = np.random.default_rng()
    for make in (read_export, read_cupy, read_dlpack):
        d = DeviceArena(1 << 16, backend=backend)
        ptr = d.slabs[0].ptr
        buf = d.alloc(shape=(64,), dtype=np.float32)
        data = rng.standard_normal(64).astype(np.float32)
        _device_view(fake, buf)[:] = data
        view, read = make(buf)
        d.close()
        assert ptr in fake.live                     # the view still holds the slab
        np.testing.assert_array_equal(read(), data)
        buf.free()                                  # legal after close
        del view, read
        gc.collect()
        assert ptr not in fake.live                 # freed with the last view
    d = DeviceArena(1 << 16, backend=backend)       # no view: freed by close() itself
    d.alloc(64)
    d.close()
    assert fake.live == {}
    assert len(fake.calls_named("free")) == 4


def test_pinned_cupy_views_keep_their_bytes_through_free_and_evict(fake, backend):
    # buf.cupy() had no pin= (numpy() and as_tensor have one): a CuPy view kept
    # past buf.free() read and wrote the next allocation of the arena, which took
    # the same block. A pinned one holds the block until it and the arrays over
    # it (a DLPack capsule here) are gone, as numpy(pin=True) views do.
    rng = np.random.default_rng()
    d = DeviceArena(1 << 16, backend=backend)
    m = HostArena(1 << 16, mapped=True, backend=backend)
    buf = d.alloc(shape=(64,), dtype=np.float32)
    plain = buf.cupy()                              # unpinned: valid until the free
    buf.free()
    other = d.alloc(shape=(64,), dtype=np.float32)  # takes the block at once
    data = rng.standard_normal(64).astype(np.float32)
    _device_view(fake, other)[:] = data
    np.testing.assert_array_equal(plain.get(), data)   # the next buffer's bytes
    del plain
    other.free()
    for arena in (d, m):
        data = rng.standard_normal(64).astype(np.float32)
        buf = arena.alloc(shape=(64,), dtype=np.float32)
        _device_view(fake, buf)[:] = data
        view = buf.cupy(pin=True)
        capsule = _Capsule(view.__dlpack__())
        buf.free()                                  # postponed: a view still reads it
        with pytest.raises(DoubleFreeError):
            buf.free()
        for new_view in (buf.cupy, lambda: buf.cupy(pin=True)):
            with pytest.raises(UseAfterFreeError, match="its release waits for views"):
                new_view()
        other = arena.alloc(shape=(64,), dtype=np.float32)
        assert other.offset != view.data.ptr - arena.slabs[0].device_ptr
        _device_view(fake, other)[:] = -data
        np.testing.assert_array_equal(view.get(), data)
        del view
        gc.collect()
        assert not buf.is_freed                     # the capsule holds the array
        np.testing.assert_array_equal(np.from_dlpack(capsule).view(np.float32), data)
        del capsule
        gc.collect()
        assert buf.is_freed and arena.stats().allocated_bytes == other.nbytes
        other.free()
        arena._check_invariants()
    # evict / drop_host refuse the copy a pinned view reads; the other copy may go
    h = HostArena(1 << 16, backend=backend)
    buf = d.alloc(shape=(64,), dtype=np.float32)
    T.offload(buf, arena=h)
    T.synchronize(buf)
    view = buf.cupy("device", pin=True)
    with pytest.raises(ResidencyError, match=r"pinned view.*cupy\(pin=True\)"):
        T.evict(buf)
    T.drop_host(buf)
    assert buf.residency == "device"
    del view
    gc.collect()
    T.offload(buf, arena=h)
    T.synchronize(buf)
    T.evict(buf)
    assert buf.residency == "host"
    with pytest.raises(ResidencyError, match="mapped=True"):   # host-only memory,
        buf.cupy(pin=True)                                     # pinned or not
    assert buf._pins == 0
    buf.free()


def test_out_of_memory_leaves_the_arena_unchanged(fake, backend):
    with pytest.raises(OutOfMemoryError, match="cudaMalloc") as exc:
        DeviceArena(128 << 20, backend=backend)
    assert exc.value.requested == 128 << 20
    d = DeviceArena(1 << 20, max_bytes=8 << 20, growth_bytes=1 << 20, backend=backend)
    a = d.alloc(1 << 20)
    before = d.stats()
    fake.fail_malloc = True
    with pytest.raises(OutOfMemoryError):
        d.alloc(4096)                                # needs a second slab
    after = d.stats()
    assert (after.allocated_bytes, after.reserved_bytes, after.slabs, after.live_blocks) == \
        (before.allocated_bytes, before.reserved_bytes, before.slabs, before.live_blocks)
    d._check_invariants()
    fake.fail_malloc = False
    b = d.alloc(4096)                                # and it still works
    assert d.stats().slabs == 2
    a.free()
    b.free()
    fake.fail_host_alloc = True
    with pytest.raises(OutOfMemoryError, match="cudaHostAlloc"):
        HostArena(1 << 20, backend=backend)
    d.close()
    assert fake.live == {}


# ------------------------------------------------------------ interfaces
def test_array_interfaces_point_at_the_right_bytes(fake, backend):
    d = DeviceArena(1 << 20, backend=backend)
    m = HostArena(1 << 20, mapped=True, backend=backend)
    p = HostArena(1 << 20, backend=backend)
    d.alloc(1000)                                    # so offsets are not 0
    m.alloc(1000)
    p.alloc(1000)
    db = d.alloc(shape=(3, 5), dtype=np.float32)
    mb = m.alloc(shape=(7,), dtype=np.int64)
    pb = p.alloc(shape=(6,), dtype=np.float64)
    cai = db.__cuda_array_interface__
    assert cai["data"] == (d.slabs[0].ptr + db.offset, False) and db.offset > 0
    assert cai["shape"] == (3, 5) and cai["typestr"] == "<f4" and cai["version"] == 3
    assert not hasattr(db, "__array_interface__")
    with pytest.raises(ResidencyError, match="not host-addressable"):
        db.numpy()
    # mapped host memory: the GPU sees the device alias, the CPU the host pointer
    mcai = mb.__cuda_array_interface__
    assert mcai["data"][0] == m.slabs[0].device_ptr + mb.offset
    assert np.asarray(mb).ctypes.data == m.slabs[0].ptr + mb.offset
    with pytest.raises(TypeError, match="not host-addressable"):
        np.asarray(db)                              # was a 0-d object array
    mb.numpy()[:] = np.arange(7) * 11
    np.testing.assert_array_equal(_device_view(fake, mb), np.arange(7) * 11)
    _device_view(fake, mb)[2] = -5                   # a kernel writes host memory
    assert mb.numpy()[2] == -5
    # pinned, not mapped: host only; cupy() refuses it as numpy() refuses device
    # memory (a bare AttributeError from the attribute came out of the method)
    assert not hasattr(pb, "__cuda_array_interface__")
    with pytest.raises(ResidencyError, match="mapped=True"):
        pb.cupy()
    assert np.asarray(pb).ctypes.data == p.slabs[0].ptr + pb.offset
    # a kernel writes the device buffer; to_numpy copies it back
    _device_view(fake, db)[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(db.to_numpy(), np.arange(15).reshape(3, 5))
    arr = db.cupy()
    assert arr.data.ptr == cai["data"][0] and arr.data.device_id == 1
    # after close the pointers dangle: refused like numpy() and DLPack (the CUDA
    # interface and cupy() handed them out)
    d.close()
    for use in (lambda: db.__cuda_array_interface__, db.cupy):
        with pytest.raises(UseAfterFreeError, match="was closed"):
            use()


def test_zero_size_buffers_export_a_null_cuda_pointer(fake, backend):
    # the CUDA array interface asks for 0 when there are no elements; the block's
    # address was handed out (the next allocation's first byte)
    d = DeviceArena(1 << 20, backend=backend)
    m = HostArena(1 << 20, mapped=True, backend=backend)
    d.alloc(1000)
    for arena in (d, m):
        empty = arena.alloc(shape=(0, 4), dtype=np.float32)
        cai = empty.__cuda_array_interface__
        assert cai["data"] == (0, False) and cai["shape"] == (0, 4)
        assert empty.cupy().size == 0
        full = arena.alloc(shape=(2,), dtype=np.float32)
        assert full.__cuda_array_interface__["data"][0] != 0


def test_dlpack_forwards_the_protocol_arguments(fake, backend):
    d = DeviceArena(1 << 20, backend=backend)
    p = HostArena(1 << 20, backend=backend)
    db = d.alloc(shape=(4,), dtype=np.float32)
    pb = p.alloc(shape=(4,), dtype=np.float32)
    pb.numpy()[:] = [1, 2, 3, 4]
    assert db.__dlpack_device__() == (2, 1)          # kDLCUDA on the backend's device
    assert pb.__dlpack_device__() == (1, 0)          # kDLCPU
    # what torch >= 2.x / CuPy pass to a producer
    db.__dlpack__(stream=7, max_version=(1, 0), copy=None)
    assert fake.dlpack_calls[-1] == dict(stream=7, max_version=(1, 0), dl_device=None,
                                         copy=None)
    db.__dlpack__(stream=1, max_version=(1, 0), dl_device=(2, 1))
    assert fake.dlpack_calls[-1]["dl_device"] == (2, 1)
    n_calls = len(fake.dlpack_calls)
    # host memory: numpy's capsule (no stream for kDLCPU); real consumers take it
    np.testing.assert_array_equal(np.from_dlpack(pb), [1, 2, 3, 4])
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(pb)                       # passes max_version=(1, 0)
    t[0] = 10
    assert pb.numpy()[0] == 10 and len(fake.dlpack_calls) == n_calls


# -------------------------------------------------------------- transfers
def test_offload_prefetch_copy_round_trips(fake, backend):
    d = DeviceArena(4 << 20, backend=backend)
    h = HostArena(4 << 20, backend=backend)
    rng = np.random.default_rng(0)
    bufs, sums = [], []
    for i in range(12):
        b = d.alloc(shape=(1000 + 77 * i,), dtype=np.float32)
        _device_view(fake, b)[:] = rng.standard_normal(b.shape, dtype=np.float32)
        bufs.append(b)
        sums.append(zlib.crc32(b.to_numpy().tobytes()))
    for _ in range(3):
        for b in bufs:
            T.offload(b, arena=h)
        for b in bufs[::2]:
            T.evict(b)                               # evict while the copy may run
        T.synchronize()
        for b in bufs[1::2]:
            T.evict(b)
        for b in bufs:
            assert b.residency == "host"
            assert zlib.crc32(b.numpy().tobytes()) == sums[bufs.index(b)]
        for b in reversed(bufs):
            T.prefetch(b)
        for b in bufs:
            T.synchronize(b)
            T.drop_host(b)
    for b, s in zip(bufs, sums):
        assert b.residency == "device" and zlib.crc32(b.to_numpy().tobytes()) == s
    # copy: device -> device of another buffer, then device -> host
    dst = d.alloc(shape=bufs[3].shape, dtype=np.float32)
    T.synchronize(T.copy(dst, bufs[3]))
    assert zlib.crc32(dst.to_numpy().tobytes()) == sums[3]
    hdst = h.alloc(shape=bufs[4].shape, dtype=np.float32)
    T.synchronize(T.copy(hdst, bufs[4]))
    assert zlib.crc32(hdst.numpy().tobytes()) == sums[4]
    kinds = {args[3] for args in fake.calls_named("memcpyAsync")}
    streams = {args[4] for args in fake.calls_named("memcpyAsync")}
    eng = T.get_engine(backend)
    assert kinds == {fake.modules["cupy.cuda.runtime"].memcpyDefault}
    assert streams == {eng.h2d.ptr, eng.d2h.ptr} and 0 not in streams
    for b in bufs + [dst, hdst]:
        b.free()
    eng.synchronize()
    assert eng.in_flight == 0
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0
    d._check_invariants()
    h._check_invariants()


def test_copies_wait_for_their_stream_and_free_is_stream_ordered(fake, backend):
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(1 << 16)
    device_offset = b.offset
    _device_view(fake, b)[:] = 3
    eng = T.get_engine(backend)
    gate = threading.Event()
    eng.d2h.launch_host_func(gate.wait)
    ev = T.offload(b, arena=h)
    assert not ev.query() and b.residency == "in-flight"
    T.evict(b)                                       # device block freed after the copy
    before = d.stats()
    assert before.pending_bytes == 1 << 16           # ... gated on the copy's event
    c = d.alloc(1 << 16)                             # so this gets other bytes
    assert c.offset != device_offset
    gate.set()
    deadline = time.monotonic() + 10
    while not ev.query():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert b.residency == "host" and (b.numpy() == 3).all()
    b.free()
    c.free()


def test_alloc_takes_rtmem_cuda_streams_not_raw_cupy_ones(fake, backend):
    d = DeviceArena(1 << 16, backend=backend)
    raw = fake.modules["cupy"].cuda.Stream()
    with pytest.raises(TypeError, match="cuda backend.*got Stream"):
        d.alloc(256, stream=raw)                     # wrap it: CudaStream(raw)
    assert d.stats().allocated_bytes == 0
    side = backend.new_stream()
    b = d.alloc(256, stream=side)
    assert b._device.block.stream == side            # reuse keyed by the stream
    b.free()


def _count_new_events(backend, monkeypatch) -> list:
    """A list that gets an entry for every event ``backend`` makes from now on."""
    made = []
    real_new_event = backend.new_event
    monkeypatch.setattr(backend, "new_event", lambda: made.append(1) or real_new_event())
    return made


def test_compute_stream_frees_record_no_event_and_fence_other_streams(
        fake, backend, monkeypatch):
    d = DeviceArena(1 << 16, backend=backend)
    made = _count_new_events(backend, monkeypatch)
    gate = threading.Event()
    backend.current_stream().launch_host_func(gate.wait)   # earlier work still runs
    b = d.alloc(1 << 15)
    offset = b.offset
    b.free()
    again = d.alloc(1 << 15)                   # the compute stream reuses it at once
    assert again.offset == offset and made == []
    again.free()
    copy = backend.new_stream("copy")
    other = d.alloc(1 << 15, stream=copy)      # another stream gets other bytes
    assert other.offset != offset and made == []
    other.free()        # a copy-stream block: freed behind an event on that stream
    assert len(made) == 2       # (and one fencing the compute work before it)
    made.clear()
    # Only the freed bytes fit: the copy stream's allocation stamps the compute
    # stream's frees with one event and waits for it, i.e. for the gated work.
    threading.Timer(0.2, gate.set).start()
    whole = d.alloc(1 << 16, stream=copy)
    assert gate.is_set() and whole.offset == 0 and len(made) == 1
    whole.free()
    d._check_invariants()


def test_a_stream_reuses_its_pending_free_with_the_free_bytes_beside_it_at_once(
        fake, backend):
    # Only the compute stream's own pending free plus the free bytes after it
    # held the request: best fit found no single block and the allocation waited
    # for the stamp, i.e. for all the gated work on the stream (a host stall).
    # Stream order allows the compute stream to reuse its own free at once.
    rng = np.random.default_rng()
    d = DeviceArena(1 << 16, backend=backend)
    half = 256 * int(rng.integers(129, 250))       # more than the free rest
    gate = threading.Event()
    backend.current_stream().launch_host_func(gate.wait)   # earlier work still runs
    got = {}
    try:
        b = d.alloc(half)
        offset = b.offset
        b.free()
        need = half + 256 * int(rng.integers(1, ((1 << 16) - half) // 256 + 1))
        worker = threading.Thread(target=lambda: got.setdefault("buf", d.alloc(need)))
        worker.start()
        worker.join(timeout=10)                 # not forever if it does wait
        assert "buf" in got, "the allocation waited for the gated compute stream"
        assert got["buf"].offset == offset and d.stats().pending_bytes == 0
        d._check_invariants()
    finally:
        gate.set()
        worker.join()
    got["buf"].free()
    d._check_invariants()


def test_a_buffer_for_another_wrapper_of_the_compute_stream_frees_as_compute_ones_do(
        fake, backend, monkeypatch):
    # _release compares streams by equality: a second CudaStream of the compute
    # stream's handle is the compute stream, so the free is the compute
    # stream's (no event, reused there at once), not a side stream's behind
    # two events (one on it, one fencing the compute work)
    from rtmem.backends.cuda import CudaStream
    d = DeviceArena(1 << 16, backend=backend)
    made = _count_new_events(backend, monkeypatch)
    compute = backend.current_stream()
    twin = CudaStream(compute.raw, "twin")
    assert twin == compute and twin is not compute
    b = d.alloc(1 << 15, stream=twin)
    offset = b.offset
    b.free()
    again = d.alloc(1 << 15)
    assert again.offset == offset and made == []
    again.free()
    d._check_invariants()


def test_host_arena_gives_the_cpu_bytes_only_after_the_gpu_is_done(fake, backend):
    h = HostArena(1 << 16, backend=backend)
    gate = threading.Event()
    compute = backend.current_stream()
    compute.launch_host_func(gate.wait)        # a GPU copy may still read the bytes
    b = h.alloc(1 << 15)
    offset = b.offset
    b.free()
    cpu = h.alloc(1 << 15)                     # default: for the CPU, other bytes
    assert cpu.offset != offset
    staged = h.alloc(1 << 14, stream=compute)  # GPU-only staging: reused at once
    assert staged.offset == offset
    gate.set()
    compute.synchronize()
    staged.free()
    compute.synchronize()
    again = h.alloc(1 << 15)                   # the GPU is past the free: reusable
    assert again.offset == offset
    for x in (cpu, again):
        x.free()
    h._check_invariants()


def test_gpu_suite_events_script_runs_on_the_fake(fake, capsys):
    # tests/test_backend_gpu.py runs this script in a child process on a real GPU;
    # read it from the source (importing that module would probe for a GPU).
    tree = ast.parse(pathlib.Path(__file__).with_name("test_backend_gpu.py").read_text())
    script = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign)
                  and getattr(node.targets[0], "id", "") == "_EVENTS_ORDER_COPIES")
    exec(compile(script, "<events>", "exec"), {})
    assert capsys.readouterr().out.strip() == "ok"


def test_copy_of_a_released_slab_is_refused(fake, backend):
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(4096)
    slab = d.slabs[0]
    d.close()
    with pytest.raises(UseAfterFreeError, match="was closed"):
        T.offload(b, arena=h)       # the buffer layer refuses first ...
    with pytest.raises(BackendError, match="released"):
        backend.copy_async(h.slabs[0], 0, slab, 0, 16, None)   # ... and the backend


def test_a_failed_copy_is_a_backend_error_and_changes_nothing(fake, backend, monkeypatch):
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(shape=(1000,), dtype=np.float32, kind="weight")
    _device_view(fake, b)[:] = np.random.default_rng(3).standard_normal(1000, np.float32)
    def state():   # what a failed copy must leave as it was (not the op counters)
        return (b.to_numpy().tobytes(), b.residency,
                *((s.allocated_bytes, s.reserved_bytes, s.live_blocks, s.bytes_by_kind)
                  for s in (d.stats(), h.stats())))
    before = state()

    def sticky(*args):
        raise _fake_cupy.CUDARuntimeError(700)    # an earlier kernel's illegal address
    monkeypatch.setattr(fake.modules["cupy.cuda.runtime"], "memcpyAsync", sticky)
    with pytest.raises(BackendError, match="cudaMemcpyAsync of 4,000 bytes.*earlier kernel"):
        T.offload(b, arena=h)
    monkeypatch.undo()
    assert state() == before
    T.offload(b, arena=h)                          # the next copy works
    T.synchronize(b)
    T.evict(b)
    assert b.to_numpy().tobytes() == before[0]


def _offload_failing_later(fake, monkeypatch, buf, host):
    """Offload ``buf`` to ``host`` with a copy that fails on its stream, later
    (a sticky cudaErrorIllegalAddress, as a kernel fault leaves), and return
    the offload's event; later copies work."""
    runtime = fake.modules["cupy.cuda.runtime"]
    real = runtime.memcpyAsync

    def faulting(dst, src, size, kind, stream):
        def fault():
            raise _fake_cupy.CUDARuntimeError(700)
        fake._stream_of(stream)._enqueue(fault)
    monkeypatch.setattr(runtime, "memcpyAsync", faulting)
    try:
        return T.offload(buf, arena=host)
    finally:
        monkeypatch.setattr(runtime, "memcpyAsync", real)


def test_wait_never_blocks_nor_reports_and_synchronize_raises_a_failed_copy(
        fake, backend, monkeypatch):
    # NOTE [ Copy failures at synchronize ]: wait() with no argument only orders
    # the compute stream (it must not block the host on cuda, and CUDA reports
    # an asynchronous failure only at a synchronization); synchronize() raised
    # CuPy's own CUDARuntimeError, where the host backend raises a BackendError.
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(shape=(256,), dtype=np.float32)
    eng = T.get_engine(backend)
    gate = threading.Event()
    eng.d2h.raw.launch_host_func(lambda _arg: gate.wait(), None)
    _offload_failing_later(fake, monkeypatch, b, h)
    T.wait()                                        # returns with the copy gated
    assert not gate.is_set() and b.residency == "in-flight"
    gate.set()
    T.wait()                                        # ordering only: nothing raised
    try:
        with pytest.raises(BackendError, match="d2h.*illegal.*sticky.*restart") as err:
            T.synchronize()
        assert isinstance(err.value.__cause__, _fake_cupy.CUDARuntimeError)
    finally:
        fake.async_errors.clear()                   # a fresh context, as after a restart
    T.synchronize()


@pytest.mark.parametrize("use", ["synchronize(buf)", "synchronize(event)", "host view"])
def test_waiting_on_a_failed_copy_is_a_backend_error_not_a_success(
        fake, backend, monkeypatch, use):
    # CudaEvent.synchronize raised CuPy's own CUDARuntimeError for a sticky CUDA
    # failure, past `except BackendError`: synchronize(buf), synchronize(event)
    # and a host view waiting for the copy did. As a BackendError it must still
    # come out (the buffer-wait paths swallow an event's BackendError, which the
    # host backend's events report again through their buffer), not be a success.
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(shape=(256,), dtype=np.float32)
    gate = threading.Event()
    T.get_engine(backend).d2h.raw.launch_host_func(lambda _arg: gate.wait(), None)
    event = _offload_failing_later(fake, monkeypatch, b, h)
    call = {"synchronize(buf)": lambda: T.synchronize(b),
            "synchronize(event)": lambda: T.synchronize(event),
            "host view": lambda: b.numpy("host")}[use]
    opener = threading.Timer(0.05, gate.set)        # the copy fails while waited for
    opener.start()
    try:
        with pytest.raises(BackendError, match="illegal.*sticky.*restart") as err:
            call()
        assert isinstance(err.value.__cause__, _fake_cupy.CUDARuntimeError)
    finally:
        opener.join()
        fake.async_errors.clear()                   # a fresh context, as after a restart
    T.synchronize()


def test_querying_an_event_or_the_device_after_a_sticky_error_is_a_backend_error(fake, backend):
    # CudaEvent.query() (and .done) let CuPy's own CUDARuntimeError out after a
    # sticky CUDA failure (cudaEventQuery reports it, as every later call does),
    # past `except BackendError`, where synchronize() raises a BackendError.
    stream = backend.new_stream("x")
    event = backend.new_event().record(stream)
    stream.synchronize()
    assert event.query()
    fake.async_errors.append(_fake_cupy.CUDARuntimeError(700))   # a kernel faulted
    try:
        # CudaBackend.synchronize() (cudaDeviceSynchronize) let it out too
        for ask in (event.query, lambda: event.done, backend.synchronize):
            with pytest.raises(BackendError, match="illegal.*sticky.*restart") as err:
                ask()
            assert isinstance(err.value.__cause__, _fake_cupy.CUDARuntimeError)
    finally:
        fake.async_errors.clear()                   # a fresh context, as after a restart
    assert event.query()


def test_debug_arena_poisons_and_catches_a_gpu_write_after_free(fake, backend):
    d = DeviceArena(1 << 16, debug=True, backend=backend)
    assert fake.calls_named("memsetAsync")           # the slab was poisoned on device
    b = d.alloc(4096)
    stale = _device_view(fake, b)                   # a kernel's view outlives the free
    b.free()
    stale[3] = 1
    with pytest.raises(UseAfterFreeError):
        d.alloc(4096)
    c = d.alloc(4096)                                # re-poisoned: usable again
    c.free()


def test_streams_compare_by_handle(fake, backend):
    cur = backend.current_stream()
    assert cur == backend.current_stream() and cur.ptr == 0
    s = backend.new_stream("x")
    assert s != cur and s.ptr != 0
    assert s.raw.non_blocking                   # copy streams must not sync with stream 0
    with s.raw:
        assert backend.current_stream() == s     # CuPy's `with stream:` is honoured
        d = DeviceArena(1 << 16, backend=backend)
        b = d.alloc(128)
        assert backend.current_stream().ptr == s.ptr
    b.free()
    ev = backend.new_event()
    assert ev.query()                               # never recorded: complete
    assert ev.raw.disable_timing and not ev.raw.block


# ----------------------------------------------------------- integrations
def test_cupy_allocator_hook(fake, backend):
    from rtmem.integrations import cupy as rtcupy
    cp = fake.modules["cupy"]
    d = DeviceArena(1 << 20, backend=backend)
    alloc = rtcupy.allocator_for(d)
    mp = alloc(1000)
    assert d.stats().count_by_kind["workspace"] == 1
    buf_ptr = mp.ptr
    assert d.slabs[0].ptr <= buf_ptr < d.slabs[0].ptr + d.slabs[0].nbytes
    assert mp.mem.device_id == backend.device_id and mp.mem.size == 1000
    del mp
    gc.collect()
    assert d.stats().count_by_kind["workspace"] == 0   # freed when CuPy drops it
    default = cp.cuda.get_allocator()
    previous = rtcupy.install(d)
    assert previous is default and cp.cuda.get_allocator() is not default
    kept = cp.cuda.get_allocator()(64)
    assert d.stats().count_by_kind["workspace"] == 1
    del kept
    rtcupy.uninstall(previous)
    assert cp.cuda.get_allocator() is default
    rtcupy.install(d)
    rtcupy.uninstall()                                # None: CuPy's default pool
    assert cp.cuda.get_allocator() == cp.get_default_memory_pool().malloc
    with rtcupy.using(d):
        assert cp.cuda.get_allocator() is not cp.get_default_memory_pool().malloc
        held = cp.cuda.get_allocator()(10)
        assert d.stats().count_by_kind["workspace"] >= 1
        with pytest.raises(RuntimeError, match="outside that block"):
            rtcupy.install(d)                     # CuPy refuses inside using_allocator
        # was CuPy's bare ValueError, where install() said what to do
        with pytest.raises(RuntimeError, match="cannot uninstall .* outside that block"):
            rtcupy.uninstall(previous)
    del held
    gc.collect()
    assert d.stats().count_by_kind["workspace"] == 0
    with pytest.raises(ValueError, match="device memory"):
        rtcupy.allocator_for(HostArena(1 << 16, backend=backend))


def test_cupy_hook_refuses_bad_arguments_and_leaks_nothing(fake, backend, monkeypatch):
    from rtmem.integrations import cupy as rtcupy
    cp = fake.modules["cupy"]
    d = DeviceArena(1 << 20, backend=backend)
    default = cp.cuda.get_allocator()
    with pytest.raises(ValueError, match="kind must be one of"):
        rtcupy.install(d, kind="weights")        # every allocation would fail
    with pytest.raises(TypeError, match="DeviceArena"):
        rtcupy.allocator_for(object())
    assert cp.cuda.get_allocator() is default
    alloc = rtcupy.allocator_for(d)

    def broken(*args, **kwargs):
        raise RuntimeError("UnownedMemory failed")
    monkeypatch.setattr(cp.cuda, "UnownedMemory", broken)
    with pytest.raises(RuntimeError, match="UnownedMemory failed"):
        alloc(1000)
    assert d.stats().count_by_kind["workspace"] == 0    # the buffer was freed again


def test_unordered_buffers_reuse_only_completed_frees(fake, backend):
    # alloc(stream=UNORDERED) is for memory used on streams rtmem does not see
    # (numba's): it must not take bytes whose compute-stream free is still queued.
    from rtmem import UNORDERED
    d = DeviceArena(1 << 16, backend=backend)
    gate = threading.Event()
    compute = backend.current_stream()
    compute.launch_host_func(gate.wait)         # work before the free still runs
    b = d.alloc(1 << 14)
    offset = b.offset
    b.free()
    other = d.alloc(1 << 14, stream=UNORDERED)
    assert other.offset != offset
    assert d.alloc(1 << 14).offset == offset    # the compute stream reuses it at once
    gate.set()
    compute.synchronize()
    d._check_invariants()


def test_numba_plugin_defers_frees_and_refuses_bad_installs():
    # In a child process: numba.cuda without the simulator, on the fake CuPy.
    # Frees ignored numba's defer_cleanup(); a refused install had already
    # replaced the plugged-in arena; a failed memalloc kept its buffer;
    # get_memory_info ignored a LimitAdaptor's budget; a bad
    # RTMEM_NUMBA_ARENA_BYTES went unnamed in the error; numba's context for
    # another device was bound to the arena (device 0's memory on device 1);
    # install() after numba made its own context returned and did nothing there.
    import os
    import subprocess
    pytest.importorskip("numba.cuda")
    script = pathlib.Path(__file__).with_name("_numba_emm_on_fake.py")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_per_thread_default_streams_are_one_stream_per_thread(fake, backend, monkeypatch):
    # Under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 every thread's default stream has
    # the handle cudaStreamPerThread: compared by handle, a block freed on one
    # thread's stream was reused at once on another's.
    from rtmem.backends.cuda import PER_THREAD_STREAM
    ptds = fake.modules["cupy"].cuda.Stream()
    ptds.ptr = PER_THREAD_STREAM        # one stand-in queue; rtmem sees the handle
    monkeypatch.setattr(backend, "_get_current_stream", lambda: ptds)
    mine = backend.current_stream()
    box = {}
    worker = threading.Thread(target=lambda: box.update(s=backend.current_stream()))
    worker.start()
    worker.join()
    assert mine != box["s"] and hash(mine) != hash(box["s"])
    assert backend.current_stream() == mine

    d = DeviceArena(1 << 16, backend=backend)
    made = _count_new_events(backend, monkeypatch)
    gate = threading.Event()
    ptds.launch_host_func(lambda _arg: gate.wait(), None)   # its work still runs
    b = d.alloc(1 << 14)
    offset = b.offset
    b.free()
    assert len(made) == 1           # an event now, from this thread: no later stamp
    worker = threading.Thread(target=lambda: box.update(b=d.alloc(1 << 14)))
    worker.start()
    worker.join()
    assert box["b"].offset != offset    # another thread's stream waits for the event
    again = d.alloc(1 << 14)
    assert again.offset == offset       # this thread's stream reuses it at once
    gate.set()
    for x in (again, box["b"]):
        x.free()
    ptds.synchronize()
    d._check_invariants()


def test_read_waits_for_the_current_stream(fake, backend):
    # to_numpy of device memory must see what a kernel on the *current* stream
    # wrote, even when that stream is not the legacy one the copy runs on.
    d = DeviceArena(1 << 16, backend=backend)
    b = d.alloc(shape=(64,), dtype=np.int32)
    _device_view(fake, b)[:] = 0
    s = backend.new_stream("user")
    gate = threading.Event()
    s.launch_host_func(gate.wait)                   # the kernel below runs late
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    try:
        with s.raw:
            fake.modules["cupy"].asarray(b)[:] = 7   # enqueued on s
            assert (b.to_numpy() == 7).all()
    finally:
        timer.cancel()
        gate.set()
    b.free()


def test_cupy_free_during_garbage_collection_is_deferred(fake, backend):
    # CuPy memory in a reference cycle is freed by the garbage collector, which may
    # run while rtmem's allocator holds its lock: freeing there would deadlock.
    from rtmem.integrations import cupy as rtcupy
    d = DeviceArena(1 << 20, backend=backend)
    alloc = rtcupy.allocator_for(d)

    class Cycle:
        pass
    c = Cycle()
    c.self, c.mem = c, alloc(1000)
    del c
    assert d.stats().count_by_kind["workspace"] == 1

    collect_holding(d.core._lock)
    assert d.stats().count_by_kind["workspace"] == 1      # deferred ...
    kept = alloc(64)                                      # ... to the next allocation
    assert d.stats().count_by_kind["workspace"] == 1
    del kept
    gc.collect()
    assert rtcupy.flush() == 0 and d.stats().count_by_kind["workspace"] == 0


def test_cupy_arrays_from_the_hook_outlive_arena_close(fake, backend):
    # CuPy arrays allocated through the hook (install() / using()) held their
    # buffer but not its slab: arena.close() cudaFree'd memory they still pointed
    # at (the fake's FREED bytes), where buf.cupy() views hold the slab.
    from rtmem.integrations import cupy as rtcupy
    cp = fake.modules["cupy"]
    rng = np.random.default_rng()
    for hook in ("using", "install"):
        d = DeviceArena(1 << 16, backend=backend)
        ptr = d.slabs[0].ptr
        data = rng.standard_normal(64).astype(np.float32)
        if hook == "using":
            with rtcupy.using(d):
                arr = cp.empty(64, np.float32)
        else:
            previous = rtcupy.install(d)
            try:
                arr = cp.empty(64, np.float32)
            finally:
                rtcupy.uninstall(previous)
        arr[...] = data
        d.close()
        assert ptr in fake.live                     # the array still holds the slab
        np.testing.assert_array_equal(arr.get(), data)
        del arr
        gc.collect()
        assert ptr not in fake.live                 # freed with the last array
        assert d.stats().count_by_kind["workspace"] == 0


@pytest.mark.parametrize("cupy14", [True, False], ids=["from_external", "ExternalStream"])
def test_as_tensor_waits_for_a_prefetch_on_torchs_current_stream(fake, backend,
                                                                 monkeypatch, cupy14):
    # torch kernels read an exported buffer on torch's current stream, which need
    # not be CuPy's (under `with torch.cuda.stream(s)`): the wait for a prefetch
    # still in flight must land on torch's stream, not on CuPy's legacy one.
    import sys
    import types
    torch = pytest.importorskip("torch")
    from rtmem.torch import as_tensor, on_torch_stream
    cuda = sys.modules["cupy"].cuda
    if cupy14:   # CuPy >= 14 warns on every ExternalStream: it must not be used
        def deprecated(*args, **kwargs):
            raise AssertionError("ExternalStream used where Stream.from_external exists")
        monkeypatch.setattr(cuda, "ExternalStream", deprecated)
    else:        # CuPy 13 has no Stream.from_external
        monkeypatch.delattr(cuda.Stream, "from_external")
    d = DeviceArena(1 << 20, backend=backend)
    h = HostArena(1 << 20, backend=backend)
    b = d.alloc(shape=(1024,), dtype=np.float32)
    T.offload(b, arena=h)
    T.evict(b)
    T.synchronize(b)
    side = backend.new_stream("torch side stream")
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=side.ptr))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "as_tensor", lambda obj, device=None: (obj, device))
    gate = threading.Event()
    T.get_engine(backend).h2d.launch_host_func(gate.wait)   # the prefetch runs late
    T.prefetch(b)
    try:
        export, device = as_tensor(b)
        assert device == f"cuda:{backend.device_id}"
        # (not b.__cuda_array_interface__ here: that would wait on CuPy's stream)
        assert export.__cuda_array_interface__["data"][0] == \
            b.placement("device").slab.device_ptr + b.placement("device").offset
        on_side, on_legacy = threading.Event(), threading.Event()
        side.launch_host_func(on_side.set)
        fake.null_stream.launch_host_func(lambda _arg: on_legacy.set(), None)
        assert on_legacy.wait(5)         # CuPy's stream was not made to wait
        assert not on_side.wait(0.2)     # torch's stream waits for the prefetch
    finally:
        gate.set()
    assert on_side.wait(5)
    # outside as_tensor CuPy's current stream is its own again
    assert backend.current_stream().ptr == 0
    with on_torch_stream(backend.device_id):
        assert backend.current_stream().ptr == side.ptr
    del export
    b.free()


def test_the_gpu_views_host_memory_only_where_it_is_mapped(fake, backend, monkeypatch):
    # a pinned, unmapped buffer has no device pointer: device_alias is refused,
    # and parameters in device memory take no gradients there
    torch = pytest.importorskip("torch")
    from rtmem.torch import as_tensor, place_parameters
    monkeypatch.setattr(torch, "as_tensor", lambda obj, device=None: (obj, device))
    pinned = HostArena(1 << 20, backend=backend)
    mapped = HostArena(1 << 20, mapped=True, backend=backend)
    b, mb = (a.alloc(shape=(16,), dtype=np.float32) for a in (pinned, mapped))
    with pytest.raises(ResidencyError, match="mapped host buffer on the cuda backend"):
        as_tensor(b, device_alias=True)
    export, device = as_tensor(mb, device_alias=True)
    assert device == f"cuda:{backend.device_id}"
    assert export.__cuda_array_interface__["data"][0] == \
        mb.placement("host").slab.device_ptr + mb.placement("host").offset
    del export
    d = DeviceArena(1 << 20, backend=backend)
    model = torch.nn.Linear(4, 4)
    weight = model.weight.data_ptr()
    with pytest.raises(ValueError, match=r"DeviceArena or a HostArena\(mapped=True\)"):
        place_parameters(model, d, grad_arena=pinned)
    assert model.weight.data_ptr() == weight and model.weight.grad is None
    assert d.stats().allocated_bytes == 0
    for buf in (b, mb):
        buf.free()


def test_wait_takes_torch_and_cupy_events(fake, backend):
    # transfers.wait(event) passed a torch.cuda.Event's query/synchronize check
    # and then failed on .raw; both foreign kinds now order the compute stream.
    cp = fake.modules["cupy"]
    eng = T.get_engine(backend)
    gate = threading.Event()
    eng.d2h.launch_host_func(gate.wait)
    cupy_event = cp.cuda.Event()
    cupy_event.record(eng.d2h.raw)

    class TorchEvent:               # torch.cuda.Event's surface: cuda_event handle
        def __init__(self, handle):
            self.cuda_event = handle

        def query(self):
            return cupy_event.done

        def synchronize(self):
            cupy_event.synchronize()
    compute = backend.current_stream()
    for event in (cupy_event, TorchEvent(cupy_event.ptr), TorchEvent(0)):
        T.wait(event)
    waits = fake.calls_named("streamWaitEvent")
    assert [(s, e) for s, e, _ in waits] == [(compute.ptr, cupy_event.ptr)] * 2
    done = compute.raw.record()
    assert not done.done                   # the compute stream waits for the gate
    gate.set()
    done.synchronize()
    with pytest.raises(TypeError, match="cannot wait for a"):
        compute.wait_event(TorchEvent("not a handle"))


def test_an_alignment_beyond_cudamallocs_is_honoured(fake, backend):
    # cudaMalloc aligns to 256 B; offsets are aligned relative to the slab, so an
    # arena asking for more widens its slab by one alignment and uses the aligned
    # part (freed as one allocation)
    for arena in (DeviceArena(1 << 16, backend=backend, alignment=1 << 13),
                  HostArena(1 << 16, backend=backend, alignment=1 << 13, mapped=True)):
        bufs = [arena.alloc(1000) for _ in range(3)]
        slab = arena.slabs[0]
        assert all((slab.ptr + b.offset) % (1 << 13) == 0 for b in bufs)
        assert all(b.__cuda_array_interface__["data"][0] % (1 << 13) == 0 for b in bufs)
        arena.close()
    gc.collect()
    assert fake.live == {}


# ------------------------------------------------ integrations: hunt fixes
def test_integrations_refuse_a_closed_arena_and_bad_sizes(fake, backend):
    # A closed arena was installed as CuPy's allocator (every allocation then
    # failed); allocator(-1) handed out a byte and allocator(10.5) 10 bytes.
    from rtmem.errors import InvalidPointerError, UnitError
    from rtmem.integrations import cupy as rtcupy
    cp = fake.modules["cupy"]
    default = cp.cuda.get_allocator()
    closed = DeviceArena(1 << 16, backend=backend)
    closed.close()
    for hook in (rtcupy.allocator_for, rtcupy.install):
        with pytest.raises(InvalidPointerError, match="closed"):
            hook(closed)
    with pytest.raises(InvalidPointerError, match="closed"):
        with rtcupy.using(closed):
            pass
    assert cp.cuda.get_allocator() is default
    d = DeviceArena(1 << 16, backend=backend)
    alloc = rtcupy.allocator_for(d)
    for bad in (-1, None, True):
        with pytest.raises(UnitError):
            alloc(bad)
    assert d.stats().count_by_kind["workspace"] == 0
    mp = alloc(10.5)
    assert mp.mem.size == 11
    del mp
    gc.collect()
    assert d.stats().count_by_kind["workspace"] == 0


def test_cupy_allocator_runs_out_of_memory_as_cupy_does(fake, backend, monkeypatch):
    # CuPy's callers catch cupy.cuda.memory.OutOfMemoryError (cuTENSOR falls back
    # to no workspace on it); the arena's OutOfMemoryError went past them.
    import pickle

    from rtmem.integrations import cupy as rtcupy
    cp = fake.modules["cupy"]

    class CupyOOM(MemoryError):          # as cupy/cuda/memory.pyx defines it
        def __init__(self, size, total, limit=0):
            self._size, self._total, self._limit = size, total, limit
            super().__init__(f"Out of memory allocating {size:,} bytes")

        def __reduce__(self):
            return (type(self), (self._size, self._total, self._limit))
    monkeypatch.setattr(cp.cuda.memory, "OutOfMemoryError", CupyOOM, raising=False)
    d = DeviceArena(1 << 16, backend=backend)
    with rtcupy.using(d):
        with pytest.raises(CupyOOM) as info:
            cp.empty((1 << 17,), cp.uint8)
    err = info.value
    assert isinstance(err, OutOfMemoryError) and err.requested == 1 << 17
    assert "out of memory" in str(err) and err.stats is not None
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is OutOfMemoryError and back.requested == 1 << 17
    assert str(back) == str(err)
    assert d.stats().count_by_kind["workspace"] == 0
    kept = rtcupy.allocator_for(d)(1 << 10)      # the arena works on
    assert d.stats().count_by_kind["workspace"] == 1
    del kept


_NUMBA_CLOSED_ARENA = """
import sys
sys.path.insert(0, sys.argv[1])
import _fake_cupy
fc = _fake_cupy.build(device=0, device_count=1, device_bytes=8 << 20, host_bytes=8 << 20)
sys.modules.update(fc.modules)
from numba.cuda.cudadrv import driver
from rtmem.arena import DeviceArena
from rtmem.errors import InvalidPointerError, UnitError
from rtmem.integrations import numba_emm
driver._logger = driver.make_logger()
arena = DeviceArena(1 << 20, backend="cuda")
numba_emm.install(arena)
closed = DeviceArena(1 << 16, backend="cuda")
closed.close()
try:
    numba_emm.install(closed)
except InvalidPointerError:
    pass
else:
    raise AssertionError("a closed arena was installed")
assert numba_emm._arena is arena


class Context:
    class device:
        id = 0


mgr = numba_emm.manager_class()(context=Context())
mgr.initialize()
try:
    mgr.memalloc(-1)
except UnitError:
    pass
else:
    raise AssertionError("memalloc(-1) allocated")
assert arena.stats().count_by_kind["workspace"] == 0
arena.close()
fc.shutdown()
print("ok")
"""


def test_numba_plugin_refuses_a_closed_arena_and_negative_sizes():
    # install(closed_arena) was accepted (numba then failed at every allocation);
    # memalloc(-1) returned a MemoryPointer of size -1 over a 1-byte buffer.
    import os
    import subprocess
    pytest.importorskip("numba.cuda")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", _NUMBA_CLOSED_ARENA,
                           str(pathlib.Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("cupy_installed", [False, True])
def test_numba_plugin_install_without_an_arena_needs_cupy_at_once(monkeypatch,
                                                                  cupy_installed):
    # install() with no arena and no nbytes returned without CuPy: the default
    # arena is made (on the cuda backend, which needs CuPy) only when numba
    # creates its context, so the error came at the first numba.cuda allocation.
    # In-process, numba.cuda is the simulator (no EMM): stand-ins for numba.
    import types
    from rtmem.errors import CuPyMissingError
    from rtmem.integrations import numba_emm
    plugged = []
    numba_cuda = types.SimpleNamespace(set_memory_manager=plugged.append)
    monkeypatch.setattr(numba_emm, "_numba_cuda", lambda: (numba_cuda, None))
    monkeypatch.setattr(numba_emm, "manager_class", lambda: "the plugin class")
    monkeypatch.setattr(numba_emm, "_arena", None)
    monkeypatch.setitem(sys.modules, "cupy",
                        types.ModuleType("cupy") if cupy_installed else None)
    if cupy_installed:
        numba_emm.install()
        assert plugged == ["the plugin class"]
    else:
        with pytest.raises(CuPyMissingError, match=r"^rtmem.integrations.numba_emm needs "
                                                   r"CuPy .*pip install rtmem\[cuda12\]"):
            numba_emm.install()
        assert plugged == []        # refused before anything changed
    assert numba_emm._arena is None


def test_a_trace_numbers_two_wrappers_of_one_stream_as_one(fake, backend):
    # Numbered by id(): two wrappers of one CUDA stream (equal, one stream to
    # the allocator) became two streams in the trace, and a replay ordered
    # their blocks apart.
    import io
    import json
    from rtmem.adaptors import TracingAdaptor
    from rtmem.allocator import BestFitAllocator
    from rtmem.backends.cuda import CudaStream
    s = backend.new_stream("x")
    again = CudaStream(s.raw)
    assert again is not s and again == s
    sink = io.StringIO()
    tr = TracingAdaptor(BestFitAllocator(1 << 16), sink)
    blocks = [tr.allocate(100, s), tr.allocate(100, again), tr.allocate(100, object())]
    for b in blocks:
        tr.deallocate(b)
    streams = [json.loads(ln)["stream"] for ln in sink.getvalue().splitlines()[:3]]
    assert streams == [0, 0, 1]


def test_a_prefetch_takes_bytes_freed_on_the_compute_stream_without_waiting(fake, backend):
    # A copy's destination is allocated for the compute stream
    # (TransferEngine.alloc_key): the copy is fenced behind the compute work
    # enqueued so far, so bytes freed in that order are safe for it at once.
    # Allocated for no stream, a prefetch into a full arena blocked the host
    # until the compute work before the free had run.
    d = DeviceArena(1 << 16, backend=backend)
    h = HostArena(1 << 16, backend=backend)
    src = h.alloc(1 << 16)
    src.numpy()[:] = 5
    old = d.alloc(1 << 16)                      # the whole device arena
    gate = threading.Event()
    backend.current_stream().launch_host_func(gate.wait)   # earlier work still runs
    old.free()
    hang_breaker = threading.Timer(5, gate.set)
    hang_breaker.start()
    try:
        T.prefetch(src, arena=d)
        assert not gate.is_set(), "the prefetch waited for the compute stream's work"
    finally:
        hang_breaker.cancel()
        gate.set()
    T.synchronize(src)
    assert src.residency == "both" and (_device_view(fake, src) == 5).all()
    src.free()
    d._check_invariants()
