"""Transfers on the host backend: ordering, integrity, residency, no leaks."""

from __future__ import annotations

import gc
import threading
import time
import zlib

import numpy as np
import pytest

from rtmem import transfers as T
from rtmem.arena import DeviceArena, HostArena
from rtmem.backends import get_backend
from rtmem.buffer import _Move
from rtmem.errors import BackendError, OutOfMemoryError, ResidencyError, UseAfterFreeError


@pytest.fixture
def arenas():
    d = DeviceArena("4MiB", backend="host")
    h = HostArena("4MiB", backend="host")
    yield d, h
    T.get_engine("host").synchronize()
    d._check_invariants()
    h._check_invariants()


def gate_stream(stream):
    """Block ``stream`` until the returned threading.Event is set."""
    gate = threading.Event()
    stream.launch_host_func(gate.wait)
    return gate


def crc(buf):
    return zlib.crc32(buf.to_numpy().tobytes())


def test_copies_run_in_stream_order_behind_events(arenas):
    d, h = arenas
    eng = T.get_engine("host")
    b = d.alloc(shape=(1024,), dtype=np.float32)
    b.numpy()[:] = 1.0
    gate = gate_stream(eng.d2h)
    ev = T.offload(b, arena=h)
    assert not ev.query() and b.residency == "in-flight"
    assert eng.in_flight >= 1
    with pytest.raises(ResidencyError, match="in flight"):
        T.offload(b, arena=h)
    T.evict(b)                     # legal during the offload: freed after it
    assert b.residency == "in-flight"
    # The freed device block is gated by the offload's event: the H2D stream
    # must not receive it while the copy may still read it.
    assert d.stats().pending_bytes == 4096
    other = d.alloc(4096, stream=eng.h2d)
    assert other.offset != 0
    gate.set()
    T.synchronize(b)
    assert b.residency == "host" and ev.query()
    assert (b.numpy("host") == 1.0).all()
    other.free()
    b.free()


