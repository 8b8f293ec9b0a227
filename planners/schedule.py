"""Schedules: typed operation sequences stored as numpy arrays.

A :class:`Schedule` is three parallel arrays (``op``, ``stage``, ``aux``) so that
jitted code (the simulator, planners' reconstruction) can walk it without Python
objects, plus a readable text form that parses back::

    F_ck 0, F_none 1, F_all 2, L, B 2, F_all 1, B 1, F_all 0, B 0

Operation vocabulary (see NOTE [ Chain notation ] in chain.py for indices):

===============  ===========  ==================================================
text             code         meaning
===============  ===========  ==================================================
``F_none i``     F_NONE       forward of stage i, input a_i dropped (F^∅)
``F_ck i``       F_CK         forward of stage i, input kept (F^ck)
``F_all i``      F_ALL        forward of stage i keeping everything B i needs (F^all)
``L``            LOSS         loss forward+backward: a_n -> delta_n
``B i``          B            backward of stage i: delta_{i+1} -> delta_i
``delete a3``    DELETE       drop the device copy of a_3 (``abar3`` for abar_3)
``offload a3``   OFFLOAD      copy a_3 device -> host (device copy stays)
``prefetch a3``  PREFETCH     copy a_3 host -> device
``w_offload i``  W_OFFLOAD    copy weights of stage i to host, then free them
``w_delete i``   W_DELETE     free the device weights of stage i (host is master)
``w_prefetch i`` W_PREFETCH   copy weights of stage i host -> device
``g_offload i``  G_OFFLOAD    move the weight gradient of stage i to host
===============  ===========  ==================================================

Codes 32 and above are reserved for pipeline operations.
"""

from __future__ import annotations

import json
import os
import re
from enum import IntEnum

import numpy as np

from rtmem.errors import ScheduleError

from ._documents import naming_file, parse_document, read_text, write_text

__all__ = ["Op", "Schedule"]


class Op(IntEnum):
    """Operation codes stored in :attr:`Schedule.op` (int8)."""

    F_NONE = 0
    F_CK = 1
    F_ALL = 2
    LOSS = 3
    B = 4
    DELETE = 5
    OFFLOAD = 6
    PREFETCH = 7
    W_OFFLOAD = 8
    W_DELETE = 9
    W_PREFETCH = 10
    G_OFFLOAD = 11


#: Ops that run on the compute stream (the rest are transfers or frees).
COMPUTE_OPS = frozenset({Op.F_NONE, Op.F_CK, Op.F_ALL, Op.LOSS, Op.B})
#: Ops whose ``stage`` field is an activation index and ``aux`` says a (0) or abar (1).
ACTIVATION_OPS = frozenset({Op.DELETE, Op.OFFLOAD, Op.PREFETCH})

_STAGE_NAMES = {Op.F_NONE: "F_none", Op.F_CK: "F_ck", Op.F_ALL: "F_all", Op.B: "B",
                Op.W_OFFLOAD: "w_offload", Op.W_DELETE: "w_delete",
                Op.W_PREFETCH: "w_prefetch", Op.G_OFFLOAD: "g_offload"}
#: Kinds of operation code, for Schedule's checks: _KIND[code] for 0 <= code <
#: _CODE_LIMIT, and _KIND[_CODE_LIMIT] (unknown) for every other code.
_UNKNOWN, _ORDINARY, _ACTIVATION, _LOSS_KIND = 0, 1, 2, 3
_CODE_LIMIT = max(Op) + 1
_KIND = np.full(_CODE_LIMIT + 1, _UNKNOWN, np.int8)
_KIND[[int(o) for o in Op]] = _ORDINARY
_KIND[[int(o) for o in ACTIVATION_OPS]] = _ACTIVATION
_KIND[int(Op.LOSS)] = _LOSS_KIND
_KIND.setflags(write=False)

_ACT_NAMES = {Op.DELETE: "delete", Op.OFFLOAD: "offload", Op.PREFETCH: "prefetch"}
_PARSE_STAGE = {v.lower(): k for k, v in _STAGE_NAMES.items()}
_PARSE_STAGE.update({"f_∅": Op.F_NONE, "fnone": Op.F_NONE, "fck": Op.F_CK,
                     "fall": Op.F_ALL, "f_ø": Op.F_NONE})
