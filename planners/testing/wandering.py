"""Random walks over every operation the simulator allows.

:func:`valid_schedules` builds a schedule from a persistent rematerialization
sequence and weaves moves between two uses of a tensor: the shapes planners
emit. :func:`wandering_schedules` is wilder. At each step it takes one of the
operations that NOTE [ Simulator semantics ] allows in the current state: a
forward of any stage whose input is resident (again and again if it likes), the
next backward step, a discard or an offload of any resident tensor, a prefetch
of any host copy, a weight or gradient move. After a random number of steps it
finishes greedily. Schedules an executor has to survive come out of it: an
``F_all`` over a resident abar, a checkpoint discarded and recomputed, a
prefetch long after its offload, a plain a_k consumed while a host copy stays,
weights deleted and brought back around several uses.

The walk keeps its own model of the state (residency only: no bytes, no time),
so a test that simulates what it draws checks that model against the simulator.
"""

from __future__ import annotations

from ..chain import Chain
from ..schedule import Op, Schedule
from .._validation import is_int

from rtmem._optional import require

from . import _HYPOTHESIS_MISSING

require("hypothesis", _HYPOTHESIS_MISSING)   # before the import that fails bare

from hypothesis import strategies as st  # noqa: E402
from ._arguments import StrategyArgumentError, check_flags, public_name  # noqa: E402 (needs hypothesis)

__all__ = ["wandering_schedules"]

_A, _ABAR = 0, 1