def _completes(event, limit_s=30.0):
    """Whether ``event`` completes within ``limit_s`` seconds (a hang guard for
    copies of microseconds, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("blocked", ["d2h", "h2d"])
def test_each_direction_runs_while_the_other_is_blocked(arenas, blocked, fresh_seed):
    # DESIGN §3: dedicated H2D and D2H streams, so that both directions overlap;
    # a copy of one direction must not queue behind the other direction's work
    # (one shared copy stream would pass every ordering test above)
    d, h = arenas
    eng = T.get_engine("host")
    assert eng.h2d is not eng.d2h
    rng = np.random.default_rng(fresh_seed)
    going_down = d.alloc(shape=(4096,), dtype=np.float32)
    going_down.numpy()[:] = down = rng.standard_normal(4096, dtype=np.float32)
    coming_up = h.alloc(shape=(4096,), dtype=np.float32)
    coming_up.numpy()[:] = up = rng.standard_normal(4096, dtype=np.float32)
    gate = gate_stream(getattr(eng, blocked))
    try:
        stuck, free_running = ((T.offload(going_down, arena=h), T.prefetch(coming_up, arena=d))
                               if blocked == "d2h" else
                               (T.prefetch(coming_up, arena=d), T.offload(going_down, arena=h)))
        assert _completes(free_running), f"a copy waited for the blocked {blocked} stream"
        assert not stuck.query()
    finally:
        gate.set()
    T.synchronize(going_down), T.synchronize(coming_up)
    assert np.array_equal(going_down.numpy("host"), down)
    assert np.array_equal(coming_up.numpy("device"), up)
    going_down.free(), coming_up.free()


def test_prefetch_waits_for_unfinished_offload(arenas):
    d, h = arenas
    eng = T.get_engine("host")
    b = d.alloc(shape=(256,), dtype=np.int64)
    b.numpy()[:] = np.arange(256)
    gate = gate_stream(eng.d2h)
    T.offload(b, arena=h)
    T.evict(b)
    ev = T.prefetch(b)             # H2D must wait for the D2H still gated
    assert not ev.query()
    gate.set()
    ev.synchronize()
    T.wait(b)
    assert (b.numpy() == np.arange(256)).all()
    b.free()


def test_checksums_survive_offload_prefetch_cycles(arenas):
    d, h = arenas
    rng = np.random.default_rng(0)
    bufs, sums = [], []
    for i in range(24):
        b = d.alloc(shape=(int(rng.integers(1, 4000)),), dtype=np.float32,
                    kind="activation" if i % 2 else "weight")
        b.numpy()[:] = rng.standard_normal(b.shape).astype(np.float32)
        bufs.append(b)
        sums.append(crc(b))
    for cycle in range(5):
        events = [T.offload(b, arena=h) for b in bufs]
        for b in bufs:
            T.evict(b)
        T.synchronize()
        assert all(e.query() for e in events) and d.stats().allocated_bytes == 0
        for b in reversed(bufs):   # prefetch in another order: offsets change
            T.prefetch(b)
        for b, s in zip(bufs, sums):
            T.wait(b)
            assert crc(b) == s, f"cycle {cycle}: data corrupted"
            T.drop_host(b)
    for b in bufs:
        b.free()
    T.synchronize()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_thousand_cycles_do_not_leak(arenas):
    d, h = arenas
    eng = T.get_engine("host")
    b = d.alloc(shape=(4096,), dtype=np.uint8)
    b.numpy()[:] = 42
    slabs_before = (len(d.slabs), len(h.slabs))

    def cycle():
        T.offload(b, arena=h)
        T.evict(b)
        T.prefetch(b)
        T.wait(b)
        T.drop_host(b)
    # one cycle first: a transfer stream starts its worker thread on first use,
    # which depends on what this process ran before (test order), not on a leak
    cycle()
    T.synchronize()
    gc.collect()
    threads_before = threading.active_count()
    for _ in range(1000):
        cycle()
    T.synchronize()
    assert (b.numpy() == 42).all()
    assert eng.in_flight == 0
    assert (len(d.slabs), len(h.slabs)) == slabs_before
    assert h.stats().allocated_bytes == 0
    assert d.stats().allocated_bytes == 4096
    assert d.stats().alloc_count == 1002      # b, then one prefetch per cycle
    gc.collect()
    assert threading.active_count() <= threads_before
    b.free()


def test_a_view_of_a_missing_copy_names_the_move_that_makes_it(arenas):
    # the refusal said "prefetch or offload it first" for either side, although
    # only a prefetch makes a device copy and only an offload a host copy
    d, h = arenas
    b = d.alloc(1024)
    with pytest.raises(ResidencyError, match="no host copy") as info:
        b.numpy("host")
    assert "offload it first" in str(info.value) and "prefetch" not in str(info.value)
    assert info.value.state == "device" and info.value.action == "view host"
    T.offload(b, arena=h)
    T.evict(b)
    T.synchronize()
    with pytest.raises(ResidencyError, match="no device copy") as info:
        b.numpy("device")
    assert "prefetch it first" in str(info.value) and "offload" not in str(info.value)
    assert b.residency == "host"
    b.free()


def test_illegal_moves_are_refused(arenas):
    d, h = arenas
    b = d.alloc(1024)
    with pytest.raises(ResidencyError, match="already has a device copy"):
        T.prefetch(b)
    with pytest.raises(ResidencyError, match="only copy") as info:
        T.evict(b)
    assert info.value.state == "device" and info.value.action == "evict"
    with pytest.raises(ResidencyError, match="no host copy"):
        T.drop_host(b)
    with pytest.raises(ResidencyError, match="no host arena"):
        T.offload(b)
    T.offload(b, arena=h)
    T.synchronize(b)
    assert b.residency == "both"
    with pytest.raises(ResidencyError, match="already has a host copy"):
        T.offload(b)
    T.evict(b)
    assert b.residency == "host"
    with pytest.raises(ResidencyError, match="no device copy"):
        T.offload(b)
    with pytest.raises(ResidencyError, match="no device copy"):
        T.evict(b)
    with pytest.raises(ResidencyError, match="only copy"):
        T.drop_host(b)
    gate = gate_stream(T.get_engine("host").h2d)
    T.prefetch(b)
    with pytest.raises(ResidencyError, match="prefetch into the device copy"):
        T.evict(b)
    with pytest.raises(ResidencyError, match="in flight"):
        T.drop_host(b)
    gate.set()
    T.synchronize(b)
    b.free()


def test_oom_during_prefetch_leaves_buffer_on_host(arenas):
    d, h = arenas
    b = d.alloc(1 << 20)
    T.offload(b, arena=h)
    T.synchronize(b)
    T.evict(b)
    hog = d.alloc(4 << 20)
    with pytest.raises(OutOfMemoryError):
        T.prefetch(b)
    assert b.residency == "host" and b.placement("device") is None
    hog.free()
    T.prefetch(b)
    T.synchronize(b)
    assert b.residency == "both"
    b.free()


def test_copy_between_buffers(arenas):
    d, h = arenas
    src = d.alloc(shape=(100,), dtype=np.float64)
    src.numpy()[:] = np.linspace(0, 1, 100)
    dst = h.alloc(shape=(100,), dtype=np.float64)
    ev = T.copy(dst, src)
    ev.synchronize()
    assert np.array_equal(dst.numpy(), src.numpy())
    back = d.alloc(shape=(100,), dtype=np.float64)
    T.copy(back, dst)
    T.wait(back)
    assert np.array_equal(back.numpy(), src.numpy())
    with pytest.raises(ValueError, match="fewer"):
        T.copy(d.alloc(8), src)
    for b in (src, dst, back):
        b.free()


def test_copy_into_a_buffer_with_two_copies_is_refused(arenas):
    # It used to write the device copy only: the host copy stayed attached but
    # stale, and evict() then kept the stale one (the new data was lost).
    d, h = arenas
    src = d.alloc(shape=(4,), dtype=np.float32)
    src.numpy()[:] = 7
    dst = d.alloc(shape=(4,), dtype=np.float32)
    dst.numpy()[:] = 1
    T.offload(dst, arena=h)
    for _ in range(2):          # in flight, then settled in "both"
        with pytest.raises(ResidencyError, match="drop_host.*evict") as info:
            T.copy(dst, src)
        assert info.value.action == "copy into"
        T.synchronize(dst)
    assert dst.residency == "both"
    T.drop_host(dst)
    T.copy(dst, src)
    T.synchronize(dst)
    assert np.all(dst.numpy() == 7)
    src.free()
    dst.free()


def test_moves_refuse_a_buffer_whose_free_waits_for_views(arenas):
    # Transfers used to accept a buffer freed while a pinned view lived; when
    # the view died in a garbage collection, the prefetch's own allocation ran
    # the queued free mid-move and leaked the new device block.
    d, h = arenas
    b = h.alloc(4096)
    b.numpy()[:] = 9
    b.device_arena = d
    view = b.numpy(pin=True)
    b.free()                                    # waits for the view
    for move in (T.prefetch, T.drop_host, T.evict):
        with pytest.raises(UseAfterFreeError, match="freed"):
            move(b)
    other = h.alloc(16)
    with pytest.raises(UseAfterFreeError):
        T.copy(b, other)
    other.free()
    cycle = [view]
    cycle.append(cycle)
    del view, cycle
    gc.collect()                                # the free is queued by the collection
    with pytest.raises(UseAfterFreeError):
        T.prefetch(b)                           # runs the queued free first
    assert b.is_freed
    T.synchronize()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_synchronize_cannot_erase_a_move_started_meanwhile(arenas, monkeypatch):
    # synchronize(buf) cleared a completed move without the buffer's lock: a
    # prefetch started between its read and its clear was erased, and evict()
    # was then accepted during the prefetch. The poller's query is slowed to
    # open that window every time.
    from rtmem.backends import host as H
    d, h = arenas
    eng = T.get_engine("host")
    b = d.alloc(4096)
    b.numpy()[:] = 3
    T.offload(b, arena=h)
    T.synchronize(b)
    T.evict(b)
    done = T.copy(*(h.alloc(64) for _ in range(2)))
    done.synchronize()
    b._pending = _Move(done, "host")     # a completed move, not yet cleared
    query, in_window = H.HostEvent.query, threading.Event()

    def slow_query(event):
        result = query(event)
        if threading.current_thread().name == "poller":
            in_window.set()
            threading.Event().wait(0.2)
        return result
    monkeypatch.setattr(H.HostEvent, "query", slow_query)
    poller = threading.Thread(target=T.synchronize, args=(b,), name="poller")
    poller.start()
    in_window.wait()
    gate = gate_stream(eng.h2d)
    ev = T.prefetch(b)
    poller.join()
    assert not ev.query() and b.residency == "in-flight"
    with pytest.raises(ResidencyError, match="prefetch"):
        T.evict(b)
    gate.set()
    T.synchronize(b)
    assert b.residency == "both" and np.all(b.numpy() == 3)
    b.free()


def test_a_failed_copy_is_undone_and_reported(arenas, monkeypatch):
    # A copy failing on the H2D thread was reported by synchronize(), yet the
    # buffer moved to "both" and drop_host() then discarded the only good copy.
    from rtmem.backends import host as H
    d, h = arenas
    b = h.alloc(4096)
    b.numpy()[:] = 42
    b.device_arena = d
    real = H._copy

    def failing(dst, src):
        monkeypatch.setattr(H, "_copy", real)       # fail once
        raise MemoryError("simulated copy failure")
    monkeypatch.setattr(H, "_copy", failing)
    T.prefetch(b)
    with pytest.raises(BackendError, match="H2D copy.*dropped") as err:
        T.synchronize(b)
    # chained to the copy's own exception, as event.synchronize() chains it (the
    # buffer's error had no cause: its traceback was lost)
    assert isinstance(err.value.__cause__, MemoryError)
    assert b.residency == "host" and d.stats().allocated_bytes == 0
    with pytest.raises(ResidencyError, match="only copy"):
        T.drop_host(b)
    T.synchronize(T.prefetch(b))                    # the stream serves later work
    assert b.residency == "both" and np.all(b.numpy() == 42)
    b.free()


def test_stream_failures_reach_dependents_only():
    # The first failure was kept forever: events that completed before it raised
    # too, work ordered after it on another stream did not, and the stream (the
    # process-wide engine's) stayed broken.
    be = get_backend("host")
    a, c = be.new_stream("a"), be.new_stream("c")
    before = be.new_event().record(a)
    before.synchronize()

    def boom():
        raise RuntimeError("copy failed")
    gate = gate_stream(a)
    a.launch_host_func(boom)
    failed = be.new_event().record(a)
    c.wait_event(failed)
    dependent = be.new_event().record(c)
    gate.set()
    for ev in (failed, dependent):
        with pytest.raises(BackendError, match="copy failed"):
            ev.synchronize()
    before.synchronize()                            # completed before: clean
    assert before.error is None and isinstance(failed.error, RuntimeError)
    later = be.new_event().record(a)
    later.synchronize()                             # reported once, then recovered
    c.synchronize()


def test_an_event_reports_the_first_failure_before_it_not_a_later_one():
    # NOTE [ Host stream failures ]: the stream keeps its first unreported
    # failure; a second failure before the next event does not replace it.
    be = get_backend("host")
    s = be.new_stream("twice")

    def boom(what):
        raise RuntimeError(what)
    s.launch_host_func(lambda: boom("first failure"))
    s.launch_host_func(lambda: boom("second failure"))
    with pytest.raises(BackendError, match="first failure"):
        be.new_event().record(s).synchronize()
    s.synchronize()                                 # both reported by that event
    s.close()


def test_backend_synchronize_waits_for_every_stream_before_raising():
    # It raised at the first failed stream it visited, while the others still
    # ran: arena.close() then released memory that queued copies still used.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    bad, slow = be.new_stream("bad"), be.new_stream("slow")
    be._streams = [bad, slow]                       # visit the failed one first

    def boom():
        raise RuntimeError("copy failed")
    done = []
    gate = gate_stream(slow)
    slow.launch_host_func(lambda: done.append(1))
    bad.launch_host_func(boom)
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(BackendError, match="copy failed"):
        be.synchronize()
    assert done == [1]                              # the slow stream had finished


def test_a_closed_host_stream_refuses_work_instead_of_hanging():
    # Work enqueued after close() sat behind the stop marker and never ran, so
    # synchronize() (the stream's, and the backend's) blocked forever.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    s = be.new_stream("closing")
    ran = []
    s.launch_host_func(lambda: ran.append("before"))
    s.close()
    with pytest.raises(BackendError, match="closed"):
        s.launch_host_func(lambda: ran.append("after"))
    with pytest.raises(BackendError, match="closed"):
        be.new_event().record(s)
    s.synchronize()                                 # waits for the work before close
    be.synchronize()
    assert ran == ["before"]
    s.close()                                       # idempotent


def test_a_buffer_allocated_for_a_stream_later_closed_can_still_be_freed():
    # Its free enqueued an ordering event on its allocation stream, which the
    # closed stream refused: every free() raised and the bytes leaked for good.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    h = HostArena(4096, backend=be)
    s = be.new_stream("user")
    b = h.alloc(256, stream=s)
    gate = gate_stream(s)                   # work queued before close still runs
    ran = []
    s.launch_host_func(lambda: ran.append(1))
    s.close()
    assert s.closed
    threading.Timer(0.1, gate.set).start()
    b.free()                                # waits out s's queue, then frees
    assert ran == [1] and h.stats().live_blocks == 0 and h.stats().allocated_bytes == 0
    open_stream = be.new_stream("open")
    with pytest.raises(ValueError, match="open"):
        open_stream.join()
    h.close()


def test_a_dropped_backend_takes_its_transfer_engine_and_threads_with_it():
    # The engine registry held every backend ever used, with its two copy
    # threads: one per DeviceArena(..., backend=HostBackend()), never freed.
    import weakref
    from rtmem.backends.host import HostBackend
    gc.collect()
    threads = threading.active_count()
    refs = []
    for _ in range(5):
        be = HostBackend()
        d, h = DeviceArena(1 << 16, backend=be), HostArena(1 << 16, backend=be)
        b = d.alloc(shape=(64,), dtype=np.float32)
        T.synchronize(T.offload(b, arena=h))
        b.free()
        d.close()
        h.close()
        refs.append(weakref.ref(be))
        del be, d, h, b
    gc.collect()
    assert all(r() is None for r in refs)
    deadline = time.monotonic() + 10        # the stopped workers exit
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads


@pytest.mark.parametrize("wait", ["numpy", "to_numpy", "residency"])
def test_slabs_of_arenas_dropped_after_a_copy_waited_through_the_buffer_are_freed(wait):
    # Only transfers.synchronize/wait polled the engine's keepalives; a copy
    # waited through the buffer kept both slabs alive after the arenas were
    # dropped, until some unrelated later copy.
    import weakref
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    d, h = DeviceArena(1 << 20, backend=be), HostArena(1 << 20, backend=be)
    b = d.alloc(shape=(1024,), dtype=np.float32)
    b.numpy()[:] = 1.0
    eng = T.get_engine(be)
    gate = gate_stream(eng.d2h)             # in flight when the view waits, as on a GPU
    T.offload(b, arena=h)
    threading.Timer(0.05, gate.set).start()
    if wait == "numpy":
        b.numpy("host")
    elif wait == "to_numpy":
        b.to_numpy()
    else:
        while b.residency == "in-flight":
            time.sleep(0.001)
    assert len(eng._inflight) == 0          # read without the poll in_flight does
    slabs = [weakref.ref(sl.owner) for a in (d, h) for sl in a.slabs]
    b.free()
    del b, d, h
    gc.collect()
    assert [r() for r in slabs] == [None, None]


def _in_forked_child(fn, timeout=30):
    """Run ``fn()`` in a child made by fork(); its exit code (None: it hung)."""
    import multiprocessing
    import warnings
    with warnings.catch_warnings():         # "multi-threaded, use of fork()": the point
        warnings.simplefilter("ignore", DeprecationWarning)
        child = multiprocessing.get_context("fork").Process(target=fn)
        child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return child.exitcode


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
def test_transfers_and_close_work_in_a_child_forked_after_copies_ran():
    # The child inherited the streams but not their worker threads: its copies
    # never ran and every wait, and arena close(), hung (NOTE [ Host streams
    # after fork ]). The parent's work in flight at the fork does not run in
    # the child; its events fail there, and its buffers are undone.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    d, h = DeviceArena(1 << 16, backend=be), HostArena(1 << 16, backend=be)
    b = d.alloc(shape=(256,), dtype=np.float32)
    b.numpy()[:] = np.arange(256)
    T.synchronize(T.offload(b, arena=h))    # the worker threads now exist
    d2h = T.get_engine(be).d2h
    gate, running, ran = threading.Event(), threading.Event(), []
    d2h.launch_host_func(lambda: (running.set(), gate.wait()))
    assert running.wait(30)                 # running at the fork, the rest queued
    d2h.launch_host_func(lambda: ran.append("queued"))
    moving = d.alloc(shape=(128,), dtype=np.float32)
    moving.numpy()[:] = 5.0
    T.offload(moving, arena=h)
    ev = be.new_event().record(d2h)

    def child():
        import os
        try:
            try:
                ev.synchronize()
                os._exit(3)
            except BackendError as e:
                if "forked" not in str(e):
                    os._exit(4)
            try:
                T.synchronize(moving)
                os._exit(5)
            except BackendError:            # undone: still on the device, intact
                pass
            if moving.residency != "device" or not (moving.to_numpy() == 5.0).all():
                os._exit(6)
            c = d.alloc(shape=(64,), dtype=np.float32)
            c.numpy()[:] = 7.0
            T.synchronize(T.offload(c, arena=h))    # a fresh worker serves it
            ok = ran == [] and (c.to_numpy() == 7.0).all() and \
                (b.to_numpy() == np.arange(256)).all()
            with HostArena(4096, backend=be) as scratch:
                scratch.alloc(16).free()
            d.close()
            h.close()
            os._exit(0 if ok else 7)
        except BaseException:
            os._exit(8)

    try:
        assert _in_forked_child(child) == 0
    finally:
        gate.set()
    T.synchronize(moving)                   # the parent is unaffected
    assert ran == ["queued"] and moving.residency == "both"
    assert (moving.to_numpy() == 5.0).all() and (b.to_numpy() == np.arange(256)).all()
    b.free()
    moving.free()
    d.close()
    h.close()


def _alloc_refused(arena, words):
    """A forked child's body: exit 0 if ``arena.alloc`` raises a BackendError
    whose message has ``words``; 3 if it succeeds, 4 for another message, 8 for
    another exception."""
    def child():
        import os
        try:
            arena.alloc(16)
            os._exit(3)
        except BackendError as e:
            os._exit(0 if words in str(e) else 4)
        except BaseException:
            os._exit(8)
    return child


def _forked_while_held(lock, child, timeout=8):
    """Exit code of ``child()`` run in a process forked while another thread
    holds ``lock`` (None: the child hung past ``timeout`` seconds); the thread
    lets go once the child is done."""
    release, t = _held_by_a_thread(lock)
    try:
        return _in_forked_child(child, timeout=timeout)
    finally:
        release.set()
        t.join()


def _held_by_a_thread(lock):
    """Start a thread that holds ``lock`` (as one inside an alloc, a free or a
    poll does) until the returned event is set; returns (release, thread)."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    return release, t


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
@pytest.mark.parametrize("held", ["allocator", "accounting", "stats adaptor", "engine",
                                  "backends"])
