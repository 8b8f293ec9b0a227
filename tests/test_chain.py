import builtins
import dataclasses
import json
import math
import os
import re

import numpy as np

import pytest
from hypothesis import given, settings

from rtmem.errors import ChainError
from rtmem.planners import Chain, builtin, builtin_names, from_spec
from rtmem.planners.profiles import gpt2, resnet
from rtmem.planners.testing import chains


def test_arrays_and_defaults():
    c = Chain(u_f=[1, 2], u_b=[3, 4], x=[5, 6], xbar=[7, 8.2])
    assert c.n == len(c) == 2
    assert c.xbar.dtype == np.int64 and c.xbar.tolist() == [7, 9]  # bytes rounded up
    assert c.u_f.dtype == np.float64
    assert c.w.tolist() == [0, 0] and c.o_f.tolist() == [0, 0] and c.x0 == 0
    assert c.compute_time == 10.0
    with pytest.raises(ValueError):
        c.x[0] = 3    # read-only: a chain is a value


@pytest.mark.parametrize("kwargs, field, index, fragment", [
    (dict(u_f=[1, math.nan], u_b=[1, 1], x=[1, 1], xbar=[1, 1]), "u_f", 1, "not finite"),
    (dict(u_f=[1, 1], u_b=[1, -1], x=[1, 1], xbar=[1, 1]), "u_b", 1, "negative"),
    (dict(u_f=[1, 1], u_b=[1, 1], x=[1, 1, 1], xbar=[1, 1]), "x", None, "3 entries"),
    (dict(u_f=[], u_b=[], x=[], xbar=[]), "u_f", None, "at least one stage"),
    (dict(u_f=[1], u_b=[1], x=[5], xbar=[4]), "xbar", 0, "xbar must be >= x"),
    (dict(u_f=[1], u_b=[1], x=[1], xbar=[1], w=[math.inf]), "w", 0, "not finite"),
    (dict(u_f=[[1]], u_b=[1], x=[1], xbar=[1]), "u_f", None, "one-dimensional"),
    (dict(u_f=["a"], u_b=[1], x=[1], xbar=[1]), "u_f", 0, "u_f[0] = 'a' is not a number"),
    (dict(u_f=[1], u_b=[1], x=[1], xbar=[1], x0=-1), "x0", None, ">= 0"),
    (dict(u_f=[1], u_b=None, x=[1], xbar=[1]), "u_b", None, "required"),
])
def test_bad_chains_name_field_and_index(kwargs, field, index, fragment):
    with pytest.raises(ChainError) as e:
        Chain(**kwargs)
    assert e.value.field == field and e.value.index == index
    assert fragment in str(e.value)


@pytest.mark.parametrize("field, value, shown", [
    ("x", True, "True"), ("xbar", np.True_, "True"), ("w", "12", "'12'"),
    ("u_f", "1.0", "'1.0'"), ("u_b", b"2", "b'2'"), ("o_f", False, "False"),
])
def test_the_constructor_refuses_bools_and_strings_as_times_and_sizes(field, value, shown):
    # numpy and float() converted them: x=[True, ...] was a 1-byte activation and
    # u_f=["1.0", ...] a time, where a chain document refuses both
    rng = np.random.default_rng()
    n = int(rng.integers(2, 6))
    i = int(rng.integers(0, n))
    x = rng.integers(1, 1000, n)
    arrays = dict(u_f=rng.random(n), u_b=rng.random(n), x=x, xbar=x + 1000, w=x, o_f=x)
    column = list(arrays[field])
    column[i] = value
    arrays[field] = column
    unit = "seconds" if field.startswith("u_") else "bytes"
    with pytest.raises(ChainError) as e:
        Chain(**arrays)
    assert f"{field}[{i}] = {shown} is not a number; pass a number of {unit}" in str(e.value)
    assert (e.value.field, e.value.index) == (field, i)


@pytest.mark.parametrize("dtype", [bool, str, object])
def test_the_constructor_refuses_bool_and_string_arrays(dtype):
    rng = np.random.default_rng()
    x = rng.integers(1, 1000, 4)
    bad = np.array([True, False, True, True], dtype=dtype)
    if dtype is str:
        bad = x.astype(str)
    with pytest.raises(ChainError, match=r"x\[0\] = .* is not a number") as e:
        Chain(u_f=rng.random(4), u_b=rng.random(4), x=bad, xbar=x + 1000)
    assert e.value.field == "x"


