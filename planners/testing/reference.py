"""A straightforward pure-Python simulator, independent of the jitted one.

It implements NOTE [ Simulator semantics ] of ``rtmem.planners.simulator`` with
Python sets, dicts and a heap, so that property tests can compare the two and
``bench/simulate.py`` has a baseline. It raises ``ScheduleError`` with the same
``reason`` codes but shorter messages. Use :func:`rtmem.planners.simulate` in
real code: this one is ~100x slower.
"""

from __future__ import annotations

import heapq

from rtmem.errors import ScheduleError

from ..chain import Chain
from ..platform import Platform
from ..schedule import Op, Schedule
from .._validation import simulation_args

__all__ = ["reference_simulate"]

_COMPUTE_OPS = (Op.F_NONE, Op.F_CK, Op.F_ALL, Op.B, Op.LOSS)


def reference_simulate(chain: Chain, schedule: Schedule, platform: Platform) -> dict:
    """Return a dict of what :class:`~rtmem.planners.SimResult` holds, in plain
    Python: ``makespan`` and ``compute_time`` (float s), ``peak``, ``h2d_bytes``
    and ``d2h_bytes`` (int bytes), and per op the lists ``starts``, ``ends``
    (float s), ``mems`` and ``mems_after`` (int bytes, the timeline's ``mem``
    and ``mem_after`` columns). Takes what :func:`~rtmem.planners.simulate`
    takes (a schedule or its text)."""
    # input validation is shared; semantics are not
    schedule = simulation_args(chain, schedule, platform)
    n = chain.n
    a_size, abar_size = chain.activation_sizes()
    size = {("a", k): int(a_size[k]) for k in range(n + 1)}
    size.update({("abar", k): int(abar_size[k]) for k in range(1, n + 1)})
    w = [int(v) for v in chain.w]
    limit = platform.memory_limit
    bw = platform.bandwidth
    chan_of = {"h2d": "h2d", "d2h": "d2h"} if platform.channel == "duplex" else \
        {"h2d": "link", "d2h": "link"}
    chan_free = {"h2d": 0.0, "d2h": 0.0, "link": 0.0}

    on_device = {("a", 0): 0.0}          # tensor -> time it is ready
    transfer_end = {}                      # tensor -> end of last transfer touching it
    on_host = {}                           # tensor -> time the host copy is complete
    weights = {i: 0.0 for i in range(n)}   # stage -> ready time, for weights on device
    w_host = {i: 0.0 for i in range(n)}
    w_transfer = {i: 0.0 for i in range(n)}
    grads = {}                             # stage -> ready time
    pending = []                           # heap of (time, bytes) frees
    used = size[("a", 0)] + sum(w)
    peak = used
    if used > limit:
        raise ScheduleError("initial memory over the limit", reason="memory-limit",
                            over_bytes=used - limit)
    delta = n + 1
    clock = 0.0
    starts, ends, mems, mems_after = [], [], [], []
    compute_time = 0.0
    moved = {"h2d": 0, "d2h": 0}

    def fail(k, reason, msg, over=None):
        raise ScheduleError(f"op {k}: {msg}", op_index=k, reason=reason, over_bytes=over)

    def settle(t):
        nonlocal used
        while pending and pending[0][0] <= t:
            used -= heapq.heappop(pending)[1]

    def make_room(k, t, extra):
        nonlocal used
        settle(t)
        while used + extra > limit and pending:
            t = max(t, pending[0][0])
            settle(t)
        if used + extra > limit:
            fail(k, "memory-limit", "over the memory limit", used + extra - limit)
        return t

    def release(tensor_bytes, when, now):
        nonlocal used
        if when > now:
            heapq.heappush(pending, (when, tensor_bytes))
        else:
            used -= tensor_bytes

    def dsize(k):
        return 0 if k == n + 1 else size[("a", k)]

    def transfer(direction, nbytes, ready):
        """Queue ``nbytes`` on ``direction``'s channel once ``ready``; (start, end)."""
        c = chan_of[direction]
        start = max(clock, ready, chan_free[c])
        chan_free[c] = start + nbytes / bw
        moved[direction] += nbytes
        return start, chan_free[c]

    for k, (op, s, aux) in enumerate(schedule):
        start = end = clock
        if op in _COMPUTE_OPS:
            if op == Op.LOSS:
                if delta != n + 1:
                    fail(k, "backward-order", "loss twice")
                src = [t for t in (("a", n), ("abar", n)) if t in on_device]
                if not src:
                    fail(k, "missing-input", f"a{n} missing")
                t0 = max(clock, min(on_device[t] for t in src))
                dur, need = chain.u_loss, dsize(n) + chain.o_loss
            else:
                if s not in weights:
                    fail(k, "missing-weights", "weights missing")
                t0 = max(clock, weights[s])
                if op == Op.B:
                    if delta != s + 1:
                        fail(k, "backward-order", "out of order")
                    if ("abar", s + 1) not in on_device:
                        fail(k, "missing-input", "abar missing")
                    t0 = max(t0, on_device[("abar", s + 1)])
                    dur, need = float(chain.u_b[s]), dsize(s) + int(chain.o_b[s]) + w[s]
                else:
                    out_t = ("abar", s + 1) if op == Op.F_ALL else ("a", s + 1)
                    dur, need = float(chain.u_f[s]), size[out_t] + int(chain.o_f[s])
                if op == Op.F_NONE:
                    src = [("a", s)] if ("a", s) in on_device else []
                    if not src:
                        fail(k, "missing-input", "plain input missing")
                else:
                    src = [t for t in (("a", s), ("abar", s)) if t in on_device]
                    if not src:
                        fail(k, "missing-input", "input missing")
                t0 = max(t0, min(on_device[t] for t in src))
            start = make_room(k, t0, need)
            end = start + dur
            mem = used + need
            peak = max(peak, mem)
            compute_time += dur
            if op in (Op.B, Op.LOSS):
                k_in = n if op == Op.LOSS else s
                if op == Op.B:
                    used -= dsize(s + 1)
                    del on_device[("abar", s + 1)]
                    t_free = max(end, transfer_end.get(("abar", s + 1), 0))
                    release(size[("abar", s + 1)], t_free, end)
                    grads[s] = end
                    used += w[s]
                if ("a", k_in) in on_device and ("abar", k_in) not in on_device:
                    del on_device[("a", k_in)]
                    release(size[("a", k_in)], max(end, transfer_end.get(("a", k_in), 0)), end)
                used += dsize(k_in)
                delta = k_in
            else:
                if op == Op.F_NONE:
                    del on_device[("a", s)]
                    release(size[("a", s)], max(end, transfer_end.get(("a", s), 0)), end)
                out_t = ("abar", s + 1) if op == Op.F_ALL else ("a", s + 1)
                if out_t not in on_device:
                    on_device[out_t] = end
                    transfer_end.pop(out_t, None)     # a fresh copy: no transfer yet
                    used += size[out_t]
            clock = end
        elif op in (Op.DELETE, Op.OFFLOAD, Op.PREFETCH):
            t = ("abar" if aux else "a", s)
            if op == Op.PREFETCH:
                if t in on_device:
                    fail(k, "already-resident", "already on device")
                if t not in on_host:
                    fail(k, "no-host-copy", "no host copy")
                clock = make_room(k, clock, size[t])
                used += size[t]
                peak = max(peak, used)
                start, end = transfer("h2d", size[t], on_host[t])
                on_device[t] = end
                transfer_end[t] = end
            elif t not in on_device:
                fail(k, "not-resident", "not on device")
            elif op == Op.OFFLOAD:
                if t in on_host:
                    fail(k, "host-copy-exists", "offloaded twice")
                start, end = transfer("d2h", size[t], on_device[t])
                on_host[t] = end
                transfer_end[t] = max(transfer_end.get(t, 0.0), end)
            else:
                del on_device[t]
                end = max(clock, transfer_end.get(t, 0.0))
                release(size[t], end, clock)
        elif op == Op.W_PREFETCH:
            if s in weights:
                fail(k, "weight-state", "weights already on device")
            clock = make_room(k, clock, w[s])
            used += w[s]
            peak = max(peak, used)
            start, end = transfer("h2d", w[s], w_host[s])
            weights[s] = end
            w_transfer[s] = end
        elif op in (Op.W_OFFLOAD, Op.W_DELETE):
            if s not in weights:
                fail(k, "weight-state", "weights not on device")
            ready = weights.pop(s)
            if op == Op.W_OFFLOAD:
                start, end = transfer("d2h", w[s], ready)
                w_host[s] = end
            else:
                end = max(clock, w_transfer[s])
            release(w[s], end, clock)
        else:  # G_OFFLOAD
            if s not in grads:
                fail(k, "missing-gradient", "no gradient")
            start, end = transfer("d2h", w[s], grads.pop(s))
            release(w[s], end, clock)
        starts.append(start)
        ends.append(end)
        # a move's row: the usage right after it was issued
        mems.append(mem if op in _COMPUTE_OPS else used)
        # frees still pending but due by the op's end count as done
        mems_after.append(used - sum(b for t_free, b in pending if t_free <= end))
    if delta != 0:
        raise ScheduleError("backward incomplete", reason="incomplete")
    return {"makespan": max(ends, default=0.0), "peak": peak, "starts": starts,
            "ends": ends, "mems": mems, "mems_after": mems_after,
            "compute_time": compute_time, "h2d_bytes": moved["h2d"],
            "d2h_bytes": moved["d2h"]}