def test_a_child_forked_while_a_thread_uses_an_arena_raises_instead_of_hanging(held):
    # A thread allocating, freeing or moving (a prefetch thread, as the README's
    # "Threads and processes" allows) holds a lock at the fork; that thread does
    # not exist in the child, so the child's first use of the arena waited
    # forever: a DataLoader worker hung. An arena or allocator lock held means a
    # half-done update, so that arena is refused in the child, with a
    # BackendError saying why and what to do; the transfer engine's and the
    # backend registry's locks guard single container operations, so they are
    # renewed. Other arenas work.
    from rtmem.adaptors import StatisticsAdaptor
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    busy = HostArena(1 << 16, backend=be, adaptors=[StatisticsAdaptor])
    d, h = DeviceArena(1 << 16, backend=be), HostArena(1 << 16, backend=be)
    kept = busy.alloc(shape=(16,), dtype=np.float32)
    kept.numpy()[:] = 3.0
    import rtmem.backends
    lock = {"allocator": busy.core._lock, "accounting": busy._acct_lock,
            "stats adaptor": busy.allocator._lock, "engine": T.get_engine(be)._lock,
            "backends": rtmem.backends._lock}[held]
    def child():
        import os
        try:
            if held not in ("engine", "backends"):
                for use in (lambda: busy.alloc(16), kept.free, busy.stats, busy.close):
                    try:
                        use()
                        os._exit(3)
                    except BackendError as e:
                        if "forked" not in str(e) or "another thread" not in str(e):
                            os._exit(4)
                if not (kept.numpy() == 3.0).all():    # its data is still readable
                    os._exit(5)
                if "unusable in this forked child" not in repr(busy):
                    os._exit(9)
            b = d.alloc(shape=(64,), dtype=np.float32)
            b.numpy()[:] = 7.0
            T.synchronize(T.offload(b, arena=h))
            T.synchronize()                     # the default backend's engine
            ok = (b.to_numpy() == 7.0).all() and get_backend("host").name == "host"
            b.free()
            d.close()
            h.close()
            os._exit(0 if ok else 6)
        except BaseException:
            os._exit(8)

    assert _forked_while_held(lock, child) == 0
    for arena in (busy, d, h):          # the parent is unaffected
        arena.alloc(16).free()
    assert (kept.numpy() == 3.0).all()
    kept.free()
    for arena in (busy, d, h):
        arena.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
