"""rtmem.LossScaler against torch.amp.GradScaler: the same scale schedule bit for
bit, the same training (skipped steps included) with CPUAdam, OffloadedAdam and
NumpyAdam as with torch.optim.Adam, checkpoints that move between the two, and
misuse refused with the scaler unchanged."""

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from rtmem import LossScaler  # noqa: E402
from rtmem.errors import LossScaleError, OptimizerError  # noqa: E402
from rtmem.loss_scale import _MAX_SCALE, _MIN_SCALE  # noqa: E402
from rtmem.optim import CPUAdam, NumpyAdam  # noqa: E402
from rtmem.planners import min_feasible_memory, plan_remat  # noqa: E402
from rtmem.torch import (OffloadedAdam, ScheduleExecutor, gpt2_model,  # noqa: E402
                         profile_sequential)


@pytest.fixture(autouse=True)
def host_backend(monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "host")


HYPER = dict(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=3)


def torch_scaler(**kw):
    return torch.amp.GradScaler("cpu", **{**HYPER, **kw})


def state_of(scaler):
    return scaler.get_scale(), scaler.state_dict()["_growth_tracker"]


# ----------------------------------------------------------------- the schedule

@settings(max_examples=60, deadline=None)
@given(init=st.floats(1e-30, 3e38), growth=st.floats(1.0001, 1e4),
       backoff=st.floats(1e-4, 0.9999), interval=st.integers(1, 4),
       skips=st.lists(st.booleans(), min_size=1, max_size=40))
def test_the_schedule_is_gradscalers_bit_for_bit(init, growth, backoff, interval, skips):
    """One parameter, a gradient that is inf on the chosen steps: torch's scaler
    (over torch.optim.SGD) and ours (over NumpyAdam, whose kernel finds the inf)
    give the same float32 scale and growth count after every update."""
    hyper = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                 growth_interval=interval)
    ref, mine = torch.amp.GradScaler("cpu", **hyper), LossScaler(**hyper)
    p = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.0)
    adam = NumpyAdam([np.zeros(1, np.float32)], lr=0.0)
    ref.scale(torch.ones(()))
    assert ref.get_scale() == mine.get_scale()
    for skip in skips:
        g = np.float32("inf" if skip else 1.0)
        p.grad = torch.full((1,), float(g))
        ref.step(sgd)
        ref.update()
        mine.step(adam, [np.array([g])])
        assert adam.last_step_skipped == skip
        try:
            mine.update()
        except LossScaleError:      # ours stops where the reciprocal leaves float32
            assert ref.get_scale() < _MIN_SCALE
            return
        assert state_of(mine) == state_of(ref)


def test_growth_stops_at_the_float32_limit_and_backoff_error_leaves_the_scale():
    s = LossScaler(init_scale=3e38, growth_interval=1)
    adam = NumpyAdam([np.zeros(2, np.float32)])
    s.step(adam, [np.ones(2, np.float32)])
    s.update()
    assert s.get_scale() == float(np.float32(3e38))     # 6e38 is inf in float32: kept
    tiny = LossScaler(init_scale=2e-38)
    tiny.step(adam, [np.full(2, np.nan, np.float32)])
    with pytest.raises(LossScaleError, match=r"non-finite.*end it with "
                                             r"update\(new_scale=\.\.\.\)"):
        tiny.update()
    assert tiny.get_scale() == float(np.float32(2e-38))
    # the next step said only "call update() once per iteration", which raised again
    with pytest.raises(LossScaleError, match=r"already called.*update\(new_scale=\.\.\.\)"):
        tiny.step(adam, [np.ones(2, np.float32)])
    # the pending skip is still there: a new scale ends the iteration
    tiny.update(new_scale=1.0)
    assert tiny.get_scale() == 1.0