class _Walk:
    """Residency of a chain of ``n`` stages after some operations (NOTE
    [ Simulator semantics ]): tensors ``(k, kind)`` (kind 0: a_k, 1: abar_k) on
    the device and on the host, stages whose weights are on the device or whose
    weight gradients are, and ``g``, the index of the next gradient to make
    (``n + 1``: the loss is next; 0: the backward pass is over).

    ``flagged`` holds the stages that ``Chain.no_recompute`` marks: each runs one
    forward, an ``F_all`` (only it makes the abar that its B needs), and that abar
    is kept on the device or the host until its B; ``ran`` holds those run."""

    def __init__(self, n: int, flagged=()):
        self.n = n
        self.flagged = set(flagged)
        self.ran = set()
        self.dev = {(0, _A)}
        self.host = set()
        self.w_dev = set(range(n))
        self.g_dev = set()
        self.g = n + 1

    def _either(self, k: int) -> bool:
        return (k, _A) in self.dev or (k, _ABAR) in self.dev

    def _keeps(self, t) -> bool:
        """False for an operation on ``t`` that would lose a_0 or the abar_{s+1}
        of a flagged stage s before its B: nothing can make them again, and a
        backward step needs them, so the walk could not finish."""
        if t in self.host:
            return True
        k, kind = t
        if t == (0, _A):
            return False
        return not (kind == _ABAR and k - 1 in self.flagged and self.g > k - 1)

    def legal(self) -> tuple[list, list, list]:
        """Every ``(op, stage, aux)`` allowed now, in a fixed order, in three
        lists: compute operations, activation moves, gradient and weight moves."""
        n, dev = self.n, self.dev
        compute, moves, weights = [], [], []
        for s in range(n):
            if s not in self.w_dev or s in self.ran:
                continue
            if s in self.flagged:
                if self._either(s):
                    compute.append((Op.F_ALL, s, 0))   # its one run keeps abar_{s+1}
                continue
            if (s, _A) in dev and self._keeps((s, _A)):
                compute.append((Op.F_NONE, s, 0))      # reads and frees a plain a_s
            if self._either(s):
                compute += [(Op.F_CK, s, 0), (Op.F_ALL, s, 0)]
        if self.g == n + 1 and self._either(n):
            compute.append((Op.LOSS, 0, 0))
        elif 0 < self.g <= n:
            s = self.g - 1
            if s in self.w_dev and (s + 1, _ABAR) in dev and self._either(s):
                compute.append((Op.B, s, 0))
        for k, kind in sorted(dev):
            if (k, kind) not in self.host:
                moves.append((Op.OFFLOAD, k, kind))
            if self._keeps((k, kind)):
                moves.append((Op.DELETE, k, kind))
        moves += [(Op.PREFETCH, k, kind) for k, kind in sorted(self.host - dev)]
        # Gradient moves first: after the weight moves of all n stages, a
        # g_offload's choice index grew with the stage count, so a failure that
        # needs one did not shrink to a shorter chain (an 8-op failure on 2 stages
        # shrank to 17 ops on 5 stages, or 31 on 7).
        weights += [(Op.G_OFFLOAD, s, 0) for s in sorted(self.g_dev)]
        for s in range(n):
            weights += ([(Op.W_OFFLOAD, s, 0), (Op.W_DELETE, s, 0)] if s in self.w_dev
                        else [(Op.W_PREFETCH, s, 0)])
        return compute, moves, weights

    def apply(self, op) -> None:
        code, s, aux = op
        dev = self.dev
        if code in (Op.F_NONE, Op.F_CK, Op.F_ALL):
            if s in self.flagged:
                self.ran.add(s)
            if code == Op.F_NONE:
                dev.discard((s, _A))
            dev.add((s + 1, _ABAR if code == Op.F_ALL else _A))   # kept if resident
        elif code in (Op.LOSS, Op.B):
            k = self.n if code == Op.LOSS else s
            if code == Op.B:
                dev.discard((s + 1, _ABAR))
                self.g_dev.add(s)
            if (k, _A) in dev and (k, _ABAR) not in dev:
                dev.discard((k, _A))       # a plain input is consumed (Table 2.1)
            self.g = k
        elif code == Op.OFFLOAD:
            self.host.add((s, aux))
        elif code == Op.DELETE:
            dev.discard((s, aux))
        elif code == Op.PREFETCH:
            dev.add((s, aux))
        elif code in (Op.W_OFFLOAD, Op.W_DELETE):
            self.w_dev.discard(s)
        elif code == Op.W_PREFETCH:
            self.w_dev.add(s)
        else:   # G_OFFLOAD
            self.g_dev.discard(s)

    def progress(self):
        """The next operation of a greedy finish (None once the backward pass is
        over): bring back or recompute, from the nearest resident or host copy,
        what the next backward step needs."""
        if self.g == 0:
            return None
        if self.g == self.n + 1:
            return self._need_either(self.n) or (Op.LOSS, 0, 0)
        s = self.g - 1
        return (self._need_weights(s) or self._need_abar(s + 1) or self._need_either(s)
                or (Op.B, s, 0))

    def _need_weights(self, s: int):
        return None if s in self.w_dev else (Op.W_PREFETCH, s, 0)

    def _need_abar(self, k: int):
        if (k, _ABAR) in self.dev:
            return None
        if (k, _ABAR) in self.host:
            return (Op.PREFETCH, k, _ABAR)
        return self._produce(k, Op.F_ALL)

    def _need_either(self, k: int):
        if self._either(k):
            return None
        # k > 0: a_0 is never lost (_Walk._keeps)
        return self._host_copy(k) or self._produce(k, Op.F_CK)

    def _host_copy(self, k: int):
        """The prefetch of a host copy of a_k or abar_k, if there is one."""
        for kind in (_A, _ABAR):
            if (k, kind) in self.host:
                return (Op.PREFETCH, k, kind)
        return None

    def _produce(self, k: int, op):
        """The next step toward running ``op`` on stage k-1 to make a_k / abar_k:
        down the chain to the nearest resident or host copy. A loop: as a
        recursion through _need_either it raised RecursionError on chains of
        ~500 stages (max_steps=0 draws nothing, so any length is usable)."""
        while True:
            s = k - 1
            step = self._need_weights(s)
            if step is None and self._either(s):
                # a flagged stage runs once, as F_all (its B needs abar_{s+1})
                return (Op.F_ALL if s in self.flagged else op, s, 0)
            step = step or self._host_copy(s)
            if step is not None:
                return step
            k, op = s, Op.F_CK     # s > 0: a_0 is never lost (_Walk._keeps)