@pytest.mark.parametrize("field, value", [("x0", True), ("u_loss", "0.5"), ("o_loss", np.True_)])
def test_the_constructor_refuses_bool_and_string_scalars(field, value):
    with pytest.raises(ChainError) as e:
        Chain(u_f=[1.0], u_b=[1.0], x=[1], xbar=[1], **{field: value})
    shown = repr(value).replace("np.True_", "True")
    assert f"{field} = {shown} is not a number" in str(e.value) and e.value.field == field


def test_no_recompute_still_takes_bools_and_numeric_arrays_still_pass():
    rng = np.random.default_rng()
    x = rng.integers(1, 1000, 3)
    flags = np.array([True, False, True])
    chain = Chain(u_f=rng.random(3).astype(np.float32), u_b=rng.random(3), x=x.astype(np.int32),
                  xbar=x + 1, no_recompute=flags)
    assert chain.no_recompute.tolist() == flags.tolist() and chain.x.tolist() == x.tolist()


def test_homogeneous():
    c = Chain.homogeneous(5, u_f=2, x=3)
    assert c.n == 5 and set(c.xbar.tolist()) == {3} and c.x0 == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ChainError):
            Chain.homogeneous(bad)


@settings(max_examples=50, deadline=None)
@given(chains())
def test_json_round_trip(chain):
    assert Chain.from_json(chain.to_json()) == chain


def test_save_load(tmp_path):
    c = builtin("gpt2-small")
    c.save(tmp_path / "c.json")
    assert Chain.load(tmp_path / "c.json") == c


def test_a_save_that_fails_part_way_leaves_the_old_file_whole(tmp_path, monkeypatch):
    # written in place, a write that failed (a full disk, Ctrl-C) left a cut-off
    # document where the old one was: the chain being planned was lost
    old, new = builtin("gpt2-small"), builtin("resnet50")
    path = tmp_path / "c.json"
    old.save(path)
    real_open = open

    class FullDisk:                 # a file whose write stops part-way
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:10])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opened(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode else f
    monkeypatch.setattr(builtins, "open", opened)
    with pytest.raises(OSError, match="No space"):
        new.save(path)
    monkeypatch.undo()
    assert Chain.load(path) == old
    assert os.listdir(tmp_path) == ["c.json"]       # no temporary file left behind
    link = tmp_path / "link.json"
    link.symlink_to(path)
    new.save(link)                                  # a link's target is replaced
    assert link.is_symlink() and Chain.load(path) == new


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "malformed chain JSON"),
    ("[1, 2]", "JSON object"),
    ('{"format": "other"}', "not a chain document"),
    ('{"version": 9, "u_f": [1]}', "version 9"),
    ('{"u_f": [1], "u_b": [1], "x": [1], "xbar": [1], "bogus": 1}', "bogus"),
    ('{"u_f": [1], "u_b": [1], "x": [1], "xbar": [1], "n": 3}', "n = 3"),
])
def test_malformed_json(text, fragment):
    with pytest.raises(ChainError, match=fragment):
        Chain.from_json(text)


def test_builtin_profiles_are_heterogeneous_and_realistic():
    assert {"gpt2-small", "resnet50", "resnet1001"} <= set(builtin_names())
    for name in builtin_names():
        c = builtin(name)
        assert c.name == name and c.compute_time > 0
        assert len(set(c.xbar.tolist())) > 1
    small = builtin("gpt2-small")
    assert small == gpt2(layers=12, hidden=768, heads=12, seq=1024, batch=8,
                         name="gpt2-small")
    # GPT-2 small block at seq 1024, batch 8, fp16: 34 sbh + 5 a s^2 b bytes
    s, b, h, a = 1024, 8, 768, 12
    assert small.xbar[1] == 34 * s * b * h + 5 * a * s * s * b
    assert small.w[1] == (12 * h * h + 13 * h) * 2
    assert builtin("resnet1001").n == 335


