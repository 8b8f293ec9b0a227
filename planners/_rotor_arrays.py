"""The DP stage arrays of rotor's passes (:class:`StageArrays`, in bytes from
:func:`stage_arrays`, in slots from :func:`discretize`) and the pieces both
passes share: the persistent table's (planners/rotor.py) and the least memory's
(planners/_rotor_min_memory.py). The names are those of NOTE [ Persistent DP
C_MP ] in planners/rotor.py, which re-exports the public ones; split from it
so that each pass reads on its own.
"""

from __future__ import annotations

import numba
import numpy as np

from rtmem.errors import ChainError

from .chain import Chain
from .schedule import Op


_F_NONE, _F_CK, _F_ALL, _LOSS, _B = (int(Op.F_NONE), int(Op.F_CK), int(Op.F_ALL),
                                     int(Op.LOSS), int(Op.B))


@numba.njit(cache=True)
def _emit_leaf(ops, stages, n_ops, s, last):
    """Write the operations of the one-stage interval (s, s) of the jitted schedule
    walks at position ``n_ops`` of ``ops`` / ``stages``: the loss when ``s`` is
    ``last`` (the loss's DP stage), else F_all s then B s. Returns the new count."""
    if s == last:
        ops[n_ops], stages[n_ops] = _LOSS, 0
        return n_ops + 1
    ops[n_ops], stages[n_ops] = _F_ALL, s
    ops[n_ops + 1], stages[n_ops + 1] = _B, s
    return n_ops + 2


class StageArrays:
    """Per-DP-stage arrays (N = n+1 entries, the loss last), as NOTE
    [ Persistent DP C_MP ] (planners/rotor.py) names them.

    Times ``uf``, ``ub`` in seconds (float64); sizes ``xin``, ``xo``, ``xb``,
    ``of``, ``ob``, ``w``, ``G`` in bytes or in slots (int64), depending on
    whether it came from :func:`stage_arrays` or :func:`discretize`.
    ``Gb[k]`` = G[k] + w[k] (weight gradients present while B_k runs).
    ``nr[k]`` (int64): the first stage >= k that must not be recomputed (N: none).
    The DP passes check these (``_check_stage_arrays``: N entries each, integer
    sizes >= 0) before their jitted loops index them, and raise ChainError.
    """

    __slots__ = ("uf", "ub", "xin", "xo", "xb", "of", "ob", "G", "Gb", "nr")

    def __init__(self, uf, ub, xin, xo, xb, of, ob, G, Gb, nr=None):
        self.uf, self.ub = uf, ub
        self.xin, self.xo, self.xb, self.of, self.ob, self.G, self.Gb = \
            xin, xo, xb, of, ob, G, Gb
        # nr[s]: the first DP stage >= s the chain marks no_recompute, N if none
        N = uf.shape[0]
        self.nr = np.full(N, N, np.int64) if nr is None else nr

    @property
    def N(self) -> int:
        return int(self.uf.shape[0])


_TIMES = ("uf", "ub")
_SIZES = ("xin", "xo", "xb", "of", "ob", "G", "Gb")


def _check_stage_arrays(arrays: StageArrays, who: str) -> None:
    """Raise :class:`~rtmem.errors.ChainError` unless ``arrays`` has what the jitted
    passes index blindly: every field a 1-D array of N entries, the times real,
    the sizes and ``nr`` integers, the sizes non-negative (a negative one moves a
    memory index past the table), ``nr`` the first-flagged-stage index
    :func:`stage_arrays` makes. O(N); ``who`` names the caller in the message.
    :func:`stage_arrays` and :func:`discretize` of a valid Chain always pass."""
    N = arrays.N if getattr(arrays.uf, "ndim", 0) == 1 else None
    for name in _TIMES + _SIZES + ("nr",):
        arr = getattr(arrays, name)
        kinds = "f" if name in _TIMES else "iu"
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds \
                or (N is not None and arr.shape[0] != N) or N == 0:
            got = (f"{arr.dtype} of shape {arr.shape}" if isinstance(arr, np.ndarray)
                   else type(arr).__name__)
            raise ChainError(
                f"{who}: StageArrays.{name} must be a 1-D {'float' if kinds == 'f' else 'integer'}"
                f" array of N = {N} >= 1 entries (as uf), got {got}; build the arrays with "
                "stage_arrays(chain) or discretize()")
    for name in _SIZES:
        arr = getattr(arrays, name)
        if arr.min() < 0:
            k = int(np.argmax(arr < 0))
            raise ChainError(f"{who}: StageArrays.{name}[{k}] = {int(arr[k])} is negative; "
                             "sizes are bytes or slots, >= 0")
    # nr[k] is the first no_recompute stage at or after k (N if none): k itself or
    # nr[k + 1]. Out of range it cannot index past anything (the passes only take
    # min(t, nr[s])), but it silently hides the flag, and a flagged stage would be
    # planned to run twice.
    nr, ks = arrays.nr, np.arange(arrays.N)
    ok = (nr == ks) | (nr == np.append(nr[1:], arrays.N))
    ok[-1] = nr[-1] == arrays.N        # the loss (stage N - 1) is never flagged
    if not ok.all():
        k = int(np.argmin(ok))
        raise ChainError(f"{who}: StageArrays.nr[{k}] = {int(nr[k])} is not the first "
                         f"no_recompute stage at or after {k} (it must be {k} or nr[{k + 1}], "
                         f"and nr[{arrays.N - 1}] = N = {arrays.N}); build the arrays with "
                         "stage_arrays(chain) or discretize()")


