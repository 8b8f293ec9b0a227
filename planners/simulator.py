"""The schedule simulator: the one oracle every planner is checked against.

NOTE [ Simulator semantics ]
The compute operations (F_none, F_ck, F_all, L, B) follow Table 2.1 of the thesis
exactly (thesis-remat.md §3.1 and Appendix A.1): no implicit deletes, F_none reads
only a plain a_i (erratum 12), B i needs delta_{i+1}, abar_{i+1} and a_i or abar_i
and consumes delta_{i+1}, abar_{i+1} and a plain a_i. Backward steps must come in
the order L, B n-1, ..., B 0, each exactly once. The memory an operation needs is
everything resident + its output + its overhead (Rule 1 below).

Rules (numbered so code can point at them):

1. Memory is every byte resident on the device: activations, gradients
   delta_k (delta_{n+1} has size 0, delta_k has the size of a_k), weights, weight
   gradients (created by B i, w[i] bytes), and, while a compute op runs, its output
   and temporary overhead. It must never exceed ``Platform.memory``.
2. Compute ops run one at a time, in schedule order, on the compute stream. An op
   starts at the earliest time when (a) the previous compute op has ended, (b) its
   inputs are on the device (a prefetch has finished) and (c) its memory fits,
   waiting for in-flight frees (offload completions) if needed (assumption O.3).
3. A transfer is *issued* when the compute stream reaches it in schedule order,
   i.e. at the end of the previous compute op (an executor records an event after
   each compute op and makes the copy wait on it). It starts when its channel is
   free (``shared``: one channel for both directions, O.1; ``duplex``: one per
   direction) and its source is ready, and lasts size / bandwidth (O.2).
   Transfers on one channel run in issue order.
4. A prefetch reserves its full size when issued (an allocator must hand out the
   destination before the copy is enqueued); this is at or before the transfer
   start, so it is at least as strict as O.7. If the reservation does not fit it
   waits for in-flight frees, blocking the schedule (the host thread) meanwhile.
5. ``offload`` copies to the host and leaves the device copy in place, so compute
   ops may keep reading it (the thesis' offload of abar_l runs while F_{l+1} reads
   it). ``delete`` drops the device copy; the bytes return when every transfer
   using it has finished: an offload reading it (O.7: an offload frees on
   completion) or a prefetch still writing it. So do those of data a compute op
   consumes (F_none's input, B's abar and plain input). A delete of data with no
   host copy discards it (explicit deletes are outside the thesis' model, erratum
   11; the planners never emit them for remat alone).
6. ``w_offload i`` copies the weights of stage i to the host and frees them on
   completion; ``w_delete i`` frees them at once (the host holds the master copy),
   or, while a ``w_prefetch i`` still writes them, when it lands;
   ``w_prefetch i`` brings them back (Rule 4). F i and B i need the weights of
   stage i. ``g_offload i`` moves the weight gradient made by B i to the host and
   frees it on completion. All weights start on the device.
7. The makespan is the end of the last operation, transfers included.

All sizes are int64 bytes and all times float64 seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from rtmem.errors import ScheduleError

from .chain import Chain
from .platform import Platform
from .schedule import Op, Schedule

__all__ = ["SimResult", "simulate"]

from ._validation import simulation_args  # noqa: E402
from ._sim_errors import (_E_ALREADY_RESIDENT, _E_BACKWARD_ORDER, _E_GRAD_MISSING,  # noqa: E402
                          _E_HOST_COPY_EXISTS, _E_INCOMPLETE, _E_INITIAL_MEMORY,
                          _E_MEMORY, _E_MISSING_ABAR, _E_MISSING_INPUT,
                          _E_NO_HOST_COPY, _E_NOT_RESIDENT, _E_WEIGHT_MISSING,
                          _E_WEIGHT_STATE, OK, raise_error)

_F_NONE, _F_CK, _F_ALL, _LOSS, _B = int(Op.F_NONE), int(Op.F_CK), int(Op.F_ALL), \
    int(Op.LOSS), int(Op.B)
_DELETE, _OFFLOAD, _PREFETCH = int(Op.DELETE), int(Op.OFFLOAD), int(Op.PREFETCH)
_W_OFFLOAD, _W_DELETE, _W_PREFETCH, _G_OFFLOAD = int(Op.W_OFFLOAD), int(Op.W_DELETE), \
    int(Op.W_PREFETCH), int(Op.G_OFFLOAD)

#: dtype of :attr:`SimResult.timeline`: times in float64 seconds, bytes in int64.
TIMELINE_DTYPE = np.dtype([("start", np.float64), ("end", np.float64),
                           ("mem", np.int64), ("mem_after", np.int64)])


@dataclass(frozen=True, eq=False)
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes
    ----------
    makespan:
        End of the last operation, seconds.
    peak:
        Highest device memory in use at any time, bytes.
    timeline:
        Structured array (dtype ``TIMELINE_DTYPE``), one row per operation:
        ``start`` and ``end`` (float64 s), ``mem`` (int64 bytes in use while it
        runs: for compute ops resident data plus output plus overhead; for
        transfers and frees the usage right after the op was issued) and
        ``mem_after`` (int64 bytes when the op is over). The byte columns are
        exact: the largest ``mem`` is ``peak``, unless the usage before op 0
        (the chain input and every stage's weights) was higher, which a
        schedule that moves weights off the device before it computes can do.
    compute_time:
        Total busy time of the compute stream, seconds.
    h2d_bytes, d2h_bytes:
        Bytes moved host->device and device->host (exact ints).
    """

    makespan: float
    peak: int
    timeline: np.ndarray
    compute_time: float
    h2d_bytes: int
    d2h_bytes: int

    @property
    def idle_time(self) -> float:
        """Makespan minus compute time: seconds lost waiting for transfers or frees."""
        return self.makespan - self.compute_time