def test_a_forked_child_refuses_an_arena_whose_core_was_busy_under_a_user_adaptor():
    # The after-fork check found the core allocator by walking each adaptor's
    # own `upstream` attribute; a user's adaptor that keeps its upstream under
    # another name (adaptors= takes any callable returning an allocator) ended
    # the walk there, so a core lock a thread held at the fork was missed and
    # the child's first alloc on that arena hung.
    from rtmem.backends.host import HostBackend

    class Counting:                     # duck-typed: no AllocatorAdaptor, no .upstream
        def __init__(self, inner):
            self._inner, self.calls = inner, 0

        def allocate(self, nbytes, stream=None):
            self.calls += 1
            return self._inner.allocate(nbytes, stream)

        def deallocate(self, block, **kw):
            self._inner.deallocate(block, **kw)

        def stats(self):
            return self._inner.stats()

    busy = HostArena(1 << 16, backend=HostBackend(), adaptors=[Counting])
    busy.alloc(16).free()
    assert busy.allocator.calls == 1            # the stack is in use
    child = _alloc_refused(busy, "forked")

    assert _forked_while_held(busy.core._lock, child) == 0
    busy.alloc(16).free()                       # the parent is unaffected
    busy.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
def test_a_forked_child_refuses_an_arena_whose_middle_adaptor_was_busy():
    # The after-fork check walks the whole stack through each adaptor's
    # upstream, not the top adaptor and the core only: a lock held at the fork
    # in an adaptor between them (a statistics adaptor under a budget) made
    # the child's first alloc on that arena hang.
    from rtmem.adaptors import LimitAdaptor, StatisticsAdaptor
    from rtmem.backends.host import HostBackend
    busy = HostArena(1 << 16, backend=HostBackend(),
                     adaptors=[StatisticsAdaptor, lambda up: LimitAdaptor(up, 1 << 15)])
    middle = busy.allocator.upstream
    assert isinstance(middle, StatisticsAdaptor) and middle is not busy.core
    busy.alloc(16).free()

    child = _alloc_refused(busy, "forked")

    assert _forked_while_held(middle._lock, child) == 0
    busy.alloc(16).free()                       # the parent is unaffected
    busy.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
def test_a_child_forked_inside_an_alloc_is_told_the_forking_thread_may_hold_the_lock():
    # A plain Lock does not say who holds it: an arena whose lock the thread
    # that forked held (a fork from inside an adaptor's allocate) is refused in
    # the child, whose message blamed "another thread" that never existed.
    from rtmem.backends.host import HostBackend
    busy = HostArena(1 << 16, backend=HostBackend())

    child = _alloc_refused(busy, "the thread that forked")

    with busy.core._lock:
        assert _in_forked_child(child, timeout=8) == 0
    busy.alloc(16).free()                       # the parent is unaffected
    busy.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no fork")
def test_a_child_forked_while_a_thread_holds_a_buffer_lock_raises_instead_of_hanging():
    # A thread inside a move, a view or a free of one buffer holds that buffer's
    # lock at the fork; the thread does not exist in the child, so the child's
    # free of that buffer, and transfers.synchronize() (which settles every
    # buffer moved since), waited forever. The buffer may be half-updated: the
    # child refuses it with a BackendError naming the remedy. Buffers whose
    # locks were free or held by the forking thread, and new ones, work as in
    # the parent.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    d, h = DeviceArena(1 << 16, backend=be), HostArena(1 << 16, backend=be)
    busy = d.alloc(shape=(32,), dtype=np.float32, kind="weight")
    idle = d.alloc(shape=(64,), dtype=np.float32)
    rng = np.random.default_rng()
    data = rng.standard_normal(64).astype(np.float32)
    busy.numpy()[:] = 2.0
    idle.numpy()[:] = data
    for b in (busy, idle):          # watched by the engine's synchronize()
        T.synchronize(T.offload(b, arena=h))
    sync = T.get_engine(be).synchronize     # transfers.synchronize() of this backend

    def child():
        import os
        try:
            try:
                sync()
                os._exit(3)
            except BackendError as e:
                if "forked" not in str(e) or "spawn" not in str(e):
                    os._exit(4)
            sync()                          # raised once, as a failed copy is
            for use in (busy.free, lambda: busy.numpy(), lambda: T.evict(busy),
                        lambda: T.synchronize(busy)):
                try:
                    use()
                    os._exit(5)
                except BackendError as e:
                    if "forked" not in str(e) or "weight buffer" not in str(e):
                        os._exit(6)
            if "unusable in this forked child" not in repr(busy):
                os._exit(7)
            if idle.residency != "both" or not (idle.to_numpy() == data).all():
                os._exit(9)
            T.evict(idle)
            T.synchronize(T.prefetch(idle))
            ok = (idle.numpy() == data).all()
            fresh = d.alloc(shape=(16,), dtype=np.float32)
            fresh.numpy()[:] = 5.0
            T.synchronize(T.offload(fresh, arena=h))
            ok = ok and (fresh.to_numpy() == 5.0).all()
            fresh.free()
            idle.free()
            sync()
            os._exit(0 if ok else 10)
        except BaseException:
            os._exit(8)

    with idle._lock:    # held by the thread that forks: it owns it in the child too
        assert _forked_while_held(busy._lock, child) == 0
    assert busy.residency == "both" and (busy.to_numpy() == 2.0).all()
    for b in (busy, idle):          # the parent is unaffected
        b.free()
    sync()
    d.close()
    h.close()


def test_a_record_refused_by_a_closed_stream_leaves_the_event_as_it_was():
    # The event switched to the new recording before the stream refused it: it
    # stayed pending forever, and its synchronize() hung.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    s = be.new_stream("closing")
    ev = be.new_event().record(s)
    ev.synchronize()
    s.close()
    with pytest.raises(BackendError, match="closed"):
        ev.record(s)
    assert ev.query() and ev.error is None
    ev.synchronize()                                # the earlier recording: done
    fresh = be.new_event()
    with pytest.raises(BackendError, match="closed"):
        fresh.record(s)
    assert fresh.query()                            # still never recorded


def test_moves_on_a_one_copy_buffer_being_copied_into_name_the_real_obstacle(arenas):
    # A copy() into a buffer with one copy made evict / drop_host / offload say
    # "in flight (a prefetch), synchronize first"; after that they were refused
    # for having one copy all along.
    d, h = arenas
    eng = T.get_engine("host")
    gates = [gate_stream(eng.h2d), gate_stream(eng.d2h)]
    on_device, on_host = d.alloc(256), h.alloc(256)
    T.copy(on_device, d.alloc(256))
    T.copy(on_host, h.alloc(256))
    try:
        assert on_device.residency == on_host.residency == "in-flight"
        with pytest.raises(ResidencyError, match="device copy is the only copy"):
            T.evict(on_device)
        with pytest.raises(ResidencyError, match="no host copy"):
            T.drop_host(on_device)
        with pytest.raises(ResidencyError, match="host copy is the only copy"):
            T.drop_host(on_host)
        with pytest.raises(ResidencyError, match="no device copy"):
            T.offload(on_host)
        with pytest.raises(ResidencyError, match="in flight"):
            T.offload(on_device, arena=h)         # here the copy is what is in the way
    finally:
        for gate in gates:
            gate.set()
    T.synchronize()


def test_host_streams_refuse_non_events_as_cuda_streams_do():
    # An AttributeError ('NoneType' object has no attribute '_done') from deep
    # inside, where a CUDA stream raises a TypeError saying what to pass.
    be = get_backend("host")
    for stream in (be.new_stream("w"), be.current_stream()):
        for bad in (None, 3, "event"):
            with pytest.raises(TypeError, match="cannot wait for a"):
                stream.wait_event(bad)
    with pytest.raises(TypeError, match="cannot wait for a"):
        be.new_stream("w").wait_event(threading.Event())


