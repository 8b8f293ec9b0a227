import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtmem.errors import ScheduleError
from rtmem.planners import Chain, Op, Plan, Schedule, sequential_schedule, store_all_schedule
from rtmem.planners.testing import chains, valid_schedules


def test_text_form():
    s = Schedule.from_text("F_ck 0, F_none 1, F_all 2, L, B 2, offload abar2, "
                           "prefetch a0, delete abar1, w_offload 1, w_delete 0, "
                           "w_prefetch 1, g_offload 2")
    assert str(s) == ("F_ck 0, F_none 1, F_all 2, L, B 2, offload abar2, prefetch a0, "
                      "delete abar1, w_offload 1, w_delete 0, w_prefetch 1, g_offload 2")
    assert s[5] == (Op.OFFLOAD, 2, 1)
    assert s.op.dtype == np.int8 and len(s) == 12
    assert s.count(Op.B) == 1
    # new lines, comments and thesis spellings
    t = Schedule.from_text("Fck 0  # keep the input\nF_∅ 1\nLoss\n")
    assert str(t) == "F_ck 0, F_none 1, L"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_text_and_json_round_trip(data):
    chain = data.draw(chains(1, 6))
    sched = data.draw(valid_schedules(chain))
    assert Schedule.from_text(str(sched)) == sched
    assert Schedule.from_json(sched.to_json()) == sched


def test_save_load_both_forms(tmp_path):
    s = sequential_schedule(7, 3)
    for name in ("s.txt", "s.json"):
        s.save(tmp_path / name)
        assert Schedule.load(tmp_path / name) == s


def test_files_starting_with_a_byte_order_mark_load(tmp_path):
    # Windows editors start UTF-8 files with a BOM: it was read as part of the
    # first token ("unknown operation '\ufeffF_all'"), a JSON schedule was parsed
    # as text, and a chain file was "malformed chain JSON: Unexpected UTF-8 BOM"
    s = sequential_schedule(4, 2)
    chain = Chain.homogeneous(4)
    for name, text in (("s.txt", "\n".join(s.op_text(k) for k in range(len(s)))),
                       ("s.json", s.to_json()), ("c.json", chain.to_json())):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert Schedule.load(tmp_path / "s.txt") == s
    assert Schedule.load(tmp_path / "s.json") == s
    assert Chain.load(tmp_path / "c.json") == chain