# ----------------------------------------------------------------- training

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(n, bad=(), seed=1):
    """Random batches; on the ``bad`` steps the loss is multiplied by 1e38, so its
    scaled gradients overflow whatever the parameters (a deterministic skip)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g),
             1e38 if i in bad else 1.0) for i in range(n)]


def train(model, opt, scaler, data, clip=None, loss_fn=torch.nn.functional.mse_loss):
    scales = []
    for x, y, blow_up in data:
        loss = loss_fn(model(x), y) * blow_up
        scaler.scale(loss).backward()
        if clip is not None:
            clip()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(state_of(scaler))
    return scales


BAD = {2, 3, 9, 10, 11, 17}


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def against_torch(make_opt, scaler, clip=None):
    """Train ``make_opt(params)`` driven by ``scaler`` and, on a copy of the
    model, torch.optim.Adam driven by GradScaler (with ``unscale_`` + torch's
    clipping when ``clip`` is given), over batches that overflow on the BAD
    steps. Asserts the same scales after every update and the same parameters;
    returns (model, optimizer, the scales)."""
    mine, ref = make_model(), make_model()
    data = batches(24, BAD)
    ref_opt, ref_scaler = torch.optim.Adam(ref.parameters(), lr=1e-2), torch_scaler()
    opt = make_opt(mine.parameters())
    ref_clip = my_clip = None
    if clip is not None:
        def ref_clip():
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)

        def my_clip():
            clip(mine, opt)
    want = train(ref, ref_opt, ref_scaler, data, ref_clip)
    assert train(mine, opt, scaler, data, my_clip) == want
    assert_same_params(mine, ref)
    return mine, opt, want


@pytest.mark.parametrize("kind", ["cpu_adam", "offloaded_adam", "offloaded_adam_clipped",
                                  "cpu_adam_clipped"])
def test_training_matches_gradscaler_with_torch_adam(kind):
    scaler, clip = LossScaler(**HYPER), None
    if kind.startswith("cpu_adam"):
        def make_opt(params):
            return CPUAdam(params, lr=1e-2)
    else:
        def make_opt(params):
            return OffloadedAdam(params, lr=1e-2, chunk_elements=7)
    if kind == "offloaded_adam_clipped":
        def clip(model, opt):
            opt.clip_grad_norm_(0.05, grad_scale=scaler.get_scale())
    unscaled_norms = []
    if kind == "cpu_adam_clipped":
        # LossScaler's documented recipe for CPUAdam (it has no unscale_): clip
        # the scaled gradients at max_norm * S, as GradScaler's unscale_ + clip
        # at max_norm (a clip at plain 0.05 here fails the comparison)
        def clip(model, opt):
            s = scaler.get_scale()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 * s)
            unscaled_norms.append(float(norm) / s)
    _, opt, want = against_torch(make_opt, scaler, clip)
    assert opt.skipped_steps == len(BAD)
    assert len({s for s, _ in want}) > 4      # it grew and backed off, more than once
    if kind == "cpu_adam_clipped":             # the clip did cut the good steps' norms
        assert sum(0.05 < n < math.inf for n in unscaled_norms) > 10
    if not kind.startswith("cpu_adam"):
        opt.close()


def test_two_optimizers_skip_on_their_own_and_the_update_backs_off():
    """As with GradScaler: the optimizer whose gradients overflowed skips, the
    other steps, and the update backs off once."""
    def two():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(3, 4, generator=g), 1e38 if i in (1, 4) else 1.0) for i in range(8)]

    def run(a, b, opts, scaler):
        scales = []
        for x, blow_up in data:
            loss = a(x).square().mean() + b(x).square().mean() * blow_up
            scaler.scale(loss).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
            for o in opts:
                o.zero_grad()
            scales.append(state_of(scaler))
        return scales

    ra, rb = two()
    ma, mb = two()
    want = run(ra, rb, [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ra, rb)],
               torch_scaler())
    opts = [OffloadedAdam(m.parameters(), lr=1e-2) for m in (ma, mb)]
    assert run(ma, mb, opts, LossScaler(**HYPER)) == want
    assert [o.skipped_steps for o in opts] == [0, 2]
    assert_same_params(ma, ra)
    assert_same_params(mb, rb)
    for o in opts:
        o.close()


def test_a_schedule_executor_scales_inside_its_loss_function():
    """The executor calls loss_fn at the schedule's L: scaling there gives the
    gradients of plain training with GradScaler, remat and skips included."""
    model, loss_fn, make = gpt2_model(layers=3, hidden=16, heads=2, seq=8, vocab=32)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    data = [(*make(2, g), 1e38 if i in (1, 5) else 1.0) for i in range(8)]
    chain = profile_sequential(model, *data[0][:2], loss_fn, repeats=1)
    plan = plan_remat(chain, min_feasible_memory(chain))
    assert "F_ck" in str(plan.schedule)       # it recomputes
    scaler, blow_up = LossScaler(**HYPER), [1.0]
    ex = ScheduleExecutor(model, plan, lambda out, y: scaler.scale(loss_fn(out, y) * blow_up[0]))
    # eps=1e-3: the attention's key bias has an analytically zero gradient, whose
    # float32 noise (~1e-9, different under remat) Adam would blow up to lr-sized
    # steps with eps=1e-8
    opt = CPUAdam(model.parameters(), lr=1e-2, eps=1e-3)
    got = []
    for x, y, b in data:
        blow_up[0] = b
        ex.step(x, y)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        got.append(state_of(scaler))
    ref_opt, ref_scaler = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-3), torch_scaler()
    want = train(ref, ref_opt, ref_scaler, data, loss_fn=loss_fn)
    assert got == want and opt.skipped_steps == 2
    assert_same_params(model, ref)


def test_numpy_adam_without_torch_tensors():
    rng = np.random.default_rng()
    p = rng.standard_normal(16).astype(np.float32)
    ref = p.copy()
    adam, ref_adam = NumpyAdam([p], lr=1e-2), NumpyAdam([ref], lr=1e-2)
    scaler = LossScaler(**HYPER)
    g = rng.standard_normal(16).astype(np.float32)
    assert scaler.step(adam, [scaler.scale(g)]) is True
    ref_adam.step([g])
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    scaler.update()
    assert scaler.step(adam, [np.full(16, np.inf, np.float32)]) is False
    scaler.update()
    assert scaler.get_scale() == float(np.float32(1024.0 * 0.3))


# ----------------------------------------------------------------- calls and checkpoints

def test_scale_keeps_dtypes_and_containers_and_records_autograd():
    s = LossScaler(init_scale=8.0)
    half = torch.ones(3, dtype=torch.float16, requires_grad=True)
    out = s.scale(half.sum())
    assert out.dtype == torch.float16 and out.item() == 24.0
    out.backward()
    assert torch.equal(half.grad, torch.full((3,), 8.0, dtype=torch.float16))
    arr = np.ones(2, np.float16)
    assert s.scale(arr).dtype == np.float16
    nested = s.scale([torch.ones(()), (np.ones(1, np.float32), 2.0)])
    assert isinstance(nested, list) and isinstance(nested[1], tuple)
    assert float(nested[0]) == 8.0 and nested[1][1] == 16.0
    for bad in (None, "loss", True):
        with pytest.raises(OptimizerError, match="outputs"):
            s.scale(bad)
    # no multiplication by a float: a bare TypeError ("unsupported operand
    # type(s) for *") that did not say what scale() takes
    for bad in ({"lm": torch.ones(())}, (x for x in [torch.ones(())]), {1.0}, object()):
        with pytest.raises(OptimizerError, match="outputs must be a tensor, an array, a "
                           f"number, or a list/tuple of them; got {type(bad).__name__}"):
            s.scale(bad)


def test_state_dicts_move_between_gradscaler_and_loss_scaler():
    ref = torch_scaler()
    ref.scale(torch.ones(()))
    p = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.0)
    for g in (1.0, 1.0, float("inf"), 1.0):     # scale 1024 -> 307.2, tracker 1
        p.grad = torch.full((1,), g)
        ref.step(sgd)
        ref.update()
    mine = LossScaler()
    mine.load_state_dict(ref.state_dict())
    assert mine.state_dict() == ref.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(mine.state_dict())
    assert back.state_dict() == ref.state_dict()
    assert LossScaler(enabled=False).state_dict() == {}


@pytest.mark.parametrize("bad, argument", [
    ({}, "state_dict"),
    ([("scale", 1.0)], "state_dict"),
    ({"scale": 2.0}, "state_dict"),
    ({**LossScaler().state_dict(), "scale": float("nan")}, "scale"),
    ({**LossScaler().state_dict(), "growth_factor": 1.0}, "growth_factor"),
    ({**LossScaler().state_dict(), "_growth_tracker": 2000}, "_growth_tracker"),
    ({**LossScaler().state_dict(), "growth_interval": 2.5}, "growth_interval"),
    ({**LossScaler().state_dict(), "scale": "1e3"}, "scale"),
])
def test_bad_state_dicts_are_refused_and_change_nothing(bad, argument):
    s = LossScaler(**HYPER)
    before = s.state_dict()
    with pytest.raises(OptimizerError) as err:
        s.load_state_dict(bad)
    assert err.value.argument == argument
    assert s.state_dict() == before


@pytest.mark.parametrize("kw, argument", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(init_scale=1e39), "init_scale"),
    (dict(init_scale="big"), "init_scale"),
    # text float() parses (from a config file) and bools were taken as numbers,
    # while growth_interval="2000" was refused
    (dict(init_scale="65536"), "init_scale"),
    (dict(init_scale=True), "init_scale"),
    (dict(growth_factor="2"), "growth_factor"),
    (dict(backoff_factor="0.5"), "backoff_factor"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=True), "growth_interval"),
    (dict(growth_interval=2.0), "growth_interval"),
    (dict(enabled=1), "enabled"),
])
def test_bad_arguments_are_refused(kw, argument):
    with pytest.raises(OptimizerError) as err:
        LossScaler(**kw)
    assert err.value.argument == argument


def test_update_sets_a_new_scale_from_a_number_tensor_or_array():
    s = LossScaler(**HYPER)
    s.update(new_scale=0.1)
    assert s.get_scale() == float(np.float32(0.1))
    s.update(new_scale=torch.tensor([4.0]))
    assert s.get_scale() == 4.0
    s.update(new_scale=np.float64(2.0))
    assert s.get_scale() == 2.0
    for bad, match in ((torch.ones(1, requires_grad=True), "grad"),
                       (torch.ones(2), "one-element"), (np.ones(3), "one-element"),
                       (-1.0, "out of range"), ("5", "not a real number")):
        with pytest.raises(OptimizerError, match=match):
            s.update(new_scale=bad)
    assert s.get_scale() == 2.0


def test_misuse_is_refused_and_leaves_the_scaler_unchanged():
    s = LossScaler(**HYPER)
    adam = NumpyAdam([np.zeros(4, np.float32)])
    grads = [np.ones(4, np.float32)]
    with pytest.raises(LossScaleError, match="no scaler.step"):
        s.update()
    with pytest.raises(OptimizerError, match="GradScaler"):
        s.step(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(OptimizerError, match="grad_scale") as err:
        s.step(adam, grads, grad_scale=2.0)
    assert err.value.argument == "grad_scale"
    # a step the optimizer refuses is not counted: it can be retried
    with pytest.raises(OptimizerError):
        s.step(adam, [np.ones(5, np.float32)])
    with pytest.raises(LossScaleError, match="no scaler.step"):
        s.update()
    assert s.step(adam, grads) is True
    with pytest.raises(LossScaleError, match="already"):
        s.step(adam, grads)
    s.update()
    assert state_of(s) == (1024.0, 1)


def test_disabled_scaler_passes_everything_through():
    s = LossScaler(enabled=False, init_scale=1024.0)
    loss = torch.ones(())
    assert s.scale(loss) is loss and s.get_scale() == 1.0 and not s.is_enabled()
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.5)      # any optimizer: no grad_scale is passed
    s.step(opt)
    assert torch.equal(p.detach(), torch.full((3,), -0.5))
    s.update()
    s.load_state_dict({})
    assert "enabled=False" in repr(s)


def test_exported_and_named_like_the_other_errors():
    assert rtmem.LossScaler is LossScaler and rtmem.LossScaleError is LossScaleError
    assert issubclass(LossScaleError, RuntimeError)
    assert math.isclose(_MIN_SCALE, np.finfo(np.float32).tiny)


# ----------------------------------------------------------------- torch's GradScaler

@pytest.mark.parametrize("kind", ["cpu_adam", "offloaded_unflushed",
                                  "offloaded_unflushed_clipped"])
def test_torch_gradscaler_drives_cpu_adam_and_unflushed_offloaded_adam(kind):
    """CPUAdam keeps p.grad, so GradScaler unscales it as for any optimizer;
    OffloadedAdam(flush_in_backward=False) takes GradScaler's scale into its
    kernel (NOTE [ GradScaler ]), or none after an explicit unscale_."""
    scaler, clip = torch_scaler(), None
    if kind == "cpu_adam":
        def make_opt(params):
            return CPUAdam(params, lr=1e-2)
    else:
        def make_opt(params):
            return OffloadedAdam(params, lr=1e-2, flush_in_backward=False)
    if kind.endswith("clipped"):
        def clip(model, opt):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    mine, opt, _ = against_torch(make_opt, scaler, clip)
    if kind != "cpu_adam":
        assert opt.skipped_steps == len(BAD) and "found_inf" not in vars(opt)
        x, y, _ = batches(1)[0]
        scaler.scale(torch.nn.functional.mse_loss(mine(x), y)).backward()
        with pytest.raises(OptimizerError, match="passes the scale itself"):
            scaler.step(opt, grad_scale=2.0)
        assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
        opt.close()


def test_torch_gradscaler_is_refused_by_a_flushing_offloaded_adam_with_nothing_lost():
    model = make_model()
    opt = OffloadedAdam(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y, _ = batches(1)[0]
    ref_scaler = torch_scaler()
    ref_scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    with pytest.raises(OptimizerError, match="LossScaler"):
        ref_scaler.step(opt)
    assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
    assert opt.step_count == 0
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    # the flushed gradients are still there for the right scaler
    scaler = LossScaler(**HYPER)
    scaler.step(opt)
    assert opt.step_count == 1 and not opt.last_step_skipped
    opt.close()


def test_float16_gradients_overflow_skip_and_the_scale_settles():
    """The use it is for: a float16 model whose scaled gradients overflow float16
    at the first scales. Those steps are skipped with the parameters untouched,
    the scale backs off until they fit, and training goes on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).half()
    opt = OffloadedAdam(model.parameters(), lr=1e-2)
    scaler = LossScaler(init_scale=2.0 ** 24, growth_interval=50)
    first = [p.detach().clone() for p in model.parameters()]
    data = batches(30)
    losses = []
    for x, y, _ in data:
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        if len(losses) == 1:
            assert opt.last_step_skipped                # 2**24 * grad > 65504
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), first))
    assert 1 <= opt.skipped_steps < 15
    assert scaler.get_scale() == 2.0 ** (24 - opt.skipped_steps)
    assert opt.step_count == 30 - opt.skipped_steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    opt.close()