def test_from_spec():
    c = from_spec("gpt2:layers=3,hidden=64,heads=4,seq=32,batch=2,vocab=100")
    assert c.n == 5
    assert from_spec("resnet:depth=18,image=64,batch=2").n == 10
    assert from_spec("resnet50") == builtin("resnet50")
    for bad, fragment in [("nope", "unknown chain"), ("gpt2:layers", "key=value"),
                          ("gpt2:layers=x", "not a number"), ("gpt2:colour=3", "bad arguments"),
                          ("resnet:depth=7", "depth must be"), ("gpt2:hidden=10,heads=3",
                                                                "multiple of heads")]:
        with pytest.raises(ChainError, match=fragment):
            from_spec(bad)
    with pytest.raises(ChainError, match="available"):
        builtin("gpt5")
    assert resnet(depth=18, image=32, batch=1).n == 10


def test_spec_refuses_a_repeated_key():
    with pytest.raises(ChainError, match="layers is given twice"):
        from_spec("gpt2:layers=2,layers=3")


@pytest.mark.parametrize("spec, got", [
    ("gpt2:layers=1e3", "got '1e3' (read as 1000.0)"),
    ("resnet:depth=5E1", "got '5E1' (read as 50.0)"),
    ("gpt2:seq=Infinity", "got 'Infinity' (read as inf)"),
    ("gpt2:flops=-5e12", "got '-5e12' (read as -5000000000000.0)"),
    ("resnet:image=+20", "got '+20' (read as 20)"),
    ("gpt2:layers=2.0", "got 2.0"),             # written as read: said once
])
def test_a_spec_error_shows_the_value_as_written(spec, got):
    # layers=1e3 was refused with "got 1000.0", a number the user never typed
    with pytest.raises(ChainError) as e:
        from_spec(spec)
    assert str(e.value).endswith(got) and e.value.field == spec.split(":")[1].split("=")[0]


def test_chain_document_without_its_arrays_is_a_chain_error():
    with pytest.raises(ChainError, match="lacks the field"):
        Chain.from_json("{}")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(w=[2**61] * 4), "add up to"),          # each fits int64, the total does not
    (dict(x0=1e30), "x0"), (dict(o_loss=2**70), "o_loss"),
])
def test_sizes_the_planners_cannot_count_are_refused(kwargs, fragment):
    with pytest.raises(ChainError, match=fragment):
        Chain(**{"u_f": [1] * 4, "u_b": [1] * 4, "x": [1] * 4, "xbar": [1] * 4, **kwargs})


@pytest.mark.parametrize("spec", ["resnet:flops=0", "gpt2:layers=inf", "gpt2:layers=nan",
                                  "gpt2:flops=inf", "resnet:batch=inf", "gpt2:flops=-1",
                                  # a TypeError from range(), and a chain "resnet50.0"
                                  "gpt2:layers=2.0", "resnet:depth=50.0"])
def test_specs_with_non_finite_or_zero_values_are_chain_errors(spec):
    # ZeroDivisionError / OverflowError / ValueError escaped (a traceback from the
    # CLI), and flops=inf gave a chain of zero times.
    from rtmem.planners import from_spec
    with pytest.raises(ChainError, match="must be"):
        from_spec(spec)


@pytest.mark.parametrize("kwargs, field", [
    (dict(u_f=[1e308, 1e308]), "u_f"),        # each finite, the sum is not
    (dict(u_f=[1e308, 1e300]), "u_f"),        # sum finite, 3 x sum (recomputation) not
    # one stage may run forward twice ("F_ck 0, F_all 0, L, B 0"): 2 x 1e308 overflows
    (dict(u_f=[1e308], u_b=[1], x=[4], xbar=[8]), "u_f"),
    (dict(u_b=[1e308, 1e308]), "u_b"),
    (dict(u_loss=1.7e308, u_b=[1e308, 0]), "u_b"),
])
def test_times_whose_makespan_overflows_are_refused(kwargs, field):
    # compute_time was inf, plan_remat returned makespan inf and the CLI wrote JSON
    # Infinity (or raised a raw ValueError)
    args = {"u_f": [1, 1], "u_b": [1, 1], "x": [4, 5], "xbar": [8, 9], **kwargs}
    with pytest.raises(ChainError, match="too large") as err:
        Chain(**args)
    assert err.value.field == field


