"""Transfers, residency and zero-copy views as a state machine, on the host backend.

A DeviceArena and a HostArena (small, sometimes growing, sometimes debug=True, which
poisons freed bytes) go through random allocations, writes through fresh views,
offload / prefetch / evict / drop_host (some back to back, meeting copies in flight),
transfers.copy, pinned views (numpy(pin=True), rtmem.torch.as_tensor) kept and
dropped, frees (also while such views live), trim and synchronize, against a model
of each buffer's bytes per side. After every step, once transfers.synchronize() ran:
each live buffer's bytes and every kept view equal the model; placements,
residency and per-kind accounting equal it too, no two live blocks overlap and
arena._check_invariants() holds. A refused operation raises the documented error
and changes no accounting or placement. A buffer freed while pinned views live is
freed at once for its user (every new view or move raises UseAfterFreeError,
residency "freed") but keeps its bytes until the last view dies.

Only deterministic outcomes are asserted: copies run on the host backend's stream
threads, so where a copy still in flight decides (a move refused as in flight, what
fits where), either outcome is accepted. For the same reason no rule has a
precondition: which buffers exist can depend on such an outcome (an allocation that
fits or not), and hypothesis, replaying a choice sequence, must find the same rules
to choose from or it fails the test as flaky (FlakyStrategyDefinition). A rule with
nothing to work on does nothing.
"""

import gc

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from _machines import machine_settings

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from rtmem import _deferred  # noqa: E402
from rtmem import transfers as T  # noqa: E402
from rtmem.allocator import align_up  # noqa: E402
from rtmem.buffer import KINDS  # noqa: E402
from rtmem.errors import (DoubleFreeError, InvalidPointerError, OutOfMemoryError,  # noqa: E402
                          ResidencyError, UseAfterFreeError)
from rtmem.torch import as_tensor, from_tensor  # noqa: E402

SIDES = ("device", "host")
MOVES = ("offload", "prefetch", "evict", "drop_host")
PICK = st.integers(0, 999)          # an index into a list of candidates, modulo its length
SEED = st.integers(0, 2**32 - 1)
MOSTLY = st.sampled_from([True, True, True, False])


def pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def u8(view):
    """A flat uint8 view (numpy or torch) sharing the memory of ``view``."""
    return view.reshape(-1).view(torch.uint8 if isinstance(view, torch.Tensor) else np.uint8)


class Model:
    """What one buffer should hold: its bytes per side (None: no copy there)."""

    def __init__(self, buf, side, data):
        self.buf, self.n, self.data = buf, buf.nbytes, {"device": None, "host": None}
        self.data[side] = data
        self.seen = {side}      # sides with a default arena for prefetch / offload
        self.views = []         # kept pinned views: (side, start, flat uint8 slice)
        self.freeing = False    # free() was called while pinned views lived
        self.busy = None        # the side a copy issued in this step may still write

    primary = property(lambda self: "device" if self.data["device"] is not None else "host")

    def residency(self):
        return "both" if None not in self.data.values() else self.primary

    def gone(self):
        return self.freeing or self.buf.is_freed

    def __repr__(self):
        return f"<{self.n} B {self.residency()}, freeing={self.freeing}: {self.buf!r}>"


