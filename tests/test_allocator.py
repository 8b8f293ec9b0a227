"""The allocator core: best fit, splitting, coalescing, stream-ordered reuse, OOM."""

from __future__ import annotations

import pickle
import random
import threading

import numpy as np
import pytest
import hypothesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize,
                                 invariant, rule)

from _events import FakeEvent, StreamEvent, complete_one, overlaps
from _threads import run_on_threads
from rtmem.allocator import AllocatorStats, BestFitAllocator, align_up
from rtmem.errors import DoubleFreeError, InvalidPointerError, OutOfMemoryError
from rtmem.jit_allocator import JitBestFitAllocator


# ---------------------------------------------------------------- unit tests
def test_exact_sizes_no_power_of_two_rounding():
    a = BestFitAllocator(1 << 20)
    b1 = a.allocate(1000)
    b2 = a.allocate(3 * 256 + 1)
    b3 = a.allocate(0)
    assert (b1.size, b1.requested) == (1024, 1000)
    assert (b2.size, b2.requested) == (1024, 769)
    assert (b3.size, b3.requested) == (256, 0)
    s = a.stats()
    assert s.allocated_bytes == 2304 and s.requested_bytes == 1769
    assert all(b.offset % 256 == 0 for b in (b1, b2, b3))
    a._check_invariants()


def test_custom_alignment_and_validation():
    a = BestFitAllocator(4096, alignment=64)
    assert a.allocate(65).size == 128
    with pytest.raises(ValueError, match="power of two"):
        BestFitAllocator(4096, alignment=96)
    with pytest.raises(ValueError, match="initial_bytes"):
        BestFitAllocator(0)
    with pytest.raises(ValueError, match="negative"):
        a.allocate(-1)


def test_best_fit_picks_smallest_hole_and_coalesces():
    a = BestFitAllocator(10 * 1024, alignment=256)
    blocks = [a.allocate(1024) for _ in range(10)]
    a.deallocate(blocks[1])                        # 1 KiB hole
    a.deallocate(blocks[4])
    a.deallocate(blocks[5])                        # 2 KiB hole (coalesced)
    assert a.stats().largest_free_bytes == 2048
    small = a.allocate(1024)
    assert small.offset == blocks[1].offset        # best fit, not first fit
    for b in blocks[:1] + blocks[2:4] + blocks[6:] + [small]:
        a.deallocate(b)
    a._check_invariants()
    s = a.stats()
    assert s.largest_free_bytes == s.reserved_bytes == 10 * 1024
    assert s.fragmentation == 0.0


def test_fragmentation_stat():
    a = BestFitAllocator(4 * 1024, alignment=1024)
    bs = [a.allocate(1024) for _ in range(4)]
    a.deallocate(bs[0])
    a.deallocate(bs[2])
    s = a.stats()
    assert s.free_bytes == 2048 and s.largest_free_bytes == 1024
    assert s.fragmentation == pytest.approx(0.5)


def test_oom_carries_numbers_and_leaves_state():
    a = BestFitAllocator(4096)
    a.allocate(3000)
    before = a.stats()
    with pytest.raises(OutOfMemoryError) as info:
        a.allocate(2000)
    err = info.value
    assert err.requested == 2000
    assert isinstance(err.stats, AllocatorStats) and err.stats.allocated_bytes == 3072
    assert "2,000 bytes" in str(err) and "max_bytes" in str(err)
    assert a.stats() == before
    again = pickle.loads(pickle.dumps(err))
    assert again.requested == 2000 and again.stats == err.stats
    a._check_invariants()


def test_growth_by_slabs_up_to_limit_and_trim():
    a = BestFitAllocator(4096, max_bytes=3 * 4096)
    blocks = [a.allocate(4096) for _ in range(3)]
    assert a.stats().slabs == 3
    with pytest.raises(OutOfMemoryError):
        a.allocate(1)
    assert a.stats().slabs == 3
    for b in blocks:
        a.deallocate(b)
    assert a.trim() == 2 * 4096
    s = a.stats()
    assert s.slabs == 1 and s.reserved_bytes == 4096
    big = a.allocate(8192)                         # larger than growth: own slab
    assert big.size == 8192 and a.stats().reserved_bytes == 3 * 4096
    a._check_invariants()


def test_trim_waits_for_stream_ordered_frees():
    rec = Recorder()
    a = BestFitAllocator(4096, max_bytes=3 * 4096, event_source=rec)
    blocks = [a.allocate(4096, "s") for _ in range(3)]
    for b in blocks:
        a.deallocate(b, stream="s", ordered=True)
    assert a.trim() == 2 * 4096                    # stamped, waited for, released
    assert len(rec.events) == 1 and rec.events[0][1].syncs == 1
    assert a.stats().pending_bytes == 0
    a._check_invariants()


def test_double_free_and_foreign_pointer():
    a, other = BestFitAllocator(4096), BestFitAllocator(4096)
    b = a.allocate(100)
    a.deallocate(b)
    before = a.stats()
    with pytest.raises(DoubleFreeError):
        a.deallocate(b)
    with pytest.raises(InvalidPointerError):
        a.deallocate(other.allocate(100))
    with pytest.raises(InvalidPointerError):
        a.deallocate("not a block")
    assert a.stats() == before
    a._check_invariants()


def test_stream_ordered_reuse():
    a = BestFitAllocator(4096)
    s1, s2 = object(), object()
    b = a.allocate(4096, s1)
    ev = FakeEvent()
    a.deallocate(b, stream=s1, event=ev)
    assert a.stats().pending_bytes == 4096
    same = a.allocate(1024, s1)                    # same stream: reusable at once
    assert same.offset == 0 and ev.syncs == 0
    a.deallocate(same, stream=s1, event=ev)
    ev.done = True                                 # event completed: any stream
    other = a.allocate(4096, s2)
    assert other.offset == 0 and ev.syncs == 0
    a.deallocate(other)
    a._check_invariants()


def test_other_stream_waits_for_event_then_flush_on_pressure():
    a = BestFitAllocator(8192)
    s1, s2 = object(), object()
    b = a.allocate(4096, s1)
    ev = FakeEvent()
    a.deallocate(b, stream=s1, event=ev)
    c = a.allocate(4096, s2)                       # must not take the gated block
    assert not overlaps(b, c) and ev.syncs == 0
    d = a.allocate(4096, s2)                       # only the gated block is left:
    assert ev.syncs == 1 and d.offset == b.offset  # flush waited, then reused it
    a._check_invariants()


class Recorder:
    """An ``event_source`` that counts the events it records."""

    def __init__(self):
        self.events = []

    def __call__(self, stream):
        ev = FakeEvent()
        self.events.append((stream, ev))
        return ev


def test_ordered_free_reuses_on_its_stream_with_no_event():
    rec = Recorder()
    a = BestFitAllocator(1 << 20, event_source=rec)
    s1, s2 = object(), object()
    for _ in range(7):                             # a training loop's churn on s1,
        blocks = [a.allocate(4096 * (k + 1), s1) for k in range(8)]
        for b in blocks:                           # below one maintenance round
            a.deallocate(b, stream=s1, ordered=True)
    assert a._deferrals < a._maintain_every
    assert rec.events == [], "same-stream reuse must record no event"
    assert a.stats().pending_bytes > 0
    a._check_invariants()
    # Another stream needs more than the ready tail: the miss stamps s1's blocks
    # with one event, the stamp is not done, so the flush waits for it.
    big = a.allocate((1 << 20) - 4096, s2)
    assert len(rec.events) == 1 and rec.events[0][0] is s1
    assert rec.events[0][1].syncs == 1 and big.offset == 0
    a._check_invariants()


