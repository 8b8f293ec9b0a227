"""rtmem.optim: CPUAdam / CPUAdamW (torch front end) and NumpyAdam / NumpyAdamW."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rtmem.optim as optim
from rtmem.errors import OptimizerError
from rtmem.kernels import adam_update


def _rel_err(x, ref):
    """Max error relative to |ref| + rms(ref): float32 round-off, robust near 0."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.sqrt(np.mean(ref * ref))
    return float(np.max(np.abs(x - ref) / (np.abs(ref) + scale)))


# --------------------------------------------------------------------------- numpy front end

def test_numpy_api_works_without_torch():
    # A fresh interpreter where `import torch` fails.
    code = textwrap.dedent("""
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
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


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


# --------------------------------------------------------------------------- torch front end

torch = pytest.importorskip("torch")


def _models(seed, shapes=((64, 33), (33,), (40_000,))):
    """Two param lists with identical values: float32 (ours) and float64 (oracle)."""
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    ref = [p.detach().double().clone().requires_grad_() for p in ours]
    return ours, ref


def _step_twins(ours, theirs, opt, their_opt, gen=None, steps=1):
    """``steps`` steps of both optimizers, each with the same fresh random
    gradients on the twin parameter lists."""
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        their_opt.step()


def _groups(params, wd):
    # Two groups with different lr and weight decay.
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 2 * wd}]


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch_adam_in_float64(decoupled, amsgrad, wd):
    ours, ref = _models(int(decoupled) + 2 * int(amsgrad) + int(wd * 100))
    Ours = optim.CPUAdamW if decoupled else optim.CPUAdam
    Ref = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = Ours(_groups(ours, wd), lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=wd,
               amsgrad=amsgrad)
    ref_opt = Ref(_groups(ref, wd), lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=wd,
                  amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(99)
    for _ in range(20):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            q.grad = g.double()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert _rel_err(p.detach(), q.detach()) < 1e-5
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert _rel_err(opt.state[p][key], ref_opt.state[q][key]) < 1e-5
        assert float(opt.state[p]["step"]) == 20.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gradients_match_torch_on_the_same_values(dtype):
    tdtype = getattr(torch, dtype)
    ours, ref = _models(7)
    opt = optim.CPUAdam(ours, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(8)
    for _ in range(10):
        grads = [torch.randn(p.shape, generator=gen).to(tdtype) for p in ours]
        opt.step(grads=grads)
        for q, g in zip(ref, grads):
            q.grad = g.double()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert p.grad is None
        assert _rel_err(p.detach(), q.detach()) < 1e-5


def test_bias_correction_first_step_moves_by_lr():
    p = torch.tensor([1.0, -2.0, 3.0, 0.5]).requires_grad_()
    p0 = p.detach().clone()
    opt = optim.CPUAdam([p], lr=0.1)
    p.grad = torch.tensor([0.3, -4.0, 2.0, -0.7])
    opt.step()
    torch.testing.assert_close(p0 - p.detach(), 0.1 * torch.sign(p.grad), rtol=1e-6,
                               atol=1e-6)


def test_overflow_skips_step_bit_identically_and_training_resumes():
    ours, _ = _models(11)
    twin = [p.detach().clone().requires_grad_() for p in ours]
    opt = optim.CPUAdam(ours, lr=1e-3, amsgrad=True)
    twin_opt = optim.CPUAdam(twin, lr=1e-3, amsgrad=True)
    gen = torch.Generator().manual_seed(12)
    scale = 2.0 ** 10

    def grads():
        return [torch.randn(p.shape, generator=gen) for p in ours]

    for _ in range(3):
        gs = grads()
        opt.step(grads=[g * scale for g in gs], grad_scale=scale)
        twin_opt.step(grads=gs)
    assert not opt.last_step_skipped
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in ours]
    bad = [g * scale for g in grads()]
    bad[2][39_999] = float("nan")   # one NaN, at the very end of the last parameter
    opt.step(grads=bad, grad_scale=scale)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    for p, b in zip(ours, params_before):
        assert torch.equal(p.detach(), b)
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, val in st.items():
            assert torch.equal(after["state"][k][key], val), key
    # A power-of-two scale is exact, so the scaled run equals the unscaled twin.
    gs = grads()
    opt.step(grads=[g * scale for g in gs], grad_scale=scale)
    twin_opt.step(grads=gs)
    assert not opt.last_step_skipped
    for p, q in zip(ours, twin):
        assert torch.equal(p.detach(), q.detach())


def test_state_dict_round_trip_mid_training_is_exact():
    ours, _ = _models(13)
    opt = optim.CPUAdamW(_groups(ours, 0.1), lr=1e-2, amsgrad=True)
    gen = torch.Generator().manual_seed(14)
    for _ in range(5):
        for p in ours:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in ours], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)   # weights_only: the state is plain tensors
    clone = [p.requires_grad_() for p in saved["model"]]
    opt2 = optim.CPUAdamW(_groups(clone, 0.1), lr=1e-2, amsgrad=True)
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[1]["lr"] == 3e-3
    _step_twins(ours, clone, opt, opt2, gen, steps=5)
    for p, q in zip(ours, clone):
        assert torch.equal(p.detach(), q.detach())
    # Loading copies: training opt2 on did not write into the loaded dict.
    assert float(saved["opt"]["state"][0]["step"]) == 5.0


def test_state_dict_moves_between_torch_adam_and_cpu_adam():
    ours, _ = _models(15)
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.Adam(theirs, lr=1e-2)
    gen = torch.Generator().manual_seed(16)
    for _ in range(4):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=gen)
        torch_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    opt = optim.CPUAdam(ours, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _step_twins(ours, theirs, opt, torch_opt, gen, steps=4)
    for p, q in zip(ours, theirs):
        assert _rel_err(p.detach(), q.detach()) < 1e-5
    back_params = [p.detach().clone().requires_grad_() for p in ours]
    back = torch.optim.Adam(back_params, lr=1e-2)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step_twins(ours, back_params, opt, back, gen)
    assert float(back.state_dict()["state"][0]["step"]) == 9.0
    for p, q in zip(ours, back_params):
        assert _rel_err(p.detach(), q.detach()) < 1e-6


def test_lr_scheduler_drives_the_learning_rate():
    ours, ref = _models(17)
    opt = optim.CPUAdam(ours, lr=1e-2)
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.1)
    gen = torch.Generator().manual_seed(18)
    for _ in range(10):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.double()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    for p, q in zip(ours, ref):
        assert _rel_err(p.detach(), q.detach()) < 1e-5


def test_zero_grad_and_params_without_grad():
    ours, _ = _models(19)
    opt = optim.CPUAdam(ours, lr=1e-2)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
    before = [p.detach().clone() for p in ours]
    ours[1].grad = torch.ones_like(ours[1])
    opt.step()
    assert torch.equal(ours[0].detach(), before[0]) and ours[0] not in opt.state
    assert not torch.equal(ours[1].detach(), before[1])


def test_closure_loss_is_returned():
    p = torch.randn(10, requires_grad=True)
    opt = optim.CPUAdam([p], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and p.grad is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_copies_hold_the_rounded_updated_params(dtype):
    ours, _ = _models(20)
    copies = {p: torch.empty(p.shape, dtype=dtype) for p in ours}
    opt = optim.CPUAdam(ours, lr=1e-2)
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step(copies=copies)
    for p in ours:
        assert torch.equal(copies[p], p.detach().to(dtype))


def test_num_threads_does_not_change_results():
    a, _ = _models(21)
    b = [p.detach().clone().requires_grad_() for p in a]
    oa = optim.CPUAdam(a, lr=1e-2, num_threads=1)
    ob = optim.CPUAdam(b, lr=1e-2)
    _step_twins(a, b, oa, ob)
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
    with pytest.raises(OptimizerError, match="num_threads"):
        optim.CPUAdam(a, num_threads=0)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), "beta1"),
    (dict(betas=(0.9, -0.5)), "beta2"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_hyperparameters_are_rejected(kwargs, fragment):
    with pytest.raises(OptimizerError, match=fragment):
        optim.CPUAdam([torch.zeros(3, requires_grad=True)], **kwargs)


def test_bad_params_and_grads_are_rejected_before_anything_changes():
    with pytest.raises(OptimizerError, match="float32"):
        optim.CPUAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(OptimizerError, match="contiguous"):
        optim.CPUAdam([torch.zeros(4, 3).t().requires_grad_()])
    ours, _ = _models(22)
    opt = optim.CPUAdam(ours, lr=1e-2)
    before = [p.detach().clone() for p in ours]
    for p in ours:
        p.grad = torch.randn_like(p)
    cases = [
        (dict(grads=[p.grad for p in ours[:2]]), "3 params"),
        (dict(grads=[ours[0].grad, ours[1].grad, torch.ones(999)]), "shape"),
        (dict(grads=[ours[0].grad, ours[1].grad, torch.ones(80_000)[::2]]), "contiguous"),
        (dict(grads=[ours[0].grad, ours[1].grad, torch.ones(40_000, dtype=torch.int32)]),
         "dtype"),
        (dict(grad_scale=-1.0), "grad_scale"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(OptimizerError, match=fragment):
            opt.step(**kwargs)
    opt.param_groups[0]["lr"] = -0.5   # e.g. a broken schedule
    with pytest.raises(OptimizerError, match="lr"):
        opt.step()
    for p, b in zip(ours, before):
        assert torch.equal(p.detach(), b)
    assert not opt.state     # refused steps made no (lazily created) state either


def test_load_state_dict_rejects_state_of_another_model():
    a, _ = _models(23)
    opt = optim.CPUAdam(a)
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    other = [torch.zeros(5, requires_grad=True) for _ in a]
    with pytest.raises(OptimizerError, match="another model"):
        optim.CPUAdam(other).load_state_dict(opt.state_dict())


def test_refused_load_state_dict_leaves_the_optimizer_as_it_was():
    a, _ = _models(24)
    opt = optim.CPUAdam(a, lr=0.1)
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][0]["exp_avg"].fill_(42.0)
    bad["state"][0]["step"].fill_(99.0)
    bad["state"][2]["exp_avg"] = torch.zeros(5)          # another model's state
    with pytest.raises(OptimizerError, match="another model"):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    assert now["param_groups"] == good["param_groups"]
    for k, st in good["state"].items():
        for key, v in st.items():
            assert torch.equal(now["state"][k][key], v), (k, key)
    opt.step()                                           # and it still works
    assert float(opt.state[a[0]]["step"]) == 2.0


def test_malformed_arguments_get_optimizer_errors():
    p = torch.nn.Parameter(torch.ones(3))
    cases = [
        (lambda: optim.NumpyAdam(np.ones(4, np.float32)), "list of arrays"),
        (lambda: optim.NumpyAdam([np.ones(4, np.float32)]).load_state_dict({}), "'hyper'"),
        (lambda: optim.CPUAdam([p]).load_state_dict({"foo": 1}), "'param_groups'"),
        # a dict keyed by something else would silently update nothing
        (lambda: optim.CPUAdam([p]).step(grads={torch.ones(3): torch.ones(3)}),
         "not a parameter"),
    ]
    for call, fragment in cases:
        with pytest.raises(OptimizerError, match=fragment):
            call()


def test_optim_all_lists_exactly_its_public_classes():
    defined = {n for n in dir(optim) if not n.startswith("_")
               and getattr(getattr(optim, n), "__module__", None) == "rtmem.optim"}
    assert set(optim.__all__) == defined
    assert issubclass(optim.CPUAdamW, torch.optim.Optimizer)