class _TransfersMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.arenas, self.bufs, self.dead = {}, [], []

    @initialize(size=st.sampled_from([2048, 4096, 8192]), grow=st.booleans(),
                debug=st.booleans(), alignment=st.sampled_from([64, 256]),
                first=st.lists(st.tuples(st.sampled_from(SIDES), SEED), min_size=1, max_size=3))
    def setup(self, size, grow, debug, alignment, first):
        kw = dict(backend="host", debug=debug, alignment=alignment)
        if grow:    # growth slabs, which trim() gives back once empty
            kw.update(max_bytes=3 * size, growth_bytes=size // 2)
        self.size = size
        self.arenas = {"device": rtmem.DeviceArena(size, **kw),
                       "host": rtmem.HostArena(size, **kw)}
        for side, seed in first:    # buffers to work on even if alloc is switched off
            self.alloc(side, np.float32, seed % 200, KINDS[seed % len(KINDS)], "shape", seed)

    def _pick(self, pick, pool, want=None):
        """A model of ``pool``, one satisfying ``want`` if any does."""
        good = [m for m in pool if want(m)] if want else []
        pool = good or pool
        return pool[pick % len(pool)]

    def _snap(self, m=None):
        """Accounting of both arenas and m's placements: what a refusal keeps."""
        return ([(s.allocated_bytes, s.live_blocks, s.bytes_by_kind, s.count_by_kind)
                 for s in (a.stats() for a in self.arenas.values())],
                m and (m.buf._device, m.buf._host))

    def _refused(self, fn, errors, m=None):
        before = self._snap(m)
        with pytest.raises(errors):
            fn()
        assert self._snap(m) == before, "a refused operation changed accounting or placements"

    def _forget(self, m):
        self.bufs.remove(m)
        m.data, m.views = {"device": None, "host": None}, []
        self.dead = [*self.dead, m][-4:]    # a few freed ones, for use-after-free checks

    def _check_gone(self, m, where):
        """A freed buffer refuses every new view, copy out and move, also while its
        free waits for pinned views: a new view or placement would outlive the bytes."""
        for fn in (lambda: m.buf.numpy(where, pin=True), lambda: as_tensor(m.buf, where=where),
                   lambda: m.buf.numpy(where), m.buf.to_numpy, lambda: T.prefetch(m.buf)):
            self._refused(fn, UseAfterFreeError, m)
        assert m.buf.residency == "freed" and m.buf.is_freed == (m not in self.bufs)

    def _write(self, m, side, seed):
        """Fresh bytes through a fresh view (a tensor for odd seeds): fresh views wait
        for the copies touching their placement, so no synchronize is needed."""
        data = pattern(seed, m.n)
        src = np.frombuffer(data, np.uint8)
        if seed % 2:
            u8(as_tensor(m.buf, where=side)).copy_(torch.from_numpy(src.copy()))
        else:
            u8(m.buf.numpy(side))[:] = src
        m.data[side] = data

    def _move(self, m, op, dest):
        """``op`` (one of MOVES) on m, against the model. ``dest``: the arena a copy
        goes to: "own" (of the right location), "none" (the buffer's default) or
        "wrong" (of the other location: a ValueError)."""
        has = {s: m.data[s] is not None for s in SIDES}
        if op in ("offload", "prefetch"):
            new, old = ("host", "device") if op == "offload" else ("device", "host")
            arena = {"own": self.arenas[new], "none": None, "wrong": self.arenas[old]}[dest]
            fn = lambda: getattr(T, op)(m.buf, arena=arena)  # noqa: E731
            err = (UseAfterFreeError if m.gone() else ResidencyError
                   if not has[old] or has[new] or (arena is None and new not in m.seen)
                   else ValueError if dest == "wrong" else None)
            # offload refuses while a copy of the buffer runs; prefetch chains on it
            racy = op == "offload" and m.busy
        else:
            new, old = ("host", "device") if op == "evict" else ("device", "host")
            fn = lambda: getattr(T, op)(m.buf)  # noqa: E731
            pinned = any(side == old for side, _, _ in m.views)
            err = (UseAfterFreeError if m.gone() else ResidencyError
                   if not (has[old] and has[new]) or pinned else None)
            # evict refuses during a copy into the device side, drop_host during any
            racy = m.busy == "device" or (op == "drop_host" and m.busy)
        allowed = ((err,) if err else ()) + ((ResidencyError,) if racy else ())
        if err is None and op in ("offload", "prefetch"):
            allowed += (OutOfMemoryError,)      # what fits depends on earlier reuse
        before = self._snap(m)
        try:
            fn()
        except allowed:
            assert self._snap(m) == before, f"a refused {op} changed accounting or placements"
            return
        assert err is None, f"{op} of {m} did not raise {err.__name__}"
        if op in ("offload", "prefetch"):
            m.data[new], m.busy = m.data[old], new
            m.seen.add(new)
        else:
            m.data[old] = None

    @rule(side=st.sampled_from(SIDES), dtype=st.sampled_from([np.uint8, np.int16, np.float16,
                                                              np.float32, np.float64]),
          count=st.integers(0, 700), kind=st.sampled_from(KINDS), seed=SEED,
          how=st.sampled_from(["shape", "nbytes", "torch"]))
    def alloc(self, side, dtype, count, kind, how, seed):
        arena, dtype = self.arenas[side], np.dtype(dtype)
        shape, n = ((count // 2, 2) if count % 2 == 0 else (count,)), count * dtype.itemsize
        before = self._snap()
        try:
            if how == "torch":      # the bytes come in through a pinned tensor view
                src = np.frombuffer(pattern(seed, n), dtype).reshape(shape)
                buf = from_tensor(torch.from_numpy(src.copy()), arena, kind=kind)
            elif how == "shape":
                buf = arena.alloc(shape=shape, dtype=dtype, kind=kind)
            else:
                buf = arena.alloc(n, dtype=dtype, kind=kind)
        except OutOfMemoryError:
            assert self._snap() == before, "a refused allocation changed accounting"
            # an arena holding nothing serves whatever fits its first slab
            assert any(m.data[side] is not None for m in self.bufs) or \
                align_up(max(n, 1), arena.alignment) > self.size
            return
        assert (buf.nbytes, buf.kind, buf.residency) == (n, kind, side)
        assert buf.shape == (shape if how != "nbytes" else (count,))
        m = Model(buf, side, pattern(seed, n))
        if how != "torch":
            self._write(m, side, seed)
        self.bufs.append(m)

    @rule(pick=PICK, side=st.sampled_from(SIDES), seed=SEED)
    def write(self, pick, side, seed):
        pool = [m for m in self.bufs if not m.freeing]
        if not pool:
            return
        m = self._pick(pick, pool)
        self._write(m, side if m.data[side] is not None else m.primary, seed)

    @rule(pick=PICK, legal=MOSTLY, dest=st.sampled_from(["own", "none", "wrong"]), seed=SEED,
          op=st.sampled_from(MOVES), then=st.lists(st.sampled_from(
              [*MOVES, *MOVES, "write", "synchronize", "wait"]), max_size=4))
    def moves(self, pick, legal, dest, seed, op, then):
        """Moves of one buffer back to back: the later ones may meet earlier copies
        still in flight (prefetch during an offload, evict of its source, ...)."""
        if not (self.bufs or self.dead):
            return
        want = {"offload": "device", "prefetch": "host"}.get(op, "both")
        m = self._pick(pick, self.bufs + self.dead,
                       legal and (lambda m: not m.gone() and m.residency() == want))
        ops = [op, *then]
        if legal and op in ("evict", "drop_host") and not m.gone() and m.residency() != "both":
            # first make the copy it drops (and let it land: dropping during it is racy)
            ops[:0] = ["offload" if m.primary == "device" else "prefetch", "synchronize"]
        for k, op in enumerate(ops):
            if op in MOVES:
                self._move(m, op, dest if k == 0 else "own")
            elif m.gone():
                continue
            elif op == "write":
                self._write(m, m.primary, seed + k)
            else:       # wait blocks on the host backend, whose compute is synchronous
                getattr(T, op)(m.buf)
                m.busy = None
                assert m.buf.residency == m.residency()

    @rule(dst=PICK, src=PICK, legal=MOSTLY)
    def copy(self, dst, src, legal):
        if not self.bufs:
            return
        pool = self.bufs + self.dead
        d = self._pick(dst, pool, legal and (lambda m: not m.gone() and m.residency() != "both"))
        s = self._pick(src, pool, legal and (lambda m: not m.gone() and m is not d
                                             and m.n <= d.n))
        # a copy writes one side of dst: refused with both, one would go stale
        err = (UseAfterFreeError if d.gone() or s.gone() else ValueError if d is s or d.n < s.n
               else ResidencyError if d.residency() == "both" else None)
        if err:
            return self._refused(lambda: T.copy(d.buf, s.buf), err, d)
        T.copy(d.buf, s.buf)
        d.data[d.primary] = s.data[s.primary] + d.data[d.primary][s.n:]
        d.busy = d.primary

    @rule(pick=PICK, where=st.sampled_from([None, *SIDES]), tensor=st.booleans(),
          cut=st.tuples(PICK, PICK))
    def view(self, pick, where, tensor, cut):
        if not (self.bufs or self.dead):
            return
        m = self._pick(pick, self.bufs + self.dead)
        if m.gone():
            return self._check_gone(m, where)
        make = (lambda: as_tensor(m.buf, where=where)) if tensor else \
            (lambda: m.buf.numpy(where, pin=True))
        side = where or m.primary
        if m.data[side] is None:
            return self._refused(make, ResidencyError, m)
        a, b = sorted(c % (m.n + 1) for c in cut)
        m.views.append((side, a, u8(make())[a:b]))  # a slice holds the pin as the view did
        if m.residency() == "both":     # the copy a pinned view reads cannot be dropped
            self._refused(lambda: T.evict(m.buf) if side == "device" else T.drop_host(m.buf),
                          ResidencyError, m)

    @rule(pick=PICK, collect=st.booleans())
    def drop_view(self, pick, collect):
        pairs = [(m, i) for m in self.bufs for i in range(len(m.views))]
        if not pairs:
            return
        m, i = pairs[pick % len(pairs)]
        before = self._snap()
        del m.views[i]
        if collect:
            gc.collect()
        if m.freeing and not m.views:
            if not m.buf.is_freed:
                # a view caught in a reference cycle dies in a collection, which queues
                # the free (NOTE [ Frees from finalizers ]); otherwise it ran at once
                gc.collect()
                _deferred.flush()
            assert m.buf.is_freed and m.buf.residency == "freed"
            self._forget(m)
        else:
            assert self._snap() == before

    @rule(pick=PICK, viewed=MOSTLY, how=st.sampled_from(["buf", "arena", "foreign"]),
          trim=st.booleans())
    def free(self, pick, viewed, how, trim):
        if trim:    # give back the growth slabs earlier frees emptied: nothing live moves
            before = self._snap()
            assert min(a.trim() for a in self.arenas.values()) >= 0 and self._snap() == before
        if not (self.bufs or self.dead):
            return
        m = self._pick(pick, self.bufs + self.dead,
                       lambda m: not m.gone() and (bool(m.views) or not viewed))
        if m.gone():
            return self._refused(lambda: self.arenas["host"].free(m.buf) if how == "arena"
                                 else m.buf.free(), DoubleFreeError, m)
        placed = [self.arenas[s] for s in SIDES if m.data[s] is not None]
        foreign = [a for a in self.arenas.values() if a not in placed]
        if how == "foreign" and foreign:
            return self._refused(lambda: foreign[0].free(m.buf), InvalidPointerError, m)
        before = self._snap()
        if how == "buf":
            m.buf.free()
        else:
            placed[-1].free(m.buf)      # any arena holding a placement will do
        if m.views:     # the bytes stay reserved while pinned views read them
            m.freeing = True
            assert not m.buf.is_freed and self._snap() == before
        else:
            self._forget(m)
        # views of a side it lacks too: once that said "prefetch or offload it first"
        self._check_gone(m, next((s for s in SIDES if m.data[s] is None), None))

    @invariant()
    def bytes_match_the_model(self):
        T.synchronize()     # every copy done: residency and bytes are settled
        for m in self.bufs:
            m.busy = None
            assert m.buf.residency == ("freed" if m.freeing else m.residency()), m
            assert not m.buf.is_freed
            if not m.freeing:
                for s in (s for s in SIDES if m.data[s] is not None):
                    assert u8(m.buf.numpy(s)).tobytes() == m.data[s], f"{s} bytes of {m}"
                assert u8(m.buf.to_numpy()).tobytes() == m.data[m.primary], m
            for side, a, v in m.views:
                got = (v.numpy() if isinstance(v, torch.Tensor) else v).tobytes()
                assert got == m.data[side][a:a + len(v)], f"a {side} view of {m}"

    @invariant()
    def accounting_matches_the_model(self):
        for side, arena in self.arenas.items():
            sizes, requested, counts = ({k: 0 for k in KINDS} for _ in range(3))
            spans = []
            for m in self.bufs:
                p = m.buf._device if side == "device" else m.buf._host
                assert (p is None) == (m.data[side] is None), f"{side} placement of {m}"
                if p is not None:
                    b, kind = p.block, m.buf.kind
                    assert p.arena is arena and b.is_live and b.requested == m.n
                    assert b.size == align_up(max(m.n, 1), arena.alignment)
                    sizes[kind] += b.size
                    requested[kind] += m.n
                    counts[kind] += 1
                    spans.append((b.slab, b.offset, b.end))
            st_ = arena.stats()
            assert (st_.bytes_by_kind, st_.requested_by_kind, st_.count_by_kind) == \
                (sizes, requested, counts)
            assert (st_.allocated_bytes, st_.live_blocks) == \
                (sum(sizes.values()), sum(counts.values()))
            spans.sort()
            for (slab, _, end), (slab2, start, _) in zip(spans, spans[1:]):
                assert slab != slab2 or end <= start, f"live blocks overlap in {arena}"
            arena._check_invariants()

    def teardown(self):
        try:
            T.synchronize()
            for m in self.bufs:
                m.views.clear()     # the last views die: the postponed frees run
            gc.collect()
            _deferred.flush()
            for m in self.bufs:
                if not m.freeing:
                    m.buf.free()
                assert m.buf.is_freed, m
            for a in self.arenas.values():     # nothing leaked
                st_ = a.stats()
                assert st_.allocated_bytes == st_.live_blocks == 0, st_
                assert a.trim() >= 0
                a._check_invariants()
            assert T.get_engine("host").in_flight == 0
        finally:
            for a in self.arenas.values():
                a.close()


_TransfersMachine.TestCase.settings = machine_settings(25, 30)


@pytest.mark.usefixtures("host_backend")
class TestTransferStates(_TransfersMachine.TestCase):
    pass


def test_no_rule_has_a_precondition():
    """Which rules can run must not depend on the stream threads' timing (the module
    docstring): a precondition here made hypothesis fail the machine as flaky."""
    from hypothesis import stateful
    rules = [getattr(f, stateful.RULE_MARKER) for f in vars(_TransfersMachine).values()
             if hasattr(f, stateful.RULE_MARKER)]
    assert len(rules) == 7 and [r.function.__name__ for r in rules if r.preconditions] == []