@numba.njit(cache=True, nogil=True)
def _apply_frees(t, mem, pf_t, pf_b, npf):
    """Apply every pending free due at or before ``t``; return (mem, npf)."""
    k = 0
    while k < npf:
        if pf_t[k] <= t:
            mem -= pf_b[k]
            npf -= 1
            pf_t[k] = pf_t[npf]
            pf_b[k] = pf_b[npf]
        else:
            k += 1
    return mem, npf


@numba.njit(cache=True, nogil=True)
def _wait_for_memory(t, extra, limit, mem, pf_t, pf_b, npf):
    """Earliest time >= t at which ``mem + extra <= limit`` (Rule 2c / Rule 4).

    Returns (time, mem, npf, over): ``over`` > 0 means it never fits, by that many
    bytes even after every pending free.
    """
    mem, npf = _apply_frees(t, mem, pf_t, pf_b, npf)
    while mem + extra > limit and npf > 0:
        k_min = 0
        for k in range(1, npf):
            if pf_t[k] < pf_t[k_min]:
                k_min = k
        t = max(t, pf_t[k_min])
        mem, npf = _apply_frees(t, mem, pf_t, pf_b, npf)
    over = mem + extra - limit
    return t, mem, npf, over if over > 0 else 0


@numba.njit(cache=True, nogil=True)
def _release(t_free, now, nbytes, mem, pf_t, pf_b, npf):
    """Free ``nbytes`` at time ``now``: at once, or as a pending free due at
    ``t_free`` when a transfer still uses them until then (Rule 5: bytes return
    when the last copy reading them ends). Returns (mem, npf)."""
    if t_free > now:
        pf_t[npf] = t_free
        pf_b[npf] = nbytes
        return mem, npf + 1
    return mem - nbytes, npf


@numba.njit(cache=True, nogil=True)
def _first_ready(dev, ready, k):
    """When the first resident copy of activation k (a_k or abar_k) is ready: an
    op that reads either may start then (seconds; a copy must be resident)."""
    t = 1e300
    for kind in range(2):
        if dev[k, kind] and ready[k, kind] < t:
            t = ready[k, kind]
    return t


@numba.njit(cache=True, nogil=True)
def _fail(err, code, j, a=-1, b=-1):
    """Record violation ``code`` at op ``j`` with its two details (see
    ``_sim_errors.raise_error`` for their meaning per code)."""
    err[0] = code
    err[1] = j
    err[2] = a
    err[3] = b


