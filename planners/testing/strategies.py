"""Hypothesis strategies for chains, platforms and valid schedules (see
``rtmem.planners.testing``)."""

from __future__ import annotations

import math

from ..chain import Chain
from ..platform import CHANNELS, Platform
from ..schedule import Op, Schedule
from .reference import reference_simulate
from .wandering import wandering_schedules

from rtmem._optional import require

from . import _HYPOTHESIS_MISSING

require("hypothesis", _HYPOTHESIS_MISSING)   # before the import that fails bare

from hypothesis import strategies as st  # noqa: E402
from ._arguments import StrategyArgumentError, check_flags, check_range, public_name  # noqa: E402 (needs hypothesis)

__all__ = ["chains", "platforms", "valid_schedules", "simulation_cases"]


@st.composite
def _spread_ints(draw, max_exponent: int, allow_zero: bool = True):
    """Non-negative ints whose magnitude spans 10**0 .. 10**max_exponent."""
    if allow_zero and draw(st.integers(0, 9)) == 0:
        return 0
    exponent = draw(st.integers(0, max_exponent))
    mantissa = draw(st.integers(10, 99))
    return mantissa * 10**exponent // 10


def chains(min_stages: int = 1, max_stages: int = 8, *, homogeneous: bool | None = None,
           small: bool = False, weights: bool = True, overheads: bool = True,
           no_recompute: bool = False):
    """Strategy for :class:`~rtmem.planners.Chain`.

    Parameters
    ----------
    min_stages, max_stages:
        Range of the number of stages (>= 1). Each heterogeneous stage takes
        about 20 draws, which Hypothesis's input buffer bounds: keep
        ``max_stages`` below ~200 (or ``homogeneous=True``, a few draws in all);
        for longer chains use :class:`~rtmem.planners.Chain` or the profiles.
    homogeneous:
        ``True``: all stages identical (the Revolve setting); ``False``: every
        value drawn per stage; ``None``: either.
    small:
        Small integer sizes (0..12 bytes; ``xbar`` = ``x`` + 0..12) and integer
        times (0..10 s), for brute-force oracles; otherwise sizes are 0 or span
        1 B .. 99 GB (``xbar`` = ``x`` + such a size: up to 198 GB) and times
        are 0 or span 1 us .. 9.9 s (log-uniform).
    weights, overheads:
        Whether ``w`` and ``o_f``/``o_b`` may be non-zero.
    no_recompute:
        Whether stages may be flagged ``Chain.no_recompute`` (must run their
        forward once, as ``F_all``). ``True``: each stage's flag is drawn (one
        boolean per stage, about half of them set, drawn per stage for
        homogeneous chains too); a flag shrinks to ``False``, so a failure
        shrinks toward fewer flagged stages. ``False`` (default): no flag set,
        and the draws are those of a call without the option.

    Invalid arguments raise :class:`~hypothesis.errors.InvalidArgument` (also
    a ValueError) when this is called, as for every strategy here.
    """
    # checked now: inside the composite they raised at the first draw, deep in
    # Hypothesis's engine (the same for each strategy below)
    min_stages, max_stages = check_range("chains", min_stages, max_stages)
    check_flags("chains", homogeneous=homogeneous, small=small, weights=weights,
                overheads=overheads, no_recompute=no_recompute)
    return _chains(min_stages=min_stages, max_stages=max_stages, homogeneous=homogeneous,
                   small=small, weights=weights, overheads=overheads,
                   no_recompute=no_recompute)


@st.composite
@public_name("chains")
def _chains(draw, min_stages=1, max_stages=8, *, homogeneous=None, small=False, weights=True,
            overheads=True, no_recompute=False):
    homo = draw(st.booleans()) if homogeneous is None else homogeneous
    if small:
        size = st.integers(0, 12)
        time = st.integers(0, 10).map(float)
    else:
        size = _spread_ints(10)
        time = _spread_ints(6).map(lambda v: v * 1e-6)
    zero = st.just(0)
    # The chain-wide values first, then one stage at a time: drawn column by
    # column after the stage count (and x0 last), lowering the count shifted every
    # later draw onto another value, so a failure that needed x0 > 0 kept extra
    # stages when shrunk. Now a shorter chain just leaves its last stages unread.
    x0, u_loss = draw(size), draw(time)
    o_loss = draw(size if overheads else zero)
    n = draw(st.integers(min_stages, max_stages))
    stage = st.tuples(time, time, size, size, size if weights else zero,
                      size if overheads else zero, size if overheads else zero)
    # A flag is drawn with its stage, so a shorter chain drops its flags too;
    # without the option the draws are exactly those of before it (the same
    # strategies: their labels steer Hypothesis's generation). A homogeneous
    # chain's stages share their costs, not their flags (all or no stage flagged
    # leaves only store-all or nothing to test).
    flags = None
    if homo:
        stages = [draw(stage)] * n
        if no_recompute:
            flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif no_recompute:
        both = draw(st.lists(st.tuples(stage, st.booleans()), min_size=n, max_size=n))
        stages, flags = [s for s, _ in both], [f for _, f in both]
    else:
        stages = draw(st.lists(stage, min_size=n, max_size=n))
    u_f, u_b, x, extra, w, o_f, o_b = (list(column) for column in zip(*stages))
    xbar = [a + b for a, b in zip(x, extra)]
    return Chain(u_f=u_f, u_b=u_b, x=x, xbar=xbar, w=w, o_f=o_f, o_b=o_b,
                 x0=x0, u_loss=u_loss, o_loss=o_loss, name="hypothesis", no_recompute=flags)