def test_huge_but_bounded_times_plan_to_finite_makespans():
    import json

    from rtmem.planners import min_feasible_memory, plan_remat
    chain = Chain(u_f=[1e300, 1e300], u_b=[1, 1], x=[4, 5], xbar=[8, 9])
    plan = plan_remat(chain, min_feasible_memory(chain))
    assert math.isfinite(plan.makespan) and math.isfinite(chain.compute_time)
    json.loads(plan.to_json(), parse_constant=lambda c: pytest.fail(f"JSON {c}"))


@pytest.mark.parametrize("kwargs", [
    dict(x=[3 * 2**60], xbar=[3 * 2**60]),               # a_1 + delta_1 during the loss
    dict(x=[1], xbar=[2], x0=2**61, w=[2**55], o_b=[2**55], o_loss=2**55),  # delta_0 at B 0
])
def test_sizes_whose_peak_is_beyond_unlimited_memory_are_refused(kwargs):
    # Both passed the old sum check, then every planner (plan_remat, compare_remat,
    # the baselines) raised a ScheduleError even at budget "inf": the store-all
    # peak is beyond the 2**62 bytes that stand for unlimited memory.
    with pytest.raises(ChainError, match="add up to"):
        Chain(u_f=[1], u_b=[1], **kwargs)


def test_sizes_just_within_the_bound_plan_at_unlimited_memory():
    from rtmem.planners import min_feasible_memory, plan_remat, plan_store_all
    chain = Chain(u_f=[1, 1], u_b=[1, 1], x=[2**58] * 2, xbar=[2**58] * 2, x0=2**58)
    assert plan_remat(chain, "inf").peak == plan_store_all(chain, "inf").peak < 2**62
    assert min_feasible_memory(chain) < 2**62


@pytest.mark.parametrize("n, stages", [("3", 3), (3.0, 3), (True, 1)])
def test_chain_document_stage_count_must_be_an_integer(n, stages):
    # "3" was refused as "says n = 3 but its arrays have 3 stages"; 3.0 and true
    # (for one stage) passed
    d = dict(Chain.homogeneous(stages).to_dict(), n=n)
    with pytest.raises(ChainError, match=f"n = {n!r} but"):
        Chain.from_dict(d)


def test_the_size_bound_is_reached_by_a_schedule_and_refuses_exactly_2_62():
    # One stage with x = xbar = a and x0 = c >= a: "F_ck 0, F_all 0, L, B 0" keeps
    # a_0, a_1 and abar_1 to B 0, which adds delta_1 (a) and its output delta_0
    # (c): a peak of 2c + 3a, the bound's x0 + sum(x) + sum(xbar) + max(x) +
    # max(xbar, x0). With 2c + 3a = 2**62 (a = 2**59, c = 5 * 2**58) that peak is
    # memory the planners cannot count: refused; one byte less of x0 plans.
    from rtmem.planners import Platform, Schedule, simulate
    a, c = 2**59, 5 * 2**58
    assert 2 * c + 3 * a == 2**62
    with pytest.raises(ChainError, match="add up to 4,611,686,018,427,387,904 bytes"):
        Chain(u_f=[1], u_b=[1], x=[a], xbar=[a], x0=c)
    chain = Chain(u_f=[1], u_b=[1], x=[a], xbar=[a], x0=c - 1)
    sched = Schedule.from_text("F_ck 0, F_all 0, L, B 0")
    assert simulate(chain, sched, Platform(math.inf)).peak == 2 * (c - 1) + 3 * a
    # weights and their gradients are both resident at B 0 of store-all:
    # 4 unit activations + 2 w bytes = 2**62 at w = 2**61 - 2
    with pytest.raises(ChainError, match="add up to"):
        Chain(u_f=[1], u_b=[1], x=[1], xbar=[1], x0=1, w=[2**61 - 2])
    chain = Chain(u_f=[1], u_b=[1], x=[1], xbar=[1], x0=1, w=[2**61 - 3])
    assert simulate(chain, Schedule.from_text("F_all 0, L, B 0"),
                    Platform(math.inf)).peak == 4 + 2 * (2**61 - 3)