def test_ordered_free_merges_same_stream_neighbours_not_ready_ones():
    a = BestFitAllocator(4096, event_source=Recorder())
    s1, s2 = object(), object()
    x, y, z, w = (a.allocate(1024, s1) for _ in range(4))
    a.deallocate(w)                                # ready: any stream, at once
    a.deallocate(z, stream=s1, ordered=True)       # must not absorb ready w
    assert a.stats().pending_bytes == 1024
    a.deallocate(y, stream=s1, ordered=True)       # merges with z's pending block
    assert a.stats().pending_bytes == 2048 and len(a._pending[s1]) == 1
    other = a.allocate(1024, s2)                   # w stayed ready for s2
    assert other.offset == w.offset
    a.deallocate(x, stream=s1, ordered=True)
    again = a.allocate(3072, s1)                   # s1 reuses all three at once
    assert again.offset == 0
    a._check_invariants()


def test_stamp_completes_then_other_streams_reuse_without_waiting():
    rec = Recorder()
    a = BestFitAllocator(8192, event_source=rec)
    a._maintain_every = 4
    s1, s2 = object(), object()
    blocks = [a.allocate(1024, s1) for _ in range(8)]
    for b in blocks[:4]:
        a.deallocate(b, stream=s1, ordered=True)
    assert rec.events == []
    a.deallocate(a.allocate(1024, s1), stream=s1, ordered=True)  # maintenance due
    assert len(rec.events) == 1                    # one stamp for four frees
    rec.events[0][1].done = True                   # the GPU caught up
    for b in blocks[4:]:
        a.deallocate(b)
    got = a.allocate(8192, s2)                     # poll made them ready: no wait
    assert got.offset == 0 and rec.events[0][1].syncs == 0
    a._check_invariants()


def test_completed_frees_let_go_of_their_short_lived_streams():
    # A pending free kept its stream referenced (from the pending indexes, and
    # from the block once ready) until every pending free of the allocator was
    # retired at once, which never happens while another stream's free is in
    # flight: a program making one stream per batch kept every dead stream (on
    # the host backend, each with its worker thread).
    import gc
    import weakref

    class Stream:
        pass

    events = []                                    # what the stamps recorded

    def record(stream):                            # (a Recorder keeps the streams)
        events.append(FakeEvent())
        return events[-1]

    a = BestFitAllocator(1 << 16, event_source=record)
    busy = Stream()                                # long-lived, its work in flight
    a.deallocate(a.allocate(4096, busy), stream=busy, event=FakeEvent())
    for how in ("event", "ordered"):
        refs = []
        for i in range(50):
            s = Stream()
            b = a.allocate(1024 * (1 + i % 3), s)
            if how == "event":
                events.append(FakeEvent())
                a.deallocate(b, stream=s, event=events[-1])
            else:
                a.deallocate(b, stream=s, ordered=True)
            for ev in events:                      # the work so far has completed
                ev.done = True
            refs.append(weakref.ref(s))
            del s, b
        a._check_invariants()
        gc.collect()
        # Each free on a new stream retired the streams before it whose work had
        # completed: the last one or two (its stamp not yet polled) remain.
        assert sum(r() is not None for r in refs) <= 2, how
        a.stats()                                  # a poll retires what completed
        gc.collect()
        # What remains is pending: an ordered free waits for a stamp.
        assert sum(r() is not None for r in refs) == (how == "ordered"), how
        assert all(keys for keys in a._pending.values()), "an idle stream is indexed"
    a.flush()
    gc.collect()
    assert all(r() is None for r in refs), "a ready block keeps its last stream"
    assert a.stats().pending_bytes == 0
    a._check_invariants()


def test_ordered_free_bad_arguments_leave_the_block_live():
    a = BestFitAllocator(4096)
    b = a.allocate(1024, "s")
    with pytest.raises(ValueError, match="no event_source"):
        a.deallocate(b, stream="s", ordered=True)
    a2 = BestFitAllocator(4096, event_source=Recorder())
    c = a2.allocate(1024, "s")
    with pytest.raises(ValueError, match="needs a stream"):
        a2.deallocate(c, ordered=True)
    with pytest.raises(ValueError, match="no event"):
        a2.deallocate(c, stream="s", event=FakeEvent(), ordered=True)
    assert b.is_live and c.is_live
    assert a.stats().live_blocks == a2.stats().live_blocks == 1


def test_resize_in_place_and_moving():
    a = BestFitAllocator(8192)
    b = a.allocate(1000)
    assert a.resize(b, 2000) is b and b.size == 2048 and b.requested == 2000
    assert a.resize(b, 100) is b and b.size == 256
    wall = a.allocate(256)
    assert wall.offset == 256
    moved = a.resize(b, 4096)
    assert moved is not b and moved.size == 4096 and not b.is_live
    assert a.stats().requested_bytes == 4096 + 256
    a._check_invariants()