def platforms(min_memory: int = 1, max_memory: int = 2**40):
    """Strategy for :class:`~rtmem.planners.Platform` (memory in bytes, bandwidth in
    bytes/s log-uniform from 1 kB/s to 990 TB/s, or infinite; either channel model)."""
    # integers only: an infinite bound raised an OverflowError
    min_memory, max_memory = check_range(
        "platforms", min_memory, max_memory,
        " for min_memory, max_memory (max_memory defaults to 2**40 bytes)")
    return _platforms(min_memory=min_memory, max_memory=max_memory)


@st.composite
@public_name("platforms")
def _platforms(draw, min_memory=1, max_memory=2**40):
    memory = draw(st.integers(min_memory, max_memory))
    bandwidth = draw(st.one_of(st.just(math.inf), _spread_ints(11, allow_zero=False)
                               .map(lambda v: max(v, 1) * 1e3)))
    return Platform(memory=memory, bandwidth=bandwidth, channel=draw(st.sampled_from(CHANNELS)))


@st.composite
def _persistent_compute(draw, n: int, flagged=()):
    """A random persistent rematerialization sequence (thesis-remat.md §3.6 shape):
    each segment either starts with F_all (case C1) or keeps a_s with F_ck, runs
    F_none to a random s', solves the tail, then the head (case C2).

    ``flagged`` (bools, one per stage: ``Chain.no_recompute``) marks stages that
    may run once only: C2 recomputes stages s..s', so a flagged stage starts a C1
    segment and no C2 segment spans one (the simulator refuses a second run)."""
    # first flagged stage at or after each index (n: none), to bound s'
    next_flagged = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        next_flagged[i] = i if i < len(flagged) and flagged[i] else next_flagged[i + 1]
    ops = []
    # explicit stack instead of recursion: hypothesis chains can be long
    stack = [("solve", 0, n, False)]
    while stack:
        item = stack.pop()
        if item[0] == "emit":
            ops.append(item[1])
            continue
        _, s, t, input_is_bar = item
        if s == t:
            if t == n:
                ops.append((Op.LOSS, 0))
            else:
                ops += [(Op.F_ALL, s), (Op.B, s)]
            continue
        # False (what Hypothesis shrinks a boolean to) keeps everything, so a
        # failure shrinks toward the store-all schedule, not toward recomputation.
        if next_flagged[s] == s or not draw(st.booleans()):
            ops.append((Op.F_ALL, s))
            stack += [("emit", (Op.B, s)), ("solve", s + 1, t, True)]
        else:
            s2 = draw(st.integers(s, min(t, next_flagged[s]) - 1))
            ops.append((Op.F_CK, s))
            ops += [(Op.F_NONE, i) for i in range(s + 1, s2 + 1)]
            stack += [("solve", s, s2, input_is_bar), ("solve", s2 + 1, t, False)]
    return ops


def _tensor_events(ops, n):
    """Replay compute ops; return {instance: (key, [op indices])} where an instance
    is one residency period of a tensor (key = ("a"|"abar", k)) and the indices
    are the ops that produce, read or consume it (-1: resident at the start)."""
    resident = {("a", 0): 0}
    events = {0: (("a", 0), [-1])}
    next_id = 1

    def touch(key, j):
        events[resident[key]][1].append(j)

    def produce(key, j):
        nonlocal next_id
        if key in resident:
            touch(key, j)
        else:
            resident[key] = next_id
            events[next_id] = (key, [j])
            next_id += 1

    for j, (op, s) in enumerate(ops):
        if op == Op.LOSS:
            s = n
        src = [key for key in (("a", s), ("abar", s)) if key in resident]
        if op == Op.F_NONE:
            src = [("a", s)]
        for key in src:
            touch(key, j)
        if op == Op.F_NONE:
            del resident[("a", s)]
            produce(("a", s + 1), j)
        elif op in (Op.F_CK, Op.F_ALL):
            produce(("abar" if op == Op.F_ALL else "a", s + 1), j)
        else:
            if op == Op.B:
                touch(("abar", s + 1), j)
                del resident[("abar", s + 1)]
            if ("a", s) in resident and ("abar", s) not in resident:
                del resident[("a", s)]
    return events