_PARSE_ACT = {v: k for k, v in _ACT_NAMES.items()}
#: Every first word (lower case) an operation of the text form may start with.
OP_WORDS = frozenset(_PARSE_STAGE) | frozenset(_PARSE_ACT) | {"l", "loss"}
_ACT_RE = re.compile(r"^(a|abar)([0-9]+)$")
_DIGITS = re.compile(r"[0-9]+")      # ASCII only: str.isdigit also accepts "²", "٣"
_FORMAT = "rtmem.schedule"
_VERSION = 1


def _op_text(op: int, stage: int, aux: int) -> str:
    op = Op(op)
    if op == Op.LOSS:
        return "L"
    if op in _ACT_NAMES:
        return f"{_ACT_NAMES[op]} {'abar' if aux else 'a'}{stage}"
    return f"{_STAGE_NAMES[op]} {stage}"


def _int_array(name: str, values) -> np.ndarray:
    """``values`` as int64, refusing what a cast would change: a stage of 1.7 was
    silently truncated to 1, and a string "3" parsed."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"{name} must be an array of integers ({e})",
                            reason="malformed") from None
    if arr.dtype.kind in "iub" or (arr.size == 0 and arr.dtype.kind == "f"):
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (np.abs(arr) >= 2.0**62)
        if not bad.any():
            return arr.astype(np.int64)
        k = int(np.flatnonzero(bad.ravel())[0])
        raise ScheduleError(f"{name}[{k}] = {float(arr.ravel()[k])!r} is not an integer; "
                            "operation codes and indices are whole numbers",
                            op_index=k if arr.ndim == 1 else None, reason="malformed")
    raise ScheduleError(f"{name} must be an array of integers, got dtype {arr.dtype}",
                        reason="malformed")


def _quoted(token: str, limit: int = 60) -> str:
    """``repr(token)``, cut short: an unreadable 200 kB line (a JSON file given
    as schedule text) went whole into the error message."""
    return repr(token) if len(token) <= limit else repr(token[:limit - 3] + "...")


class Schedule:
    """An immutable sequence of operations.

    Parameters
    ----------
    op, stage, aux:
        Parallel 1-D arrays: operation code (:class:`Op`), stage index (or
        activation index for ``delete``/``offload``/``prefetch``; stored as 0 for
        the loss, which has none), and the kind
        of activation for those (0: a, 1: abar; 0 for every other op).

    Build one from text with :meth:`from_text`, from ``(Op, stage[, aux])`` tuples
    with :meth:`from_ops`, or from JSON with :meth:`from_json`. ``str(schedule)``
    gives the text form. Stage ranges are checked against a chain by the
    simulator; here only the codes and signs are checked.
    """

    __slots__ = ("op", "stage", "aux")

    def __init__(self, op, stage, aux=None):
        op = _int_array("op", op)
        stage = _int_array("stage", stage)
        aux = np.zeros_like(op) if aux is None else _int_array("aux", aux)
        if not (op.ndim == stage.ndim == aux.ndim == 1) or not (
                op.shape == stage.shape == aux.shape):
            raise ScheduleError(
                f"op, stage and aux must be 1-D arrays of one length, got shapes "
                f"{op.shape}, {stage.shape}, {aux.shape}", reason="malformed")
        # One table lookup per operation gives its kind; np.isin (four calls) was
        # ~40% of plan_sequential's and plan_revolve's time, which build a schedule
        # per segment or slot count. Negative codes seen as uint64 are huge, so one
        # comparison with _CODE_LIMIT sends them (and codes past it) to _UNKNOWN.
        kind = _KIND[np.minimum(op.view(np.uint64), _CODE_LIMIT)]
        if (kind == _UNKNOWN).any():
            k = int(np.flatnonzero(kind == _UNKNOWN)[0])
            raise ScheduleError(
                f"op {k}: unknown operation code {int(op[k])}; valid codes are "
                f"{[f'{o.name}={int(o)}' for o in Op]}", op_index=k, reason="unknown-op")
        # one pass for both bounds (a negative index is huge as uint64); the errors
        # are then told apart in the old order: any negative index first
        if (stage.view(np.uint64) >= 2**31).any():
            if (stage < 0).any():
                k = int(np.flatnonzero(stage < 0)[0])
                raise ScheduleError(f"op {k}: negative stage index {int(stage[k])}",
                                    op_index=k, reason="stage-range")
            # stored as int32 below: would wrap around
            k = int(np.flatnonzero(stage >= 2**31)[0])
            raise ScheduleError(f"op {k}: stage index {int(stage[k])} is beyond any chain "
                                f"(at most 2**31 - 1)", op_index=k, reason="stage-range")
        # The loss has no stage (its text form is a bare "L"): any stage given with
        # it is dropped, so a schedule equals its own text and JSON round trip.
        stage = np.where(kind == _LOSS_KIND, 0, stage)
        # aux is 0 for all but the activation ops (a or abar there): nothing to check
        # when it is 0 throughout, as it is when not given
        if aux.any():
            is_act = kind == _ACTIVATION
            bad = (aux.view(np.uint64) > 1) | ((aux != 0) & ~is_act)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise ScheduleError(
                    f"op {k}: aux = {int(aux[k])} is invalid; aux is 0 (a) or 1 (abar) for "
                    "delete/offload/prefetch and 0 for every other operation",
                    op_index=k, reason="malformed")
            bad = is_act & (aux == 1) & (stage == 0)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise ScheduleError(f"op {k}: abar0 does not exist (abar_0 = a_0 by "
                                    "convention); write a0", op_index=k, reason="malformed")
        self.op = op.astype(np.int8)
        self.stage = stage.astype(np.int32)
        self.aux = aux.astype(np.int8)
        for a in (self.op, self.stage, self.aux):
            a.setflags(write=False)

    # ----------------------------------------------------------------- basics
    def __len__(self) -> int:
        return int(self.op.shape[0])

    def __iter__(self):
        for o, s, a in zip(self.op.tolist(), self.stage.tolist(), self.aux.tolist()):
            yield Op(o), s, a

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Schedule(self.op[k], self.stage[k], self.aux[k])
        return Op(int(self.op[k])), int(self.stage[k]), int(self.aux[k])

    def __eq__(self, other) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (np.array_equal(self.op, other.op) and np.array_equal(self.stage, other.stage)
                and np.array_equal(self.aux, other.aux))

    __hash__ = None

    def __add__(self, other: "Schedule") -> "Schedule":
        if not isinstance(other, Schedule):
            return NotImplemented
        return Schedule(np.concatenate((self.op, other.op)),
                        np.concatenate((self.stage, other.stage)),
                        np.concatenate((self.aux, other.aux)))

    def op_text(self, k: int) -> str:
        """Text of operation ``k`` (e.g. ``'F_ck 3'``)."""
        return _op_text(int(self.op[k]), int(self.stage[k]), int(self.aux[k]))

    def __str__(self) -> str:
        return ", ".join(self.op_text(k) for k in range(len(self)))

    def __repr__(self) -> str:
        text = str(self)
        if len(text) > 120:
            text = text[:117] + "..."
        return f"Schedule({len(self)} ops: {text})"

    def count(self, op: Op) -> int:
        """Number of operations with code ``op``."""
        return int(np.count_nonzero(self.op == int(op)))

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_ops(cls, ops) -> "Schedule":
        """Build from an iterable of ``(Op, stage)`` or ``(Op, stage, aux)``."""
        rows = [tuple(t) + (0,) * (3 - len(t)) for t in ops]
        if not rows:
            return cls(np.zeros(0), np.zeros(0))
        op, stage, aux = zip(*rows)
        return cls(op, stage, aux)

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse the text form (operations separated by commas or new lines).

        Raises :class:`~rtmem.errors.ScheduleError` naming the first token it
        cannot read. ``#`` starts a comment that runs to the end of the line.
        """
        text = "\n".join(line.split("#", 1)[0] for line in str(text).splitlines())
        tokens = [t.strip() for t in re.split(r"[,;\n]", text)]
        tokens = [t for t in tokens if t]
        op = np.empty(len(tokens), np.int64)
        stage = np.empty(len(tokens), np.int64)
        aux = np.zeros(len(tokens), np.int64)
        for k, tok in enumerate(tokens):
            parts = tok.split()
            head = parts[0].lower()
            if head in ("l", "loss"):
                if len(parts) != 1:      # was "unknown operation 'L'", listing L as known
                    raise ScheduleError(f"op {k}: the loss takes no stage; write "
                                        f"{_quoted(parts[0])} alone, not {_quoted(tok)}",
                                        op_index=k, reason="parse")
                op[k], stage[k] = Op.LOSS, 0
                continue
            if len(parts) != 2:
                raise ScheduleError(
                    f"op {k}: cannot read {_quoted(tok)}; expected e.g. 'F_ck 3', 'B 2', "
                    "'L' or 'offload abar4'", op_index=k, reason="parse")
            if head in _PARSE_STAGE:
                if not _DIGITS.fullmatch(parts[1]) or len(parts[1]) > 18:   # int64-safe
                    raise ScheduleError(f"op {k}: stage in {_quoted(tok)} must be a "
                                        "non-negative integer below 10**18", op_index=k,
                                        reason="parse")
                op[k], stage[k] = _PARSE_STAGE[head], int(parts[1])
            elif head in _PARSE_ACT:
                m = _ACT_RE.match(parts[1].lower())
                if m is None or len(m.group(2)) > 18:
                    raise ScheduleError(
                        f"op {k}: {_quoted(parts[1])} in {_quoted(tok)} is not an activation; "
                        "write a<k> or abar<k>, e.g. 'offload abar3'", op_index=k,
                        reason="parse")
                op[k], stage[k] = _PARSE_ACT[head], int(m.group(2))
                aux[k] = 1 if m.group(1) == "abar" else 0
            else:
                raise ScheduleError(
                    f"op {k}: unknown operation {_quoted(parts[0])} in {_quoted(tok)}; known: "
                    "F_none, F_ck, F_all, B, L, delete, offload, prefetch, w_offload, "
                    "w_delete, w_prefetch, g_offload", op_index=k, reason="unknown-op")
        return cls(op, stage, aux)

    # ------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """JSON document holding the text form; :meth:`from_json` reads it back."""
        return json.dumps({"format": _FORMAT, "version": _VERSION, "n_ops": len(self),
                           "ops": str(self)})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Parse a schedule JSON document (see :meth:`to_json`)."""
        d = parse_document(text, kind="schedule", fmt=_FORMAT, version=_VERSION,
                           error=ScheduleError, required=("ops",), optional=("n_ops",),
                           reason="parse")
        if not isinstance(d["ops"], str):
            raise ScheduleError(f"schedule document: ops must be the text form (a string), "
                                f"got {d['ops']!r}", reason="parse")
        sched = cls.from_text(d["ops"])
        # a string "3" or true is not a count (it said "n_ops = 1 but holds 1")
        n_ops = d.get("n_ops", len(sched))
        if type(n_ops) is not int or n_ops != len(sched):
            raise ScheduleError(f"schedule document says n_ops = {n_ops!r} but holds "
                                f"{len(sched)} operations", reason="parse")
        return sched

    def save(self, path: str | os.PathLike) -> None:
        """Write the schedule to ``path``: JSON if it ends in ``.json``, else text."""
        path = os.fspath(path)
        write_text(path, self.to_json() if path.endswith(".json") else
                   "\n".join(self.op_text(k) for k in range(len(self))) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Schedule":
        """Read a schedule written by :meth:`save` (JSON or text, by content); a
        ScheduleError in it names ``path`` first."""
        text = read_text(path, kind="schedule", error=ScheduleError, reason="parse")
        with naming_file(path, ScheduleError):
            return cls.parse(text)

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """A schedule from its JSON document or its text form (told apart by the
        leading ``{``)."""
        return cls.from_json(text) if text.lstrip().startswith("{") else cls.from_text(text)