def test_views_of_a_copy_source_wait_for_the_copy(arenas):
    # The source of copy() is not in flight itself, but the copy still reads it:
    # refilling it through a view (a pinned staging buffer's next batch) must
    # wait, or the copy sends the new bytes.
    d, h = arenas
    src, dst = h.alloc(1 << 16), d.alloc(1 << 16)
    src.numpy()[:] = 1
    gate = gate_stream(T.get_engine("host").h2d)
    T.copy(dst, src)
    timer = threading.Timer(0.2, gate.set)     # opens the copy after a while
    timer.start()
    try:
        src.numpy()[:] = 2                     # waits for the copy to read the 1s
    finally:
        timer.cancel()
        gate.set()
    T.synchronize()
    assert (dst.numpy() == 1).all() and (src.numpy() == 2).all()
    src.free()
    dst.free()


def test_free_during_copy_keeps_block_reserved(arenas):
    d, h = arenas
    eng = T.get_engine("host")
    src = d.alloc(4 << 20)                         # the whole device slab
    src.numpy()[:] = 9
    gate = gate_stream(eng.d2h)
    T.offload(src, arena=h)
    host_block = src.placement("host").block
    src.free()                                     # both frees wait for the copy
    assert h.stats().pending_bytes == host_block.size
    gate.set()
    T.synchronize()
    assert h.stats().pending_bytes == 0 and d.stats().allocated_bytes == 0
    again = d.alloc(4 << 20)
    again.free()


def test_block_reused_on_a_copy_stream_stays_gated_when_freed(arenas):
    # A device block freed behind a queued offload was taken over by an
    # allocation on that copy stream (legal: stream order), then freed with no
    # transfer of its own. It used to become free for everyone at once: the CPU
    # got the bytes the offload still read, and the only copy of b was corrupted.
    d, h = arenas
    eng = T.get_engine("host")
    b = d.alloc(1 << 20)
    b.numpy()[:] = 1
    gate = gate_stream(eng.d2h)
    T.offload(b, arena=h)
    T.evict(b)                                      # freed behind the offload
    x = d.alloc(1 << 20, stream=eng.d2h)            # the same block, same stream
    assert x.offset == 0
    x.free()
    assert d.stats().pending_bytes >= 1 << 20       # still behind the offload
    y = d.alloc(1 << 20)                            # the CPU: another block
    assert y.offset != 0
    y.numpy()[:] = 99
    gate.set()
    T.synchronize(b)
    assert b.residency == "host" and np.all(b.numpy("host") == 1)
    y.free()
    b.free()


def test_wait_all_and_backend_sync(arenas):
    d, h = arenas
    bufs = [d.alloc(10000) for _ in range(8)]
    for b in bufs:
        T.offload(b, arena=h)
    T.wait()
    get_backend("host").synchronize()
    assert all(b.residency == "both" for b in bufs)
    for b in bufs:
        b.free()


def test_event_of_a_placement_covers_earlier_copies_on_the_other_stream(arenas):
    d, h = arenas
    eng = T.get_engine("host")
    src = h.alloc(shape=(512,), dtype=np.int32)
    src.numpy()[:] = 5
    to_dev = d.alloc(shape=(512,), dtype=np.int32)
    to_host = h.alloc(shape=(512,), dtype=np.int32)
    gate = gate_stream(eng.h2d)
    first = T.copy(to_dev, src)            # H2D, held by the gate
    second = T.copy(to_host, src)          # D2H stream: must not finish first
    assert not first.query()
    src.free()                             # gated on the second copy's event...
    assert h.stats().pending_bytes > 0     # ...which implies the first one
    assert not second.query()
    gate.set()
    T.synchronize(to_host)
    T.synchronize(to_dev)
    assert (to_dev.numpy() == 5).all() and (to_host.numpy() == 5).all()
    to_dev.free()
    to_host.free()


class _FailFreeOnce:
    """Adaptor factory: the arena's next free raises before reaching the allocator."""

    def __init__(self):
        self.armed = False

    def __call__(self, upstream):
        from rtmem.adaptors import AllocatorAdaptor
        outer = self

        class Failing(AllocatorAdaptor):
            def deallocate(self, block, **kw):
                if outer.armed:
                    outer.armed = False
                    raise RuntimeError("injected free failure")
                self.upstream.deallocate(block, **kw)
        return Failing(upstream)


def test_free_failing_on_one_placement_keeps_the_buffer_on_the_rest(arenas):
    # The device placement is released first; when the host one then fails, the
    # buffer must stay live on the host (never keep the released device block,
    # which the allocator hands to the next request).
    d, _ = arenas
    fail = _FailFreeOnce()
    h = HostArena("1MiB", backend="host", adaptors=[fail])
    b = d.alloc(shape=(256,), dtype=np.float32)
    b.numpy()[:] = np.arange(256)
    T.offload(b, arena=h)
    T.synchronize(b)
    fail.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        b.free()
    assert b.residency == "host" and b.placement("device") is None
    np.testing.assert_array_equal(b.numpy(), np.arange(256))
    assert d.stats().allocated_bytes == 0
    b.free()                                    # the retry frees the rest
    assert b.residency == "freed" and h.stats().allocated_bytes == 0
    h._check_invariants()


def test_failed_copy_frees_its_destination(arenas, monkeypatch):
    d, h = arenas
    x = h.alloc(shape=(64,), dtype=np.float32)

    def refuse(*args):
        raise RuntimeError("injected copy failure")
    monkeypatch.setattr(d.backend, "copy_async", refuse)
    with pytest.raises(RuntimeError, match="injected"):
        T.prefetch(x, arena=d)
    assert d.stats().allocated_bytes == 0 and x.residency == "host"
    monkeypatch.undo()
    x.free()


def test_waiting_on_a_freed_buffer_raises_as_its_other_uses(arenas):
    # wait(buf) and synchronize(buf) returned silently on a freed buffer, as if
    # its data were ready, where numpy(), the moves and copy raise
    d, h = arenas
    engine = T.get_engine("host")
    settled = d.alloc(shape=(16,))
    settled.free()
    moving = d.alloc(shape=(1024,))
    moving.numpy()[:] = np.random.default_rng().standard_normal(1024)
    gate = gate_stream(engine.d2h)
    T.offload(moving, arena=h)
    moving.free()                               # stream-ordered: the copy still waits
    pinned = h.alloc(64)
    view = pinned.numpy(pin=True)
    pinned.free()                               # its release waits for the view
    try:
        for b, match in ((settled, "was freed; allocate"), (moving, "was freed; allocate"),
                         (pinned, "freed .its release waits for views")):
            for use in (T.wait, T.synchronize, lambda b: b.numpy()):
                with pytest.raises(UseAfterFreeError, match=match):
                    use(b)
    finally:
        gate.set()
    del view
    gc.collect()
    T.synchronize()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_buffers_of_a_closed_arena_say_so(arenas):
    _, h = arenas
    d = DeviceArena("1MiB", backend="host")
    z = d.alloc(shape=(32,), dtype=np.float32)
    d.close()
    # no copy in an open arena: its data is gone, every use raises ("device")
    assert z.residency == "freed" and not z.is_freed
    for use in (z.numpy, z.to_numpy, lambda: T.offload(z, arena=h), lambda: T.wait(z),
                lambda: T.synchronize(z)):
        with pytest.raises(UseAfterFreeError, match="arena .*was closed.*only there "
                           "and is gone: free"):
            use()
    z.free()                                    # cleaning up stays legal
    assert z.residency == "freed"


@pytest.mark.parametrize("closed", ["device", "host"])
def test_closing_one_arena_keeps_the_copy_in_the_other(arenas, closed):
    # An offloaded buffer whose device arena was closed kept its dead device
    # placement, and every use refused the buffer: the host copy (intact bytes in
    # an open arena) could be neither read, nor prefetched again, nor evicted to.
    d0, h0 = arenas
    d, h = DeviceArena("1MiB", backend="host"), HostArena("1MiB", backend="host")
    data = np.random.default_rng().standard_normal(64).astype(np.float32)
    b = d.alloc(shape=(64,), dtype=np.float32)
    b.numpy()[:] = data
    T.synchronize(T.offload(b, arena=h))
    pinned = d.alloc(shape=(8,), dtype=np.float32)  # its copy there is viewed
    pinned_data = np.random.default_rng().standard_normal(8).astype(np.float32)
    pinned.numpy()[:] = pinned_data
    T.synchronize(T.offload(pinned, arena=h))
    view = pinned.numpy("device" if closed == "device" else "host", pin=True)
    (d if closed == "device" else h).close()
    kept = "host" if closed == "device" else "device"
    assert b.residency == kept and b.placement(closed) is None
    np.testing.assert_array_equal(b.numpy(kept), data)
    np.testing.assert_array_equal(b.to_numpy(), data)
    # and it moves on from there, into arenas still open
    T.synchronize(T.prefetch(b, arena=d0) if kept == "host" else T.offload(b, arena=h0))
    assert b.residency == "both"
    np.testing.assert_array_equal(b.numpy("host"), data)
    b.free()
    # the closed copy, kept attached for its view, is no copy: residency said
    # "both" (NOTE [ Residency state machine ], closed arenas)
    assert pinned.residency == kept and repr(pinned).count(f" {kept} ") == 1
    # a copy pinned by views of released memory is not dropped under them; the
    # error said only "close an arena only after its buffers are done with",
    # not that the other copy is intact and the views keep it out of reach
    for use in (pinned.to_numpy, lambda: pinned.numpy(kept)):
        with pytest.raises(UseAfterFreeError, match=f"the {closed} arena .*was closed.*"
                           f"1 pinned view.*{kept} copy is intact: drop those views"):
            use()
    del view
    gc.collect()
    assert pinned.residency == kept                 # usable again, nothing lost
    np.testing.assert_array_equal(pinned.to_numpy(), pinned_data)
    pinned.free()
    (h if closed == "device" else d).close()
    assert d0.stats().allocated_bytes == 0 and h0.stats().allocated_bytes == 0