@pytest.mark.parametrize("name", ["x0", "o_loss"])
@pytest.mark.parametrize("value", [2**62, float(2**62)])
def test_a_scalar_size_of_2_62_bytes_is_refused_by_its_own_name(name, value):
    # 2**62 is the planners' stand-in for unlimited memory: the scalar sizes stop
    # below it as the per-stage ones do (not only later, by the sum of all sizes)
    with pytest.raises(ChainError, match=rf"{name} = .* bytes is too large") as err:
        Chain(u_f=[1], u_b=[1], x=[1], xbar=[1], **{name: value})
    assert err.value.field == name


@pytest.mark.parametrize("change", [
    dict(u_f=[1, 9]), dict(u_b=[9, 1]), dict(x=[1, 2]), dict(xbar=[3, 2]), dict(w=[0, 1]),
    dict(o_f=[1, 0]), dict(o_b=[0, 1]), dict(x0=2), dict(u_loss=0.5), dict(o_loss=1),
    dict(name="other")])
def test_chains_that_differ_in_any_field_are_not_equal(change):
    base = dict(u_f=[1, 1], u_b=[1, 1], x=[1, 1], xbar=[2, 2], w=[0, 0], o_f=[0, 0],
                o_b=[0, 0], x0=1, u_loss=0.0, o_loss=0, name="c")
    assert Chain(**base) == Chain(**base)
    assert Chain(**base) != Chain(**{**base, **change})


@pytest.mark.parametrize("spec", ["gpt2:layers=0", "gpt2:batch=0", "resnet:batch=0",
                                  "resnet:image=31", "resnet:act_bytes=0"])
def test_specs_with_sizes_below_the_least_are_refused(spec):
    # a zero-layer GPT-2 or a zero-batch ResNet made a chain of zero sizes that
    # planned as if it were a model; a ResNet needs 32 pixels for its 5 halvings
    with pytest.raises(ChainError, match="must be"):
        from_spec(spec)


def test_resnet_sizes_by_hand():
    # resnet18 at 36 px, batch 2, 4-byte activations: the stem halves twice
    # (36 -> 9); each later group halves with ceiling (9 -> 5 -> 3 -> 2, not
    # 9 -> 4 -> 2 -> 1) and its first block has a projection shortcut
    b, p = 2, 4
    c = resnet(depth=18, image=36, batch=b, classes=10)
    assert c.n == 10 and c.x0 == 3 * 36 * 36 * b * p
    assert c.x[0] == 64 * 9 * 9 * b * p                         # stem: 64 x 9 x 9
    assert c.xbar[0] == (2 * 64 * 18 * 18 + 64 * 9 * 9) * b * p  # conv+BN at 18x18, pool
    # group 0, block 0: stride 1, 64 -> 64 channels: no projection;
    # 4 conv/BN outputs of 64 x 9 x 9 and the block output
    assert c.x[1] == 64 * 81 * b * p and c.xbar[1] == 5 * 64 * 81 * b * p
    # group 1, block 0: stride 2 (9 -> 5), 64 -> 128, projection conv + BN
    assert c.x[3] == 128 * 25 * b * p and c.xbar[3] == (4 + 1 + 2) * 128 * 25 * b * p
    assert c.x[5] == 256 * 9 * b * p and c.x[7] == 512 * 4 * b * p
    assert c.u_b.tolist() == (2 * c.u_f).tolist()
    # resnet50 group 0, block 0: stride 1 but 64 -> 256 channels, so a projection
    r = resnet(depth=50, image=64, batch=1, act_bytes=1)
    hw = 16 * 16
    assert r.x[1] == 256 * hw
    assert r.xbar[1] == (2 * 64 * hw + 2 * 64 * hw + 2 * 256 * hw + 256 * hw + 2 * 256 * hw)


def test_shipped_chains_are_what_their_generators_build():
    # the JSON files are package data written from SHIPPED: a generator changed
    # without rewriting them (or the reverse) made builtin("resnet50") and
    # from_spec("resnet:depth=50,image=224,batch=64") different chains
    from rtmem.planners import profiles
    for name, (family, kwargs) in profiles.SHIPPED.items():
        assert builtin(name) == getattr(profiles, family)(**kwargs, name=name), name


