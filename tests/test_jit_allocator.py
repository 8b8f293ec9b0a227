"""The compiled allocator core (rtmem.jit_allocator): the same placements as the
Python core, event-gated frees, threads, growth of its table, errors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize,
                                 invariant, rule)

from _events import FakeEvent, StreamEvent, complete_one, overlaps
from rtmem import _jit_core
from rtmem.adaptors import LimitAdaptor, StatisticsAdaptor, replay
from rtmem.allocator import BestFitAllocator, align_up
from rtmem.errors import DoubleFreeError, InvalidPointerError, OutOfMemoryError
from rtmem.jit_allocator import JitBestFitAllocator, JitBlock


def place(block):
    return (block.slab, block.offset, block.size, block.requested)


# ---------------------------------------------------- against the Python core
class SamePlacements(RuleBasedStateMachine):
    """Without events, both cores choose the same block for every request
    (smallest that fits, then lowest address), split, merge, resize, grow, trim
    and refuse alike: every handle and every statistic must agree."""

    pairs = Bundle("pairs")

    @initialize(alignment=st.sampled_from([1, 64, 256]), slab_units=st.integers(4, 48),
                grow=st.sampled_from([1, 2, 4]), growth_units=st.integers(1, 32),
                capacity=st.sampled_from([1, 2, 64]))
    def setup(self, alignment, slab_units, grow, growth_units, capacity):
        kw = dict(alignment=alignment, max_bytes=slab_units * 64 * grow,
                  growth_bytes=growth_units * 64)
        self.py = BestFitAllocator(slab_units * 64, **kw)
        # capacity 1 or 2: the block table grows (Rule 5) during the run
        self.jit = JitBestFitAllocator(slab_units * 64, capacity=capacity, **kw)
        self.live = {}

    @rule(target=pairs, nbytes=st.integers(0, 40 * 64))
    def alloc(self, nbytes):
        try:
            p = self.py.allocate(nbytes)
        except OutOfMemoryError:
            before = self.jit.stats()
            with pytest.raises(OutOfMemoryError) as err:
                self.jit.allocate(nbytes)
            assert err.value.requested == nbytes and err.value.stats == before
            assert self.jit.stats() == before
            return None
        j = self.jit.allocate(nbytes)
        assert place(j) == place(p)
        self.live[id(j)] = j
        return p, j

    @rule(pair=consumes(pairs))
    def free(self, pair):
        if pair is not None:
            self.py.deallocate(pair[0])
            self.jit.deallocate(self.live.pop(id(pair[1])))

    @rule(pair=pairs)
    def double_free(self, pair):
        if pair is not None and id(pair[1]) not in self.live:
            before = self.jit.stats()
            with pytest.raises(DoubleFreeError):
                self.jit.deallocate(pair[1])
            assert self.jit.stats() == before

    @rule(target=pairs, pair=consumes(pairs), nbytes=st.integers(0, 20 * 64))
    def resize(self, pair, nbytes):
        if pair is None:
            return None
        p, j = pair
        assert self.jit.fits_in_place(j, nbytes) == self.py.fits_in_place(p, nbytes)
        try:
            p2 = self.py.resize(p, nbytes)
        except OutOfMemoryError:
            with pytest.raises(OutOfMemoryError):
                self.jit.resize(j, nbytes)
            assert j.is_live and place(j) == place(p)
            return pair
        j2 = self.jit.resize(j, nbytes)
        assert (j2 is j) == (p2 is p) and place(j2) == place(p2)
        self.live.pop(id(j))
        self.live[id(j2)] = j2
        return p2, j2

    @rule()
    def trim(self):
        assert self.jit.trim() == self.py.trim()

    @rule()
    def reset_peak(self):
        self.jit.reset_peak()
        self.py.reset_peak()

    @invariant()
    def agree(self):
        if hasattr(self, "jit"):
            self.jit._check_invariants()
            assert self.jit.stats() == self.py.stats()

    def teardown(self):
        if hasattr(self, "jit"):
            live = self.jit.live_blocks()
            assert sorted(map(place, live)) == sorted(map(place, self.live.values()))
            for j in live:              # any handle to a live block frees it
                self.jit.deallocate(j)
            self.jit._check_invariants()
            assert self.jit.stats().largest_free_bytes == \
                max(n for _, n, _ in self.jit._slabs.values())


SamePlacements.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSamePlacements = SamePlacements.TestCase


# ----------------------------------------------------------- event-gated frees
class GatedFrees(RuleBasedStateMachine):
    """Frees behind events (given, or recorded by ``ordered=True``) on three
    streams: no byte is handed out again, to any stream, before its event
    completed (by the test, or by the allocator waiting under pressure)."""

    blocks = Bundle("blocks")

    @initialize(slab_units=st.integers(4, 32), grow=st.booleans())
    def setup(self, slab_units, grow):
        self.events = []
        self.a = JitBestFitAllocator(slab_units * 256, max_bytes=slab_units * 256 *
                                     (2 if grow else 1), capacity=4,
                                     event_source=lambda s: StreamEvent(self.events, s))
        self.live = {}
        self.gated = []         # (slab, offset, end, event)

    @rule(target=blocks, nbytes=st.integers(0, 24 * 256), stream=st.integers(0, 2))
    def alloc(self, nbytes, stream):
        try:
            block = self.a.allocate(nbytes, stream)
        except OutOfMemoryError:
            s = self.a.stats()
            assert all(ev.done for *_, ev in self.gated), "OOM before waiting"
            assert s.largest_free_bytes < align_up(max(nbytes, 1), 256)
            return None
        for other in self.live.values():
            assert not overlaps(block, other)
        for slab, off, end, ev in self.gated:
            if slab == block.slab and off < block.end and block.offset < end:
                assert ev.done, "bytes reused before their event completed"
        self.gated = [g for g in self.gated if not g[3].done]
        self.live[id(block)] = block
        return block

    @rule(block=consumes(blocks), stream=st.integers(0, 2),
          how=st.sampled_from(["now", "event", "ordered"]))
    def free(self, block, stream, how):
        if block is None:
            return
        self.live.pop(id(block))
        if how == "ordered":
            self.a.deallocate(block, stream=stream, ordered=True)
            ev = self.events[-1]
        else:
            ev = StreamEvent(self.events, stream) if how == "event" else None
            self.a.deallocate(block, stream=stream, event=ev)
        if ev is not None:
            self.gated.append((block.slab, block.offset, block.end, ev))

    @rule(data=st.data())
    def complete_event(self, data):
        complete_one(self.events, data)

    @invariant()
    def consistent(self):
        if hasattr(self, "a"):
            self.a._check_invariants()
            s = self.a.stats()
            assert s.allocated_bytes == sum(b.size for b in self.live.values())
            assert s.live_blocks == len(self.live)

    def teardown(self):
        if hasattr(self, "a"):
            for block in self.live.values():
                self.a.deallocate(block)
            self.a.flush()
            self.a._check_invariants()
            s = self.a.stats()
            assert s.pending_bytes == 0 and s.largest_free_bytes == \
                self.a._slabs[0][1], "the first slab did not coalesce back"


GatedFrees.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestGatedFrees = GatedFrees.TestCase


# ------------------------------------------------------------------ unit tests
def test_a_miss_waits_for_the_oldest_event_first_and_only_as_long_as_needed():
    a = JitBestFitAllocator(4 * 256)
    blocks = [a.allocate(256) for _ in range(4)]
    events = [FakeEvent() for _ in blocks]
    for b, ev in zip(blocks, events):
        a.deallocate(b, stream="s", event=ev)
    assert a.stats().pending_bytes == 4 * 256
    a.allocate(256)
    assert [ev.syncs for ev in events] == [1, 0, 0, 0]
    events[2].done = True       # completed (out of order on one stream: a model)
    a.allocate(256)
    assert [ev.syncs for ev in events] == [1, 1, 0, 0], "the oldest waits first"


def test_a_completed_event_frees_at_once_and_a_pending_one_is_polled_later():
    a = JitBestFitAllocator(1 << 16)
    b, c = a.allocate(1000), a.allocate(1000)
    done = FakeEvent()
    done.done = True
    a.deallocate(b, stream=1, event=done)
    assert a.stats().pending_bytes == 0
    ev = FakeEvent()
    a.deallocate(c, stream=1, event=ev)
    assert a.stats().pending_bytes == 1024
    ev.done = True
    assert a.stats().pending_bytes == 0 and a.stats().largest_free_bytes == 1 << 16
    a._check_invariants()


def test_errors_name_the_problem_and_change_nothing():
    a, other = JitBestFitAllocator(1 << 16), JitBestFitAllocator(1 << 16)
    b = a.allocate(100)
    before = a.stats()
    with pytest.raises(InvalidPointerError, match="not allocated by this allocator"):
        a.deallocate(other.allocate(10))
    with pytest.raises(InvalidPointerError):
        a.deallocate(BestFitAllocator(1 << 16).allocate(10))
    with pytest.raises(InvalidPointerError):
        a.deallocate(7)
    with pytest.raises(ValueError, match="no event_source"):
        a.deallocate(b, stream=1, ordered=True)
    with pytest.raises(ValueError, match="needs the stream"):
        a.deallocate(b, event=FakeEvent())
    for bad in (1.5, "10", True, None):
        with pytest.raises(TypeError, match="integer number of bytes"):
            a.allocate(bad)
    with pytest.raises(ValueError, match="negative"):
        a.allocate(-1)
    with pytest.raises(OutOfMemoryError, match="1 TiB"):
        a.allocate(1 << 40)
    with pytest.raises(OutOfMemoryError):
        a.allocate(1 << 64)
    with pytest.raises(ValueError, match="resize to a negative"):
        a.resize(b, -5)
    with pytest.raises(ValueError, match="capacity"):
        JitBestFitAllocator(1024, capacity=0)
    with pytest.raises(ValueError, match="power of two"):
        JitBestFitAllocator(1024, alignment=3)
    assert a.stats() == before and b.is_live
    a._check_invariants()


def test_a_stale_handle_never_frees_the_next_owner_of_its_bytes():
    a = JitBestFitAllocator(1024)
    old = a.allocate(1024)
    a.deallocate(old)
    new = a.allocate(1024)
    assert place(new) == place(old)     # the same bytes and table slot
    with pytest.raises(DoubleFreeError):
        a.deallocate(old)
    with pytest.raises(DoubleFreeError):
        a.resize(old, 10)
    assert new.is_live and not old.is_live
    a.deallocate(new)


def test_a_stale_table_refuses_every_call_and_keeps_its_contents():
    a = JitBestFitAllocator(1 << 20, capacity=2)
    first = a.allocate(256)
    old = a._S
    a.allocate(256), a.allocate(256)            # needs a third slot: the table grows
    assert a._S is not old and old[_jit_core.STALE] == 1
    frozen = old.copy()
    for fn, arg in ((_jit_core.alloc, 256), (_jit_core.free, first.ticket),
                    (_jit_core.defer, first.ticket), (_jit_core.resize, first.ticket)):
        args = (arg, 512) if fn is _jit_core.resize else (arg,)
        assert fn(old, *args) == _jit_core.IS_STALE
    assert (old == frozen).all()
    a.deallocate(first)                         # through the new table
    a._check_invariants()


def test_a_deallocate_racing_a_table_swap_retries_on_the_new_table(monkeypatch):
    # A free whose thread loaded the old array just before another grew it:
    # the compiled call answers IS_STALE and the slow path frees it for real.
    a = JitBestFitAllocator(1 << 20, capacity=2)
    b = a.allocate(256)
    stale = a._S
    a.allocate(256), a.allocate(256)
    fresh = a._S
    a._S = stale                                # what the racing thread saw
    calls = []
    real_free = _jit_core.free

    def free_then_swap(S, ticket):
        r = real_free(S, ticket)
        calls.append(r)
        a._S = fresh
        return r

    import rtmem.jit_allocator as ja
    monkeypatch.setattr(ja, "_free", free_then_swap)
    a.deallocate(b)
    assert calls[0] == _jit_core.IS_STALE and calls[-1] == 0
    assert not b.is_live
    a._check_invariants()


def test_adaptors_and_replay_run_over_the_jit_core():
    stats = StatisticsAdaptor(JitBestFitAllocator(1 << 20))
    limited = LimitAdaptor(stats, 64 << 10)
    b = limited.allocate(10_000)
    b = limited.resize(b, 20_000)           # in place: LimitAdaptor asks fits_in_place
    with pytest.raises(OutOfMemoryError):
        limited.allocate(50_000)
    limited.deallocate(b)
    assert stats.statistics().current_bytes == 0
    trace = [("alloc", 0, 5000, None), ("alloc", 1, 300, 1), ("resize", 0, 9000, None),
             ("free", 1, 0, None), ("free", 0, 0, None)]
    res = replay(trace, JitBestFitAllocator(1 << 20), measure_extent=True)
    assert res.pairs == 2 and res.ooms == 0


def test_handles_describe_themselves():
    a = JitBestFitAllocator(1 << 16, alignment=512)
    b = a.allocate(700, stream="s")
    assert isinstance(b, JitBlock) and b.stream == "s"
    assert (b.slab, b.offset, b.size, b.end, b.requested) == (0, 0, 1024, 1024, 700)
    assert "live" in repr(b) and a.owns(b) and a.slab_handle(0) is None
    a.deallocate(b)
    assert "freed" in repr(b) and not a.owns(b)


def test_the_hot_calls_skip_numbas_dispatcher_where_it_can_and_fall_back_where_not():
    import rtmem.jit_allocator as ja
    JitBestFitAllocator(1024)
    # numba 0.68 gives the machine code's entry point: no type resolution per call
    assert ja._alloc is not _jit_core.alloc and ja._free is not _jit_core.free

    class NoOverloads:
        overloads = {}
    d = NoOverloads()
    assert ja._entry(d) is d                    # a numba without entry points


def test_a_slab_whose_table_growth_fails_goes_back_to_its_source(monkeypatch):
    class Source:
        def __init__(self):
            self.live = set()

        def add_slab(self, nbytes):
            self.live.add(nbytes)
            return nbytes

        def release_slab(self, handle):
            self.live.remove(handle)

    src = Source()
    a = JitBestFitAllocator(1024, max_bytes=4096, growth_bytes=2048, capacity=2,
                            slab_source=src)
    b = a.allocate(512)                         # the table's two slots: b, the rest
    before = a.stats()

    def no_memory(S, capacity):
        raise MemoryError("no memory for a bigger table")
    monkeypatch.setattr(_jit_core, "grow", no_memory)
    with pytest.raises(MemoryError):            # grows the table before the slab
        a.allocate(1024)
    assert src.live == {1024} and a.stats() == before
    # a lock-free allocation on another thread took the slot after the check
    monkeypatch.setattr(_jit_core, "has_room", lambda S: True)
    with pytest.raises(MemoryError):
        a.allocate(1024)
    assert src.live == {1024} and a.stats() == before
    monkeypatch.undo()
    c = a.allocate(1024)                        # slab id 1, as if never tried
    assert c.slab == 1 and src.live == {1024, 2048}
    a.deallocate(b), a.deallocate(c)
    a._check_invariants()
