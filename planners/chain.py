"""The chain model shared by every planner.

NOTE [ Chain notation ]
A chain has ``n`` stages (0-based here, 1-based in the thesis: our stage ``i`` is
the thesis' layer ``i+1``), followed by a loss. Stage ``i`` reads activation ``i``
and writes activation ``i+1``; activation 0 is the chain input.

- ``u_f[i]``, ``u_b[i]`` (seconds): forward / backward time of stage ``i``
  (u_{F_l}, u_{B_l} in thesis-remat.md §3.1).
- ``x[i]`` (bytes): size of the stage output a_{i+1}; also the size of the gradient
  delta_{i+1} flowing back into it (erratum 13 of thesis-remat.md: delta = a is
  assumed by every recurrence).
- ``xbar[i]`` (bytes): everything the stage's backward needs from its forward,
  output included (abar_{i+1}); ``xbar >= x``.
- ``x0`` (bytes): the chain input a_0 (abar_0 = a_0 by convention).
- ``w[i]`` (bytes): weights of the stage; its weight gradient has the same size.
- ``o_f[i]``, ``o_b[i]`` (bytes): temporary memory of forward / backward.
- ``u_loss`` (s), ``o_loss`` (bytes): time and overhead of the loss (forward and
  backward together); the loss turns a_n into delta_n, whose size is ``x[-1]``.
- ``no_recompute[i]`` (bool): stage ``i`` must run its forward exactly once per
  step (as ``F_all i``): it modifies its input a_i in place, so a second forward
  would read the modified a_i. Not in the thesis; the simulator refuses a
  schedule that breaks it and plan_remat's DP never splits a segment that would
  recompute such a stage (NOTE [ Persistent DP C_MP ]).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace

import numpy as np

from rtmem.errors import ChainError

from ._documents import JsonFile, check_document, is_json_number, parse_document
from ._validation import MAX_BYTES, _not_a_number, as_scalar, as_vector, check_int, check_time_bound

__all__ = ["Chain"]

_FORMAT = "rtmem.chain"
_VERSION = 1
_ARRAYS = ("u_f", "u_b", "x", "xbar", "w", "o_f", "o_b")
_SIZES = frozenset({"x", "xbar", "w", "o_f", "o_b"})


@dataclass(frozen=True, eq=False)
class Chain(JsonFile):
    """A sequential network as the planners see it: per-stage times and sizes.

    Parameters
    ----------
    u_f, u_b:
        Forward and backward time of each stage, seconds (>= 0, finite).
    x:
        Size of each stage's output activation, bytes.
    xbar:
        Size of everything each stage saves for its backward (output included),
        bytes; must be >= ``x`` stage by stage.
    w:
        Weight bytes per stage (default 0). Weight gradients are the same size.
    x0:
        Size of the chain input, bytes (default 0).
    o_f, o_b:
        Temporary memory of each forward / backward, bytes (default 0).
    u_loss, o_loss:
        Loss time (s) and temporary memory (bytes), default 0.
    no_recompute:
        Per stage, True when the stage must never be recomputed (its forward
        runs once per step, as ``F_all``): a stage that modifies its input in
        place, which :func:`~rtmem.torch.profile_sequential` sets. Default: all
        False. Booleans (or 0/1) only.
    name:
        Free-form label used in tables and plots.

    All arrays are validated on construction: same length, at least one stage,
    numbers (a bool or a string, which numpy would convert, is refused; bool
    and string arrays by their dtype), finite and non-negative; a
    :class:`~rtmem.errors.ChainError` names the field and the first bad index.
    Byte sizes are stored as int64 (rounded up), times as float64. See
    ``NOTE [ Chain notation ]`` in this module for the mapping to the thesis'
    notation.
    """

    u_f: np.ndarray
    u_b: np.ndarray
    x: np.ndarray
    xbar: np.ndarray
    w: np.ndarray = None
    x0: int = 0
    o_f: np.ndarray = None
    o_b: np.ndarray = None
    u_loss: float = 0.0
    o_loss: int = 0
    name: str = field(default="")
    no_recompute: np.ndarray = None

    _DOCUMENT = ("chain", ChainError)

    def __post_init__(self):
        u_f = as_vector("u_f", self.u_f, None, integral=False)
        n = u_f.shape[0]
        if n == 0:
            raise ChainError("a chain needs at least one stage; u_f is empty", field="u_f")
        values = {"u_f": u_f}
        for name in _ARRAYS[1:]:
            raw = getattr(self, name)
            if raw is None:
                if name in ("u_b", "x", "xbar"):
                    raise ChainError(f"{name} is required", field=name)
                raw = np.zeros(n)
            values[name] = as_vector(name, raw, n, integral=name in _SIZES)
        bad = np.flatnonzero(values["xbar"] < values["x"])
        if bad.size:
            i = int(bad[0])
            raise ChainError(
                f"xbar[{i}] = {values['xbar'][i]} < x[{i}] = {values['x'][i]}: what a stage "
                "saves for backward includes its output, so xbar must be >= x",
                field="xbar", index=i)
        for name, arr in values.items():
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "x0", as_scalar("x0", self.x0, integral=True))
        object.__setattr__(self, "u_loss", as_scalar("u_loss", self.u_loss, integral=False))
        object.__setattr__(self, "o_loss", as_scalar("o_loss", self.o_loss, integral=True))
        # The simulator and the DPs add these up in int64: keep every total in range
        # (Python ints here, so the check itself cannot overflow). This bounds the
        # peak of any schedule: a_k and abar_k both resident, the current delta,
        # and an op's output (abar, or delta_0 of the size of a_0) and overhead.
        # Without sum(x) and the two maxima a chain could need more than the
        # 2**62 bytes that stand for unlimited memory: every planner then raised
        # a ScheduleError (even at budget "inf"), not an InfeasibleError.
        total = (self.x0 + self.o_loss + sum(int(v) for v in values["xbar"])
                 + sum(int(v) for v in values["x"])
                 + int(values["x"].max()) + max(int(values["xbar"].max()), self.x0)
                 + 2 * sum(int(v) for v in values["w"]) + int(values["o_f"].max())
                 + int(values["o_b"].max()))
        if total >= MAX_BYTES:
            raise ChainError(f"the chain's sizes add up to {total:,} bytes, beyond the "
                             f"2**62 the planners count in; express sizes in larger units "
                             f"or use fewer stages", field="xbar")
        # Times are summed in float64 by the simulator and the DPs: bound the
        # makespan of any planner's schedule (the multi-chain and Revolve DPs check
        # their step times with the same bound)
        with np.errstate(over="ignore"):     # a sum that overflows is refused below
            sum_f, sum_b = float(values["u_f"].sum()), float(values["u_b"].sum())
        check_time_bound(n, sum_f, sum_b, self.u_loss, what="the chain's times",
                         formula="(n + 1) * sum(u_f) + sum(u_b) + u_loss",
                         values=f"sum(u_f) = {sum_f:.3g} s, sum(u_b) = {sum_b:.3g} s, "
                                f"u_loss = {self.u_loss:.3g} s, {n} stages")
        object.__setattr__(self, "name", str(self.name))
        object.__setattr__(self, "no_recompute", _flags(self.no_recompute, n))

    # ------------------------------------------------------------------ basics
    @property
    def n(self) -> int:
        """Number of stages (the loss not included)."""
        return int(self.u_f.shape[0])

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return (f"<Chain{label}: {self.n} stages, compute {self.compute_time:.4g} s, "
                f"sum(xbar) {int(self.xbar.sum())} B, weights {int(self.w.sum())} B>")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Chain):
            return NotImplemented
        return (all(np.array_equal(getattr(self, a), getattr(other, a)) for a in _ARRAYS)
                and np.array_equal(self.no_recompute, other.no_recompute)
                and (self.x0, self.u_loss, self.o_loss, self.name)
                == (other.x0, other.u_loss, other.o_loss, other.name))

    __hash__ = None

    @property
    def compute_time(self) -> float:
        """Sum of all forward and backward times plus the loss, seconds: the
        makespan of training without recomputation or waiting."""
        return float(self.u_f.sum() + self.u_b.sum() + self.u_loss)

    def activation_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Sizes (bytes) of a_k and abar_k for k = 0..n (index 0 is the input)."""
        a = np.concatenate(([self.x0], self.x)).astype(np.int64)
        abar = np.concatenate(([self.x0], self.xbar)).astype(np.int64)
        return a, abar

    # ----------------------------------------------------------- constructors
    @classmethod
    def homogeneous(cls, n: int, *, u_f: float = 1.0, u_b: float = 1.0, x: int = 1,
                    xbar: int | None = None, x0: int | None = None, w: int = 0,
                    u_loss: float = 0.0, name: str = "") -> "Chain":
        """A chain of ``n`` identical stages (the Revolve setting).

        ``xbar`` defaults to ``x`` and ``x0`` to ``x`` (unit sizes everywhere).
        """
        n = check_int("n", n, low=1, error=ChainError, field="n")
        xbar = x if xbar is None else xbar
        x0 = x if x0 is None else x0
        return cls(u_f=[u_f] * n, u_b=[u_b] * n, x=[x] * n, xbar=[xbar] * n, w=[w] * n,
                   x0=x0, u_loss=u_loss, name=name or f"homogeneous-{n}")

    def select(self, stages, *, name: str | None = None) -> "Chain":
        """A chain made of the given stages of this one, in the given order.

        ``stages`` lists 0-based stage indices; an index may repeat (stretching
        a profiled block to more layers: ``chain.select([0, 1, 1, 1, 2])``).
        Every per-stage field (times, sizes, ``no_recompute`` and any field a
        chain gains later) is taken from the stage selected; ``x0``, ``u_loss``
        and ``o_loss`` are kept. ``name`` defaults to this chain's name.

        ``x0`` is kept as it is, so the first stage selected should be one that
        reads an input of that size (``dataclasses.replace`` the result to change
        it). An index out of range, or not an integer, is a ChainError.
        """
        idx = np.asarray(stages)
        if idx.ndim != 1 or idx.size == 0:
            raise ChainError(f"select needs a non-empty list of stage indices, got shape "
                             f"{idx.shape}", field="stages")
        if idx.dtype.kind not in "iu":
            raise ChainError(f"stage indices must be integers, got dtype {idx.dtype} "
                             f"({idx.tolist()[:5]}...)", field="stages")
        bad = np.flatnonzero((idx < 0) | (idx >= self.n))
        if bad.size:
            i = int(bad[0])
            raise ChainError(f"stage index {int(idx[i])} (position {i}) is out of range for "
                             f"a chain of {self.n} stages (0..{self.n - 1})",
                             field="stages", index=i)
        # every array field is per stage (x0, u_loss, o_loss are scalars): take
        # them all by type, so a per-stage field added later is not dropped
        per_stage = {f.name: getattr(self, f.name)[idx] for f in fields(self)
                     if isinstance(getattr(self, f.name), np.ndarray)}
        return replace(self, **per_stage, name=self.name if name is None else name)

    @property
    def recomputable(self) -> bool:
        """Whether every stage may be recomputed (no ``no_recompute`` flag set)."""
        return not self.no_recompute.any()

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """Plain-Python form (lists and numbers) used by :meth:`to_json`."""
        d = {"format": _FORMAT, "version": _VERSION, "name": self.name, "n": self.n,
             "x0": self.x0, "u_loss": self.u_loss, "o_loss": self.o_loss}
        for a in _ARRAYS:
            d[a] = getattr(self, a).tolist()
        if self.no_recompute.any():   # documents of chains without it are unchanged
            d["no_recompute"] = self.no_recompute.tolist()
        return d

    def to_json(self, indent: int | None = None) -> str:
        """Serialize to a JSON string; :meth:`from_json` reads it back exactly."""
        return json.dumps(self.to_dict(), indent=indent)

    def digest(self) -> str:
        """SHA-256 (64 hex digits) of this chain's numbers: of :meth:`to_json`'s
        document (no indent) with ``name`` left empty, so that two chains have the
        same digest exactly when they are equal but for their labels. Every
        planner records it in ``Plan.info["chain_sha256"]``, which
        :meth:`Plan.check_chain <rtmem.planners.Plan.check_chain>` compares: a
        chain edited or profiled again (its times or sizes changed) has another
        one."""
        d = self.to_dict()
        d["name"] = ""      # a label: renaming a chain leaves its plans valid
        return hashlib.sha256(json.dumps(d).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d) -> "Chain":
        """Build a chain from :meth:`to_dict` output. Unknown keys are an error, and
        so are times and sizes that are not JSON numbers (``"32768"``, ``true``,
        ``null``): a :class:`~rtmem.errors.ChainError` names ``field[index]``."""
        check_document(d, kind="chain", fmt=_FORMAT, version=_VERSION, error=ChainError,
                       lenient=True)
        known = set(_ARRAYS) | {"format", "version", "name", "n", "x0", "u_loss", "o_loss",
                                "no_recompute"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ChainError(f"unknown chain field(s) {unknown}; known fields are "
                             f"{sorted(known)}")
        missing = [k for k in ("u_f", "u_b", "x", "xbar") if k not in d]
        if missing:
            raise ChainError(f"chain document lacks the field(s) {missing}; a chain needs "
                             f"u_f, u_b, x and xbar (see Chain.to_dict)", field=missing[0])
        _check_document_values(d)
        kwargs = {k: d[k] for k in known - {"format", "version", "n"} if k in d}
        chain = cls(**kwargs)
        # a string "3" said "n = 3 but its arrays have 3 stages"; true passed as 1
        if "n" in d and (type(d["n"]) is not int or d["n"] != chain.n):
            raise ChainError(f"chain document says n = {d['n']!r} but its arrays have "
                             f"{chain.n} stages", field="n")
        return chain

    @classmethod
    def from_json(cls, text: str) -> "Chain":
        """Parse a chain from a JSON string (see :meth:`to_json`)."""
        return cls.from_dict(parse_document(text, kind="chain", fmt=_FORMAT, version=_VERSION,
                                            error=ChainError, lenient=True))


def _check_document_values(d: dict) -> None:
    """ChainError unless the times, sizes and name of chain document ``d`` have the
    JSON types :meth:`Chain.to_dict` writes. The constructor converts what numpy
    and ``float()`` convert, so a hand-edited file's ``true`` was read as 1 byte,
    ``"32768"`` as a number and ``null`` reported as ``nan``."""
    for key in _ARRAYS:
        values = d.get(key)
        if isinstance(values, (list, tuple)):
            for i, v in enumerate(values):
                if not is_json_number(v):
                    raise _not_a_number(key, v, i, not key.startswith("u_"), document=True)
    for key in ("x0", "u_loss", "o_loss"):
        if key in d and not is_json_number(d[key]):
            raise _not_a_number(key, d[key], None, key != "u_loss", document=True)
    if "name" in d and not isinstance(d["name"], str):
        raise ChainError(f"name = {json.dumps(d['name'], default=repr)} must be a string "
                         f"(the chain's label)", field="name")


def _flags(raw, n: int) -> np.ndarray:
    """``no_recompute`` as a read-only bool array of ``n`` entries (all False for
    None); anything but booleans or 0/1 of the right length is a ChainError."""
    if raw is None:
        flags = np.zeros(n, bool)
    else:
        arr = np.asarray(raw)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise ChainError(f"no_recompute must have one entry per stage ({n}), got "
                             f"shape {arr.shape}", field="no_recompute")
        if arr.dtype != bool:
            values = arr.tolist()
            bad = [i for i, v in enumerate(values)
                   if type(v) not in (bool, int) or v not in (0, 1)]
            if bad:
                raise ChainError(f"no_recompute[{bad[0]}] = {values[bad[0]]!r}: each entry must "
                                 f"be True or False", field="no_recompute", index=bad[0])
        flags = arr.astype(bool)
    flags.setflags(write=False)
    return flags