def test_moves_refuse_an_arena_of_the_wrong_kind(arenas):
    d, h = arenas
    dev = d.alloc(shape=(8,), dtype=np.float32)
    host = h.alloc(shape=(8,), dtype=np.float32)
    with pytest.raises(ValueError, match="offload needs a host arena"):
        T.offload(dev, arena=d)
    with pytest.raises(ValueError, match="prefetch needs a device arena"):
        T.prefetch(host, arena=h)
    assert dev.residency == "device" and host.residency == "host"
    assert d.stats().live_blocks == 1 and h.stats().live_blocks == 1
    dev.free()
    host.free()


def test_backend_out_of_memory_while_growing_is_an_oom_with_stats(arenas, monkeypatch):
    from rtmem.backends import host as host_backend
    d = DeviceArena(4096, backend="host", max_bytes=1 << 20, growth_bytes=4096)
    x = d.alloc(4096)
    before = d.stats()

    def no_memory(nbytes):
        raise MemoryError
    monkeypatch.setattr(host_backend, "_page_aligned", no_memory)
    with pytest.raises(OutOfMemoryError, match="growing by a 4,096-byte slab") as e:
        d.alloc(1000)
    assert e.value.requested == 1000 and e.value.stats.allocated_bytes == 4096
    assert d.stats() == before
    x.free()
    d._check_invariants()


def test_wrong_argument_types_are_named(arenas):
    d, _ = arenas
    b = d.alloc(64)
    for call, fragment in ((lambda: T.prefetch(np.zeros(3)), "prefetch takes an rtmem Buffer"),
                           (lambda: T.copy(np.zeros(4), b), "copy takes an rtmem Buffer"),
                           (lambda: T.wait("foo"), "wait takes a Buffer, an event"),
                           (lambda: T.synchronize(42), "synchronize takes a Buffer")):
        with pytest.raises(TypeError, match=fragment):
            call()
    with pytest.raises(ValueError, match="offload needs a host arena"):
        T.offload(b, arena="x")
    b.free()


def _own_backend():
    """A HostBackend of the test's own, a 64 KiB device and host arena on it, and
    its transfer engine: (backend, device arena, host arena, engine). Its streams
    and copy threads are shared with no other test, so the test may gate or
    close them."""
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    return be, DeviceArena(1 << 16, backend=be), HostArena(1 << 16, backend=be), \
        T.get_engine(be)


def fail_next_copy(monkeypatch):
    """Make the next copy on a host transfer thread raise (once)."""
    from rtmem.backends import host as H
    real = H._copy

    def failing(dst, src):
        monkeypatch.setattr(H, "_copy", real)
        raise MemoryError("simulated copy failure")
    monkeypatch.setattr(H, "_copy", failing)


def failing_copy_of_a_buffer(arenas, monkeypatch, value):
    """(device arena, host arena, host engine, a 64-float device buffer filled
    with ``value``), the next copy set to fail."""
    d, h = arenas
    b = d.alloc(shape=(64,), dtype=np.float32)
    b.numpy()[:] = value
    fail_next_copy(monkeypatch)
    return d, h, T.get_engine("host"), b


def settled(event):
    """Wait for ``event`` and ignore its failure (the buffer reports it)."""
    try:
        event.synchronize()
    except BackendError:
        pass


def test_a_failed_offload_is_raised_by_the_next_synchronize_once(arenas, monkeypatch):
    # synchronize() waited for a failing offload and returned: the failure came
    # out at the buffer's next use, maybe much later, while residency (evicted
    # during the offload) said "host" as after a success.
    d, h = arenas
    data = np.random.default_rng().standard_normal(64).astype(np.float32)
    bufs = []
    for _ in range(2):
        b = d.alloc(shape=(64,), dtype=np.float32)
        b.numpy()[:] = data
        bufs.append(b)
    kept, evicted = bufs
    fail_next_copy(monkeypatch)
    settled(T.offload(kept, arena=h))
    fail_next_copy(monkeypatch)
    gate = gate_stream(T.get_engine("host").d2h)
    event = T.offload(evicted, arena=h)
    T.evict(evicted)                    # legal during the offload
    gate.set()
    settled(event)
    # one failure per call, each exactly once; the buffers are undone
    with pytest.raises(BackendError, match="D2H copy") as first:
        T.synchronize()
    with pytest.raises(BackendError, match="D2H copy") as second:
        T.synchronize()
    T.synchronize()
    assert {"dropped" in str(e.value) for e in (first, second)} == {True, False}
    assert kept.residency == "device" and evicted.residency == "host"
    np.testing.assert_array_equal(kept.numpy(), data)     # not raised again
    evicted.numpy()                                      # nor here
    T.synchronize(T.offload(kept, arena=h))              # the retry works
    np.testing.assert_array_equal(kept.numpy("host"), data)
    # a failure the buffer's own use reported first is not raised again
    fail_next_copy(monkeypatch)
    settled(T.prefetch(evicted))
    with pytest.raises(BackendError, match="H2D copy"):
        evicted.numpy()
    T.synchronize()
    for b in bufs:
        b.free()


def test_pinned_views_refuse_evicting_or_dropping_the_copy_they_read(arenas):
    # evict() released the device block a pinned view read; the next allocation
    # reused it, and the view and the new buffer wrote each other's data.
    d, h = arenas
    b = d.alloc(shape=(256,), dtype=np.float32)
    b.numpy()[:] = 1
    view = b.numpy(pin=True)
    T.synchronize(T.offload(b, arena=h))
    with pytest.raises(ResidencyError, match="pinned view.*device copy") as info:
        T.evict(b)
    assert info.value.action == "evict" and b.residency == "both"
    T.drop_host(b)                      # the host copy is not pinned
    T.synchronize(T.offload(b, arena=h))
    host_view = b.numpy("host", pin=True)
    with pytest.raises(ResidencyError, match="pinned view.*host copy"):
        T.drop_host(b)
    del view
    gc.collect()
    T.evict(b)                          # the last device view is gone
    other = d.alloc(shape=(256,), dtype=np.float32)
    other.numpy()[:] = 99
    assert np.all(host_view == 1) and b.residency == "host"
    del host_view
    b.free()
    other.free()


def test_a_failed_copy_is_raised_by_the_next_view_even_when_it_completed(arenas, monkeypatch):
    # A copy that had failed and completed before the caller looked was taken as
    # a success: numpy() returned the garbage device block, and residency/repr
    # dropped the error for good.
    d, h = arenas
    b = h.alloc(shape=(64,), dtype=np.float32)
    b.numpy()[:] = 7
    fail_next_copy(monkeypatch)
    settled(T.prefetch(b, arena=d))
    assert b.residency == "host" and "host" in repr(b)    # undone, error kept
    with pytest.raises(BackendError, match="H2D copy.*keeps its host copy"):
        b.numpy()
    assert np.all(b.numpy() == 7)                          # reported once
    # copy() from a source whose move failed raises it instead of copying garbage
    fail_next_copy(monkeypatch)
    settled(T.prefetch(b, arena=d))
    dst = h.alloc(shape=(64,), dtype=np.float32)
    with pytest.raises(BackendError, match="H2D copy"):
        T.copy(dst, b)
    assert dst.residency == "host" and dst._pending is None
    for x in (b, dst):
        x.free()