@pytest.mark.parametrize("how", ["ordered", "event"])
def test_resize_grows_into_a_neighbour_pending_on_its_own_stream(how):
    # resize grew in place only into a ready neighbour: one freed on the same
    # stream, which stream order lets that stream reuse at once, made it move
    # (or miss) although the bytes were there. The part not taken stays gated.
    from rtmem.adaptors import LimitAdaptor
    rng = np.random.default_rng()
    unit = 256
    held, freed = (int(k) * unit for k in rng.integers(1, 8, 2))
    rec = Recorder()
    a = BestFitAllocator(held + freed + unit, event_source=rec)
    s1, s2 = object(), object()
    x, y, _ = a.allocate(held, s1), a.allocate(freed, s1), a.allocate(unit, s1)
    ev = FakeEvent()
    if how == "ordered":
        a.deallocate(y, stream=s1, ordered=True)
    else:
        a.deallocate(y, stream=s1, event=ev)
    grow = held + int(rng.integers(1, freed // unit + 1)) * unit
    nbytes = grow - int(rng.integers(0, unit))
    limit = LimitAdaptor(a, held + freed + unit)   # charged the difference only
    limit._sizes[x], limit._used = x.size, held + freed + unit - (grow - held)
    assert limit.resize(x, nbytes, s1) is x
    assert (x.size, x.requested, x.offset) == (grow, nbytes, 0)
    assert ev.syncs == 0 and all(e.syncs == 0 for _, e in rec.events), "waited"
    st = a.stats()
    assert (st.pending_bytes, st.allocated_bytes) == (held + freed - grow, grow + unit)
    a._check_invariants()
    if st.pending_bytes:                    # the rest: gated for s2, at once for s1
        whole = held + freed
        assert a.fits_in_place(x, whole, s1) and not a.fits_in_place(x, whole, s2)
        assert a._best_fit(st.pending_bytes, s2) is None
        assert a.allocate(st.pending_bytes, s1).offset == grow
    a._check_invariants()


def test_many_small_blocks_coalesce_back():
    a = BestFitAllocator(1 << 20, alignment=64)
    rng = random.Random(0)
    live = [a.allocate(rng.randrange(1, 3000)) for _ in range(300)]
    rng.shuffle(live)
    for b in live:
        a.deallocate(b)
    a._check_invariants()
    assert a.stats().largest_free_bytes == 1 << 20


def test_sizes_must_be_integer_byte_counts():
    # the core takes exact byte counts: '100' or 1.7 were once int()-ed silently
    a = BestFitAllocator(1 << 16, max_bytes=1 << 41, growth_bytes=1 << 16)
    assert a.allocate(np.int64(300)).size == 512
    before = a.stats()
    for bad in ("100", 1.7, True, None):
        with pytest.raises(TypeError, match="nbytes must be an integer number of bytes"):
            a.allocate(bad)
    assert a.stats() == before
    for kw in ({"alignment": True}, {"max_bytes": 2.5e6}, {"growth_bytes": "1MiB"}):
        with pytest.raises(TypeError, match=f"{next(iter(kw))} must be an integer"):
            BestFitAllocator(1 << 16, **kw)
    with pytest.raises(ValueError, match="smaller than 1 TiB"):
        BestFitAllocator(1 << 16, max_bytes=1 << 42, growth_bytes=1 << 40)
    # a request no slab can hold is out of memory, saying why; nothing changes
    with pytest.raises(OutOfMemoryError, match="No slab holds 1 TiB") as info:
        a.allocate(1 << 40)
    assert info.value.requested == 1 << 40 and a.stats() == before


@pytest.mark.parametrize("make", [
    lambda: BestFitAllocator(4 << 20, alignment=256),
    # capacity=8: the block table grows while other threads allocate and free
    lambda: JitBestFitAllocator(4 << 20, capacity=8)], ids=["python", "jit"])
def test_concurrent_threads_no_corruption(make):
    a = make()
    owner = {}                                     # addr -> thread id, under lock
    lock = threading.Lock()

    def work(tid):
        rng = random.Random(tid)
        mine = []
        for _ in range(1500):
            if mine and (rng.random() < 0.5 or len(mine) > 40):
                b = mine.pop(rng.randrange(len(mine)))
                with lock:
                    assert owner.pop(b.addr) == (tid, b.size)
                a.deallocate(b)
            else:
                try:
                    b = a.allocate(rng.randrange(1, 20000))
                except OutOfMemoryError:
                    continue
                with lock:
                    for addr, (_, size) in owner.items():
                        assert addr + size <= b.addr or b.addr + b.size <= addr, \
                            "bytes handed out twice"
                    owner[b.addr] = (tid, b.size)
                mine.append(b)
        for b in mine:
            with lock:
                owner.pop(b.addr)
            a.deallocate(b)

    run_on_threads(work)
    s = a.stats()
    assert s.alloc_count == s.free_count and s.allocated_bytes == 0
    assert s.largest_free_bytes == s.reserved_bytes
    a._check_invariants()


def test_split_remainder_keeps_index_sorted_both_ways():
    a = BestFitAllocator(16 * 1024, alignment=256)
    bs = [a.allocate(n) for n in (2048, 256, 4096, 256)]
    a.deallocate(bs[0])                            # 2 KiB hole at 0
    a.deallocate(bs[2])                            # 4 KiB hole at 2304
    c = a.allocate(3072)                           # best fit: the 4 KiB hole
    assert c.offset == 2304
    a._check_invariants()                          # the 1 KiB tail moved before 2 KiB
    d = a.allocate(1024)
    assert d.offset == 2304 + 3072                 # smallest adequate: the tail
    e = a.allocate(1024)                           # the 2 KiB hole, lowest address
    assert e.offset == 0
    a._check_invariants()                          # 1 KiB tail took the slot in place
    assert [k >> 56 for k in a._ready] == [1024, 16 * 1024 - 2304 - 4096 - 256]


def test_spare_blocks_are_recycled_but_handed_out_blocks_never():
    a = BestFitAllocator(1 << 20)
    x = a.allocate(1024)
    y = a.allocate(1024)                           # tail split off y: never handed out
    tail = y.next
    a.deallocate(y)                                # y absorbs the tail: tail is spare
    assert a._spare == [tail] and tail.requested == -1
    z = a.allocate(2048)                           # y was handed out: a fresh handle,
    assert z is tail and z is not y and z.offset == 1024   # recycled from the spares
    with pytest.raises(DoubleFreeError):
        a.deallocate(y)                            # the stale handle stays dead
    a._check_invariants()
    a.deallocate(x)
    a.deallocate(z)                                # z merges into x: z is dead, not spare
    assert not z.is_live and all(b is not z for b in a._spare)
    for n in range(1, 300):                        # churn: z is never handed out again
        blocks = [a.allocate(n * 256), a.allocate(512)]
        assert all(b is not z for b in blocks)
        for b in blocks:
            a.deallocate(b)
    with pytest.raises(DoubleFreeError):
        a.deallocate(z)
    a._check_invariants()


def test_pending_split_with_spare_stays_gated():
    a = BestFitAllocator(8192)
    s1, s2 = object(), object()
    y = a.allocate(1024, s1)
    a.deallocate(y)                                # the tail becomes spare
    assert len(a._spare) == 1
    b = a.allocate(8192, s1)
    ev = FakeEvent()
    a.deallocate(b, stream=s1, event=ev)
    part = a.allocate(1024, s1)                    # same stream: split, tail pending
    assert part.offset == 0 and not a._spare
    assert a.stats().pending_bytes == 8192 - 1024
    a._check_invariants()
    with pytest.raises(OutOfMemoryError):          # no growth; flush would wait...
        a.allocate(16384, s2)
    assert ev.syncs == 1                           # ...and did: then nothing fits
    other = a.allocate(1024, s2)                   # the event completed: reusable
    assert other.offset == 1024
    a._check_invariants()


def test_check_invariants_catches_index_and_spare_corruption():
    def fresh():
        a = BestFitAllocator(1 << 20)
        x = a.allocate(1024)
        y = a.allocate(1024)
        a.deallocate(y)                            # one spare, ready tail
        return a, x
    a, _ = fresh()
    a._ready[0] += 1 << 56                         # stale key
    with pytest.raises(AssertionError):
        a._check_invariants()
    a, x = fresh()
    a._spare.append(a._spare[0])                   # listed twice
    with pytest.raises(AssertionError):
        a._check_invariants()
    a, x = fresh()
    a._spare[0].requested = 5                      # a handed-out block must never be spare
    with pytest.raises(AssertionError):
        a._check_invariants()
    a, x = fresh()
    a._spare.append(x)                             # a live block is not spare
    with pytest.raises(AssertionError):
        a._check_invariants()
    a, x = fresh()
    a._ready.append(x._key())                      # a live block indexed
    with pytest.raises(AssertionError):
        a._check_invariants()
    a, x = fresh()
    a._free_map[x.addr] = x                        # a live block in the free map
    with pytest.raises(AssertionError):
        a._check_invariants()


def test_lock_blocks_other_threads_until_released():
    a = BestFitAllocator(4096)
    done = threading.Event()
    t = threading.Thread(target=lambda: (a.allocate(100), a.stats(), done.set()))
    with a._lock:                                  # as a slow flush would hold it
        t.start()
        assert not done.wait(0.1), "allocate ran while the lock was held"
    assert done.wait(5.0)
    t.join()
    assert a.stats().live_blocks == 1
    a._check_invariants()


# ------------------------------------------------------------ stateful model
class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: live blocks with their stream, and regions
    freed behind events (given, or stamped later for stream-ordered frees) that
    other streams must not receive early."""

    blocks = Bundle("blocks")

    @initialize(alignment=st.sampled_from([64, 256, 512]),
                slab_units=st.integers(4, 64), grow=st.booleans(),
                maintain_every=st.sampled_from([1, 3, 64]))
    def setup(self, alignment, slab_units, grow, maintain_every):
        initial = slab_units * alignment
        self.a = BestFitAllocator(initial, alignment=alignment,
                                  max_bytes=initial * (3 if grow else 1),
                                  event_source=self._record)
        self.a._maintain_every = maintain_every     # stamp-and-poll rounds, often
        self.alignment = alignment
        self.live = {}          # id(block) -> (block, requested)
        self.gated = []         # (slab, offset, end, stream, event or model position)
        self.events = []        # StreamEvents in record order
        self.peak = 0           # the most bytes allocated at any instant

    def _record(self, stream):
        return StreamEvent(self.events, stream)

    def _released(self, stream, gate):
        """True once another stream may use memory freed on ``stream`` behind
        ``gate``: its event, or for an ordered free (``gate`` = how many events
        were recorded before the free) an event recorded on ``stream`` after the
        free that has completed."""
        if isinstance(gate, FakeEvent):
            return gate.done
        return any(ev.stream == stream and ev.done for ev in self.events[gate:])

    def _check_new(self, block, nbytes, stream):
        assert block.offset % self.alignment == 0
        assert block.size == align_up(max(nbytes, 1), self.alignment)
        for other, _ in self.live.values():
            assert other is block or not overlaps(block, other)
        keep = []
        for slab, off, end, s, ev in self.gated:
            if slab == block.slab and off < block.end and block.offset < end:
                if s != stream:
                    assert self._released(s, ev), "reused on another stream too early"
                # Reused on its own stream: the new use is ordered after the gated
                # one, and the new owner's free carries its own ordering.
                continue
            keep.append((slab, off, end, s, ev))
        self.gated = keep

    @rule(target=blocks, nbytes=st.integers(0, 40 * 512), stream=st.sampled_from([0, 1, 2]))
    def alloc(self, nbytes, stream):
        before = self.a.stats()
        live_before = self.a.live_blocks()
        try:
            block = self.a.allocate(nbytes, stream)
        except OutOfMemoryError as err:
            size = align_up(max(nbytes, 1), self.alignment)
            after = self.a.stats()
            assert err.requested == nbytes
            assert after.allocated_bytes == before.allocated_bytes
            assert after.requested_bytes == before.requested_bytes
            assert after.reserved_bytes == before.reserved_bytes
            assert self.a.live_blocks() == live_before
            # Legit only if nothing fits even after the flush, and no growth.
            assert after.largest_free_bytes < size
            assert after.reserved_bytes + max(self.a.growth_bytes, size) > self.a.max_bytes
            return None
        self._check_new(block, nbytes, stream)
        self.live[id(block)] = (block, nbytes)
        return block

    @rule(block=consumes(blocks), stream=st.sampled_from([0, 1, 2]),
          how=st.sampled_from(["now", "event", "ordered"]))
    def free(self, block, stream, how):
        if block is None:
            return
        self.live.pop(id(block))
        if how == "ordered":
            self.gated.append((block.slab, block.offset, block.end, stream,
                               len(self.events)))
            self.a.deallocate(block, stream=stream, ordered=True)
            return
        ev = None
        if how == "event":
            ev = StreamEvent(self.events, stream)
            self.gated.append((block.slab, block.offset, block.end, stream, ev))
        self.a.deallocate(block, stream=stream, event=ev)

    @rule(block=blocks)
    def double_free(self, block):
        if block is None or id(block) in self.live:
            return
        before = self.a.stats()
        with pytest.raises(DoubleFreeError):
            self.a.deallocate(block)
        assert self.a.stats().allocated_bytes == before.allocated_bytes

    @rule(block=consumes(blocks), nbytes=st.integers(0, 20 * 512),
          stream=st.sampled_from([0, 1, 2]))
    def resize(self, block, nbytes, stream):
        if block is None:
            return
        self.live.pop(id(block))
        allocated = self.a.stats().allocated_bytes
        try:
            new = self.a.resize(block, nbytes, stream)
        except OutOfMemoryError:
            assert block.is_live
            self.live[id(block)] = (block, block.requested)
            return
        if new is not block:
            assert not block.is_live
            # a move allocates the new block before freeing the old one: for
            # that instant both count (the peak must say so)
            self.peak = max(self.peak, allocated + new.size)
        self._check_new(new, nbytes, stream)
        self.live[id(new)] = (new, nbytes)

    @rule(data=st.data())
    def complete_event(self, data):
        complete_one(self.events, data)

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a._check_invariants()
        s = self.a.stats()
        assert s.allocated_bytes == sum(b.size for b, _ in self.live.values())
        assert s.requested_bytes == sum(r for _, r in self.live.values())
        assert s.live_blocks == len(self.live) == s.alloc_count - s.free_count
        assert s.free_bytes == s.reserved_bytes - s.allocated_bytes
        assert s.largest_free_bytes <= s.free_bytes
        assert s.fragmentation == (1.0 - s.largest_free_bytes / s.free_bytes
                                   if s.free_bytes else 0.0)
        # the peak is the most ever allocated: it only grows, and is reached
        self.peak = max(self.peak, s.allocated_bytes)
        assert s.peak_bytes == self.peak

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for block, _ in list(self.live.values()):
            self.a.deallocate(block)
        self.a.flush()
        self.a._check_invariants()
        for _, nbytes, first in self.a._slabs.values():
            assert first.size == nbytes and first.next is None, "slab not coalesced"


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase


def test_a_stale_handle_never_frees_the_next_owner_of_its_bytes():
    # Reused bytes get a fresh Block (NOTE [ Allocator structure ] Rule 6): the
    # old handle's double free raises instead of freeing the new allocation.
    a = BestFitAllocator(1 << 16)
    x = a.allocate(1000)
    a.deallocate(x)
    y = a.allocate(1000)
    assert y.offset == x.offset and y is not x
    for stale_call in (lambda: a.deallocate(x), lambda: a.resize(x, 10),
                       lambda: a.fits_in_place(x, 10)):
        with pytest.raises(DoubleFreeError):
            stale_call()
    assert y.is_live and a.allocate(1000).offset != y.offset
    a._check_invariants()


def test_an_event_gated_free_needs_its_stream():
    # Stream None is the key of allocations naming no stream: a free filed there
    # behind an event would be reused before the event completes.
    a = BestFitAllocator(1024)
    b = a.allocate(1024)
    with pytest.raises(ValueError, match="pass stream="):
        a.deallocate(b, event=FakeEvent())
    assert b.is_live and a.stats().pending_bytes == 0       # nothing changed
    with pytest.raises(ValueError, match="pass stream="):
        a.check_free(b, event=FakeEvent())
    ev = FakeEvent()
    a.deallocate(b, stream="s", event=ev)
    a.allocate(1024)                        # another stream: only after the event
    assert ev.syncs == 1
    a._check_invariants()


def test_slab_ids_of_trimmed_slabs_are_reused():
    a = BestFitAllocator(256, max_bytes=512)
    a.allocate(256)
    for _ in range((1 << 16) + 10):        # more cycles than there are slab ids
        a.deallocate(a.allocate(256))       # grows by a slab
        assert a.trim() == 256
    assert a.stats().slabs == 1
    a._check_invariants()


def test_growth_reaches_max_bytes_with_a_smaller_last_slab():
    a = BestFitAllocator(4096, max_bytes=6144, growth_bytes=4096)
    a.allocate(4096)
    b = a.allocate(256)                     # a 2 KiB slab: what max_bytes leaves
    assert a.stats().reserved_bytes == 6144 and b.slab == 1
    a.allocate(1792)
    with pytest.raises(OutOfMemoryError):
        a.allocate(256)
    a._check_invariants()


def test_fits_in_place_predicts_resize():
    a = BestFitAllocator(4096)
    x, y = a.allocate(1024), a.allocate(1024)
    a.deallocate(y)
    assert a.fits_in_place(x, 100) and a.fits_in_place(x, 4096)
    assert not a.fits_in_place(x, 4097)
    z = a.allocate(1024)                    # takes the neighbour back
    assert not a.fits_in_place(x, 2048)
    assert a.resize(x, 2048) is not x and a.fits_in_place(z, 1024)


def test_running_out_of_slab_ids_is_an_out_of_memory_error():
    # Slab ids are 16 bits: the 65537th slab is refused as out of memory (with
    # the stats and what to do), as every other growth limit is, not as a
    # ValueError that code catching OutOfMemoryError misses.
    a = BestFitAllocator(1, alignment=1, max_bytes=1 << 20, growth_bytes=1)
    blocks = [a.allocate(1) for _ in range(1 << 16)]
    before = a.stats()
    with pytest.raises(OutOfMemoryError, match="slab ids") as info:
        a.allocate(1)
    assert info.value.requested == 1 and info.value.stats == before
    assert a.stats() == before
    a.deallocate(blocks.pop())
    blocks.append(a.allocate(1))            # the freed byte is reused
    a._check_invariants()


def test_negative_growth_and_max_bytes_are_refused():
    # align_up(-1) is 0: growth_bytes=-1 was taken as 0 (exactly-sized slabs)
    with pytest.raises(ValueError, match="growth_bytes must be >= 0"):
        BestFitAllocator(4096, growth_bytes=-1)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        BestFitAllocator(4096, max_bytes=-1)
    assert BestFitAllocator(4096, growth_bytes=np.int64(0)).growth_bytes == 0


def test_fits_in_place_checks_its_size_as_resize_does():
    a = BestFitAllocator(4096)
    b = a.allocate(100)
    for bad, error in ((True, TypeError), ("7", TypeError), (None, TypeError),
                       (2.5, TypeError), (-5, ValueError)):
        with pytest.raises(error):
            a.resize(b, bad)
        with pytest.raises(error):          # int() took these, or said -5 fits
            a.fits_in_place(b, bad)
    assert a.fits_in_place(b, np.int64(256)) and not a.fits_in_place(b, 8192)
    a._check_invariants()


def test_a_free_whose_maintenance_raises_leaves_the_block_live_and_counted():
    # A free on a stream the indexes do not know first stamps the other streams'
    # frees; a stamp that raises (here on a closed host stream) came after the
    # counters dropped: the block stayed live but counted as freed, and a retried
    # free counted it twice (allocated -2048)
    from rtmem.backends.host import HostBackend
    from rtmem.errors import BackendError
    be = HostBackend()
    a = BestFitAllocator(1 << 16, event_source=lambda s: be.new_event().record(s))
    s1, s2 = be.new_stream("s1"), be.new_stream("s2")
    a.deallocate(a.allocate(1024, s1), stream=s1, ordered=True)    # unstamped on s1
    s1.close()
    b = a.allocate(2048, s2)
    before = a.stats()
    with pytest.raises(BackendError, match="closed"):
        a.deallocate(b, stream=s2, ordered=True)
    assert a.stats() == before
    a._check_invariants()
    a.deallocate(b)                                      # the retry frees it once
    assert a.stats().allocated_bytes == 0
    a._check_invariants()


# ------------------------------------------- mutation-audit tests (each kills a mutant)
def test_an_ordered_free_never_absorbs_another_streams_pending_neighbour():
    # Merged into y's block, x's bytes would be s2's at once: s2 could overwrite
    # them while s1's queued work still reads x. They wait for an event on s1.
    rec = Recorder()
    a = BestFitAllocator(2048, event_source=rec)
    s1, s2 = object(), object()
    x, y = a.allocate(1024, s1), a.allocate(1024, s2)
    a.deallocate(x, stream=s1, ordered=True)
    a.deallocate(y, stream=s2, ordered=True)
    assert a.stats().pending_bytes == 2048
    a._check_invariants()
    whole = a.allocate(2048, s2)                   # needs x's bytes too
    assert whole.offset == 0
    s1_events = [ev for s, ev in rec.events if s is s1]
    assert s1_events and all(ev.done for ev in s1_events), \
        "s2 got x's bytes before an event on s1 completed"
    a._check_invariants()


def test_best_fit_weighs_the_streams_pending_blocks_against_ready_ones():
    # x, pending on s1, fits a 1 KiB request exactly; the 2 KiB ready tail would
    # be split instead (NOTE [ Allocator structure ]: best fit among both)
    a = BestFitAllocator(4096, event_source=Recorder())
    s1 = object()
    x, _ = a.allocate(1024, s1), a.allocate(1024, s1)   # the second stays live
    a.deallocate(x, stream=s1, ordered=True)
    b = a.allocate(1024, s1)
    assert b.offset == x.offset
    assert a.stats().largest_free_bytes == 2048     # the ready tail is whole
    a._check_invariants()


@pytest.mark.parametrize("how", ["ordered", "event"])
def test_a_streams_pending_block_merges_with_its_ready_neighbours_without_waiting(how):
    # A request that fit only in a pending block of its own stream together with
    # the ready bytes beside it missed best fit, and the allocator waited for
    # every pending event (a host stall) although stream order lets the stream
    # reuse its own block at once. Now the block and its free neighbours merge.
    rng = np.random.default_rng()
    unit = 256
    left, mid, right = (int(k) * unit for k in rng.integers(1, 6, 3))
    rec = Recorder()
    a = BestFitAllocator(left + mid + right + unit, event_source=rec)
    s1, s2 = object(), object()
    lb, p, rb, _ = (a.allocate(n, s1) for n in (left, mid, right, unit))
    a.deallocate(lb)
    a.deallocate(rb)
    ev = FakeEvent()
    if how == "ordered":
        a.deallocate(p, stream=s1, ordered=True)
    else:
        a.deallocate(p, stream=s1, event=ev)
    free, p_start, p_end = left + mid + right, p.offset, p.end
    need = int(rng.integers(max(left, mid, right) // unit + 1, free // unit + 1)) * unit
    got = a.allocate(need - int(rng.integers(0, unit)), s1)
    assert ev.syncs == 0 and all(e.syncs == 0 for _, e in rec.events), "waited"
    assert got.size == need and 0 <= got.offset and got.end <= free
    assert got.offset <= p_start and p_end <= got.end       # the pending bytes first
    st = a.stats()
    assert (st.pending_bytes, st.free_bytes) == (0, free - need)
    with pytest.raises(DoubleFreeError):                    # p's handle stays dead
        a.deallocate(p)
    a._check_invariants()
    if st.largest_free_bytes:                               # the rest is ready for all
        other = a.allocate(st.largest_free_bytes, s2)
        assert not overlaps(other, got) and ev.syncs == 0
        assert all(e.syncs == 0 for _, e in rec.events)
        a.deallocate(other)
    a.deallocate(got, stream=s1, ordered=True)
    a.flush()
    a._check_invariants()


@pytest.mark.parametrize("fits", ["second", "both"])
def test_a_miss_waits_only_for_the_events_that_make_the_request_fit(fits):
    # The miss path waited for every pending event of every stream (a flush)
    # when the block behind one of them was enough: a host stall as long as
    # the slowest stream's queued work. Now one event at a time, one whose
    # blocks hold the request first.
    rng = np.random.default_rng()
    unit = 256
    small, big = sorted(int(k) * unit for k in rng.choice(np.arange(1, 9), 2, False))
    a = BestFitAllocator(small + big + 2 * unit)
    s1, s2, s3 = object(), object(), object()
    p1, _, p2, _ = (a.allocate(n, s) for n, s in ((small, s1), (unit, s1),
                                                   (big, s2), (unit, s2)))
    ev1, ev2 = FakeEvent(), FakeEvent()
    a.deallocate(p1, stream=s1, event=ev1)         # s1's free is the older one
    a.deallocate(p2, stream=s2, event=ev2)
    need = (small if fits == "both" else big) - int(rng.integers(0, unit))
    got = a.allocate(need, s3)
    waited = (ev1.syncs, ev2.syncs)
    assert waited == ((1, 0) if fits == "both" else (0, 1)), f"waited {waited}"
    assert got.offset == (p1 if fits == "both" else p2).offset
    assert a.stats().pending_bytes == (big if fits == "both" else small)
    a._check_invariants()


def test_a_miss_never_waits_for_its_own_streams_events_before_growing():
    # The stream may reuse its own pending blocks at once, so waiting for their
    # events makes nothing fit: the flush before growing was a pure stall.
    rng = np.random.default_rng()
    unit = 256
    held = int(rng.integers(1, 8)) * unit
    a = BestFitAllocator(held + unit, max_bytes=4 * (held + unit))
    s1 = object()
    p, _ = a.allocate(held, s1), a.allocate(unit, s1)
    ev = FakeEvent()
    a.deallocate(p, stream=s1, event=ev)
    got = a.allocate(held + unit + int(rng.integers(1, unit)), s1)
    assert ev.syncs == 0 and got.slab == 1
    assert a.stats().pending_bytes == held         # still reusable by s1 at once
    assert a.allocate(held, s1).offset == p.offset and ev.syncs == 0
    a._check_invariants()


def test_peak_follows_every_byte_with_alignment_one():
    a = BestFitAllocator(64, alignment=1)
    b = a.allocate(1)
    assert a.stats().peak_bytes == 1
    a.deallocate(b)
    c = a.allocate(2)
    assert a.stats().peak_bytes == 2
    a.deallocate(c)
    a.reset_peak()
    assert a.stats().peak_bytes == 0
    a.allocate(3)
    assert a.stats().peak_bytes == 3
    a._check_invariants()


def test_a_gated_split_tail_merged_by_an_ordered_free_is_not_made_spare():
    # The tail of a split pending block was never handed out, but the event-gated
    # FIFO still names it: absorbed, it must die, not be recycled as a spare
    a = BestFitAllocator(4096, event_source=Recorder())
    s1, s2 = object(), object()
    x = a.allocate(4096, s1)
    ev = FakeEvent()
    a.deallocate(x, stream=s1, event=ev)
    part = a.allocate(1024, s1)                    # split: the tail stays behind ev
    assert a.stats().pending_bytes == 3072
    a.deallocate(part, stream=s1, ordered=True)    # absorbs the pending tail
    assert not a._spare
    a._check_invariants()
    whole = a.allocate(4096, s2)
    assert whole.offset == 0
    a._check_invariants()


def test_a_stamped_block_merged_by_a_later_free_waits_for_the_later_event():
    # x is freed in stream order and stamped with e1; y, its neighbour, is freed
    # on the same stream and merges into x's block, whose next stamp e2 covers
    # both. The FIFO still holds (e1, x): polling must skip it (the block's
    # event is e2 now), else e1 completing handed y's bytes to another stream
    # while the work before y's free still used them.
    rec = Recorder()
    a = BestFitAllocator(4096, event_source=rec)
    a._maintain_every = 1                          # stamp and poll at every allocation
    s1, s2 = object(), object()
    x, y = a.allocate(1024, s1), a.allocate(1024, s1)
    a.deallocate(x, stream=s1, ordered=True)
    small = [a.allocate(256, s2)]                  # maintenance: x stamped with e1
    a.deallocate(y, stream=s1, ordered=True)       # merged into x's pending block
    small.append(a.allocate(256, s2))              # maintenance: stamped again, e2
    assert [s for s, _ in rec.events] == [s1, s1]
    assert a.stats().pending_bytes == 2048
    (_, e1), (_, e2) = rec.events
    e1.done = True                                 # x's last use is over, y's is not
    whole = a.allocate(2048, s2)                   # needs y's bytes too:
    assert e2.syncs == 1 and whole.offset == 0     # it waited for e2
    for b in small + [whole]:
        a.deallocate(b)
    a._check_invariants()


def test_a_block_freed_on_another_stream_is_stamped_on_that_stream():
    # T is a pending tail listed unstamped on s1, handed out again on s1, then
    # freed in stream order on s2: the stale s1 entry must not stamp it. Stamped
    # with an event on s1 (the first stream listed), T's bytes went to other
    # streams once s1's work was done, while s2's work before the free still ran.
    rec = Recorder()
    a = BestFitAllocator(4608, event_source=rec)
    s1, s2, s3 = object(), object(), object()
    p, k = a.allocate(4096, s1), a.allocate(256, s2)
    a.deallocate(k, stream=s2, ordered=True)       # s2 has pending frees
    a.deallocate(p, stream=s1, ordered=True)
    head = a.allocate(1024, s1)                    # split: the tail stays pending on s1
    t = a.allocate(3072, s1)                       # the tail itself, handed out
    assert t.offset == 1024
    a.deallocate(t, stream=s2, ordered=True)       # now s2's (merged with k's bytes)
    a._maintain_every = 1
    small = a.allocate(256, s3)                    # maintenance: stamps every stream
    assert all(s is s2 for s, _ in rec.events), "a free on s2 was stamped on s1"
    for s, ev in rec.events:
        if s is s1:
            ev.done = True                         # s1's work is over, s2's is not
    got = a.allocate(3072, s3)                     # only t's bytes fit:
    assert got.offset == 1024 and rec.events[-1][1].syncs == 1   # it waited for s2
    for b in (head, small, got):
        a.deallocate(b)
    a._check_invariants()


# ------------------------ mutation audit 2: limits, trim, stats, messages
def test_max_and_growth_bytes_round_up_to_the_alignment():
    # max_bytes 6000 -> 6144 (24 * 256): after the 4 KiB first slab a 2 KiB last
    # slab still fits; growth 1000 -> 1024, so every slab stays aligned
    a = BestFitAllocator(4096, max_bytes=6000, growth_bytes=1000)
    assert (a.max_bytes, a.growth_bytes) == (6144, 1024)
    a.allocate(4096)
    b = a.allocate(256)                     # a 1 KiB growth slab
    assert a.stats().reserved_bytes == 5120 and b.slab == 1
    a.allocate(768)                         # fills slab 1
    c = a.allocate(1024)                    # the last 1 KiB max_bytes leaves
    assert c.slab == 2 and a.stats().reserved_bytes == 6144
    a._check_invariants()


def test_zero_alignment_and_a_1_tib_first_slab_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        BestFitAllocator(4096, alignment=0)
    with pytest.raises(ValueError, match="smaller than 1 TiB"):
        BestFitAllocator(1 << 40, growth_bytes=1 << 20)
    # with no growth_bytes the message named it all the same (growth_bytes=2 TiB:
    # "grow by smaller slabs"), to users who had passed only the first slab's size
    with pytest.raises(ValueError, match=r"^initial_bytes=2,199,023,255,552 B: a slab"):
        BestFitAllocator(1 << 41)
    from rtmem import DeviceArena
    with pytest.raises(ValueError, match=r"^nbytes=2,199,023,255,552 B: .*smaller nbytes"):
        DeviceArena("2TiB", backend="host")


def test_trim_keeps_a_slab_with_a_live_block_behind_a_free_head():
    a = BestFitAllocator(4096, max_bytes=8192)
    a.allocate(4096)
    y, z = a.allocate(1024), a.allocate(1024)      # slab 1, offsets 0 and 1024
    assert (y.slab, z.slab, z.offset) == (1, 1, 1024)
    a.deallocate(y)                                # slab 1's head is free, z is not
    assert a.trim() == 0
    s = a.stats()
    assert s.slabs == 2 and s.reserved_bytes == 8192 and z.is_live
    a.deallocate(z)
    assert a.trim() == 4096
    a._check_invariants()


def test_a_backend_oom_while_growing_names_the_request_and_changes_nothing():
    class Source:
        fail = False

        def add_slab(self, nbytes):
            if self.fail:
                raise OutOfMemoryError("backend full")
            return object()

        def release_slab(self, handle):
            pass

    src = Source()
    a = BestFitAllocator(4096, max_bytes=1 << 20, growth_bytes=4096, slab_source=src)
    a.allocate(4096)
    src.fail = True
    before = a.stats()
    with pytest.raises(OutOfMemoryError,
                       match=r"cannot allocate 1,000 bytes: growing by a 4,096-byte slab "
                             r"failed \(backend full\)") as info:
        a.allocate(1000)
    assert info.value.requested == 1000 and info.value.stats == before
    assert a.stats() == before
    a._check_invariants()


def test_largest_free_block_counts_pending_blocks():
    # 3 KiB freed in stream order (pending, unstamped) and nothing ready: the
    # largest free block is that 3 KiB one, so fragmentation is 0, not 1
    a = BestFitAllocator(4096, event_source=Recorder())
    x, _ = a.allocate(3072, "s1"), a.allocate(1024)
    a.deallocate(x, stream="s1", ordered=True)
    s = a.stats()
    assert (s.free_bytes, s.pending_bytes, s.largest_free_bytes) == (3072, 3072, 3072)
    assert s.fragmentation == 0.0


def test_reset_peak_keeps_what_is_still_allocated():
    a = BestFitAllocator(8192)
    a.allocate(1024)
    b = a.allocate(2048)
    a.deallocate(b)
    assert a.stats().peak_bytes == 3072
    a.reset_peak()
    assert a.stats().peak_bytes == 1024            # the 1 KiB block is still live
    a._check_invariants()


def test_describe_names_each_figure():
    s = AllocatorStats(allocated_bytes=3072, requested_bytes=3000, reserved_bytes=8192,
                       peak_bytes=4096, free_bytes=5120, pending_bytes=1024,
                       largest_free_bytes=2048, fragmentation=0.6, alloc_count=5,
                       free_count=3, live_blocks=2, slabs=2)
    assert s.describe() == (
        "3.00 KiB allocated (2.93 KiB requested) of 8.00 KiB reserved in 2 slab(s); "
        "5.00 KiB free, largest free block 2.00 KiB (fragmentation 0.60), "
        "1.00 KiB waiting on events")


def test_a_negative_resize_says_resize_and_leaves_the_block():
    a = BestFitAllocator(4096)
    b = a.allocate(100)
    for call in (a.resize, a.fits_in_place):
        with pytest.raises(ValueError, match=r"cannot resize to a negative size \(-5 bytes\)"):
            call(b, -5)
    assert b.is_live and b.requested == 100 and a.stats().requested_bytes == 100


def test_an_event_gated_free_of_a_block_listed_unstamped_waits_for_its_own_event():
    # A split tail of an ordered free is listed unstamped on s1; taken again on
    # s1 (the same Block object: it was never handed out) and freed behind an
    # event E, its stale unstamped entry must not give it a stamp: the block is
    # everyone's once E completes, with no event recorded and nothing waited for.
    rec = Recorder()
    a = BestFitAllocator(4096, event_source=rec)
    s1, s2 = object(), object()
    a.deallocate(a.allocate(4096, s1), stream=s1, ordered=True)   # unstamped
    head = a.allocate(1024, s1)                     # the 3072-byte tail stays unstamped
    tail = a.allocate(3072, s1)
    ev = FakeEvent()
    a.deallocate(tail, stream=s1, event=ev)
    ev.done = True
    got = a.allocate(3072, s2)                      # a miss: stamps, polls
    assert got.offset == 1024
    assert rec.events == [] and ev.syncs == 0
    a.deallocate(head)
    a.deallocate(got)
    a._check_invariants()


def test_maintenance_comes_once_per_round_of_deferred_frees():
    # NOTE [ Stream-ordered frees ]: a stamp-and-poll round every
    # _maintain_every deferred frees (here 4), not at every allocation once the
    # first round is due. s1 churns one block: the allocations after the 4th and
    # the 8th free stamp it (one event each); 11 frees make no third round.
    rec = Recorder()
    a = BestFitAllocator(8192, event_source=rec)
    a._maintain_every = 4
    s1 = object()
    for _ in range(11):
        a.deallocate(a.allocate(1024, s1), stream=s1, ordered=True)
    assert len(rec.events) == 2 and a._deferrals == 3
    a._check_invariants()
    # By default a round is 256 frees: 300 frees on s1, with no miss, see one stamp
    rec = Recorder()
    a = BestFitAllocator(8192, event_source=rec)
    for _ in range(300):
        a.deallocate(a.allocate(1024, s1), stream=s1, ordered=True)
    assert len(rec.events) == 1 and a._deferrals == 300 - 256
    a._check_invariants()


def test_a_stream_with_nothing_pending_is_not_kept_by_a_stale_unstamped_entry():
    # s frees a block in stream order and takes it back at once: its unstamped
    # entry is stale. Once a poll finds nothing pending on s (another stream's
    # free still is), s is forgotten, that entry included, before any stamp.
    import gc
    import weakref

    class Stream:
        pass

    a = BestFitAllocator(1 << 16, event_source=lambda stream: FakeEvent())
    busy = Stream()
    a.deallocate(a.allocate(4096, busy), stream=busy, event=FakeEvent())   # in flight
    s = Stream()
    a.deallocate(a.allocate(1024, s), stream=s, ordered=True)      # unstamped on s
    a.deallocate(a.allocate(1024, s))                              # reused on s, freed
    ref = weakref.ref(s)
    del s
    a.stats()                                                      # polls
    gc.collect()
    assert ref() is None
    assert a.stats().pending_bytes == 4096
    a._check_invariants()


class CountingStream:
    """A stream that counts how often it is compared (``==``): a measure of the
    blocks and FIFOs the miss path walks, which compares each one's stream."""

    def __init__(self, counter):
        self.counter = counter

    def __eq__(self, other):
        self.counter[0] += 1
        return self is other

    __hash__ = object.__hash__


@pytest.mark.parametrize("shape", ["a-stream-per-block", "own-blocks-between"])
def test_a_miss_that_waits_for_many_events_walks_each_block_a_bounded_number_of_times(shape):
    # _wait_until_fit rescanned every FIFO head, the stream's own run search
    # included, after each event it waited for: quadratic in the events waited
    # (n = 1000 took ~1 s). Now it keeps a running view of the runs that the
    # waits make free. The waits are the same: one per event, in the order the
    # streams were indexed (a stream's own FIFO in order).
    rng = np.random.default_rng()
    n, unit = 150, 256
    counter = [0]
    me = CountingStream(counter)
    sizes = [int(k) * unit for k in rng.integers(1, 4, 2 * n)]
    a = BestFitAllocator(sum(sizes))
    blocks = [a.allocate(s) for s in sizes]
    waited, events = [], []

    class Logged(FakeEvent):
        def synchronize(self):
            waited.append(self)
            super().synchronize()

    if shape == "a-stream-per-block":           # freed in a random order
        order = [(int(i), CountingStream(counter)) for i in rng.permutation(2 * n)]
    else:                                       # one other stream splits me's blocks
        other = CountingStream(counter)
        order = [(i, other if i % 2 else me) for i in range(2 * n)]
    for i, stream in order:
        ev = Logged() if stream is not me else FakeEvent()
        if stream is not me:
            events.append(ev)
        a.deallocate(blocks[i], stream=stream, event=ev)
    counter[0] = 0
    got = a.allocate(sum(sizes), me)
    assert (got.offset, got.size) == (0, sum(sizes))
    assert [id(e) for e in waited] == [id(e) for e in events]
    assert counter[0] <= 40 * n, f"{counter[0]} stream comparisons for {n} events"
    a._check_invariants()


def _rescanning_wait_until_fit(a, size, stream):
    """The oracle for _wait_until_fit's choice of waits: the plain loop that
    rescans everything after each wait (what it did before its running view)."""
    from rtmem._blocks import _PENDING, _READY

    def head_frees(fifo):
        event, seen = fifo[0][0], set()

        def usable(b):
            return b is not None and (b.state == _READY or b.state == _PENDING and (
                b.event is event or b.stream == stream))

        for ev, block in fifo:
            if ev is not event:
                break
            if block.state != _PENDING or block.event is not event or block.addr in seen:
                continue
            while usable(block.prev):
                block = block.prev
            total = 0
            while usable(block):
                seen.add(block.addr)
                total += block.size
                block = block.next
            if total >= size:
                return True
        return False

    while True:
        block = a._best_fit(size, stream)
        if block is not None:
            (a._remove_ready if block.state == _READY else a._remove_pending)(block)
            return block
        block = a._take_own_run(size, stream)
        if block is not None:
            return block
        fifos = [f for s, f in a._fifo.items() if f and s != stream]
        if not fifos:
            return None
        fifo = next((f for f in fifos if head_frees(f)), fifos[0])
        event = fifo[0][0]
        event.synchronize()
        while fifo and fifo[0][0] is event:
            _, block = fifo.popleft()
            if block.state == _PENDING and block.event is event:
                a._remove_pending(block)
                a._make_ready(block)
        a._poll_pending()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@hypothesis.given(st.randoms(use_true_random=False))
def test_a_miss_waits_for_the_events_the_rescanning_loop_waits_for(rnd):
    # The running view of _wait_until_fit must choose the waits, and the block,
    # that rescanning everything after each wait chooses: two allocators get the
    # same random frees (ready, event-gated and ordered, on four streams, some
    # events already complete) and the same request; one uses the oracle.
    unit, n = 256, rnd.randrange(4, 24)
    sizes = [rnd.randrange(1, 4) * unit for _ in range(n)]
    fates = [rnd.choice("live ready event event ordered ordered".split()) for _ in range(n)]
    streams = [rnd.randrange(4) for _ in range(n)]
    done = [rnd.random() < 0.2 for _ in range(n)]
    want, on = rnd.randrange(1, sum(sizes) // unit + 2) * unit, rnd.randrange(4)
    grow = rnd.random() < 0.5

    def world(oracle):
        log, waits = [], []

        class Ev(StreamEvent):
            def synchronize(self):
                waits.append(log.index(self))
                super().synchronize()

        names = [object() for _ in range(4)]
        a = BestFitAllocator(sum(sizes), max_bytes=2 * sum(sizes) if grow else None,
                             event_source=lambda s: Ev(log, s))
        if oracle:
            a._wait_until_fit = lambda size, stream: _rescanning_wait_until_fit(
                a, size, stream)
        blocks = [a.allocate(s, names[k]) for s, k in zip(sizes, streams)]
        for b, fate, k, d in zip(blocks, fates, streams, done):
            if fate == "ready":
                a.deallocate(b)
            elif fate == "event":
                ev = Ev(log, names[k])
                ev.done = d
                a.deallocate(b, stream=names[k], event=ev)
            elif fate == "ordered":
                a.deallocate(b, stream=names[k], ordered=True)
        try:
            got = a.allocate(want, names[on])
            result = (got.slab, got.offset, got.size)
        except OutOfMemoryError:
            result = "oom"
        a._check_invariants()
        return waits, result, a.stats()

    assert world(False) == world(True)


@pytest.mark.parametrize("order", ["pending-then-ready", "ready-then-pending"])
@pytest.mark.parametrize("how", ["ordered", "event"])
def test_resize_grows_across_a_run_of_ready_and_own_pending_blocks(order, how):
    # resize grew in place into the next block only: a block pending on the
    # stream followed by a ready one (an ordered free never absorbs ready
    # neighbours), or the reverse, made it move although the bytes were there.
    # Now it grows across the whole run; a ready rest stays ready, a pending
    # rest stays pending on its stream behind its event, and nothing waits.
    rng = np.random.default_rng()
    unit = 256
    held, first, second = (int(k) * unit for k in rng.integers(1, 8, 3))
    rec = Recorder()
    a = BestFitAllocator(held + first + second + unit, event_source=rec)
    s1, s2 = object(), object()
    x, p, r, wall = (a.allocate(n, s1) for n in (held, first, second, unit))
    if order == "ready-then-pending":
        p, r = r, p
    ev = FakeEvent()
    a.deallocate(r)
    if how == "ordered":
        a.deallocate(p, stream=s1, ordered=True)
    else:
        a.deallocate(p, stream=s1, event=ev)
    whole = held + first + second
    grow = held + first + int(rng.integers(1, second // unit + 1)) * unit
    nbytes = grow - int(rng.integers(0, unit))
    assert a.fits_in_place(x, nbytes, s1) and a.fits_in_place(x, whole, s1)
    assert not a.fits_in_place(x, nbytes, s2) and not a.fits_in_place(x, whole + 1, s1)
    assert a.resize(x, nbytes, s1) is x
    assert (x.size, x.requested, x.offset) == (grow, nbytes, 0)
    assert ev.syncs == 0 and all(e.syncs == 0 for _, e in rec.events), "waited"
    st = a.stats()
    assert st.allocated_bytes == grow + unit and st.free_bytes == whole - grow
    # The rest is what is left of the last block: ready for all, or pending
    assert st.pending_bytes == (whole - grow if order == "ready-then-pending" else 0)
    a._check_invariants()
    if whole > grow:
        rest = a.allocate(whole - grow, s1 if st.pending_bytes else s2)
        assert rest.offset == grow and ev.syncs == 0
        a.deallocate(rest)
    a.deallocate(wall)
    a.deallocate(x)
    a.flush()
    assert a.stats().largest_free_bytes == whole + unit
    a._check_invariants()