def stage_arrays(chain: Chain) -> StageArrays:
    """Byte-level DP arrays of ``chain`` (loss appended as DP stage n)."""
    i64 = np.int64
    uf = np.append(chain.u_f, chain.u_loss).astype(np.float64)
    ub = np.append(chain.u_b, 0.0).astype(np.float64)
    xo = np.append(chain.x, 0).astype(i64)
    xb = np.append(chain.xbar, 0).astype(i64)
    xin = np.concatenate(([chain.x0], chain.x)).astype(i64)
    of = np.append(chain.o_f, 0).astype(i64)
    ob = np.append(chain.o_b, chain.o_loss).astype(i64)
    w = np.append(chain.w, 0).astype(i64)
    suffix = np.concatenate((np.cumsum(w[::-1])[::-1], [0])).astype(i64)
    G = suffix[1:]                     # sum_{j > k} w[j]
    Gb = suffix[:-1]                   # sum_{j >= k} w[j]
    N = uf.shape[0]
    nr = np.full(N, N, i64)
    for k in range(N - 2, -1, -1):     # the loss (N - 1) is never flagged
        nr[k] = k if chain.no_recompute[k] else nr[k + 1]
    return StageArrays(uf, ub, xin, xo, xb, of, ob, G, Gb, nr)


def discretize(arrays: StageArrays, slot: int) -> StageArrays:
    """Every size rounded up to whole slots of ``slot`` bytes (thesis §3.7)."""
    slot = int(slot)

    def up(v):
        return -(-v // slot)
    return StageArrays(arrays.uf, arrays.ub, up(arrays.xin), up(arrays.xo), up(arrays.xb),
                       up(arrays.of), up(arrays.ob), up(arrays.G), up(arrays.Gb), arrays.nr)


def pair_index(N: int) -> np.ndarray:
    """``idx[s, t]`` = row of pair (s, t), s <= t, in a persistent table (-1 if s > t)."""
    # column-major: the rows (s', t) for one t are adjacent, so the fill's reads of
    # the tails C(s'+1, t, .) for s' = s..t-1 stream through memory
    idx = np.full((N, N), -1, np.int64)
    k = 0
    for t in range(N):
        for s in range(t + 1):
            idx[s, t] = k
            k += 1
    return idx


# ------------------------------------------- shared by the two passes' drivers
def _reconstruct_capacity(N: int) -> int:
    """Most operations rotor.py's :func:`_reconstruct` writes for N DP stages."""
    return N * (N + 1) // 2 + 2 * N + 2


def _bands(N: int):
    """Bands ``(s_hi, s_lo, fraction done after it)`` of rows s, descending, of
    about equal work (row s of an O(N^3) fill costs ~ (N - s)^2): ~50 of them, for
    progress reports between jitted calls."""
    total = float(N) ** 3 / 3
    done, s_hi, band = 0.0, N - 1, total / 50
    while s_hi >= 0:
        s_lo, work = s_hi, 0.0
        while s_lo > 0 and work < band:
            work += float(N - s_lo) ** 2
            s_lo -= 1
        done += sum(float(N - s) ** 2 for s in range(s_lo, s_hi + 1))
        yield s_hi, s_lo, min(1.0, done / total)
        s_hi = s_lo - 1