def _random_flagged_chain(rng, n):
    sizes = rng.integers(1, 1000, size=(5, n))
    return Chain(u_f=rng.random(n), u_b=rng.random(n), x=sizes[0], xbar=sizes[0] + sizes[1],
                 w=sizes[2], o_f=sizes[3], o_b=sizes[4], x0=int(rng.integers(1, 99)),
                 u_loss=float(rng.random()), o_loss=int(rng.integers(0, 99)),
                 no_recompute=rng.random(n) < 0.5, name="random")


def test_select_keeps_every_per_stage_field_of_the_stages_it_takes():
    # bench/train_gpu.py stretched a profiled chain by copying seven named columns
    # and lost no_recompute; select takes every array field of the dataclass
    rng = np.random.default_rng()
    chain = _random_flagged_chain(rng, 6)
    idx = rng.integers(0, 6, size=11)
    sub = chain.select(idx, name="stretched")
    arrays = [f.name for f in dataclasses.fields(Chain)
              if isinstance(getattr(chain, f.name), np.ndarray)]
    assert "no_recompute" in arrays and len(arrays) == 8
    for a in arrays:
        assert np.array_equal(getattr(sub, a), getattr(chain, a)[idx]), a
    assert (sub.x0, sub.u_loss, sub.o_loss, sub.name) == (chain.x0, chain.u_loss,
                                                          chain.o_loss, "stretched")
    assert chain.select(range(6)) == chain


@pytest.mark.parametrize("stages, fragment", [
    ([], "non-empty"), ([0, 6], "index 6 .position 1. is out of range"),
    ([-1], "index -1"), ([0.0, 1.0], "integers"), ([True, False], "integers"),
    ([[0, 1]], "non-empty")])
def test_select_refuses_bad_stage_indices(stages, fragment):
    chain = _random_flagged_chain(np.random.default_rng(), 6)
    with pytest.raises(ChainError, match=fragment) as err:
        chain.select(stages)
    assert err.value.field == "stages"


@pytest.mark.parametrize("field, index, value, shown", [
    ("x", 2, True, "true"),                 # was read as a size of 1 byte
    ("x", 1, "32768", '"32768"'),           # a quoted number was read as a number
    ("u_f", 0, "0.1", '"0.1"'),
    ("u_b", 2, None, "null"),               # was reported as "u_b[2] = nan"
    ("xbar", 0, "32KiB", '"32KiB"'),        # the message printed the whole list
    ("x0", None, True, "true"), ("u_loss", None, "1", '"1"'), ("o_loss", None, None, "null"),
])
def test_chain_document_refuses_values_that_are_not_json_numbers(field, index, value, shown):
    # Chain's constructor converts what numpy and float() convert; a document's
    # values must be the JSON numbers to_dict writes, named with their index
    rng = np.random.default_rng()
    x = rng.integers(1, 1000, 4)
    d = Chain(u_f=rng.random(4), u_b=rng.random(4), x=x, xbar=x + 5, x0=8,
              u_loss=0.5, o_loss=4).to_dict()
    if index is None:
        d[field] = value
    else:
        d[field][index] = value
    where = field if index is None else f"{field}[{index}]"
    with pytest.raises(ChainError, match=re.escape(f"{where} = {shown} ")) as e:
        Chain.from_dict(d)
    assert (e.value.field, e.value.index) == (field, index)


def test_chain_document_name_must_be_a_string():
    d = dict(Chain.homogeneous(2).to_dict(), name=5)
    with pytest.raises(ChainError, match="name"):
        Chain.from_dict(d)


def test_load_names_the_file_and_keeps_the_error_fields(tmp_path):
    d = Chain.homogeneous(3).to_dict()
    d["xbar"][1] = "big"
    (tmp_path / "c.json").write_text(json.dumps(d))
    with pytest.raises(ChainError, match=re.escape(f"{tmp_path / 'c.json'}: xbar[1] = ")) as e:
        Chain.load(tmp_path / "c.json")
    assert (e.value.field, e.value.index) == ("xbar", 1)