def valid_schedules(chain: Chain, *, transfers: bool = True):
    """Strategy for schedules of ``chain`` that are valid with enough memory.

    The compute part is a random persistent rematerialization sequence; when
    ``transfers`` is true, random activation offload/delete/prefetch round trips,
    weight offloads/deletes/prefetches and gradient offloads are woven in, each
    placed between two uses of its data so that the schedule stays valid (see
    NOTE [ Simulator semantics ]). A stage that ``chain.no_recompute`` flags runs
    its forward once, as ``F_all``. Use :func:`simulation_cases` to get a platform
    on which it fits.

    Every op and every possible move takes a draw, which Hypothesis's input
    buffer bounds: with ``transfers`` keep chains below ~200 stages (a few
    hundred stages fail its ``large_base_example`` health check, resnet1001
    does); without, any length works.
    """
    if not isinstance(chain, Chain):
        # chain.n raised a bare AttributeError, e.g. for the stage count that
        # wandering_schedules takes
        raise StrategyArgumentError(f"valid_schedules: chain must be a Chain, got {chain!r}")
    check_flags("valid_schedules", transfers=transfers)
    return _valid_schedules(chain, transfers=transfers)


@st.composite
@public_name("valid_schedules")
def _valid_schedules(draw, chain, *, transfers=True):
    n = chain.n
    ops = draw(_persistent_compute(n, chain.no_recompute.tolist()))
    if not transfers:
        return Schedule.from_ops(ops)
    after = [[] for _ in range(len(ops) + 1)]   # slot j+1: right after op j
    before = [[] for _ in range(len(ops) + 1)]  # slot j: right before op j
    on_host = set()
    events = _tensor_events(ops, n)
    for inst in sorted(events, key=lambda i: events[i][1][0]):
        (kind, k), idx = events[inst]
        aux = 1 if kind == "abar" else 0
        for e1, e2 in zip(idx, idx[1:]):
            # A move is inserted on a 3 (one time in four), never on 0: Hypothesis
            # shrinks integers toward 0, so failures shrink to fewer moves.
            if e2 <= e1 or draw(st.integers(0, 3)) != 3:
                continue
            moves = []
            if (kind, k) not in on_host:
                moves.append((Op.OFFLOAD, k, aux))
                on_host.add((kind, k))
            after[e1 + 1] += moves + [(Op.DELETE, k, aux)]
            before[e2].append((Op.PREFETCH, k, aux))
    uses = {}
    for j, (op, s) in enumerate(ops):
        if op != Op.LOSS:
            uses.setdefault(s, []).append(j)
    for s, idx in uses.items():
        for e1, e2 in zip(idx, idx[1:] + [None]):
            if draw(st.integers(0, 3)) != 3:       # shrinks to no weight move
                continue
            after[e1 + 1].append((draw(st.sampled_from((Op.W_OFFLOAD, Op.W_DELETE))), s, 0))
            if e2 is None:
                break
            before[e2].append((Op.W_PREFETCH, s, 0))
        b_index = next(j for j in idx if ops[j][0] == Op.B)
        if draw(st.booleans()):
            after[b_index + 1].append((Op.G_OFFLOAD, s, 0))
    woven = []
    for j, (op, s) in enumerate(ops):
        woven += after[j] + before[j]
        woven.append((op, s, 0))
    woven += after[len(ops)]
    return Schedule.from_ops(woven)


def simulation_cases(min_stages: int = 1, max_stages: int = 8, *,
                     transfers: bool = True, small: bool = False, wander: bool = False,
                     no_recompute: bool = False):
    """Strategy for ``(chain, schedule, platform)`` that simulate without error.

    The schedule comes from :func:`valid_schedules`, or with ``wander`` from
    :func:`~rtmem.planners.testing.wandering_schedules` (any allowed operation
    at each step; ``transfers`` then also allows weight and gradient moves).
    ``small`` and ``no_recompute`` are passed to :func:`chains` (with
    ``no_recompute`` some stages run once, as ``F_all``, in either schedule).
    The platform memory is the schedule's peak with unlimited memory plus a random
    slack (the schedule then never waits for memory, so it stays valid).
    A heterogeneous chain and its moves share Hypothesis's input buffer: keep
    ``max_stages`` below ~120 (below ~200 with ``transfers=False``; a few dozen
    with ``wander``).
    """
    # checked here too: through chains() a bad range was reported as "chains: ..."
    min_stages, max_stages = check_range("simulation_cases", min_stages, max_stages)
    check_flags("simulation_cases", transfers=transfers, small=small, wander=wander,
                no_recompute=no_recompute)
    return _simulation_cases(min_stages=min_stages, max_stages=max_stages,
                             transfers=transfers, small=small, wander=wander,
                             no_recompute=no_recompute)


@st.composite
@public_name("simulation_cases")
def _simulation_cases(draw, min_stages=1, max_stages=8, *, transfers=True, small=False,
                      wander=False, no_recompute=False):
    chain = draw(chains(min_stages, max_stages, small=small, no_recompute=no_recompute))
    schedule = draw(wandering_schedules(chain, transfers=transfers, weights=transfers)
                    if wander else valid_schedules(chain, transfers=transfers))
    probe = draw(platforms())
    unlimited = Platform(math.inf, probe.bandwidth, probe.channel)
    peak = reference_simulate(chain, schedule, unlimited)["peak"]
    slack = draw(st.integers(0, max(1, peak)))
    return chain, schedule, Platform(max(1, peak + slack), probe.bandwidth, probe.channel)