def test_an_offload_failing_after_evict_keeps_the_buffer_freeable(arenas, monkeypatch):
    # offload, evict (legal during the offload), then the offload fails: both
    # placements were dropped, numpy()/free() raised AttributeError, the buffer
    # could not be freed and the message said it kept its other copy.
    d, h = arenas
    b = d.alloc(shape=(64,), dtype=np.float32)
    fail_next_copy(monkeypatch)
    gate = gate_stream(T.get_engine("host").d2h)
    ev = T.offload(b, arena=h)
    T.evict(b)
    gate.set()
    settled(ev)
    with pytest.raises(BackendError, match="bytes of its host copy are not valid"):
        T.synchronize(b)
    assert b.residency == "host" and b.numpy().shape == (64,)
    b.free()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_a_prefetch_chained_on_a_failed_offload_is_not_valid_either(arenas, monkeypatch):
    # offload, evict, prefetch (which waits for the offload), then the offload
    # fails: the prefetch failed with it, and its undo kept the garbage host
    # copy as the good one; retrying the prefetch "succeeded" with zeros.
    d, h = arenas
    b = d.alloc(shape=(64,), dtype=np.float32)
    b.numpy()[:] = 3
    fail_next_copy(monkeypatch)
    gate = gate_stream(T.get_engine("host").d2h)
    T.offload(b, arena=h)
    T.evict(b)
    ev = T.prefetch(b)
    gate.set()
    settled(ev)
    with pytest.raises(BackendError, match="not valid"):
        T.synchronize(b)
    assert b.residency == "device"          # one placement left, reported not valid
    b.free()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_a_view_waiting_for_a_failing_copy_reports_the_buffer_error_once(arenas, monkeypatch):
    # A view blocked on its placement's copy re-raised that copy's raw stream
    # failure: the source of a failed transfers.copy (whose bytes are fine) could
    # not be viewed, and a buffer's failed offload was reported twice (the raw
    # error, then the buffer's own), the first saying nothing of the copy kept.
    d, h = arenas
    d2h = T.get_engine("host").d2h
    src = d.alloc(shape=(64,), dtype=np.float32)
    src.numpy()[:] = 5
    dst = h.alloc(shape=(64,), dtype=np.float32)
    fail_next_copy(monkeypatch)
    gate = gate_stream(d2h)
    T.copy(dst, src)
    threading.Timer(0.2, gate.set).start()      # the view below waits for the copy
    assert np.all(src.numpy() == 5)             # the copy only read src
    with pytest.raises(BackendError, match="host copy are not valid"):
        T.synchronize(dst)                      # the copy's own buffer reports it
    fail_next_copy(monkeypatch)
    gate = gate_stream(d2h)
    T.offload(src, arena=h)
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(BackendError, match="D2H copy.*keeps its device copy"):
        src.numpy()                             # waits, then the buffer's error
    assert np.all(src.numpy() == 5) and src.residency == "device"   # reported once
    T.synchronize(src)
    for b in (src, dst):
        b.free()


def test_buffer_shape_dtype_and_kind_are_read_only(arenas):
    # b.shape = (80,) on a 16-byte buffer let numpy() read its neighbour's data;
    # b.kind = ... made the per-kind accounting go negative
    d, _ = arenas
    b = d.alloc(shape=(4,), dtype=np.float32)
    for name, value in (("shape", (80,)), ("dtype", np.float64), ("kind", "weight"),
                        ("nbytes", 1 << 20)):
        with pytest.raises(AttributeError):
            setattr(b, name, value)
    b.free()
    assert d.stats().bytes_by_kind["activation"] == 0


def test_to_numpy_reads_under_the_buffer_lock_so_no_move_frees_what_it_reads(
        arenas, monkeypatch):
    # to_numpy chose the placement, then read it without the lock: an evict or
    # drop_host on another thread could free the block in between and a new
    # buffer take it, so the copy returned another buffer's bytes
    d, h = arenas
    buf = d.alloc(shape=(256,), dtype=np.float32)
    buf.numpy()[:] = np.random.default_rng(3).standard_normal(256, np.float32)
    T.synchronize(T.offload(buf, arena=h))
    backend = d.backend
    read, seen = backend.read, []

    def try_the_lock():
        seen.append(buf._lock.acquire(blocking=False))
        if seen[-1]:
            buf._lock.release()

    def read_while_a_move_tries_the_lock(*args):
        other = threading.Thread(target=try_the_lock)
        other.start()
        other.join()
        return read(*args)

    monkeypatch.setattr(backend, "read", read_while_a_move_tries_the_lock)
    out = buf.to_numpy()
    monkeypatch.undo()
    assert seen == [False]           # a move on another thread would have waited
    assert np.array_equal(out, buf.numpy("host"))
    buf.free()


def test_a_prefetch_chained_on_an_offload_that_fails_just_before_it_still_fails(
        arenas, monkeypatch):
    # The offload failed (and completed) between prefetch's residency check and
    # the enqueue of its copy: _issue skipped events that query() complete, so
    # the H2D copy never inherited the failure. The prefetch copied the garbage
    # host bytes and reported success: residency "both", no error, zeros.
    d, h, eng, b = failing_copy_of_a_buffer(arenas, monkeypatch, 3)
    gate = gate_stream(eng.d2h)
    off = T.offload(b, arena=h)
    T.evict(b)
    real = eng._after_compute

    def after_compute(stream):      # the first step of the prefetch's _issue
        monkeypatch.setattr(eng, "_after_compute", real)
        gate.set()                  # a thread switch: the offload runs and fails
        settled(off)
        real(stream)
    monkeypatch.setattr(eng, "_after_compute", after_compute)
    settled(T.prefetch(b))
    assert off.error is not None
    with pytest.raises(BackendError, match="not valid"):
        T.synchronize(b)
    assert b.residency == "device"
    b.free()
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0


def test_a_failed_copy_reports_on_its_own_event_when_another_thread_records_meanwhile(
        arenas, monkeypatch):
    # A host stream reports a failure by the first event recorded after the
    # failed work. _issue enqueued the copy and recorded its event in two steps:
    # another thread's event in between (its own offload, a gated free) took the
    # failure, and the failed offload reported success with a host copy of zeros.
    d, h, eng, b = failing_copy_of_a_buffer(arenas, monkeypatch, 7)
    real = eng.backend.copy_async
    other = []
    thread = threading.Thread(target=lambda: other.append(
        eng.backend.new_event().record(eng.d2h)))

    def copy_async(*args):
        monkeypatch.setattr(eng.backend, "copy_async", real)
        real(*args)
        thread.start()
        # unlocked, the other thread records here; held off by the stream's
        # lock, it records once this copy's event is in (the join times out)
        thread.join(0.2)
    monkeypatch.setattr(eng.backend, "copy_async", copy_async)
    off = T.offload(b, arena=h)
    thread.join()
    settled(off)
    other[0].synchronize()           # clean: the failure is not its to report
    with pytest.raises(BackendError, match="D2H copy .* failed: MemoryError"):
        T.synchronize(b)
    assert b.residency == "device" and np.all(b.numpy() == 7)
    b.free()


def test_a_free_during_a_copy_also_waits_for_the_buffers_own_stream():
    # A buffer allocated for a side stream and freed while its offload still
    # copies is freed on the copy stream, behind the copy and behind the side
    # stream's work queued so far (it may still use the block). Without the
    # second wait the block was reusable by everyone once the copy ended, while
    # the side stream's work still ran on it. Work enqueued on the copy stream
    # after the free runs only once the freed block may be reused.
    be, d, h, eng = _own_backend()
    user = be.new_stream("user")
    b = d.alloc(4096, stream=user)
    copy_gate = gate_stream(eng.d2h)
    T.offload(b, arena=h)
    user_gate = gate_stream(user)
    order = []
    user.launch_host_func(lambda: order.append("user work"))
    b.free()
    assert d.stats().pending_bytes == 4096
    eng.d2h.launch_host_func(lambda: order.append("after the free"))
    copy_gate.set()                             # the copy ends; the user work waits
    threading.Timer(0.2, user_gate.set).start()
    eng.synchronize()
    user.synchronize()
    assert order == ["user work", "after the free"]
    assert d.stats().allocated_bytes == 0 and h.stats().allocated_bytes == 0
    d._check_invariants()


def test_a_buffer_whose_copy_ran_on_a_stream_closed_since_can_be_freed():
    # A copy stream closes when its engine is dropped (HostStream.__del__) with
    # the work queued before still to run. A buffer freed while such a copy ran
    # recorded its free's event on the closed stream, which refused it: free()
    # raised and the bytes leaked. The free waits the stream out instead and
    # frees for everyone.
    _, d, h, eng = _own_backend()
    b = d.alloc(4096)
    b.numpy()[:] = 1
    gate = gate_stream(eng.d2h)
    ev = T.offload(b, arena=h)
    eng.d2h.close()                             # the queued copy still runs
    threading.Timer(0.1, gate.set).start()
    b.free()
    assert ev.query() and b.is_freed
    for arena in (d, h):
        st = arena.stats()
        assert st.allocated_bytes == 0 and st.pending_bytes == 0
        arena._check_invariants()