@numba.njit(cache=True, nogil=True)
def _simulate_core(op, stage, aux, u_f, u_b, a_size, abar_size, w, o_f, o_b,
                   u_loss, o_loss, limit, bandwidth, duplex, times, mems, err, stats,
                   moved):
    """Walk the schedule; fill ``times`` (n_ops x 2 float64: start, end, s),
    ``mems`` (n_ops x 2 int64: mem, mem_after, bytes), ``stats[0]`` (compute
    busy time, s) and ``moved`` (int64 bytes host->device, device->host).

    Byte counts stay int64 (in a float64 array, as they once were, they were
    rounded above 2**53 bytes: the timeline's maximum differed from the peak).
    Returns (makespan, peak). On a violation ``err`` holds (code, op index, a, b)
    and the return values are meaningless. Stage ranges are checked by the caller.
    """
    n = u_f.shape[0]
    n_ops = op.shape[0]
    # device residency and ready time of a_k (kind 0) and abar_k (kind 1), k = 0..n
    dev = np.zeros((n + 1, 2), np.bool_)
    ready = np.zeros((n + 1, 2))
    busy_until = np.zeros((n + 1, 2))     # end of the last transfer reading/writing it
    host = np.zeros((n + 1, 2), np.bool_)
    host_ready = np.zeros((n + 1, 2))
    w_dev = np.ones(n, np.bool_)
    w_ready = np.zeros(n)
    w_host_ready = np.zeros(n)
    g_dev = np.zeros(n, np.bool_)
    g_ready = np.zeros(n)
    pf_t = np.empty(n_ops + 1)
    pf_b = np.empty(n_ops + 1, np.int64)
    npf = 0
    chan_free = np.zeros(2)
    h2d = 0
    d2h = 1 if duplex else 0
    dev[0, 0] = True
    mem = a_size[0] + w.sum()
    peak = mem
    if mem > limit:
        _fail(err, _E_INITIAL_MEMORY, -1, mem - limit)
        return 0.0, peak
    g = n + 1                      # index of the current gradient delta_g
    cursor = 0.0                   # compute stream free / transfer issue time
    last_end = 0.0
    busy = 0.0
    moved_h2d = 0
    moved_d2h = 0
    for j in range(n_ops):
        code = op[j]
        s = stage[j]
        start = cursor
        end = cursor
        if code <= _B:
            # ---------------------------------------------------- compute ops
            t0 = cursor
            dur = 0.0
            need = 0
            if code == _LOSS:
                if g != n + 1:
                    # -2: nothing is next (B 0 ran), not -1, which names the loss
                    _fail(err, _E_BACKWARD_ORDER, j, -1, g - 1 if g > 0 else -2)
                    return 0.0, peak
                if not (dev[n, 0] or dev[n, 1]):
                    _fail(err, _E_MISSING_INPUT, j, n)
                    return 0.0, peak
                t0 = max(t0, _first_ready(dev, ready, n))
                dur = u_loss
                need = a_size[n] + o_loss
            else:
                if not w_dev[s]:
                    _fail(err, _E_WEIGHT_MISSING, j, s)
                    return 0.0, peak
                t0 = max(t0, w_ready[s])
                if code == _B:
                    if g != s + 1:
                        _fail(err, _E_BACKWARD_ORDER, j, s,
                              -1 if g == n + 1 else g - 1 if g > 0 else -2)
                        return 0.0, peak
                    if not dev[s + 1, 1]:
                        _fail(err, _E_MISSING_ABAR, j, s + 1)
                        return 0.0, peak
                    t0 = max(t0, ready[s + 1, 1])
                    dur = u_b[s]
                    need = a_size[s] + o_b[s] + w[s]
                else:
                    dur = u_f[s]
                    need = (abar_size[s + 1] if code == _F_ALL else a_size[s + 1]) + o_f[s]
                if code == _F_NONE:
                    if not dev[s, 0]:
                        _fail(err, _E_MISSING_INPUT, j, s, 1)
                        return 0.0, peak
                    t0 = max(t0, ready[s, 0])
                else:
                    if not (dev[s, 0] or dev[s, 1]):
                        _fail(err, _E_MISSING_INPUT, j, s)
                        return 0.0, peak
                    t0 = max(t0, _first_ready(dev, ready, s))
            start, mem, npf, over = _wait_for_memory(t0, need, limit, mem, pf_t, pf_b, npf)
            if over > 0:
                _fail(err, _E_MEMORY, j, over, need)
                return 0.0, peak
            end = start + dur
            mems[j, 0] = mem + need
            if mem + need > peak:
                peak = mem + need
            busy += dur
            # effects at the end of the op (Table 2.1)
            if code == _LOSS or code == _B:
                k_in = n if code == _LOSS else s          # input activation index
                if code == _B:
                    mem -= a_size[s + 1]                  # delta_{s+1} consumed
                    dev[s + 1, 1] = False
                    mem, npf = _release(busy_until[s + 1, 1], end, abar_size[s + 1], mem,
                                        pf_t, pf_b, npf)
                    g_dev[s] = True
                    g_ready[s] = end
                    mem += w[s]
                if dev[k_in, 0] and not dev[k_in, 1]:
                    dev[k_in, 0] = False
                    mem, npf = _release(busy_until[k_in, 0], end, a_size[k_in], mem,
                                        pf_t, pf_b, npf)
                mem += a_size[k_in]                       # delta_{k_in} produced
                g = k_in
            else:
                if code == _F_NONE:
                    dev[s, 0] = False
                    mem, npf = _release(busy_until[s, 0], end, a_size[s], mem, pf_t, pf_b, npf)
                kind = 1 if code == _F_ALL else 0
                if not dev[s + 1, kind]:
                    dev[s + 1, kind] = True
                    ready[s + 1, kind] = end
                    # A fresh copy: no transfer touches it yet (one that moved an
                    # earlier copy of the same value must not delay its release).
                    busy_until[s + 1, kind] = 0.0
                    mem += abar_size[s + 1] if kind == 1 else a_size[s + 1]
            cursor = end
        elif code == _DELETE or code == _OFFLOAD or code == _PREFETCH:
            # ------------------------------------------------ activation moves
            kind = aux[j]
            size = abar_size[s] if kind == 1 else a_size[s]
            if code == _PREFETCH:
                if dev[s, kind]:
                    _fail(err, _E_ALREADY_RESIDENT, j, s, kind)
                    return 0.0, peak
                if not host[s, kind]:
                    _fail(err, _E_NO_HOST_COPY, j, s, kind)
                    return 0.0, peak
                t_issue, mem, npf, over = _wait_for_memory(cursor, size, limit, mem,
                                                           pf_t, pf_b, npf)
                if over > 0:
                    _fail(err, _E_MEMORY, j, over, size)
                    return 0.0, peak
                cursor = t_issue
                mem += size
                if mem > peak:
                    peak = mem
                start = max(t_issue, host_ready[s, kind], chan_free[h2d])
                end = start + size / bandwidth
                chan_free[h2d] = end
                dev[s, kind] = True
                ready[s, kind] = end
                busy_until[s, kind] = end
                moved_h2d += size
            else:
                if not dev[s, kind]:
                    _fail(err, _E_NOT_RESIDENT, j, s, kind)
                    return 0.0, peak
                if code == _OFFLOAD:
                    if host[s, kind]:
                        _fail(err, _E_HOST_COPY_EXISTS, j, s, kind)
                        return 0.0, peak
                    start = max(cursor, ready[s, kind], chan_free[d2h])
                    end = start + size / bandwidth
                    chan_free[d2h] = end
                    host[s, kind] = True
                    host_ready[s, kind] = end
                    busy_until[s, kind] = max(busy_until[s, kind], end)
                    moved_d2h += size
                else:
                    dev[s, kind] = False
                    end = max(cursor, busy_until[s, kind])
                    mem, npf = _release(end, cursor, size, mem, pf_t, pf_b, npf)
            mems[j, 0] = mem
        elif code == _W_PREFETCH:
            if w_dev[s]:
                _fail(err, _E_WEIGHT_STATE, j, s, 0)
                return 0.0, peak
            t_issue, mem, npf, over = _wait_for_memory(cursor, w[s], limit, mem,
                                                       pf_t, pf_b, npf)
            if over > 0:
                _fail(err, _E_MEMORY, j, over, w[s])
                return 0.0, peak
            cursor = t_issue
            mem += w[s]
            if mem > peak:
                peak = mem
            start = max(t_issue, w_host_ready[s], chan_free[h2d])
            end = start + w[s] / bandwidth
            chan_free[h2d] = end
            w_dev[s] = True
            w_ready[s] = end
            moved_h2d += w[s]
            mems[j, 0] = mem
        elif code == _W_OFFLOAD or code == _W_DELETE:
            if not w_dev[s]:
                _fail(err, _E_WEIGHT_STATE, j, s, 1)
                return 0.0, peak
            w_dev[s] = False
            if code == _W_OFFLOAD:
                start = max(cursor, w_ready[s], chan_free[d2h])
                end = start + w[s] / bandwidth
                chan_free[d2h] = end
                w_host_ready[s] = end
                moved_d2h += w[s]
            else:
                end = max(cursor, w_ready[s])
            mem, npf = _release(end, cursor, w[s], mem, pf_t, pf_b, npf)
            mems[j, 0] = mem
        else:  # _G_OFFLOAD
            if not g_dev[s]:
                _fail(err, _E_GRAD_MISSING, j, s)
                return 0.0, peak
            g_dev[s] = False
            start = max(cursor, g_ready[s], chan_free[d2h])
            end = start + w[s] / bandwidth
            chan_free[d2h] = end
            moved_d2h += w[s]
            mem, npf = _release(end, cursor, w[s], mem, pf_t, pf_b, npf)
            mems[j, 0] = mem
        times[j, 0] = start
        times[j, 1] = end
        if end > last_end:
            last_end = end
        # bytes in use once this op is over (frees due by its end applied)
        after = mem
        for k in range(npf):
            if pf_t[k] <= end:
                after -= pf_b[k]
        mems[j, 1] = after
    if g != 0:
        _fail(err, _E_INCOMPLETE, -1, -1 if g == n + 1 else g - 1)
        return 0.0, peak
    stats[0] = busy
    moved[0] = moved_h2d
    moved[1] = moved_d2h
    return last_end, peak


