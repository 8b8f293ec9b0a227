"""Buffer lifetimes of a (chain, schedule) pair, by the simulator's rules.

NOTE [ Lifetimes ]
Walking a schedule with NOTE [ Simulator semantics ] (simulator.py), every piece
of device memory becomes one buffer with an inclusive op-index interval
``[alloc, free]``: it is created by op ``alloc`` (-1: resident before the first
op: a_0 and all weights) and released at the end of op ``free`` (``n_ops``:
still resident after the last op). Ops are numbered as in the schedule.

- F_* i: output a_{i+1} (F_none, F_ck) or abar_{i+1} (F_all) from op j, unless it
  is already resident; overhead o_f[i] alive during op j only; F_none also
  releases the plain a_i at j.
- L: overhead o_loss at j; releases a plain a_n (when abar_n is not resident);
  creates delta_n (size x[n-1]).
- B i: overhead o_b[i] at j; consumes delta_{i+1} and abar_{i+1} (released at
  j); releases a plain a_i when abar_i is not resident; creates delta_i (size of
  a_i) and the weight gradient of stage i (w[i] bytes).
- delete: released at j; prefetch: created at j; offload: no change.
- w_offload / w_delete / g_offload: released at j; w_prefetch: created at j.

Two buffers may share memory iff their intervals are disjoint. The simulator
defers some frees until an in-flight transfer completes (Rule 5); op indices
cannot express that, so an executor using a static layout must wait for that
transfer's event before the next buffer at the same offset is written (the
runtime allocator's stream-ordered reuse does exactly this). The peak of live
bytes over op indices equals the simulator's ``peak`` for schedules without
transfers (tested).

Pure numpy: no runtime import, usable by the planners.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rtmem.errors import ScheduleError

from ._validation import check_ranges
from .chain import Chain
from .schedule import Op, Schedule

__all__ = ["KIND_NAMES", "Lifetimes", "lifetimes"]

#: Names of the ``kind`` codes, matching the runtime's buffer kinds.
KIND_NAMES = ("activation", "weight", "gradient", "workspace")
_ACT, _WEIGHT, _GRAD, _WORK = range(4)


@dataclass(frozen=True, eq=False)
class Lifetimes:
    """Buffers of one training iteration (NOTE [ Lifetimes ]).

    ``alloc``, ``free`` (int64 op indices, inclusive, -1 .. n_ops), ``nbytes``
    (int64 bytes, > 0), ``kind`` (int8 codes into :data:`KIND_NAMES`), ``names``
    (``"a3"``, ``"abar3"``, ``"delta3"``, ``"w2"``, ``"g2"``, ``"o_f5"``, ...),
    ``n_ops`` (length of the schedule).
    """

    alloc: np.ndarray
    free: np.ndarray
    nbytes: np.ndarray
    kind: np.ndarray
    names: tuple
    n_ops: int

    def __len__(self) -> int:
        return int(self.alloc.shape[0])

    def live_bytes(self) -> np.ndarray:
        """Bytes live during each op, index t+1 for op t (t = -1 .. n_ops)."""
        span = self.n_ops + 3
        delta = np.zeros(span, np.int64)
        np.add.at(delta, self.alloc + 1, self.nbytes)
        np.add.at(delta, self.free + 2, -self.nbytes)
        return np.cumsum(delta)[:-1]

    def peak_live(self) -> int:
        """Highest sum of live bytes over all op indices, bytes."""
        return int(self.live_bytes().max()) if len(self) else 0

    def kind_name(self, i: int) -> str:
        """The kind of buffer ``i`` as a name."""
        return KIND_NAMES[int(self.kind[i])]


def lifetimes(chain: Chain, schedule: Schedule) -> Lifetimes:
    """Derive buffer lifetimes from ``schedule`` run on ``chain`` (sizes in bytes).

    The schedule should be valid (check it with :func:`~rtmem.planners.simulate`);
    a move of data that is not resident, or a prefetch of data that is, raises
    :class:`~rtmem.errors.ScheduleError`.
    Zero-byte buffers are omitted. Stage and activation indices out of range
    for ``chain`` raise :class:`~rtmem.errors.ScheduleError` (an IndexError
    before).
    """
    check_ranges(chain, schedule)
    n = chain.n
    a, abar = chain.activation_sizes()
    w = np.asarray(chain.w, np.int64)
    o_f = np.asarray(chain.o_f, np.int64)
    o_b = np.asarray(chain.o_b, np.int64)
    n_ops = len(schedule)
    alloc, free, size, kind, names = [], [], [], [], []

    def new(j, nbytes, k, name):
        nbytes = int(nbytes)
        if nbytes <= 0:
            return -1
        alloc.append(j)
        free.append(n_ops)
        size.append(nbytes)
        kind.append(k)
        names.append(name)
        return len(alloc) - 1

    def end(idx, j):
        if idx >= 0:
            free[idx] = j

    def put(table, key, j, what, nbytes, k, name):
        # A prefetch of data already resident replaced its record, which then
        # stayed live to the end: two copies of one buffer, laid out apart.
        if key in table:
            raise ScheduleError(f"op {j} ({schedule.op_text(j)}): {what} is already "
                                f"resident; validate the schedule with simulate() first",
                                op_index=j, reason="already-resident")
        table[key] = new(j, nbytes, k, name)

    def take(table, key, j, what):
        if key not in table:
            raise ScheduleError(f"op {j} ({schedule.op_text(j)}): {what} is not resident; "
                                f"validate the schedule with simulate() first",
                                op_index=j, reason="not-resident")
        return table.pop(key)

    act = {(0, 0): new(-1, a[0], _ACT, "a0")}       # (k, 0 plain | 1 abar) -> record
    weights = {i: new(-1, w[i], _WEIGHT, f"w{i}") for i in range(n)}
    grads, deltas = {}, {}
    ops, stages, auxs = schedule.op, schedule.stage, schedule.aux
    for j in range(n_ops):
        op, s, aux = int(ops[j]), int(stages[j]), int(auxs[j])
        if op in (Op.F_NONE, Op.F_CK, Op.F_ALL):
            end(new(j, o_f[s], _WORK, f"o_f{s}"), j)
            k = 1 if op == Op.F_ALL else 0
            out_bytes, out_name = (abar[s + 1] if k else a[s + 1]), f"{'abar' if k else 'a'}{s + 1}"
            if (s + 1, k) not in act:
                act[(s + 1, k)] = new(j, out_bytes, _ACT, out_name)
            else:
                # A re-run whose output is already resident still writes a
                # fresh output, dropped at the end of the op (the simulator
                # counts it during the op, and the executor computes it).
                end(new(j, out_bytes, _WORK, f"{out_name} (recomputed)"), j)
            if op == Op.F_NONE:
                end(take(act, (s, 0), j, f"a{s}"), j)
        elif op == Op.LOSS:
            end(new(j, chain.o_loss, _WORK, "o_loss"), j)
            if (n, 0) in act and (n, 1) not in act:
                end(act.pop((n, 0)), j)
            deltas[n] = new(j, a[n], _GRAD, f"delta{n}")
        elif op == Op.B:
            end(new(j, o_b[s], _WORK, f"o_b{s}"), j)
            end(take(deltas, s + 1, j, f"delta{s + 1}"), j)
            end(take(act, (s + 1, 1), j, f"abar{s + 1}"), j)
            if (s, 0) in act and (s, 1) not in act:
                end(act.pop((s, 0)), j)
            deltas[s] = new(j, a[s], _GRAD, f"delta{s}")
            grads[s] = new(j, w[s], _GRAD, f"g{s}")
        elif op == Op.DELETE:
            end(take(act, (s, aux), j, f"{'abar' if aux else 'a'}{s}"), j)
        elif op == Op.PREFETCH:
            name = f"{'abar' if aux else 'a'}{s}"
            put(act, (s, aux), j, name, abar[s] if aux else a[s], _ACT, name)
        elif op in (Op.W_OFFLOAD, Op.W_DELETE):
            end(take(weights, s, j, f"weights of stage {s}"), j)
        elif op == Op.W_PREFETCH:
            put(weights, s, j, f"weights of stage {s}", w[s], _WEIGHT, f"w{s}")
        elif op == Op.G_OFFLOAD:
            end(take(grads, s, j, f"weight gradient of stage {s}"), j)
        # OFFLOAD leaves the device copy in place: no lifetime change.
    return Lifetimes(np.asarray(alloc, np.int64), np.asarray(free, np.int64),
                     np.asarray(size, np.int64), np.asarray(kind, np.int8),
                     tuple(names), n_ops)