@pytest.mark.parametrize("text, fragment", [
    ("F_ck 0, X 1", "unknown operation 'X'"),
    ("F_ck", "cannot read 'F_ck'"),
    ("B two", "non-negative integer"),
    ("offload b3", "not an activation"),
    ("delete abar0", "abar0 does not exist"),
    ("F_ck 1 2", "cannot read"),
    # stage indices are ASCII digits, in range
    ("F_all 999999999999999999", "beyond any chain"),          # wrapped in int32: crashed
    ("F_all 0, F_all 1, F_all 4294967298, L, B 2, B 1, B 0", "beyond any chain"),
    ("B ²", "non-negative integer"),                           # str.isdigit says yes
    ("B ٣", "non-negative integer"),
    ("offload abar٣", "not an activation"),
    # 19 digits overflow int64: refused by length, not an OverflowError
    ("F_all 9999999999999999999", r"below 10\*\*18"),
    ("offload a9999999999999999999", "not an activation"),
])
def test_parse_errors(text, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Schedule.from_text(text)


def test_array_validation():
    with pytest.raises(ScheduleError, match="unknown operation code 99"):
        Schedule([0, 99], [0, 0])
    with pytest.raises(ScheduleError, match="negative stage"):
        Schedule([0], [-1])
    with pytest.raises(ScheduleError, match="aux"):
        Schedule([int(Op.B)], [0], [1])
    with pytest.raises(ScheduleError, match="one length"):
        Schedule([0, 1], [0])


@pytest.mark.parametrize("text, fragment", [
    ("nope", "malformed schedule JSON"),
    ('{"format": "rtmem.schedule"}', "not a schedule document"),
    # only hand-written chain files may leave out the header; schedules may not
    ('{"version": 1, "ops": "L"}', "format is None, expected 'rtmem.schedule'"),
    ('{"format": "rtmem.schedule", "ops": "L"}', "version None is not supported"),
    ('{"format": "rtmem.schedule", "version": 2, "ops": ""}', "version 2"),
    ('{"format": "rtmem.schedule", "version": 1, "ops": "L", "n_ops": 2}', "n_ops = 2"),
])
def test_json_errors(text, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Schedule.from_json(text)


def test_baseline_builders():
    assert str(store_all_schedule(2)) == "F_all 0, F_all 1, L, B 1, B 0"
    # torch's checkpoint_sequential split of 5 stages in 2 segments: [0, 2), [2, 5)
    assert str(sequential_schedule(5, 2)) == (
        "F_ck 0, F_none 1, F_all 2, F_all 3, F_all 4, L, B 4, B 3, B 2, "
        "F_all 0, F_all 1, B 1, B 0")
    assert sequential_schedule(4, 1) == store_all_schedule(4)
    from rtmem.errors import ChainError
    with pytest.raises(ChainError, match="segments must be"):
        sequential_schedule(3, 4)
    s = store_all_schedule(3) + Schedule.from_text("g_offload 0")
    assert len(s) == 8 and len(s[2:4]) == 2


def test_plan_documents_with_bad_numbers_are_schedule_errors():
    from rtmem.planners import Chain, Plan, plan_store_all
    d = plan_store_all(Chain.homogeneous(2), "inf").to_dict()
    for key, value in (("makespan", "x"), ("peak", float("inf")), ("budget", -5),
                       ("info", [1])):
        with pytest.raises(ScheduleError, match="plan( document)?:"):
            Plan.from_dict({**d, key: value})


def test_plans_with_non_finite_numbers_are_refused_by_field():
    # An infinite makespan was accepted (NaN and the other fields were not), from
    # the constructor and from documents alike, and to_json wrote it as
    # Infinity, which is not JSON; no planner makes one (infeasible budgets
    # raise InfeasibleError). NaN or infinity in info was written the same way.
    import json
    import math
    from rtmem.planners import Chain, Plan, plan_store_all
    plan = plan_store_all(Chain.homogeneous(2), "inf")
    d = plan.to_dict()
    fields = dict(schedule=plan.schedule, makespan=plan.makespan, peak=plan.peak,
                  budget=plan.budget, algorithm=plan.algorithm)
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ScheduleError, match=r"plan: makespan .* s must be finite"):
            Plan(**{**fields, "makespan": value})
        with pytest.raises(ScheduleError, match="plan: makespan"):
            Plan.from_dict({**d, "makespan": value})
        with pytest.raises(ScheduleError, match="plan: peak"):
            Plan(**{**fields, "peak": value})
    with pytest.raises(ScheduleError, match="plan: makespan inf s must be finite"):
        Plan.from_json(json.dumps({**d, "makespan": math.inf}))    # "Infinity"
    for info, path in (({"dp_makespan": math.nan}, r"\['dp_makespan'\] nan"),
                       ({"persistent": {"candidates": [1.0, math.inf]}},
                        r"\['persistent'\]\['candidates'\]\[1\] inf")):
        with pytest.raises(ScheduleError, match=rf"plan: info{path} must be finite"):
            Plan(**fields, info=info)
    # an unlimited budget is what "inf" means there; None in info is fine
    ok = Plan(**{**fields, "budget": math.inf}, info={"dp_makespan": None, "n": 2})
    assert Plan.from_json(ok.to_json()) == ok
    assert "Infinity" not in ok.to_json() and "NaN" not in ok.to_json()


def test_plan_documents_with_fields_of_the_wrong_type_are_refused_by_name():
    # The constructor converts what it gets: a list schedule was parsed as its
    # repr ("unknown operation \"['F_all\""), a null algorithm became "None",
    # a string makespan, a true peak or an "Infinity" budget numbers, a list
    # info {}, and a version true passed for 1.
    import json
    from rtmem.planners import Chain, Plan, plan_store_all
    d = plan_store_all(Chain.homogeneous(2), "inf").to_dict()
    for key, value, form in (
            ("schedule", ["F_all 0"], r"the text form \(a string\), got \['F_all 0'\]"),
            ("schedule", None, r"the text form \(a string\), got None"),
            ("algorithm", None, "a string"), ("algorithm", [1], "a string"),
            ("makespan", "1e3", r"a number \(seconds\), got '1e3'"),
            ("makespan", True, "a number"), ("peak", True, r"a number \(bytes\)"),
            ("peak", "100", "a number"), ("budget", "Infinity", 'a number .* or "inf"'),
            ("budget", [1], 'a number .* or "inf"'), ("info", [], "an object"),
            ("info", None, "an object")):
        with pytest.raises(ScheduleError, match=f"plan document: {key} must be {form}"):
            Plan.from_dict({**d, key: value})
    for version in (True, 1.0):
        with pytest.raises(ScheduleError, match="version .* is not supported"):
            Plan.from_dict({**d, "version": version})
    # what the planners write still loads, through JSON too
    for value in (d, json.loads(json.dumps(d)), {**d, "budget": 1 << 40},
                  {**d, "budget": float("inf")}, {**d, "makespan": 0}):
        assert Plan.from_dict(value).schedule == Plan.from_dict(d).schedule


def test_loss_stage_is_dropped_so_schedules_round_trip():
    s = Schedule.from_ops([(Op.F_ALL, 0), (Op.LOSS, 1), (Op.B, 0)])
    assert s[1] == (Op.LOSS, 0, 0)
    assert s == Schedule.from_text("F_all 0, L, B 0")
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_text(str(s)) == s


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Op)), st.integers(0, 9), st.integers(0, 1)),
                max_size=12))