def wandering_schedules(chain: Chain | int, *, max_steps: int | None = None,
                        transfers: bool = True, weights: bool = True):
    """Strategy for schedules of ``chain`` (a :class:`~rtmem.planners.Chain` or a
    stage count) that the simulator accepts with enough memory, drawn by a
    random walk over every allowed operation (module docstring). A stage that
    ``chain.no_recompute`` flags runs its forward once, as ``F_all``.

    Up to ``max_steps`` (default ``6 n + 8``) operations are drawn, each as a
    kind (the greedy step, a compute operation, an activation move, a weight or
    gradient move) and then one operation of that kind allowed in the current
    state; a greedy finish then completes the backward pass, after which (with
    ``weights``) up to two weight or gradient moves may follow ``B 0``
    (``g_offload 0``, a last weight move; at most ``max_steps``). The greedy
    step is
    choice 0, so failures shrink toward the shortest schedule. ``transfers``
    allows activation offload / delete / prefetch, ``weights`` weight and
    gradient moves. Each step takes a draw from Hypothesis's input buffer: keep
    chains to a few dozen stages. Invalid arguments raise
    :class:`~hypothesis.errors.InvalidArgument` (also a ValueError) when this
    is called.
    """
    check_flags("wandering_schedules", transfers=transfers, weights=weights)
    n = chain.n if isinstance(chain, Chain) else chain
    if not is_int(n) or n < 1:
        raise StrategyArgumentError(f"wandering_schedules: chain must be a Chain or a "
                                    f"stage count >= 1, got {chain!r}")
    steps = 6 * n + 8 if max_steps is None else max_steps
    if not is_int(steps) or steps < 0:
        raise StrategyArgumentError(f"wandering_schedules: max_steps must be an integer "
                                    f">= 0, got {max_steps!r}")
    return _wandering_schedules(chain, max_steps=max_steps, transfers=transfers,
                                weights=weights)


@st.composite
@public_name("wandering_schedules")
def _wandering_schedules(draw, chain, *, max_steps=None, transfers=True, weights=True):
    # the arguments as given (the strategy's repr shows them), checked above
    n = int(chain.n if isinstance(chain, Chain) else chain)
    steps = 6 * n + 8 if max_steps is None else int(max_steps)
    flagged = (chain.no_recompute.nonzero()[0].tolist() if isinstance(chain, Chain)
               else ())
    walk, ops = _Walk(n, flagged), []
    for _ in range(draw(st.integers(0, steps))):
        greedy = walk.progress()
        if greedy is None:
            break
        # a kind first, then one of its operations: drawn from one list of all,
        # the weight moves (2 n of them at any time) would crowd out the rest
        compute, moves, weight_moves = walk.legal()
        kinds = [m for m, on in ((compute, True), (moves, transfers),
                                 (weight_moves, weights)) if on and m]
        kind = draw(st.integers(0, len(kinds)))        # 0: the greedy step
        op = greedy if kind == 0 else kinds[kind - 1][draw(
            st.integers(0, len(kinds[kind - 1]) - 1))]
        walk.apply(op)
        ops.append(op)
    while (op := walk.progress()) is not None:
        walk.apply(op)
        ops.append(op)
    if weights and steps:
        # after B 0 only weight and gradient moves remain (g_offload 0, a last
        # weight move): without these draws no schedule had them. None with
        # max_steps=0, which draws nothing (a 600-stage find() then shrank for
        # minutes, each try replaying the greedy walk)
        for _ in range(draw(st.integers(0, min(2, steps)))):
            weight_moves = walk.legal()[2]
            if not weight_moves:
                break
            op = weight_moves[draw(st.integers(0, len(weight_moves) - 1))]
            walk.apply(op)
            ops.append(op)
    return Schedule.from_ops(ops)
