"""The compiled half of :class:`~rtmem.jit_allocator.JitBestFitAllocator`: best
fit with splitting and coalescing over one flat ``int64`` array, in
``numba.njit`` functions.

NOTE [ Jit allocator state ]
Everything the hot path touches lives in one array ``S`` so that a call
unboxes one argument (each extra array costs ~85 ns of numba dispatch, a
returned tuple ~1 µs: the functions return one int):

* ``S[0:HDR]``: the header (slot names below);
* ``S[HDR : HDR + BCAP * W]``: the block table, ``W`` int64 fields a block
  (``F_ADDR`` = slab << 40 | offset, ``F_SIZE``, ``F_PREV``/``F_NEXT`` = the
  address-ordered neighbours' indices or -1, ``F_STATE``, ``F_GEN``,
  ``F_REQ`` = requested bytes, -1 never handed out);
* ``S[KBASE : KBASE + NKEYS]``: the ready blocks' indices, sorted by
  (size, addr): best fit is one binary search, ties go to the lowest address
  (the order of :class:`~rtmem.allocator.BestFitAllocator`'s keys).

Rules (checked by ``JitBestFitAllocator._check_invariants``):

1. A slab's blocks tile it in a doubly linked list; a slab's first block
   (offset 0) keeps its index for the slab's life (merges keep the earlier
   block), so the Python side names a slab by it.
2. Ready blocks are exactly those in the key array; two ready blocks are never
   adjacent. Pending blocks (freed behind an event that has not completed) are
   in no index and merge with nothing until retired.
3. Dead block slots form the spare list (chained through ``F_NEXT``); a split
   or a new slab takes one, ``NO_ROOM`` is returned (state untouched) when the
   table is full and the caller grows it (:func:`grow`).
4. A handle is a *ticket* ``gen << 32 | index``: ``F_GEN`` is bumped at every
   hand-out, so a stale ticket (its block freed, maybe handed out again) never
   frees or resizes someone else's allocation. Generations are 31-bit: a
   stale handle aliases only after 2**31 reuses of one slot.
5. After :func:`grow` copied the state into a larger array the old one is
   marked ``STALE`` and every function called on it returns ``STALE``
   without touching it: a thread that loaded the old array just before the
   swap retries on the new one (NOTE [ Jit allocator threads ] in
   jit_allocator.py).

Counters (``ALLOCATED``, ``REQUESTED``, ``PEAK``, ``NALLOC``, ``NFREE``,
``PENDING``) are in bytes or counts, kept by the same calls.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._blocks import _DEAD, _LIVE, _OFFSET_BITS, _PENDING, _READY

# header slots
NKEYS, SPARE, HIWATER, KBASE, BCAP, ALIGN, STALE = 0, 1, 2, 3, 4, 5, 6
ALLOCATED, REQUESTED, PEAK, NALLOC, NFREE, PENDING = 7, 8, 9, 10, 11, 12
HDR = 16
# block fields
W = 8
F_ADDR, F_SIZE, F_PREV, F_NEXT, F_STATE, F_GEN, F_REQ = 0, 1, 2, 3, 4, 5, 6
# block states: those of BestFitAllocator's blocks
LIVE, READY, PENDING_STATE, DEAD = _LIVE, _READY, _PENDING, _DEAD
# return codes (tickets and indices are >= 0)
NO_FIT, NO_ROOM, IS_STALE, NOT_LIVE = -1, -2, -3, -4
OFFSET_BITS = _OFFSET_BITS
IDX_MASK = 0xFFFFFFFF


def new_state(capacity: int, alignment: int) -> np.ndarray:
    """An empty state array with room for ``capacity`` blocks (no slab yet)."""
    S = np.zeros(HDR + capacity * (W + 1), np.int64)
    S[KBASE] = HDR + capacity * W
    S[BCAP] = capacity
    S[ALIGN] = alignment
    S[SPARE] = -1
    return S


@njit(cache=True)
def _search(S, size, addr):
    """First position in the key array whose (size, addr) >= (size, addr)."""
    kb = S[KBASE]
    lo = 0
    hi = S[NKEYS]
    while lo < hi:
        mid = (lo + hi) >> 1
        j = HDR + S[kb + mid] * W
        s = S[j + F_SIZE]
        if s < size or (s == size and S[j + F_ADDR] < addr):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _insert_key(S, idx):
    j = HDR + idx * W
    pos = _search(S, S[j + F_SIZE], S[j + F_ADDR])
    kb = S[KBASE]
    n = S[NKEYS]
    for t in range(kb + n, kb + pos, -1):
        S[t] = S[t - 1]
    S[kb + pos] = idx
    S[NKEYS] = n + 1


@njit(cache=True)
def _delete_at(S, pos):
    kb = S[KBASE]
    n = S[NKEYS] - 1
    for t in range(kb + pos, kb + n):
        S[t] = S[t + 1]
    S[NKEYS] = n


@njit(cache=True)
def _remove_key(S, idx):
    j = HDR + idx * W
    _delete_at(S, _search(S, S[j + F_SIZE], S[j + F_ADDR]))


@njit(cache=True)
def _take_slot(S):
    """A dead slot for a new block (the caller checked ``has_room``)."""
    idx = S[SPARE]
    if idx >= 0:
        S[SPARE] = S[HDR + idx * W + F_NEXT]
        return idx
    idx = S[HIWATER]
    S[HIWATER] = idx + 1
    S[HDR + idx * W + F_GEN] = 0
    return idx


@njit(cache=True)
def _kill(S, idx):
    j = HDR + idx * W
    S[j + F_STATE] = DEAD
    S[j + F_NEXT] = S[SPARE]
    S[SPARE] = idx


@njit(cache=True)
def _drop_next(S, idx, nx):
    """Unlink ``nx``, the block after ``idx`` (in no index), and kill it:
    ``idx`` now reaches to where ``nx`` ended (the caller sets its size)."""
    after = S[HDR + nx * W + F_NEXT]
    S[HDR + idx * W + F_NEXT] = after
    if after >= 0:
        S[HDR + after * W + F_PREV] = idx
    _kill(S, nx)


@njit(cache=True)
def has_room(S):
    """Whether a new block fits in the table without :func:`grow`."""
    return S[SPARE] >= 0 or S[HIWATER] < S[BCAP]


@njit(cache=True)
def live_index(S, ticket):
    """The block index of a live ``ticket``, or NOT_LIVE (stale or foreign)."""
    idx = ticket & IDX_MASK
    if ticket < 0 or idx >= S[HIWATER]:
        return NOT_LIVE
    j = HDR + idx * W
    if S[j + F_GEN] != (ticket >> 32) or S[j + F_STATE] != LIVE:
        return NOT_LIVE
    return idx


@njit(cache=True)
def _new_block(S, addr, size, prev, nxt, state):
    """Link a new block between ``prev`` and ``nxt`` (indices or -1)."""
    idx = _take_slot(S)
    j = HDR + idx * W
    S[j + F_ADDR] = addr
    S[j + F_SIZE] = size
    S[j + F_PREV] = prev
    S[j + F_NEXT] = nxt
    S[j + F_STATE] = state
    S[j + F_REQ] = -1
    if prev >= 0:
        S[HDR + prev * W + F_NEXT] = idx
    if nxt >= 0:
        S[HDR + nxt * W + F_PREV] = idx
    return idx


@njit(cache=True)
def _make_ready(S, idx):
    """Index free block ``idx`` (in no index), merged with ready neighbours."""
    j = HDR + idx * W
    size = S[j + F_SIZE]
    p = S[j + F_PREV]
    nx = S[j + F_NEXT]
    if p >= 0 and S[HDR + p * W + F_STATE] == READY:
        _remove_key(S, p)
        size += S[HDR + p * W + F_SIZE]
        _drop_next(S, p, idx)
        idx = p
        j = HDR + p * W
    else:
        S[j + F_STATE] = READY
    if nx >= 0 and S[HDR + nx * W + F_STATE] == READY:
        _remove_key(S, nx)
        size += S[HDR + nx * W + F_SIZE]
        _drop_next(S, idx, nx)
    S[j + F_SIZE] = size
    _insert_key(S, idx)


@njit(cache=True)
def alloc(S, nbytes):
    """Best fit for ``nbytes`` (>= 0) bytes: the new block's ticket, or NO_FIT
    (no ready block holds it), NO_ROOM (grow the table) or IS_STALE; the state
    is untouched unless a ticket is returned."""
    if S[STALE]:
        return IS_STALE
    a = S[ALIGN]
    size = (nbytes + a - 1) & -a if nbytes > 0 else a
    pos = _search(S, size, 0)
    if pos >= S[NKEYS]:
        return NO_FIT
    if not has_room(S):
        return NO_ROOM
    idx = S[S[KBASE] + pos]
    _delete_at(S, pos)
    j = HDR + idx * W
    bsize = S[j + F_SIZE]
    if bsize > size:
        p = S[j + F_PREV]
        nx = S[j + F_NEXT]
        if p >= 0 and S[HDR + p * W + F_STATE] == PENDING_STATE and \
                (nx < 0 or S[HDR + nx * W + F_STATE] != PENDING_STATE):
            # Hand out the tail: the free head stays beside the pending block
            # and merges with it once that retires (carving the head would wall
            # it in; the same policy as BestFitAllocator).
            S[j + F_SIZE] = bsize - size
            _insert_key(S, idx)
            idx = _new_block(S, S[j + F_ADDR] + bsize - size, size, idx, nx, LIVE)
            j = HDR + idx * W
        else:
            rest = _new_block(S, S[j + F_ADDR] + size, bsize - size, idx, nx, READY)
            S[j + F_SIZE] = size
            _insert_key(S, rest)
    gen = S[j + F_GEN] + 1
    if gen > 0x7FFFFFFF:
        gen = 1
    S[j + F_GEN] = gen
    S[j + F_STATE] = LIVE
    S[j + F_REQ] = nbytes
    S[NALLOC] += 1
    S[REQUESTED] += nbytes
    allocated = S[ALLOCATED] + size
    S[ALLOCATED] = allocated
    if allocated > S[PEAK]:
        S[PEAK] = allocated
    return (gen << 32) | idx


@njit(cache=True)
def _unlive(S, ticket):
    """Count live ``ticket``'s block free (it is left in no index): its
    index, or IS_STALE / NOT_LIVE with nothing changed."""
    if S[STALE]:
        return IS_STALE
    idx = live_index(S, ticket)
    if idx < 0:
        return idx
    j = HDR + idx * W
    S[ALLOCATED] -= S[j + F_SIZE]
    S[REQUESTED] -= S[j + F_REQ]
    S[NFREE] += 1
    return idx


@njit(cache=True)
def free(S, ticket):
    """Free a live block at once: 0, or NOT_LIVE / IS_STALE (untouched)."""
    idx = _unlive(S, ticket)
    if idx < 0:
        return idx
    _make_ready(S, idx)
    return 0


@njit(cache=True)
def defer(S, ticket):
    """Free a live block behind an event: it becomes pending (counted free, in
    no index, merging with nothing) until :func:`retire`. 0 or a code."""
    idx = _unlive(S, ticket)
    if idx < 0:
        return idx
    j = HDR + idx * W
    S[j + F_STATE] = PENDING_STATE
    S[PENDING] += S[j + F_SIZE]
    return 0


@njit(cache=True)
def retire(S, idx):
    """Make pending block ``idx`` ready (its event completed). 0 or IS_STALE."""
    if S[STALE]:
        return IS_STALE
    S[PENDING] -= S[HDR + idx * W + F_SIZE]
    _make_ready(S, idx)
    return 0


@njit(cache=True)
def add_slab(S, slab, nbytes):
    """A new slab of ``nbytes`` as one ready block: its index, NO_ROOM or
    IS_STALE."""
    if S[STALE]:
        return IS_STALE
    if not has_room(S):
        return NO_ROOM
    idx = _new_block(S, slab << OFFSET_BITS, nbytes, -1, -1, READY)
    _insert_key(S, idx)
    return idx


@njit(cache=True)
def drop_slab(S, first, nbytes):
    """Remove a slab whose first block ``first`` is ready and spans all
    ``nbytes``: 1, else 0 (something in it is live or pending)."""
    j = HDR + first * W
    if S[j + F_STATE] != READY or S[j + F_SIZE] != nbytes:
        return 0
    _remove_key(S, first)
    _kill(S, first)
    return 1


@njit(cache=True)
def fits_in_place(S, idx, size):
    """Whether live block ``idx`` can become ``size`` bytes without moving:
    shrinking always can; growing needs a ready next block covering the rest."""
    j = HDR + idx * W
    have = S[j + F_SIZE]
    if size <= have:
        return True
    nx = S[j + F_NEXT]
    return nx >= 0 and S[HDR + nx * W + F_STATE] == READY and \
        have + S[HDR + nx * W + F_SIZE] >= size


@njit(cache=True)
def resize(S, ticket, nbytes):
    """Resize a live block in place to ``nbytes``: 0, NO_FIT (it would have to
    move), NO_ROOM, NOT_LIVE or IS_STALE; the state is untouched unless 0."""
    if S[STALE]:
        return IS_STALE
    idx = live_index(S, ticket)
    if idx < 0:
        return idx
    a = S[ALIGN]
    size = (nbytes + a - 1) & -a if nbytes > 0 else a
    if not fits_in_place(S, idx, size):
        return NO_FIT
    j = HDR + idx * W
    have = S[j + F_SIZE]
    nx = S[j + F_NEXT]
    if size < have:
        if not has_room(S):
            return NO_ROOM
        rest = _new_block(S, S[j + F_ADDR] + size, have - size, idx, nx, READY)
        S[j + F_SIZE] = size
        _make_ready(S, rest)
    elif size > have:
        nj = HDR + nx * W
        _remove_key(S, nx)
        left = have + S[nj + F_SIZE] - size
        if left:
            S[nj + F_ADDR] += size - have
            S[nj + F_SIZE] = left
            _insert_key(S, nx)
        else:
            _drop_next(S, idx, nx)
        S[j + F_SIZE] = size
    S[ALLOCATED] += size - have
    S[REQUESTED] += nbytes - S[j + F_REQ]
    S[j + F_REQ] = nbytes
    if S[ALLOCATED] > S[PEAK]:
        S[PEAK] = S[ALLOCATED]
    return 0


@njit(cache=True)
def snapshot(S):
    """The header, then the largest ready block's size (0 if none), copied in
    one call: a consistent view for the statistics (the GIL is held)."""
    out = np.empty(HDR + 1, np.int64)
    out[:HDR] = S[:HDR]
    n = S[NKEYS]
    out[HDR] = S[HDR + S[S[KBASE] + n - 1] * W + F_SIZE] if n else 0
    return out


@njit(cache=True)
def reset_peak(S):
    """Set the peak to what is allocated now."""
    S[PEAK] = S[ALLOCATED]


@njit(cache=True)
def grow(S, capacity):
    """A copy of ``S`` with room for ``capacity`` blocks; ``S`` is marked
    stale (Rule 5)."""
    T = np.zeros(HDR + capacity * (W + 1), np.int64)
    n_used = HDR + S[HIWATER] * W
    T[:n_used] = S[:n_used]
    kb = HDR + capacity * W
    n = S[NKEYS]
    T[kb:kb + n] = S[S[KBASE]:S[KBASE] + n]
    T[KBASE] = kb
    T[BCAP] = capacity
    S[STALE] = 1
    return T


def warm_up() -> None:
    """Compile (or load from numba's cache) every function once, with the
    argument types the allocator passes (Python ints become int64)."""
    S = new_state(4, 256)
    first = add_slab(S, 0, 4096)
    t = alloc(S, 100)
    resize(S, t, 600)
    fits_in_place(S, t & IDX_MASK, 256)
    defer(S, t)
    retire(S, t & IDX_MASK)
    free(S, alloc(S, 1))
    has_room(S)
    snapshot(S)
    reset_peak(S)
    live_index(S, 0)
    T = grow(S, 8)
    drop_slab(T, first, 4096)