def recomputed_flagged(chain: Chain, schedule: Schedule) -> int | None:
    """Index of the first operation of ``schedule`` that runs a second forward of
    a stage ``chain.no_recompute`` flags, or None (always None for a chain
    without flags: one vectorized pass over the forwards otherwise)."""
    if chain.recomputable:
        return None
    op, stage = schedule.op, schedule.stage
    fwd = np.flatnonzero(np.isin(op, (_F_NONE, _F_CK, _F_ALL))
                         & chain.no_recompute[np.minimum(stage, chain.n - 1)])
    seen = set()
    for j in fwd.tolist():
        if int(stage[j]) in seen:
            return j
        seen.add(int(stage[j]))
    return None


def check_no_recompute(chain: Chain, schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` when ``schedule`` recomputes a stage that
    ``chain.no_recompute`` flags (it modifies its input in place: a second
    forward reads the modified input)."""
    j = recomputed_flagged(chain, schedule)
    if j is not None:
        s = int(schedule.stage[j])
        raise ScheduleError(
            f"op {j} ({schedule.op_text(j)}) runs stage {s} a second time, but the chain "
            f"marks it no_recompute (it modifies its input in place, so a recomputation "
            f"would read the modified input); use a schedule that runs it once, as F_all "
            f"(plan_remat honours the flag)", op_index=j, reason="recomputed")


def simulate(chain: Chain, schedule: Schedule, platform: Platform) -> SimResult:
    """Simulate ``schedule`` on ``chain`` and ``platform``; validate every invariant.

    Returns a :class:`SimResult` (makespan in seconds, peak in bytes, a per-op
    timeline). Raises :class:`~rtmem.errors.ScheduleError` naming the first
    violated invariant: the op index, the missing activation or weights, or by
    how many bytes the memory limit is exceeded, or a second forward of a stage
    the chain marks ``no_recompute``. The rules are in
    ``NOTE [ Simulator semantics ]`` at the top of this module.
    """
    schedule = simulation_args(chain, schedule, platform)
    check_no_recompute(chain, schedule)
    a_size, abar_size = chain.activation_sizes()
    times = np.zeros((len(schedule), 2))
    mems = np.zeros((len(schedule), 2), np.int64)
    err = np.zeros(4, np.int64)
    stats = np.zeros(1)
    moved = np.zeros(2, np.int64)
    makespan, peak = _simulate_core(
        schedule.op, schedule.stage, schedule.aux, chain.u_f, chain.u_b, a_size, abar_size,
        chain.w, chain.o_f, chain.o_b, chain.u_loss, chain.o_loss, platform.memory_limit,
        platform.bandwidth, platform.channel == "duplex", times, mems, err, stats, moved)
    if err[0] != OK:
        raise_error(err, schedule, chain, platform)
    timeline = np.empty(len(schedule), TIMELINE_DTYPE)
    timeline["start"] = times[:, 0]
    timeline["end"] = times[:, 1]
    timeline["mem"] = mems[:, 0]
    timeline["mem_after"] = mems[:, 1]
    return SimResult(makespan=float(makespan), peak=int(peak), timeline=timeline,
                     compute_time=float(stats[0]), h2d_bytes=int(moved[0]),
                     d2h_bytes=int(moved[1]))