def test_update_with_a_new_scale_keeps_the_growth_count_as_gradscaler():
    # GradScaler.update(new_scale) sets the scale and leaves _growth_tracker alone:
    # a count of good steps is not lost by setting the scale by hand
    ref, mine = torch_scaler(), LossScaler(**HYPER)
    ref.scale(torch.ones(()))
    p = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.0)
    adam = NumpyAdam([np.zeros(1, np.float32)], lr=0.0)
    for new_scale in (None, 8.0, None, None):    # growth_interval 3
        p.grad = torch.ones(1)
        ref.step(sgd)
        ref.update(new_scale)
        mine.step(adam, [np.ones(1, np.float32)])
        mine.update(new_scale)
        assert state_of(mine) == state_of(ref)
    # the schedule's updates count (1, kept at the one given 8.0, 2, 3): the third
    # grows 8 to 24 and restarts the count
    assert state_of(mine) == (24.0, 0)


def test_the_float32_range_ends_are_valid_scales():
    # the least normal float32 and float32's max are accepted as scales, and a
    # backoff landing exactly on the least one is no error
    for value in (_MIN_SCALE, _MAX_SCALE):
        assert LossScaler(init_scale=value).get_scale() == value
    s = LossScaler(init_scale=2 * _MIN_SCALE, backoff_factor=0.5)
    adam = NumpyAdam([np.zeros(1, np.float32)])
    s.step(adam, [np.full(1, np.inf, np.float32)])
    s.update()
    assert s.get_scale() == _MIN_SCALE