def test_a_prefetch_failing_after_the_offload_it_waited_for_succeeded_keeps_the_host_copy(
        arenas, monkeypatch):
    # offload, evict, prefetch (chained on the offload still running), then
    # only the prefetch's copy fails: the host copy the offload wrote is good and
    # must be kept. Counting the prior move's side as garbage too (whether it
    # failed or not) dropped it and kept the garbage device copy instead.
    from rtmem.backends import host as H
    d, h = arenas
    b = d.alloc(shape=(64,), dtype=np.float32)
    data = np.random.default_rng(11).standard_normal(64).astype(np.float32)
    b.numpy()[:] = data
    real, copies = H._copy, []

    def second_fails(dst, src):
        copies.append(1)
        if len(copies) == 2:                    # the prefetch's copy (after the offload's)
            monkeypatch.setattr(H, "_copy", real)
            raise MemoryError("simulated copy failure")
        real(dst, src)
    monkeypatch.setattr(H, "_copy", second_fails)
    gate = gate_stream(T.get_engine("host").d2h)
    T.offload(b, arena=h)
    T.evict(b)
    ev = T.prefetch(b)                          # waits for the offload
    gate.set()
    settled(ev)
    with pytest.raises(BackendError, match="H2D copy.*keeps its host copy"):
        T.synchronize(b)
    assert len(copies) == 2 and b.residency == "host"
    np.testing.assert_array_equal(b.numpy(), data)
    assert d.stats().allocated_bytes == 0
    b.free()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_copy_into_a_larger_buffer_writes_only_the_sources_bytes(arenas, direction):
    # copy(dst, src) with dst.nbytes > src.nbytes copies src.nbytes: the rest
    # of dst keeps its bytes (copying dst's size read past src's end, into its
    # alignment padding or a neighbour's block, and wrote that over dst's tail).
    d, h = arenas
    rng = np.random.default_rng(5)
    src_arena, dst_arena = (h, d) if direction == "h2d" else (d, h)
    src = src_arena.alloc(shape=(100,), dtype=np.float32)
    neighbour = src_arena.alloc(shape=(64,), dtype=np.float32)   # right after src
    dst = dst_arena.alloc(shape=(300,), dtype=np.float32)
    src_data, old = (rng.standard_normal(n).astype(np.float32) for n in (100, 300))
    src.numpy()[:] = src_data
    neighbour.numpy()[:] = rng.standard_normal(64).astype(np.float32)
    dst.numpy()[:] = old
    T.synchronize(T.copy(dst, src))
    np.testing.assert_array_equal(dst.numpy()[:100], src_data)
    np.testing.assert_array_equal(dst.numpy()[100:], old[100:])
    for b in (src, neighbour, dst):
        b.free()


def test_a_copys_event_implies_the_earlier_copy_of_its_source_on_the_other_stream(arenas):
    # Two copies read one source, on the H2D then the D2H stream; the second
    # waits for the first, so that the source's one event (the last copy's)
    # covers both: freeing on it is safe. Without that wait the second copy's
    # event completed while the first still read the block.
    d, h = arenas
    eng = T.get_engine("host")
    src = h.alloc(shape=(512,), dtype=np.int32)
    data = np.random.default_rng(7).integers(1, 1 << 30, 512, dtype=np.int32)
    src.numpy()[:] = data
    to_dev = d.alloc(shape=(512,), dtype=np.int32)
    to_host = h.alloc(shape=(512,), dtype=np.int32)
    gate = gate_stream(eng.h2d)
    first = T.copy(to_dev, src)                 # H2D, held by the gate
    second = T.copy(to_host, src)               # D2H
    assert src.placement("host").event is second
    threading.Timer(0.2, gate.set).start()
    second.synchronize()
    assert first.query(), "the last copy's event completed before the first copy"
    T.synchronize()
    assert (to_dev.numpy() == data).all() and (to_host.numpy() == data).all()
    for b in (src, to_dev, to_host):
        b.free()


def test_a_copy_from_a_source_whose_move_fails_just_before_it_fails_too(arenas, monkeypatch):
    # copy(dst, src) while src's prefetch is in flight reads the device copy the
    # prefetch writes. The prefetch failed (and completed) between copy()'s
    # settle and the enqueue of its copy: the copy must wait for that move's
    # event anyway (it carries the failure), or it copied the garbage and
    # reported success.
    d, h = arenas
    eng = T.get_engine("host")
    src = h.alloc(shape=(64,), dtype=np.float32)
    src.numpy()[:] = 3
    dst = h.alloc(shape=(64,), dtype=np.float32)
    fail_next_copy(monkeypatch)
    gate = gate_stream(eng.h2d)
    pre = T.prefetch(src, arena=d)              # will fail
    real = eng._after_compute

    def after_compute(stream):                  # the first step of the copy's _issue
        monkeypatch.setattr(eng, "_after_compute", real)
        gate.set()                              # a thread switch: the prefetch fails
        settled(pre)
        real(stream)
    monkeypatch.setattr(eng, "_after_compute", after_compute)
    settled(T.copy(dst, src))
    assert pre.error is not None
    with pytest.raises(BackendError, match="host copy are not valid"):
        T.synchronize(dst)
    with pytest.raises(BackendError, match="H2D copy"):
        T.synchronize(src)
    assert src.residency == "host" and np.all(src.numpy() == 3)
    for b in (src, dst):
        b.free()


@pytest.mark.parametrize("last", ["h2d", "d2h"])
def test_wait_for_everything_covers_both_transfer_streams(arenas, last):
    # wait() with no argument orders the compute stream after the work of the
    # H2D and the D2H stream (on the host backend: blocks until both are done),
    # whichever finishes last.
    eng = T.get_engine("host")
    events = []
    for name in ("h2d", "d2h"):
        stream = getattr(eng, name)
        gate = gate_stream(stream)
        events.append(eng.backend.new_event().record(stream))
        threading.Timer(0.25 if name == last else 0.02, gate.set).start()
    T.wait()
    assert all(ev.query() for ev in events)


def test_synchronizing_a_copys_event_drops_every_completed_keepalive():
    # NOTE [ Keeping memory alive during copies ]: synchronize(event) drops the
    # engine's hold on the slabs of every completed copy, as synchronize(buf)
    # does, not one per poll; else arenas dropped next kept their memory until
    # some later copies.
    _, d, h, eng = _own_backend()
    bufs = [d.alloc(4096) for _ in range(3)]
    gate = gate_stream(eng.d2h)
    events = [T.offload(b, arena=h) for b in bufs]
    assert len(eng._inflight) == 3
    gate.set()
    T.synchronize(events[-1])
    assert len(eng._inflight) == 0              # read without the poll in_flight does
    for b in bufs:
        b.free()


def test_the_engines_synchronize_waits_for_both_streams_before_raising():
    # TransferEngine.synchronize (transfers.synchronize()) raises a failure of
    # the H2D stream only after the D2H stream is idle too, and still drops the
    # completed copies' keepalives: raised at once, the caller went on (freeing,
    # closing arenas) while copies queued on D2H still ran.
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    eng = T.get_engine(be)

    def boom():
        raise RuntimeError("copy failed")
    eng.h2d.launch_host_func(boom)
    done = []
    gate = gate_stream(eng.d2h)
    eng.d2h.launch_host_func(lambda: done.append(1))
    threading.Timer(0.1, gate.set).start()
    with pytest.raises(BackendError, match="copy failed"):
        eng.synchronize()
    assert done == [1]
    eng.synchronize()                           # reported once


def test_freeing_a_buffer_whose_copy_completed_lets_its_arenas_memory_go():
    # free() settles a completed move first, which drops the engine's keepalive
    # of its copy's slabs (NOTE [ Keeping memory alive during copies ]): freed
    # without that, arenas dropped next kept their memory until a later copy.
    import weakref
    from rtmem.backends.host import HostBackend
    be = HostBackend()
    d, h = DeviceArena(1 << 20, backend=be), HostArena(1 << 20, backend=be)
    b = d.alloc(4096)
    T.offload(b, arena=h).synchronize()         # the raw event: nothing polled
    slabs = [weakref.ref(sl.owner) for a in (d, h) for sl in a.slabs]
    b.free()
    del b, d, h
    gc.collect()
    assert [r() for r in slabs] == [None, None]
