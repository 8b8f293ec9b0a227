"""rtmem.optim's numpy front end, NumpyAdam / NumpyAdamW (no torch needed: these run
on a core install; the torch front end is tests/test_optim.py)."""

from __future__ import annotations

import numpy as np
import pytest

import rtmem.optim as optim
from rtmem.errors import OptimizerError
from rtmem.kernels import adam_update

from _subprocess import run_ok


def test_numpy_api_works_without_torch():
    # A fresh interpreter where `import torch` fails.
    code = """
        import sys
        sys.modules["torch"] = None
        import numpy as np
        import rtmem.optim as optim
        p = np.linspace(-1, 1, 100, dtype=np.float32)
        opt = optim.NumpyAdamW([p], lr=0.1)
        assert opt.step([np.ones(100, np.float32)])
        assert np.all(p < np.linspace(-1, 1, 100, dtype=np.float32))
        try:
            optim.CPUAdam
        except ImportError as e:
            assert "NumpyAdam" in str(e), e
        else:
            raise AssertionError("CPUAdam resolved without torch")
        print("ok")
    """
    run_ok(code)


def test_numpy_adam_is_the_fused_kernel_step_by_step():
    rng = np.random.default_rng(0)
    shapes = [(300, 5), (17,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    mirror = [p.copy() for p in params]
    m = [np.zeros(s, np.float32) for s in shapes]
    v = [np.zeros(s, np.float32) for s in shapes]
    vmax = [np.zeros(s, np.float32) for s in shapes]
    opt = optim.NumpyAdamW(params, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1,
                           amsgrad=True)
    for step in range(1, 8):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        assert opt.step(grads)
        for i in range(2):
            adam_update(mirror[i], grads[i], m[i], v[i], max_exp_avg_sq=vmax[i], lr=1e-2,
                        step=step, beta1=0.8, beta2=0.99, weight_decay=0.1,
                        decoupled_weight_decay=True)
    for i in range(2):
        assert params[i].tobytes() == mirror[i].tobytes()
        assert opt.state[i]["exp_avg"].tobytes() == m[i].tobytes()
        assert opt.state[i]["max_exp_avg_sq"].tobytes() == vmax[i].tobytes()
        assert opt.state[i]["step"] == 7


def test_numpy_adam_on_arena_buffers_with_state_in_the_arena(monkeypatch):
    import gc

    import rtmem
    from rtmem.errors import UseAfterFreeError
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    arena = rtmem.HostArena(1 << 22)
    rng = np.random.default_rng(5)
    shapes = [(40, 3), (7,)]
    bufs = [arena.alloc(shape=s, dtype=np.float32, kind="weight") for s in shapes]
    grads = [arena.alloc(shape=s, dtype=np.float32, kind="gradient") for s in shapes]
    for b in bufs:
        b.numpy()[...] = rng.standard_normal(b.shape)
    mirror = [b.numpy().copy() for b in bufs]
    opt = optim.NumpyAdam(bufs, lr=1e-2, amsgrad=True, state_arena=arena)
    ref = optim.NumpyAdam(mirror, lr=1e-2, amsgrad=True)
    state_bytes = arena.stats().requested_by_kind["optimizer-state"]
    assert state_bytes == 3 * 4 * sum(int(np.prod(s)) for s in shapes)
    for _ in range(4):
        for g in grads:
            g.numpy()[...] = rng.standard_normal(g.shape)
        assert opt.step(grads) and ref.step([g.numpy().copy() for g in grads])
    for b, m in zip(bufs, mirror):          # the arena's bytes were updated in place
        assert b.numpy().tobytes() == m.tobytes()
    assert opt.state[0]["max_exp_avg_sq"].tobytes() == ref.state[0]["max_exp_avg_sq"].tobytes()
    # freeing a parameter the optimizer still views waits for the optimizer
    bufs[0].free()
    assert arena.stats().count_by_kind["weight"] == 2
    with pytest.raises(UseAfterFreeError):
        optim.NumpyAdam([bufs[0]])
    del opt
    gc.collect()
    counts = arena.stats().count_by_kind
    assert counts["weight"] == 1 and counts["optimizer-state"] == 0
    arena._check_invariants()


def test_cpu_adam_on_arena_buffers(monkeypatch):
    torch = pytest.importorskip("torch")
    import rtmem
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    arena = rtmem.HostArena(1 << 20)
    buf = arena.alloc(shape=(64,), dtype=np.float32, kind="weight")
    buf.numpy()[...] = np.random.default_rng(6).standard_normal(64)
    twin = torch.tensor(buf.numpy().copy(), requires_grad=True)
    opt = optim.CPUAdamW([buf], lr=1e-2)
    ref = optim.CPUAdamW([twin], lr=1e-2)
    for k in range(3):
        g = torch.randn(64, generator=torch.Generator().manual_seed(k))
        opt.step(grads=[g])
        ref.step(grads=[g])
    assert buf.numpy().tobytes() == twin.detach().numpy().tobytes()
    # the gradients (and the fp16 copies) of Buffer parameters may be Buffers too,
    # as the docstring has it and NumpyAdam takes them: they were refused ("grad
    # must be a torch.Tensor or numpy array, got Buffer")
    grad = arena.alloc(shape=(64,), dtype=np.float32, kind="gradient")
    copy = arena.alloc(shape=(64,), dtype=np.float16, kind="workspace")
    want = torch.empty(64, dtype=torch.float16)
    for k, as_dict in ((3, False), (4, True)):
        g = torch.randn(64, generator=torch.Generator().manual_seed(k))
        grad.numpy()[...] = g.numpy()
        opt.step(grads={buf: grad} if as_dict else [grad],
                 copies={buf: copy} if as_dict else [copy])
        ref.step(grads=[g], copies=[want])
        assert buf.numpy().tobytes() == twin.detach().numpy().tobytes()
        assert copy.numpy().tobytes() == want.numpy().tobytes()
    half = arena.alloc(shape=(4,), dtype=np.float16)
    with pytest.raises(OptimizerError, match="float32"):
        optim.CPUAdam([half])


def test_numpy_adam_skips_overflowing_step_and_round_trips_state():
    rng = np.random.default_rng(1)
    p = rng.standard_normal(1000).astype(np.float32)
    opt = optim.NumpyAdam([p], lr=1e-3)
    for _ in range(3):
        opt.step([rng.standard_normal(1000).astype(np.float16)], grad_scale=8.0)
    saved = opt.state_dict()
    before = (p.copy(), opt.state[0]["exp_avg"].copy(), opt.state[0]["step"])
    bad = rng.standard_normal(1000).astype(np.float16)
    bad[999] = np.inf
    assert opt.step([bad], grad_scale=8.0) is False
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert p.tobytes() == before[0].tobytes()
    assert opt.state[0]["exp_avg"].tobytes() == before[1].tobytes()
    assert opt.state[0]["step"] == before[2] == 3
    # Mutating the optimizer never reaches the saved copy, and loading restores it.
    opt.step([rng.standard_normal(1000).astype(np.float32)])
    assert opt.state[0]["step"] == 4 and saved["state"][0]["step"] == 3
    opt.load_state_dict(saved)
    assert opt.state[0]["step"] == 3
    assert opt.state[0]["exp_avg"].tobytes() == before[1].tobytes()


def test_numpy_adam_rejects_bad_input():
    p = np.ones(10, np.float32)
    with pytest.raises(OptimizerError, match="lr"):
        optim.NumpyAdam([p], lr=-1.0)
    with pytest.raises(OptimizerError, match="pair"):
        optim.NumpyAdam([p], betas=0.9)
    with pytest.raises(OptimizerError, match="float32"):
        optim.NumpyAdam([np.ones(10)])
    with pytest.raises(OptimizerError, match="contiguous"):
        optim.NumpyAdam([np.ones(20, np.float32)[::2]])
    opt = optim.NumpyAdam([p])
    with pytest.raises(OptimizerError, match="2 gradients for 1"):
        opt.step([p, p])
    # hyper edited after construction is checked at each step: an OptimizerError,
    # not a bare TypeError from unpacking betas, and nothing changes
    opt.hyper["betas"] = 0.9
    with pytest.raises(OptimizerError, match="pair") as info:
        opt.step([np.ones(10, np.float32)])
    assert info.value.argument == "betas"
    assert (p == 1).all() and opt.state[0]["step"] == 0


def test_numpy_adam_refused_state_dict_changes_nothing():
    # Checked in full before any copy: param 0's state must not be loaded when
    # param 1's is bad.
    rng = np.random.default_rng(2)
    ps = [rng.standard_normal(n).astype(np.float32) for n in (4, 3)]
    opt = optim.NumpyAdam(ps, lr=1e-2)
    opt.step([rng.standard_normal(p.shape).astype(np.float32) for p in ps])
    before = opt.state_dict()
    for key, value, fragment in [("step", None, "step is None"),
                                 ("step", "x", "step is 'x'"),
                                 ("step", -1, "step is -1"),
                                 ("exp_avg", np.ones(3, np.complex64), "complex64")]:
        bad = opt.state_dict()
        bad["state"][0]["exp_avg"][:] = 42.0
        bad["state"][0]["step"] = 99
        bad["state"][1][key] = value
        with pytest.raises(OptimizerError, match=fragment):
            opt.load_state_dict(bad)
        for st, ref in zip(opt.state, before["state"]):
            assert st["step"] == ref["step"]
            assert st["exp_avg"].tobytes() == ref["exp_avg"].tobytes()


def test_numpy_load_state_dict_refuses_too_few_states_and_reshaped_moments():
    # Checked before any copy: a dict for fewer params loaded its first states
    # (zip stops early), a moment of the right size but another shape failed in
    # np.copyto after the params before it were loaded.
    rng = np.random.default_rng(3)
    ps = [rng.standard_normal(s).astype(np.float32) for s in ((3,), (2, 2))]
    opt = optim.NumpyAdam(ps, lr=1e-2)
    opt.step([rng.standard_normal(p.shape).astype(np.float32) for p in ps])
    before = opt.state_dict()
    short = opt.state_dict()
    short["state"] = short["state"][:1]
    short["state"][0]["step"] = 9
    reshaped = opt.state_dict()
    reshaped["state"][0]["step"] = 9
    reshaped["state"][1]["exp_avg"] = reshaped["state"][1]["exp_avg"].reshape(4)
    for bad, fragment in ((short, "state for 1 params, this optimizer has 2"),
                          (reshaped, r"param 1: exp_avg has shape \(4,\), expected \(2, 2\)")):
        with pytest.raises(OptimizerError, match=fragment) as info:
            opt.load_state_dict(bad)
        assert info.value.argument == "state_dict"
        for st, ref in zip(opt.state, before["state"]):
            assert st["step"] == ref["step"] == 1
            assert st["exp_avg"].tobytes() == ref["exp_avg"].tobytes()


def test_numpy_load_state_dict_copies_into_the_optimizers_own_arrays():
    # The docstring's promise: the state arrays stay the optimizer's (a
    # state_arena's memory), the loaded dict is never written, and a float64
    # dict (e.g. from np.savez of a cast) loads as float32.
    rng = np.random.default_rng(4)
    p = rng.standard_normal(6).astype(np.float32)
    opt = optim.NumpyAdam([p], lr=1e-2)
    opt.step([rng.standard_normal(6).astype(np.float32)])
    saved = opt.state_dict()
    kept = {k: saved["state"][0][k].copy() for k in ("exp_avg", "exp_avg_sq")}
    own = {k: opt.state[0][k] for k in kept}
    opt.load_state_dict(saved)
    assert all(opt.state[0][k] is own[k] for k in kept)
    opt.step([rng.standard_normal(6).astype(np.float32)])
    for k, v in kept.items():
        assert saved["state"][0][k].tobytes() == v.tobytes(), k
    wide = opt.state_dict()
    wide["state"][0] = {k: (v.astype(np.float64) if k != "step" else v)
                        for k, v in wide["state"][0].items()}
    opt.load_state_dict(wide)
    assert all(opt.state[0][k].dtype == np.float32 for k in kept)
    assert opt.step([rng.standard_normal(6).astype(np.float32)])


def test_adamw_default_weight_decay_is_torchs_1e_2():
    # First step, by hand in float64: the bias-corrected moments are g and g**2,
    # so p <- p * (1 - lr * wd) - lr * g / (|g| + eps), with wd = 1e-2 by default.
    g = np.array([0.5, -2.0, 1.0, -0.25], np.float32)
    p0 = np.array([1.0, -3.0, 2.0, 0.5], np.float32)
    want = p0 * (1 - 0.1 * 1e-2) - 0.1 * g / (np.abs(g.astype(np.float64)) + 1e-8)
    p = p0.copy()
    optim.NumpyAdamW([p], lr=0.1).step([g])
    np.testing.assert_allclose(p, want, rtol=1e-6)


def test_numpy_adam_refuses_params_that_share_memory():
    # Each occurrence would be updated once per step: two Adam steps a step.
    p = np.zeros(3, np.float32)
    base = np.zeros(16, np.float32)
    for params, pair in [([p, p], "params[0] and params[1]"),
                         ([np.ones(2, np.float32), base[:6], base[4:]],
                          "params[1] and params[2]"),
                         ([base[8:], base, np.ones(2, np.float32)],     # one inside another
                          "params[0] and params[1]"),
                         ([base.reshape(4, 4)[1:3], base[4:5]], "params[0] and params[1]")]:
        with pytest.raises(OptimizerError, match=r"overlap in memory") as info:
            optim.NumpyAdam(params, lr=0.1)
        assert pair in str(info.value) and info.value.argument == "params"
    assert not base.any() and not p.any()
    # Adjacent, disjoint views of one array are fine (and zero-size ones touch nothing).
    opt = optim.NumpyAdam([base[:8], base[8:], base[8:8]], lr=0.1)
    assert opt.step([np.ones(8, np.float32), np.ones(8, np.float32),
                     np.ones(0, np.float32)])
    np.testing.assert_allclose(base, -0.1, rtol=1e-6)


def test_numpy_load_state_dict_checks_the_hyperparameters_it_is_given():
    opt = optim.NumpyAdam([np.ones(4, np.float32)], lr=1e-2, amsgrad=True)
    opt.step([np.ones(4, np.float32)])
    before = opt.state_dict()
    for key in ("lr", "amsgrad", "maximize"):
        bad = opt.state_dict()
        del bad["hyper"][key]
        bad["state"][0]["step"] = 7
        with pytest.raises(OptimizerError, match=f"lacks '{key}'"):
            opt.load_state_dict(bad)
    # amsgrad=False with max_exp_avg_sq state: the flag would contradict the algorithm.
    bad = opt.state_dict()
    bad["hyper"]["amsgrad"] = False
    bad["state"][0]["step"] = 7
    with pytest.raises(OptimizerError, match="amsgrad=False") as info:
        opt.load_state_dict(bad)
    assert info.value.argument == "state_dict"
    assert opt.hyper == before["hyper"] and opt.state[0]["step"] == 1
    good = opt.state_dict()
    good["hyper"]["lr"] = np.float64(0.5)
    opt.load_state_dict(good)
    assert opt.hyper["lr"] == 0.5 and type(opt.hyper["lr"]) is float


def test_numpy_adam_errors_name_the_param_and_the_keyword():
    ps = [np.ones(4, np.float32) for _ in range(3)]
    opt = optim.NumpyAdam(ps, lr=1e-2)
    ok = np.ones(4, np.float32)
    with pytest.raises(OptimizerError, match=r"^param 1: grad has shape \(5,\)") as info:
        opt.step([ok, np.ones(5, np.float32), ok])
    assert info.value.argument == "grads"
    with pytest.raises(OptimizerError, match=r"^param 2: copies is not C-contiguous") as info:
        opt.step([ok, ok, ok], copies=[None, None, np.ones(8, np.float32)[::2]])
    assert info.value.argument == "copies"
    with pytest.raises(OptimizerError, match=r"^params\[1\]: param is not C-contiguous"):
        optim.NumpyAdam([ok, np.ones(8, np.float32)[::2]])
    assert all((p == 1).all() for p in ps)


@pytest.mark.parametrize("key, bad", [("exp_avg_sq", -1e-3), ("exp_avg_sq", -np.inf),
                                      ("max_exp_avg_sq", -2.0), ("max_exp_avg_sq", -1e39)])
def test_numpy_load_state_dict_refuses_moments_the_step_would_turn_into_nan(key, bad):
    # Copied in as given: sqrt of a negative second moment made the parameter
    # NaN at the next step, silently (non-finite moments load as they are).
    rng = np.random.default_rng(5)
    ps = [rng.standard_normal(s).astype(np.float32) for s in ((3,), (2, 4))]
    opt = optim.NumpyAdam(ps, lr=1e-2, amsgrad=True)
    opt.step([rng.standard_normal(p.shape).astype(np.float32) for p in ps])
    before = opt.state_dict()
    bad_dict = opt.state_dict()
    bad_dict["state"][1][key] = bad_dict["state"][1][key].astype(np.float64)
    index = (int(rng.integers(2)), int(rng.integers(4)))
    bad_dict["state"][1][key][index] = bad
    bad_dict["state"][0]["step"] = 9
    with pytest.raises(OptimizerError, match=rf"param 1: {key} has 1 negative element\(s\)"
                       rf".*at index \({index[0]}, {index[1]}\)") as info:
        opt.load_state_dict(bad_dict)
    assert info.value.argument == "state_dict"
    for st, ref in zip(opt.state, before["state"]):
        assert st["step"] == ref["step"] == 1
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert st[name].tobytes() == ref[name].tobytes()
    bad_dict["state"][1][key][index] = 0.0
    opt.load_state_dict(bad_dict)
    assert opt.step([rng.standard_normal(p.shape).astype(np.float32) for p in ps])
    assert all(np.isfinite(p).all() for p in ps)


def test_a_numpy_state_written_by_a_step_on_non_finite_gradients_loads_back():
    # NumpyAdam.load_state_dict's docstring still said each moment must be
    # finite after the loads stopped refusing inf/NaN moments (which a step on
    # non-finite gradients writes): its round trip gives such a state back
    rng = np.random.default_rng(11)
    p = rng.standard_normal(4).astype(np.float32)
    opt = optim.NumpyAdam([p], lr=0.1, betas=(0.0, 0.6), amsgrad=True)
    assert opt.step([np.array([np.inf, np.nan, 1.0, -2.0], np.float32)])
    saved = opt.state_dict()
    assert not np.isfinite(saved["state"][0]["exp_avg_sq"]).all()
    again = optim.NumpyAdam([rng.standard_normal(4).astype(np.float32)], amsgrad=True)
    again.load_state_dict(saved)
    for key, value in saved["state"][0].items():
        np.testing.assert_array_equal(again.state_dict()["state"][0][key], value)
    assert "finite" not in optim.NumpyAdam.load_state_dict.__doc__.split("inf/NaN")[0]


@pytest.mark.parametrize("saved_cls, loading_cls", [("NumpyAdamW", "NumpyAdam"),
                                                    ("NumpyAdam", "NumpyAdamW")])
def test_a_state_dict_of_the_other_weight_decay_is_refused(saved_cls, loading_cls):
    # The dict did not say which decay made it: a NumpyAdamW checkpoint resumed
    # in a NumpyAdam with its weight_decay as an L2 term added to the gradient
    # (another algorithm), silently. CPUAdam's groups carry it; here the class
    # is the algorithm, so the other one is refused, as amsgrad is.
    rng = np.random.default_rng(11)
    shapes = [(3, 2), (5,)]
    saved_ps = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    saved = getattr(optim, saved_cls)(saved_ps, lr=1e-2, weight_decay=0.1)
    saved.step([rng.standard_normal(s).astype(np.float32) for s in shapes])
    sd = saved.state_dict()
    ps = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    opt = getattr(optim, loading_cls)(ps, lr=1e-3, weight_decay=0.1)
    before = opt.state_dict()
    with pytest.raises(OptimizerError, match=rf"saved by a {saved_cls}.*build a "
                       rf"{saved_cls} to resume it") as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    assert opt.hyper == before["hyper"]
    assert all(st["step"] == 0 and not st["exp_avg"].any() for st in opt.state)
    again = getattr(optim, saved_cls)([p.copy() for p in ps], lr=1e-3, weight_decay=0.1)
    again.load_state_dict(sd)                   # the same class still loads it
    assert again.state[0]["step"] == 1 and again.hyper == saved.hyper
    older = {k: v for k, v in sd.items() if k != "decoupled_weight_decay"}
    opt.load_state_dict(older)                  # a dict saved before it said: as before
    assert opt.state[0]["step"] == 1


def test_numpy_adam_refused_for_a_full_arena_gives_back_the_state_it_made(monkeypatch):
    # Room for the first parameter's moments only: the constructor raises
    # part-way through; what it made goes back to the arena at once, not when
    # the traceback (held here) is dropped.
    import rtmem
    from rtmem.errors import OutOfMemoryError
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    arena = rtmem.HostArena(6 * 4096)       # a moment: 4,000 B, 4 KiB once aligned
    filler = arena.alloc(3 * 4096, kind="workspace")
    params = [np.zeros(1000, np.float32), np.zeros(1000, np.float32)]
    with pytest.raises(OutOfMemoryError) as caught:
        optim.NumpyAdam(params, amsgrad=True, state_arena=arena)
    err = caught.value
    assert err.__traceback__ is not None
    st = arena.stats()
    assert st.requested_by_kind["optimizer-state"] == 0
    assert st.count_by_kind["optimizer-state"] == 0
    arena._check_invariants()
    # the arena takes the same optimizer once it has room
    filler.free()
    opt = optim.NumpyAdam(params, amsgrad=True, state_arena=arena)
    assert arena.stats().requested_by_kind["optimizer-state"] == 3 * 2 * 4 * 1000
    del opt, err


@pytest.mark.parametrize("cls", ["NumpyAdam", "NumpyAdamW"])
def test_numpy_adam_close_gives_the_state_back_and_later_use_is_refused(monkeypatch, cls):
    import copy

    import rtmem
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    arena = rtmem.HostArena(1 << 20)
    rng = np.random.default_rng()
    p = rng.standard_normal(300).astype(np.float32)
    opt = getattr(optim, cls)([p], lr=1e-2, amsgrad=True, state_arena=arena)
    opt.step([rng.standard_normal(300).astype(np.float32)])
    saved, after_step = opt.state_dict(), p.copy()
    opt.close()
    # back at once: state_dict() copies, so nothing else views the buffers
    stats = arena.stats()
    assert stats.count_by_kind["optimizer-state"] == 0
    assert stats.requested_by_kind["optimizer-state"] == 0
    arena._check_invariants()
    opt.close()                          # idempotent
    grads = [np.ones(300, np.float32)]
    for call, what in ((lambda: opt.step(grads), "cannot step"),
                       (opt.state_dict, "cannot save"),
                       (lambda: opt.load_state_dict(saved), "cannot load")):
        with pytest.raises(OptimizerError, match=f"{what}.*closed.*close") as e:
            call()
        assert e.value.argument == "self"
    assert np.array_equal(p, after_step) and opt.state == []
    with pytest.raises(OptimizerError, match="closed"):
        copy.deepcopy(opt).step(grads)   # a copy stays closed
    # the saved state resumes in a new optimizer
    fresh = getattr(optim, cls)([p], lr=1e-2, amsgrad=True, state_arena=arena)
    fresh.load_state_dict(saved)
    assert fresh.state[0]["step"] == 1


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
@pytest.mark.parametrize("value", [np.ones(5, np.int64), np.ones(5, np.uint8),
                                   np.ones(5, bool), [1, 0, 1, 0, 1]],
                         ids=["int64", "uint8", "bool", "int-list"])
def test_numpy_load_state_dict_refuses_an_integer_or_bool_moment(key, value):
    # The same rule as CPUAdam and OffloadedAdam (tests/test_optim.py): a
    # non-floating moment means the dict is not an Adam state; it was cast to
    # float32 and loaded.
    rng = np.random.default_rng()
    p = rng.standard_normal(5).astype(np.float32)
    opt = optim.NumpyAdam([p], lr=1e-2, amsgrad=True)
    opt.step([rng.standard_normal(5).astype(np.float32)])
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][0][key] = value
    dtype = np.asarray(value).dtype
    with pytest.raises(OptimizerError, match=rf"param 0: {key} has dtype {dtype}; "
                       rf"expected real floating point") as e:
        opt.load_state_dict(bad)
    assert e.value.argument == "state_dict"
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert opt.state[0][k].tobytes() == before["state"][0][k].tobytes()
    # floating moments of any precision still load (float16 here)
    ok = opt.state_dict()
    ok["state"][0][key] = ok["state"][0][key].astype(np.float16)
    opt.load_state_dict(ok)