def test_any_schedule_round_trips(rows):
    from rtmem.planners.schedule import ACTIVATION_OPS
    # aux is meaningful (a/abar) only for activation ops, and abar0 does not exist
    rows = [(op, s, a if op in ACTIVATION_OPS and s > 0 else 0) for op, s, a in rows]
    sched = Schedule.from_ops(rows)
    assert Schedule.from_text(str(sched)) == sched
    assert Schedule.from_json(sched.to_json()) == sched


@pytest.mark.parametrize("op, stage, fragment", [
    ([0], [1.7], r"stage\[0\] = 1.7 is not an integer"),      # was truncated to 1
    ([0, 4], [0, float("nan")], r"stage\[1\] = nan"),
    ([0.5], [1], r"op\[0\] = 0.5"),
    ([0], ["1"], "array of integers"),                       # was parsed
])
def test_non_integral_codes_and_indices_are_refused(op, stage, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Schedule(op, stage)


def test_integral_floats_and_numpy_integers_are_indices():
    s = Schedule(np.array([2.0, 3.0, 4.0]), np.array([0.0, 0.0, 0.0]))
    assert s == Schedule.from_ops([(Op.F_ALL, 0), (Op.LOSS, 0), (Op.B, 0)])
    assert Schedule(np.zeros(0), np.zeros(0)) == Schedule.from_ops([])


@pytest.mark.parametrize("text, fragment", [
    # were "unknown operation 'L'" (a list of known operations naming L), and
    # "n_ops = 1 but holds 1 operations" for a string count
    ("F_all 0, L 0, B 0", "the loss takes no stage"),
    ('{"format": "rtmem.schedule", "version": 1, "ops": "L", "n_ops": "1"}', "n_ops = '1'"),
    ('{"format": "rtmem.schedule", "version": 1, "ops": "L", "n_ops": true}', "n_ops = True"),
    ('{"format": "rtmem.schedule", "version": 1, "ops": 5}', "ops must be the text form"),
])
def test_parse_messages_say_what_is_wrong(text, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Schedule.parse(text)


@pytest.mark.parametrize("text", ["[" * 100_000, "F_ck " + "9" * 100_000, "L, " + "x" * 5000,
                                  "offload " + "abar" * 1000])
def test_parse_messages_quote_a_long_token_cut_short(text):
    # a whole unreadable line (a JSON file given as schedule text) went into the
    # message: 100 kB on stderr
    with pytest.raises(ScheduleError, match=r"\.\.\.'") as info:
        Schedule.parse(text)
    assert len(str(info.value)) < 300


def test_slices_sums_and_separators_keep_every_field():
    # aux (a or abar) survives slicing and concatenation, in order
    s = Schedule.from_text("F_all 0, offload abar1, delete abar1, prefetch abar1")
    assert str(s[1:3]) == "offload abar1, delete abar1"
    t = Schedule.from_text("delete a0")
    assert str(s + t) == str(s) + ", delete a0"
    assert str(t + s) == "delete a0, " + str(s)
    # ';' separates operations like ',' and a new line
    assert Schedule.from_text("F_all 0; L;B 0") == Schedule.from_text("F_all 0, L, B 0")
    # a JSON document is told from text after leading white space
    assert Schedule.parse("\n  " + s.to_json()) == s


def test_stage_indices_stop_below_2_31_and_2_62():
    # stages are stored as int32: 2**31 would wrap to a negative index
    assert Schedule([0], [2**31 - 1]).stage[0] == 2**31 - 1
    with pytest.raises(ScheduleError, match="beyond any chain"):
        Schedule([0], [2**31])
    # a float beyond int64 (a cast gives garbage) is refused by value
    with pytest.raises(ScheduleError, match=r"stage\[0\] = 1e\+19 is not an integer"):
        Schedule([0], [1e19])


def test_equality_tells_a_from_abar_and_repr_cuts_only_past_120_characters():
    # a and abar of one index are different tensors: schedules differing only there differ
    assert Schedule.from_text("delete a1") != Schedule.from_text("delete abar1")
    assert Schedule.from_text("offload a2, L") != Schedule.from_text("offload abar2, L")
    # "F_ck 0" (6 characters) and 38 times ", L" (3 each): exactly 120 characters, whole
    s = Schedule.from_text("F_ck 0" + ", L" * 38)
    assert repr(s) == "Schedule(39 ops: F_ck 0" + ", L" * 38 + ")"
    # one more ", L" (123 characters): the first 117 and "..."
    t = Schedule.from_text("F_ck 0" + ", L" * 39)
    assert repr(t) == "Schedule(40 ops: F_ck 0" + ", L" * 37 + "...)"


def test_a_token_of_60_characters_is_quoted_whole_and_one_of_61_cut_short():
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text("X" * 60 + " 1")
    assert "'" + "X" * 60 + "'" in str(info.value)
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text("X" * 61 + " 1")
    assert "'" + "X" * 57 + "...'" in str(info.value)
    assert "X" * 58 not in str(info.value)


def test_operation_and_activation_names_are_read_in_any_case_and_aux_may_be_bool():
    assert Schedule.from_text("OFFLOAD ABAR3, Delete A2, f_CK 0") == Schedule.from_ops(
        [(Op.OFFLOAD, 3, 1), (Op.DELETE, 2, 0), (Op.F_CK, 0, 0)])
    # aux is a flag (a: False, abar: True): a bool array is read as 0 and 1
    s = Schedule([int(Op.OFFLOAD), int(Op.DELETE)], [1, 1], np.array([True, False]))
    assert str(s) == "offload abar1, delete a1"


def _isin_validation(op, stage, aux):
    """Schedule's array checks as they were with np.isin (before the table lookup
    by operation code): the reference the new checks must match, error for error.
    Takes 1-D int64 arrays of one length; returns the stored (op, stage, aux)."""
    from rtmem.planners.schedule import ACTIVATION_OPS
    valid = np.isin(op, [int(o) for o in Op])
    if not valid.all():
        k = int(np.flatnonzero(~valid)[0])
        raise ScheduleError(
            f"op {k}: unknown operation code {int(op[k])}; valid codes are "
            f"{[f'{o.name}={int(o)}' for o in Op]}", op_index=k, reason="unknown-op")
    if (stage < 0).any():
        k = int(np.flatnonzero(stage < 0)[0])
        raise ScheduleError(f"op {k}: negative stage index {int(stage[k])}",
                            op_index=k, reason="stage-range")
    if (stage >= 2**31).any():
        k = int(np.flatnonzero(stage >= 2**31)[0])
        raise ScheduleError(f"op {k}: stage index {int(stage[k])} is beyond any chain "
                            f"(at most 2**31 - 1)", op_index=k, reason="stage-range")
    stage = np.where(op == int(Op.LOSS), 0, stage)
    is_act = np.isin(op, [int(o) for o in ACTIVATION_OPS])
    bad = ~np.isin(aux, (0, 1)) | ((aux != 0) & ~is_act)
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
    return op.astype(np.int8), stage.astype(np.int32), aux.astype(np.int8)


def _same_as_isin_validation(op, stage, aux):
    """Schedule(op, stage, aux) accepts what the np.isin checks accepted, storing
    the same arrays, and refuses the rest with the same error: type, message,
    op_index and reason. Returns the reference's error (None when accepted)."""
    op, stage = np.asarray(op, np.int64), np.asarray(stage, np.int64)
    ref_aux = np.zeros_like(op) if aux is None else np.asarray(aux, np.int64)
    try:
        want = _isin_validation(op, stage, ref_aux)
    except ScheduleError as e:
        with pytest.raises(ScheduleError) as info:
            Schedule(op, stage, aux)
        got = info.value
        assert (type(got), str(got), got.op_index, got.reason) == (
            type(e), str(e), e.op_index, e.reason)
        return e
    s = Schedule(op, stage, aux)
    for a, b in zip((s.op, s.stage, s.aux), want):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    return None


# Every refusal of the array checks in this file, and one of each kind besides
_ARRAY_REFUSALS = [
    ([0, 99], [0, 0], None), ([0], [-1], None), ([int(Op.B)], [0], [1]),
    ([int(Op.DELETE)], [0], [1]), ([0], [2**31], None), ([0, 0], [2**31, -1], None),
    ([2, 2, 2, 3, 4, 4, 4], [0, 1, 4294967298, 0, 2, 1, 0], None),
    ([-1], [0], None), ([12], [0], None), ([-2**63], [0], None), ([2**62], [0], None),
    ([0], [-2**63], None), ([int(Op.OFFLOAD)], [1], [2]), ([int(Op.OFFLOAD)], [1], [-1]),
    ([int(Op.LOSS)], [7], [1]), ([int(Op.LOSS), int(Op.PREFETCH)], [7, 0], [0, 1]),
]


@pytest.mark.parametrize("op, stage, aux", _ARRAY_REFUSALS)
def test_array_checks_refuse_as_the_isin_checks_did(op, stage, aux):
    assert _same_as_isin_validation(op, stage, aux) is not None


def test_array_checks_match_the_isin_checks_on_random_arrays():
    # Codes and indices mostly valid, each with a 1 in 25 chance of an edge of its
    # check: unknown codes either side of the known ones, negative and int32-wrapping
    # stages, aux beyond 0/1 or set on an operation that is not delete/offload/
    # prefetch; abar0 and a stage given with the loss come up among the valid values
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    codes = np.array([int(o) for o in Op])
    edges = {"op": np.array([-2**63, -1, max(Op) + 1, 32, 99, 2**63 - 1]),
             "stage": np.array([-2**63, -1, 2**31 - 1, 2**31, 2**62]),
             "aux": np.array([-1, 2, 2**62])}

    def draw(name, n, valid):
        edge = rng.random(n) < 1 / 25
        return np.where(edge, rng.choice(edges[name], n), valid).astype(np.int64)

    reasons = {}
    for _ in range(1000):
        n = int(rng.integers(0, 10))
        op = draw("op", n, rng.choice(codes, n))
        stage = draw("stage", n, rng.integers(0, 4, n))
        aux = None if rng.random() < 0.2 else draw("aux", n, rng.integers(0, 2, n))
        err = _same_as_isin_validation(op, stage, aux)
        # the check that refused: its reason and the message's first two words
        key = None if err is None else (err.reason, *str(err).split(": ", 1)[1].split()[:2])
        reasons[key] = reasons.get(key, 0) + 1
    # every outcome came up, so each was compared (seed given to replay a failure)
    assert set(reasons) == {None, ("unknown-op", "unknown", "operation"),
                            ("stage-range", "negative", "stage"), ("stage-range", "stage", "index"),
                            ("malformed", "aux", "="), ("malformed", "abar0", "does")}, \
        (seed, reasons)


@pytest.mark.parametrize("cls, fmt", [(Plan, "rtmem.plan"), (Schedule, "rtmem.schedule")])
def test_a_document_of_a_newer_version_is_refused_for_its_version(cls, fmt):
    # a newer rtmem may rename fields: the file was refused as "not a plan
    # document: it lacks the field(s) [...]", sending the user to fix the file
    text = json.dumps({"format": fmt, "version": 2, "steps": []})
    with pytest.raises(ScheduleError, match="version 2 is not supported"):
        cls.from_json(text)


@pytest.mark.parametrize("cls, key", [(Plan, "inf0"), (Plan, "schedul"),
                                      (Schedule, "opps")])
def test_a_document_with_an_unknown_key_names_it(cls, key):
    # a typo of "info" dropped the plan's extras (input_bytes: the executor's
    # batch check) without a word, where a chain document refuses unknown keys
    rng = np.random.default_rng()
    n = int(rng.integers(1, 6))
    schedule = sequential_schedule(n, 1)
    d = (json.loads(schedule.to_json()) if cls is Schedule else
         Plan(schedule, float(rng.random()), int(rng.integers(0, 1000)), 2**30, "test",
              {"input_bytes": 8}).to_dict())
    real = {"inf0": "info", "schedul": "schedule", "opps": "ops"}[key]
    d[key] = d[real]
    with pytest.raises(ScheduleError, match=f"unknown .*field.*'{key}'"):
        cls.from_json(json.dumps(d))
