"""rtmem.optim: CPUAdam / CPUAdamW, the torch front end (NumpyAdam / NumpyAdamW:
tests/test_optim_numpy.py, which runs without torch)."""

from __future__ import annotations

import copy
import io
import pickle
import re

import numpy as np
import pytest

import rtmem.optim as optim
from rtmem.errors import OptimizerError


def _rel_err(x, ref):
    """Max error relative to |ref| + rms(ref): float32 round-off, robust near 0."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.sqrt(np.mean(ref * ref))
    return float(np.max(np.abs(x - ref) / (np.abs(ref) + scale)))



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


def _grad_away_from_zero(shape, gen):
    """Standard-normal gradients moved 1 away from zero (|g| >= 1).

    With coupled weight decay Adam steps on g + wd * p, and its first update
    (g + wd p) / (|g + wd p| + eps) is ill-conditioned where the sum cancels:
    float32 and float64 then round to different updates. Seed 2561947812 drew a
    bfloat16 g of -0.0075684 against wd * p = +0.0075684 and the float32 result
    was 2e-5 off the float64 one, with the kernel exactly right in float32. |g| >= 1
    exceeds |wd * p| for every |p| < 10 at the weight decays used here (<= 0.1).
    """
    g = torch.randn(shape, generator=gen)
    return torch.where(g < 0, g - 1.0, g + 1.0)


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch_adam_in_float64(decoupled, amsgrad, wd, fresh_seed):
    ours, ref = _models(fresh_seed)
    Ours = optim.CPUAdamW if decoupled else optim.CPUAdam
    Ref = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = Ours(_groups(ours, wd), lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=wd,
               amsgrad=amsgrad)
    ref_opt = Ref(_groups(ref, wd), lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=wd,
                  amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    for _ in range(20):
        for p, q in zip(ours, ref):
            g = _grad_away_from_zero(p.shape, gen)
            p.grad = g
            q.grad = g.double()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert _rel_err(p.detach(), q.detach()) < 1e-5
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert _rel_err(opt.state[p][key], ref_opt.state[q][key]) < 1e-5
        assert float(opt.state[p]["step"]) == 20.0


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gradients_match_torch_on_the_same_values(dtype, decoupled, amsgrad, fresh_seed):
    tdtype = getattr(torch, dtype)
    ours, ref = _models(fresh_seed)
    Ours = optim.CPUAdamW if decoupled else optim.CPUAdam
    Ref = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = Ours(ours, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad)
    ref_opt = Ref(ref, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    for _ in range(10):
        grads = [_grad_away_from_zero(p.shape, gen).to(tdtype) for p in ours]
        opt.step(grads=grads)
        for q, g in zip(ref, grads):
            q.grad = g.double()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert p.grad is None
        assert _rel_err(p.detach(), q.detach()) < 1e-5


def test_without_bias_correction_matches_the_textbook_update(fresh_seed):
    # bias_correction=False (torch has no such switch): m / (sqrt(v) + eps) with
    # the raw moments, in float64 by hand
    ours, ref = _models(fresh_seed)
    opt = optim.CPUAdam(ours, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, bias_correction=False)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    m = [torch.zeros_like(q) for q in ref]
    v = [torch.zeros_like(q) for q in ref]
    for _ in range(5):
        for i, (p, q) in enumerate(zip(ours, ref)):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            m[i] = 0.8 * m[i] + 0.2 * g.double()
            v[i] = 0.95 * v[i] + 0.05 * g.double() ** 2
            q.data -= 1e-2 * m[i] / (v[i].sqrt() + 1e-6)
        opt.step()
    for p, q in zip(ours, ref):
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


def test_a_skipped_or_refused_step_adds_no_state():
    # NOTE [ Skipped steps ]: a skip changes nothing, and torch (GradScaler never
    # calls Adam.step on an overflow) has no state then; a refused step neither.
    a, b = torch.randn(4, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = optim.CPUAdam([{"params": [a]}, {"params": [b]}], lr=1e-2, amsgrad=True)
    opt.step(grads=[torch.ones(4), torch.tensor([1.0, float("inf"), 1.0])],
             grad_scale=2.0)
    assert opt.last_step_skipped and opt.state_dict()["state"] == {}
    opt.param_groups[0]["amsgrad"] = False
    opt.step(grads=[torch.ones(4), torch.ones(3)])
    before = copy.deepcopy(opt.state_dict())
    # amsgrad switched on for a: the next step would add its max_exp_avg_sq, but
    # b's gradient is refused (after a's entry was made)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(OptimizerError, match="group 1 param 0: grad is not contiguous"):
        opt.step(grads=[torch.ones(4), torch.ones(6)[::2]])
    after = opt.state_dict()
    assert after["state"].keys() == before["state"].keys()
    for k, st in before["state"].items():
        assert after["state"][k].keys() == st.keys()
    # and a skip after amsgrad was switched on adds nothing either
    opt.step(grads=[torch.ones(4), torch.full((3,), float("nan"))], grad_scale=1.0)
    assert opt.last_step_skipped and "max_exp_avg_sq" not in opt.state[a]
    opt.step(grads=[torch.ones(4), torch.ones(3)])
    assert "max_exp_avg_sq" in opt.state[a] and not opt.last_step_skipped


def test_an_sgd_state_dict_is_refused_by_name():
    p = torch.randn(3, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    sgd.step()
    opt = optim.CPUAdam([p], lr=1e-3)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(OptimizerError, match="group 0 .* has no betas, eps: it is not an "
                       "Adam state dict"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.state_dict() == before


def test_a_state_without_both_moments_is_refused_by_name():
    # An Adamax state (exp_avg and exp_inf, no exp_avg_sq) loaded, and the next
    # step zero-filled exp_avg_sq beside the kept step and exp_avg: a first
    # update ~10x too large, silently (torch.optim.Adam raises KeyError there)
    p = torch.randn(3, requires_grad=True)
    adamax = torch.optim.Adamax([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(3)
        adamax.step()
    saved = adamax.state_dict()
    saved["param_groups"][0].setdefault("amsgrad", False)
    q = p.detach().clone().requires_grad_()
    opt = optim.CPUAdam([q], lr=1e-3)
    q.grad = torch.ones(3)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(OptimizerError, match="group 0 param 0: the state has step, "
                       "exp_avg, exp_inf but no exp_avg_sq: it is not an Adam"):
        opt.load_state_dict(saved)
    lacking_exp_avg = copy.deepcopy(before)
    del lacking_exp_avg["state"][0]["exp_avg"]
    with pytest.raises(OptimizerError, match="group 0 param 0: .* but no exp_avg:"):
        opt.load_state_dict(lacking_exp_avg)
    now = opt.state_dict()
    assert now["param_groups"] == before["param_groups"]
    assert now["state"][0].keys() == before["state"][0].keys()
    assert all(torch.equal(now["state"][0][k], v) for k, v in before["state"][0].items())


def test_a_state_dict_with_groups_of_other_sizes_is_an_optimizer_error():
    # torch's own refusal came out as a bare ValueError, not rtmem's type
    a, b = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    saved = optim.CPUAdam([a, b], lr=1e-3).state_dict()
    opt = optim.CPUAdam([{"params": [a]}, {"params": [b]}], lr=1e-3)
    saved["param_groups"] = [dict(saved["param_groups"][0], params=[0]),
                             dict(saved["param_groups"][0], params=[1, 2])]
    with pytest.raises(OptimizerError, match="belongs to another model or grouping"):
        opt.load_state_dict(saved)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]


def test_amsgrad_keeps_a_nan_in_its_maximum_as_torch_does():
    # torch.maximum propagates NaN; numba's max(vmax, nan) returned vmax, so the
    # state dicts disagreed after a NaN gradient (no loss scale: no finite check)
    p = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours = optim.CPUAdam([p], lr=0.1, amsgrad=True)
    ref = torch.optim.Adam([q], lr=0.1, amsgrad=True, foreach=False)
    for g in ([1.0, 1.0, 2.0], [float("nan"), 1.0, 0.5], [1.0, 1.0, 3.0]):
        p.grad, q.grad = torch.tensor(g), torch.tensor(g)
        ours.step()
        ref.step()
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        torch.testing.assert_close(ours.state[p][key], ref.state[q][key], equal_nan=True)
    assert ours.state[p]["max_exp_avg_sq"][0].isnan()
    torch.testing.assert_close(p.detach(), q.detach(), equal_nan=True)


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


def _trained_torch_twin(ours, seed: int, steps: int):
    """torch.optim.Adam (lr 1e-2) over clones of ``ours`` after ``steps`` steps of
    random gradients, ``ours`` set to its weights; (its params, it, the generator)."""
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.Adam(theirs, lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=gen)
        torch_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    return theirs, torch_opt, gen


def test_state_dict_moves_between_torch_adam_and_cpu_adam():
    ours, _ = _models(15)
    theirs, torch_opt, gen = _trained_torch_twin(ours, 16, steps=4)
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


def test_a_state_dict_whose_groups_lack_torch_adams_later_keys_loads_and_steps():
    # groups without amsgrad, maximize, ... (an older torch's, transformers'
    # AdamW's): torch.optim.Adam's __setstate__ defaults them, CPUAdam loaded
    # them, then every step raised a bare KeyError 'amsgrad'
    ours, _ = _models(41)
    ref, ref_opt, gen = _trained_torch_twin(ours, 42, steps=1)
    saved = copy.deepcopy(ref_opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable",
                    "fused", "decoupled_weight_decay"):
            group.pop(key, None)
    opt = optim.CPUAdam(ours, lr=5.0, amsgrad=True, maximize=True)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["amsgrad"], group["maximize"], group["decoupled_weight_decay"]) == \
        (False, False, False)
    _step_twins(ours, ref, opt, ref_opt, gen, steps=3)
    for p, q in zip(ours, ref):
        assert _rel_err(p.detach(), q.detach()) < 1e-5


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


def test_cpu_adam_steps_run_on_num_threads(monkeypatch):
    import numba
    from test_adam_kernels import _record_threads
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one numba thread: a thread count cannot be told from the default")
    # a step's kernels: NOTE [ Many tensors, one launch ]
    seen = _record_threads(monkeypatch, "_adam_many",
                           ("_adam_many_kernel", "_nonfinite_many_kernel"))
    from rtmem.kernels import BLOCK_ELEMENTS
    big = torch.nn.Parameter(torch.randn(3 * BLOCK_ELEMENTS))   # big enough for the pool
    big.grad = torch.randn_like(big)
    numba.set_num_threads(limit)
    optim.CPUAdam([big], lr=1e-2, num_threads=1).step(grad_scale=4.0)
    assert seen == [("_nonfinite_many_kernel", 1), ("_adam_many_kernel", 1)]
    assert numba.get_num_threads() == limit


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


def test_torch_adams_implementation_switches_are_taken():
    # a call written for torch.optim.Adam/AdamW runs unchanged (they were a
    # TypeError); what CPUAdam cannot honour is refused by name
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = p.grad.clone()
    opt = optim.CPUAdamW([p], lr=1e-2, foreach=True, fused=False, capturable=False,
                         differentiable=False)
    opt.step()
    torch.optim.AdamW([ref], lr=1e-2, foreach=False).step()
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    for name in ("capturable", "differentiable"):
        with pytest.raises(OptimizerError, match=f"{name}=True is not supported") as info:
            optim.CPUAdam([p], **{name: True})
        assert info.value.argument == name


@pytest.mark.parametrize("name", ["capturable", "differentiable"])
def test_switches_the_constructor_refuses_are_refused_from_dicts_and_groups_too(name):
    # A state dict saved by torch.optim.Adam(capturable=True) (or edited), a group
    # added or edited with the switch on: all were taken and the switch kept in
    # the group, ignored by every step. Now refused as by the constructor,
    # before anything changes.
    a, opt, good = _stepped_once(26)
    q = [p.detach().clone().requires_grad_() for p in a]
    saved = copy.deepcopy(torch.optim.Adam(q, lr=0.1, **{name: True}).state_dict())
    saved["state"] = copy.deepcopy(good["state"])
    assert saved["param_groups"][0][name] is True
    old_groups, old_state = opt.param_groups, opt.state
    with pytest.raises(OptimizerError, match=f"group 0 of the state dict has {name}=True"
                       ) as info:
        opt.load_state_dict(saved)
    assert info.value.argument == name and "set it to False" in str(info.value)
    assert opt.param_groups is old_groups and opt.state is old_state
    assert opt.state_dict()["param_groups"] == good["param_groups"]
    with pytest.raises(OptimizerError, match=f"group 1 has {name}=True") as info:
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], name: True})
    assert info.value.argument == name and len(opt.param_groups) == 1
    # edited into a group: the step is refused, nothing changed
    before = [p.detach().clone() for p in a]
    for p in a:
        p.grad = torch.randn_like(p)
    opt.param_groups[0][name] = True
    with pytest.raises(OptimizerError, match=f"group 0 has {name}=True"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(a, before))
    assert float(opt.state[a[0]]["step"]) == 1.0
    # with the switch off, the same dict loads
    opt.param_groups[0][name] = False
    saved["param_groups"][0][name] = False
    opt.load_state_dict(saved)
    opt.step()
    assert float(opt.state[a[0]]["step"]) == 2.0


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


def _stepped_once(seed):
    """(params, a CPUAdam after one step, a deep copy of its state dict)."""
    a, _ = _models(seed)
    opt = optim.CPUAdam(a, lr=0.1)
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    return a, opt, copy.deepcopy(opt.state_dict())


def _assert_state_is(opt, good, *, groups=True):
    """``opt``'s state dict equals ``good`` (a refused load changed nothing):
    every state tensor, and the param groups unless ``groups=False``."""
    now = opt.state_dict()
    if groups:
        assert now["param_groups"] == good["param_groups"]
    for k, st in good["state"].items():
        for key, v in st.items():
            # OffloadedAdam's dict holds numpy arrays
            assert torch.equal(torch.as_tensor(now["state"][k][key]), torch.as_tensor(v)), \
                (k, key)


def test_refused_load_state_dict_leaves_the_optimizer_as_it_was():
    a, opt, good = _stepped_once(24)
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][0]["exp_avg"].fill_(42.0)
    bad["state"][0]["step"].fill_(99.0)
    bad["state"][2]["exp_avg"] = torch.zeros(5)          # another model's state
    with pytest.raises(OptimizerError, match="another model"):
        opt.load_state_dict(bad)
    _assert_state_is(opt, good)
    opt.step()                                           # and it still works
    assert float(opt.state[a[0]]["step"]) == 2.0


def test_a_state_with_moments_but_no_step_is_refused_not_restarted():
    # Read as step 0: the next step was a first step again, its bias correction
    # dividing the saved moments by 1 - beta1 (~10x the update), silently;
    # torch.optim.Adam's step raises KeyError 'step' on such a state.
    a, opt, good = _stepped_once(29)
    sd = copy.deepcopy(good)
    del sd["state"][1]["step"]
    sd["param_groups"][0]["lr"] = 0.5
    with pytest.raises(OptimizerError, match=r"group 0 param 1: the state has "
                       r"exp_avg, exp_avg_sq but no step") as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    _assert_state_is(opt, good)


@pytest.mark.parametrize("which", ["CPUAdam", "OffloadedAdam"])
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("value", [torch.int64, torch.int32, torch.bool, "int-list"])
def test_an_integer_or_bool_moment_is_refused_by_every_adam(monkeypatch, which, key, value):
    # One rule for CPUAdam, OffloadedAdam and NumpyAdam (tests/test_optim_numpy.py):
    # a non-floating moment means the dict is not an Adam state (torch's load
    # casts it to the parameter's dtype; CPUAdam loaded it so, OffloadedAdam
    # refused it). Every dict torch.optim.Adam saves has floating moments.
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    from rtmem.torch import OffloadedAdam
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    params = [torch.randn(4, 3, generator=gen).requires_grad_(),
              torch.randn(6, generator=gen).requires_grad_()]
    opt = (optim.CPUAdam if which == "CPUAdam" else OffloadedAdam)(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["state"][1][key] = ([1, 0, 1, 0, 1, 0] if value == "int-list"
                            else torch.ones(6, dtype=value))
    dtype = torch.int64 if value == "int-list" else value
    with pytest.raises(OptimizerError, match=rf"parameter 1.* {key} (of )?(has )?dtype "
                       rf"{dtype}; expected (real )?floating point") as e:
        opt.load_state_dict(bad)
    assert e.value.argument == "state_dict"
    _assert_state_is(opt, good, groups=False)
    # torch.optim.Adam's own dict, half-precision moments included, still loads
    ref = torch.optim.Adam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    ref.step()
    saved = ref.state_dict()
    saved["state"][1][key] = saved["state"][1][key].to(torch.bfloat16)
    opt.load_state_dict(saved)
    if which == "OffloadedAdam":
        opt.close()


@pytest.mark.parametrize("key, bad, match", [
    # a ragged nested list raised a bare ValueError from torch.as_tensor, after
    # torch's load had replaced the state (put back by the rollback)
    ("exp_avg_sq", lambda v: [[1.0], [1.0, 2.0]],
     r"the state of parameter 1 has exp_avg_sq that is no array .*as state_dict\(\) saves it"),
    # torch's cast to float32 dropped the imaginary part, with only torch's
    # generic ComplexWarning; NumpyAdam refuses such a moment
    ("exp_avg", lambda v: torch.complex(v, torch.ones_like(v)),
     r"the state of parameter 1 has exp_avg of dtype torch.complex64; expected real "
     r"floating point"),
], ids=["no-array", "complex"])
def test_a_moment_that_is_no_adam_moment_is_refused_not_cast(key, bad, match):
    a, opt, good = _stepped_once(int(np.random.default_rng().integers(2**31)))
    sd = copy.deepcopy(good)
    sd["state"][1][key] = bad(good["state"][1][key])
    with pytest.raises(OptimizerError, match=match) as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    _assert_state_is(opt, good, groups=False)


def test_state_no_group_lists_is_refused_not_dropped():
    # torch's load keeps state under a key no group lists and loads nothing for
    # the parameter: a checkpoint whose indices a JSON round trip made strings
    # resumed with every moment and step count at zero, silently. A malformed
    # dict raised a bare AttributeError / KeyError from inside torch.
    a, opt, good = _stepped_once(28)
    as_json = copy.deepcopy(good)
    as_json["state"] = {str(k): v for k, v in as_json["state"].items()}
    stray = copy.deepcopy(good)
    stray["state"][99] = stray["state"].pop(0)
    no_params = copy.deepcopy(good)
    del no_params["param_groups"][0]["params"]
    listed = copy.deepcopy(good)
    listed["state"] = list(listed["state"].values())
    cases = [(as_json, re.escape("state for parameter '0', which none of its groups "
                                 "lists (an index turned into a string")),
             (stray, "state for parameter 99, which none of its groups lists"),
             (no_params, "each with its list of 'params'"),
             (listed, re.escape("state_dict['state'] a dict of dicts"))]
    # a string step was named as the text of torch's generator; a None or string
    # moment raised a bare TypeError / RuntimeError from torch.as_tensor
    for key, value in (("step", "2"), ("exp_avg", None), ("exp_avg_sq", "abc")):
        junk = copy.deepcopy(good)
        junk["state"][0][key] = value
        cases.append((junk, re.escape(f"parameter 0 has {key}={value!r}; expected a tensor")))
    for bad, match in cases:
        old_groups, old_state = opt.param_groups, opt.state
        with pytest.raises(OptimizerError, match=match):
            opt.load_state_dict(bad)
        assert opt.param_groups is old_groups and opt.state is old_state
    _assert_state_is(opt, good, groups=False)
    opt.load_state_dict(copy.deepcopy(good))             # the dict as saved loads
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    assert float(opt.state[a[0]]["step"]) == 2.0


def test_a_loaded_state_dict_is_copied_not_aliased():
    # torch's load keeps a saved moment of the parameter's dtype as it is: without
    # CPUAdam's own copy, every later step wrote into the caller's dict
    a, opt, good = _stepped_once(31)
    saved = copy.deepcopy(good)
    opt.load_state_dict(saved)
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    for k, st in good["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][k][key], st[key]), (k, key)


def test_a_state_dict_post_hook_may_return_the_dict_to_use():
    # torch documents that a post-hook's non-None result replaces the dict
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.CPUAdam([p], lr=0.1)
    opt.register_state_dict_post_hook(lambda o, sd: {"wrapped": sd})
    out = opt.state_dict()
    assert list(out) == ["wrapped"] and out["wrapped"]["skipped_steps"] == 0


def test_load_hooks_run_around_the_checks_as_torch_documents():
    # A pre-hook adapting the dict (unwrapping a checkpoint) was bypassed by the
    # up-front check ("must be a dict with 'state'"), and post-hooks ran for a
    # load then refused and rolled back.
    a, opt, good = _stepped_once(28)
    calls = []

    def unwrap(o, sd):
        calls.append("pre")
        return sd["optimizer"] if "optimizer" in sd else None
    opt.register_load_state_dict_pre_hook(unwrap)
    opt.register_load_state_dict_post_hook(
        lambda o: calls.append(("post", float(o.state[a[0]]["step"]))))
    bad = copy.deepcopy(good)
    bad["state"][0]["step"] = torch.tensor(7.0)
    bad["state"][2]["exp_avg"] = torch.zeros(5)          # another model's state
    for refused in (bad, {"optimizer": bad}):
        with pytest.raises(OptimizerError, match="another model"):
            opt.load_state_dict(refused)
    assert calls == ["pre", "pre"] and float(opt.state[a[0]]["step"]) == 1.0
    ok = copy.deepcopy(good)
    ok["state"][0]["step"] = torch.tensor(7.0)
    calls.clear()
    opt.load_state_dict({"optimizer": ok})
    assert calls == ["pre", ("post", 7.0)]           # each once, post after the load


@pytest.mark.parametrize("key, value, argument", [
    ("lr", -1.0, "lr"), ("betas", (1.5, 0.9), "beta1"), ("betas", (0.9,), "betas"),
    ("eps", 0.0, "eps"), ("weight_decay", float("nan"), "weight_decay")])
def test_load_state_dict_checks_the_hyperparameters_it_is_given(key, value, argument):
    # as NumpyAdam does: a bad group fails here, not at the next step()
    _, opt, good = _stepped_once(25)
    bad = copy.deepcopy(good)
    bad["param_groups"][0][key] = value
    with pytest.raises(OptimizerError, match=f"group 0 of the state dict: .*{argument}") \
            as info:
        opt.load_state_dict(bad)
    assert info.value.argument == argument
    assert opt.state_dict()["param_groups"] == good["param_groups"]
    opt.step()


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


# --------------------------------------------------------------------------- audit fixes

@pytest.mark.parametrize("fallback", [False, True])
def test_applied_step_bumps_the_autograd_version_of_params_and_copies(fallback,
                                                                      monkeypatch):
    # The kernel writes through numpy views; without the bump, backward through
    # a graph that saved the old parameter silently used the new one.
    if fallback:          # a torch without torch.autograd.graph.increment_version
        monkeypatch.delattr(torch.autograd.graph, "increment_version")
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    copy_t = torch.empty(3, dtype=torch.bfloat16)
    opt = optim.CPUAdam([w], lr=0.5)
    loss = (w * x).sum()                  # saves w for d loss / d x
    versions = (w._version, copy_t._version)
    opt.step(grads=[torch.full((3,), float("inf"))], grad_scale=2.0, copies=[copy_t])
    assert opt.last_step_skipped                          # nothing written, no bump
    assert (w._version, copy_t._version) == versions
    opt.step(grads=[torch.ones(3)], copies=[copy_t])
    assert w._version > versions[0] and copy_t._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    ref_w = torch.randn(3, requires_grad=True)            # as torch.optim.Adam does
    ref_loss = (ref_w * x).sum()
    ref_w.grad = torch.ones(3)
    torch.optim.Adam([ref_w], lr=0.5).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref_loss.backward()


def test_a_step_refused_for_num_threads_adds_no_state():
    # A pickle keeps num_threads: loaded on a machine with fewer numba threads,
    # every step is refused, and a refused step leaves no new state behind.
    import numba
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.CPUAdam([p], lr=0.1, amsgrad=True)
    opt.num_threads = numba.config.NUMBA_NUM_THREADS + 1
    p.grad = torch.ones(3)
    with pytest.raises(OptimizerError, match="num_threads"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(p.detach(), torch.ones(3))
    opt.num_threads = None
    opt.step()
    assert int(opt.state[p]["step"]) == 1


def _skipped_once(cls=None):
    """(param, a CPUAdam(W) with one applied and one skipped step)."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = (cls or optim.CPUAdam)([p], lr=1e-2)
    opt.step(grads=[torch.randn(5)])
    opt.step(grads=[torch.full((5,), float("nan"))], grad_scale=4.0)
    assert (opt.skipped_steps, opt.last_step_skipped) == (1, True)
    return p, opt


def test_state_dict_keeps_the_skip_counters_and_torch_adam_still_loads_it():
    # state_dict() had torch's two keys only: a checkpoint round trip reset
    # skipped_steps to 0 and last_step_skipped to False
    p, opt = _skipped_once()
    saved = opt.state_dict()
    assert (saved["skipped_steps"], saved["last_step_skipped"]) == (1, True)
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    q = torch.nn.Parameter(p.detach().clone())
    back = optim.CPUAdam([q], lr=1.0)
    back.load_state_dict(torch.load(buf, weights_only=True))
    assert (back.skipped_steps, back.last_step_skipped) == (1, True)
    # torch.optim.Adam loads it (the extra top-level keys are ignored) and steps
    # as CPUAdam does; its own dict has no skip record: 0 and False
    r = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.Adam([r], lr=1.0)
    ref.load_state_dict(copy.deepcopy(saved))
    g = torch.randn(5)
    r.grad, q.grad = g.clone(), g.clone()
    ref.step()
    back.step()
    torch.testing.assert_close(q, r)
    assert not back.last_step_skipped and back.skipped_steps == 1
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert (back.skipped_steps, back.last_step_skipped) == (0, False)
    assert float(back.state[q]["step"]) == 2.0
    # an older rtmem's dict (no counters) loads with 0 and False too
    _, opt2 = _skipped_once()
    old = copy.deepcopy(saved)
    del old["skipped_steps"], old["last_step_skipped"]
    opt2.load_state_dict(old)
    assert (opt2.skipped_steps, opt2.last_step_skipped) == (0, False)
    # the post-hooks see the whole dict
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sd["skipped_steps"]))
    opt.state_dict()
    assert seen == [1]


@pytest.mark.parametrize("key, bad", [("skipped_steps", -1), ("skipped_steps", 2.5),
                                      ("skipped_steps", "3"), ("last_step_skipped", "yes"),
                                      ("last_step_skipped", 1)])
def test_load_state_dict_refuses_skip_counters_that_are_no_counters(key, bad):
    p, opt = _skipped_once()
    good = copy.deepcopy(opt.state_dict())
    _, other = _skipped_once()
    other.step(grads=[torch.randn(5)])       # another step count and counters to load
    sd = copy.deepcopy(other.state_dict())
    sd[key] = bad
    # the message names the counter and its value ("skipped_steps: step is -1" did not)
    with pytest.raises(OptimizerError, match=re.escape(f"{key} is {bad!r};")) as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    now = opt.state_dict()
    assert (now["skipped_steps"], now["last_step_skipped"]) == (1, True)
    assert float(now["state"][0]["step"]) == float(good["state"][0]["step"]) == 1.0
    # NumpyAdam: the same counters, the same checks
    a = np.ones(4, np.float32)
    nopt = optim.NumpyAdam([a])
    nopt.step([np.full(4, np.nan, np.float32)], grad_scale=2.0)
    nsd = nopt.state_dict()
    assert (nsd["skipped_steps"], nsd["last_step_skipped"]) == (1, True)
    fresh = optim.NumpyAdam([np.ones(4, np.float32)])
    fresh.load_state_dict(nsd)
    assert (fresh.skipped_steps, fresh.last_step_skipped) == (1, True)
    with pytest.raises(OptimizerError, match=key):
        fresh.load_state_dict({**nsd, key: bad})
    assert (fresh.skipped_steps, fresh.last_step_skipped) == (1, True)


def test_copies_and_pickles_keep_threads_and_skip_counters():
    p = torch.randn(5, requires_grad=True)
    opt = optim.CPUAdamW([p], lr=1e-2, num_threads=1)
    opt.step(grads=[torch.randn(5)])
    opt.step(grads=[torch.full((5,), float("nan"))], grad_scale=4.0)
    assert opt.last_step_skipped and opt.skipped_steps == 1

    def via_torch_save(o):
        buf = io.BytesIO()
        torch.save(o, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    g = torch.randn(5)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt)), via_torch_save(opt)):
        assert type(clone) is type(opt)
        assert (clone.num_threads, clone.skipped_steps, clone.last_step_skipped) == (1, 1, True)
        q = clone.param_groups[0]["params"][0]
        assert torch.equal(q, p) and q is not p
        twin = copy.deepcopy(opt)
        clone.step(grads=[g])
        twin.step(grads=[g])
        assert torch.equal(q, twin.param_groups[0]["params"][0])
        assert not clone.last_step_skipped and clone.skipped_steps == 1
    # A pickle made without them (an older rtmem) gets the constructor's values.
    state = copy.deepcopy(opt.__getstate__())
    for name in ("num_threads", "skipped_steps", "last_step_skipped"):
        del state[name]
    old = optim.CPUAdamW.__new__(optim.CPUAdamW)
    old.__setstate__(state)
    assert (old.num_threads, old.skipped_steps, old.last_step_skipped) == (None, 0, False)
    old.step(grads=[g])
    assert float(old.state[old.param_groups[0]["params"][0]]["step"]) == 2.0
    # One without decoupled_weight_decay (an older torch's layout) stays AdamW, in
    # its defaults too: a group added later takes them.
    for group in (state["defaults"], *state["param_groups"]):
        del group["decoupled_weight_decay"]
    older = optim.CPUAdamW.__new__(optim.CPUAdamW)
    older.__setstate__(state)
    older.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert [g["decoupled_weight_decay"] for g in older.param_groups] == [True, True]


@pytest.mark.parametrize("bad", [-3.0, float("nan"), 2.5, float("inf")])
def test_load_state_dict_refuses_a_step_that_is_not_a_count(bad):
    a, opt, good = _stepped_once(25)
    sd = copy.deepcopy(good)
    sd["state"][1]["step"] = torch.tensor(bad)
    sd["param_groups"][0]["lr"] = 0.5
    with pytest.raises(OptimizerError, match=r"group 0 param 1: step is tensor\(") as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    _assert_state_is(opt, good)
    sd["state"][1]["step"] = 3                   # a plain int (old torch) is a count
    opt.load_state_dict(sd)
    assert float(opt.state[a[1]]["step"]) == 3.0


def test_load_state_dict_refuses_a_step_beyond_the_float32_counter():
    # state["step"] is a float32 tensor: a larger count (a plain int from an old
    # torch dict) was stored as inf, and every later step() raised OverflowError
    a, opt, good = _stepped_once(26)
    sd = copy.deepcopy(good)
    sd["state"][1]["step"] = 10 ** 39
    with pytest.raises(OptimizerError, match="step counter holds") as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    assert float(opt.state[a[1]]["step"]) == 1.0
    limit = int((2 - 2 ** -23) * 2 ** 127)      # float32's largest finite value
    sd["state"][1]["step"] = limit + 1
    with pytest.raises(OptimizerError, match="step counter holds"):
        opt.load_state_dict(sd)
    sd["state"][1]["step"] = limit               # the largest count it holds loads
    opt.load_state_dict(sd)
    assert float(opt.state[a[1]]["step"]) == float(limit)
    sd["state"][1]["step"] = 2 ** 100            # huge but a finite float32
    opt.load_state_dict(sd)
    opt.step()
    assert float(opt.state[a[1]]["step"]) == 2.0 ** 100
    assert all(torch.isfinite(p).all() for p in a)


def test_add_param_group_takes_rtmem_buffers(arena):
    bufs = [arena.alloc(shape=(8,), dtype=np.float32, kind="weight") for _ in range(3)]
    for b in bufs:
        b.numpy()[...] = 1.0
    opt = optim.CPUAdam([bufs[0]], lr=1e-2)
    opt.add_param_group({"params": [bufs[1]], "lr": 1e-1})
    opt.add_param_group({"params": bufs[2]})            # a single Buffer, too
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1, 1]
    opt.step(grads=[torch.ones(8)] * 3)
    for b, lr in zip(bufs, (1e-2, 1e-1, 1e-2)):         # updated in the arena's memory
        np.testing.assert_allclose(b.numpy(), 1.0 - lr, rtol=1e-6)
    del opt


def test_a_buffer_key_names_only_the_parameter_over_exactly_its_memory(arena):
    # a Buffer key is matched to a parameter by address and size: a tensor over
    # the Buffer's first half is another parameter, and the key names none
    buf = arena.alloc(shape=(8,), dtype=np.float32, kind="weight")
    buf.numpy()[...] = 1.0
    head = torch.from_numpy(buf.numpy()[:4])
    opt = optim.CPUAdam([head], lr=0.1)
    with pytest.raises(OptimizerError, match="not a parameter") as info:
        opt.step(grads={buf: torch.ones(8)})
    assert info.value.argument == "grads"
    assert (buf.numpy() == 1.0).all() and not opt.state
    del opt, head


def _step_mixed(ours, theirs, opt, their_opt, gen, steps):
    """As _step_twins, for twins of different dtypes (float32 vs float64)."""
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            q.grad = p.grad.to(q.dtype)
        opt.step()
        their_opt.step()


def _adamw_twins(seed, ours_cls, theirs_cls, ours_kw=None, theirs_kw=None, steps=6):
    """Run ours (float32) and torch's optimizer (float64) on the same gradients."""
    ours, ref = _models(seed, shapes=((30, 4), (7,)))
    opt = ours_cls(ours, lr=1e-2, weight_decay=0.5, **(ours_kw or {}))
    ref_opt = theirs_cls(ref, lr=1e-2, weight_decay=0.5, **(theirs_kw or {}))
    gen = torch.Generator().manual_seed(seed)
    _step_mixed(ours, ref, opt, ref_opt, gen, steps)
    return ours, ref, opt, ref_opt, gen


def _needs_torch_decoupled_flag():
    import inspect
    if "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters:
        pytest.skip("torch.optim.Adam has no decoupled_weight_decay (torch < 2.6)")


def test_state_dicts_keep_decoupled_weight_decay_between_torch_and_cpu_adam():
    _needs_torch_decoupled_flag()
    # torch Adam(decoupled_weight_decay=True) -> CPUAdam: the loaded groups say
    # AdamW, and the step honours them (it ran L2-Adam before).
    _, ref, _, ref_opt, gen = _adamw_twins(
        26, optim.CPUAdam, torch.optim.Adam, theirs_kw=dict(decoupled_weight_decay=True))
    fresh = [q.detach().float().clone().requires_grad_() for q in ref]
    moved = optim.CPUAdam(fresh, lr=1e-2, weight_decay=0.5)
    moved.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    assert moved.param_groups[0]["decoupled_weight_decay"] is True
    _step_mixed(fresh, ref, moved, ref_opt, gen, steps=4)
    assert max(_rel_err(p.detach(), q.detach()) for p, q in zip(fresh, ref)) < 1e-5
    # CPUAdamW -> torch Adam(decoupled_weight_decay=True): its groups now say so
    # (torch read the missing key as False: L2-Adam).
    ours, ref, opt, ref_opt, gen = _adamw_twins(27, optim.CPUAdamW, torch.optim.AdamW)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    back = [p.detach().double().clone().requires_grad_() for p in ours]
    torch_adam = torch.optim.Adam(back, lr=1e-2, weight_decay=0.5,
                                  decoupled_weight_decay=True)
    torch_adam.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch_adam.param_groups[0]["decoupled_weight_decay"] is True
    _step_mixed(back, ref, torch_adam, ref_opt, gen, steps=4)
    assert max(_rel_err(p.detach(), q.detach()) for p, q in zip(back, ref)) < 1e-5


def test_cpu_adam_takes_decoupled_weight_decay_per_group_like_torch():
    _needs_torch_decoupled_flag()
    ours, ref, opt, _, _ = _adamw_twins(
        28, optim.CPUAdam, torch.optim.Adam, dict(decoupled_weight_decay=True),
        dict(decoupled_weight_decay=True))
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert max(_rel_err(p.detach(), q.detach()) for p, q in zip(ours, ref)) < 1e-5
    # A group's own setting wins over the optimizer's default.
    a, b = _models(29, shapes=((30, 4), (7,)))
    mixed = optim.CPUAdam([{"params": a[:1]}, {"params": a[1:], "decoupled_weight_decay": True}],
                          lr=1e-2, weight_decay=0.5)
    ref_mixed = torch.optim.Adam([{"params": b[:1]},
                                  {"params": b[1:], "decoupled_weight_decay": True}],
                                 lr=1e-2, weight_decay=0.5)
    _step_mixed(a, b, mixed, ref_mixed, torch.Generator().manual_seed(30), steps=4)
    assert max(_rel_err(p.detach(), q.detach()) for p, q in zip(a, b)) < 1e-5
    assert [g["decoupled_weight_decay"] for g in mixed.param_groups] == [False, True]


def test_cpu_adamw_refuses_coupled_weight_decay():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(OptimizerError, match="CPUAdamW always decouples") as info:
        optim.CPUAdamW([p], decoupled_weight_decay=False)
    assert info.value.argument == "decoupled_weight_decay"
    opt = optim.CPUAdamW([p])
    with pytest.raises(OptimizerError, match="group 1: decoupled_weight_decay=False"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)],
                             "decoupled_weight_decay": False})
    assert len(opt.param_groups) == 1
    with pytest.raises(OptimizerError, match="True or False"):
        optim.CPUAdam([p], decoupled_weight_decay="yes")
    # a numpy bool (read from a config array) is a bool
    assert optim.CPUAdam([p], decoupled_weight_decay=np.True_).param_groups[0][
        "decoupled_weight_decay"] is True
    # Like torch.optim.AdamW, a torch.optim.Adam state dict loaded into CPUAdamW
    # stays AdamW.
    sd = torch.optim.Adam([torch.zeros(3, requires_grad=True)]).state_dict()
    sd["param_groups"][0]["decoupled_weight_decay"] = False
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_grad_and_copy_errors_name_the_param():
    ps = [torch.randn(4, requires_grad=True) for _ in range(5)]
    groups = [{"params": ps[:2]}, {"params": ps[2:]}]
    opt = optim.CPUAdam(groups, lr=1e-2)
    grads = [torch.randn(4) for _ in range(5)]
    cases = [
        (dict(grads=grads[:3] + [torch.randn(5)] + grads[4:]),
         r"^group 1 param 1: grad has shape \(5,\)", "grads"),
        (dict(grads=grads[:2] + [torch.randn(8)[::2]] + grads[3:]),
         r"^group 1 param 0: grad is not contiguous", "grads"),
        (dict(grads=grads, copies={ps[1]: torch.empty(3, dtype=torch.float16)}),
         r"^group 0 param 1: copies has shape \(3,\)", "copies"),
        (dict(grads=grads, copies={ps[4]: torch.empty(4, dtype=torch.int32)}),
         r"^group 1 param 2: copy has dtype torch.int32", "copies"),
    ]
    for kwargs, fragment, argument in cases:
        with pytest.raises(OptimizerError, match=fragment) as info:
            opt.step(**kwargs)
        assert info.value.argument == argument
    # numpy uint16 bits: CPUAdam.step has no grad_format=, so say what does work.
    with pytest.raises(OptimizerError, match="torch.bfloat16 tensor") as info:
        opt.step(grads=[np.zeros(4, np.uint16)] * 5)
    assert "grad_format" not in str(info.value) and info.value.argument == "grads"
    assert str(info.value).startswith("group 0 param 0: ")
    assert not opt.state


def test_a_sparse_gradient_is_refused_by_name():
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.CPUAdam([p], lr=0.1)
    with pytest.raises(OptimizerError, match="group 0 param 0: grad is a cpu "
                       "torch.sparse_coo tensor") as info:
        opt.step(grads=[torch.tensor([1.0, 0.0, 2.0]).to_sparse()])
    assert info.value.argument == "grads" and "to_dense" in str(info.value)
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state


def test_fp16_copy_overflow_is_documented_and_leaves_the_master_finite():
    p = torch.tensor([65519.0, 65520.0, 7e4, -1e6], requires_grad=True)
    out = torch.empty(4, dtype=torch.float16)
    opt = optim.CPUAdam([p], lr=1e-3)
    opt.step(grads=[torch.zeros(4)], copies=[out], grad_scale=1024.0)
    assert not opt.last_step_skipped and torch.isfinite(p).all()
    assert out[0] == 65504 and out[1:].isinf().all() and out[3] < 0
    assert "65504" in optim.CPUAdam.step.__doc__


def test_a_non_numeric_lr_gets_an_optimizer_error():
    # _check_hyper ran float(lr) before the range check: a bare TypeError/ValueError.
    p = np.ones(4, np.float32)
    for lr in (None, "1e-3x", [1e-3]):
        for make in (lambda: optim.NumpyAdam([p], lr=lr),
                     lambda: optim.CPUAdam([torch.ones(4, requires_grad=True)], lr=lr)):
            with pytest.raises(OptimizerError, match="not a real number") as info:
                make()
            assert info.value.argument == "lr"
    opt = optim.NumpyAdam([p], lr=1e-2)
    bad = opt.state_dict()
    bad["hyper"]["lr"] = None
    with pytest.raises(OptimizerError, match="lr=None") as info:
        opt.load_state_dict(bad)
    assert info.value.argument == "lr" and opt.hyper["lr"] == 1e-2
    t = torch.ones(4, requires_grad=True)
    topt = optim.CPUAdam([t], lr=1e-2)
    topt.param_groups[0]["lr"] = "0.1x"          # e.g. a broken schedule
    with pytest.raises(OptimizerError, match="not a real number"):
        topt.step(grads=[torch.ones(4)])
    assert torch.equal(t.detach(), torch.ones(4)) and not topt.state
    # a 0-d tensor lr (torch.optim accepts one) still works
    optim.CPUAdam([t], lr=torch.tensor(1e-2)).step(grads=[torch.ones(4)])
    assert not torch.equal(t.detach(), torch.ones(4))


def test_a_hyperparameter_given_as_a_string_is_refused():
    # float() parsed "1e-3" (PyYAML reads `lr: 1e-3` as that string): CPUAdam kept
    # the string in its group and an lr scheduler raised a TypeError in torch later;
    # torch.optim.Adam refuses it in its constructor.
    t = torch.ones(4, requires_grad=True)
    for key in ("lr", "eps", "weight_decay"):
        with pytest.raises(OptimizerError, match=f"{key}='1e-3' is not a real number "
                                                 f"but a string") as info:
            optim.CPUAdam([t], **{key: "1e-3"})
        assert info.value.argument == key
    opt = optim.CPUAdam([t], lr=1e-2)
    with pytest.raises(OptimizerError, match="string"):
        opt.add_param_group({"params": [torch.ones(2, requires_grad=True)], "lr": "1e-3"})
    assert len(opt.param_groups) == 1
    with pytest.raises(OptimizerError, match="string"):
        optim.NumpyAdam([np.ones(4, np.float32)], betas=("0.9", 0.999))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    opt.step(grads=[torch.ones(4)])
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 5e-3


@pytest.mark.parametrize("bad", ["no", "False", 0.0, 1, None])
def test_a_check_finite_that_is_not_a_bool_is_refused_before_anything_changes(bad):
    # step(check_finite=...) took the switch by truthiness where adam_update
    # refuses it: 0.0 with a loss scale turned the check off, and the NaN
    # gradient made the parameter NaN; "no" ("False" from a command line) checked
    nan_grad = np.array([np.nan, 1.0, 2.0, 3.0], np.float32)
    p = np.ones(4, np.float32)
    opt = optim.NumpyAdam([p], lr=1e-2)
    t = torch.ones(4, requires_grad=True)
    t.grad = torch.from_numpy(nan_grad.copy())
    topt = optim.CPUAdam([t], lr=1e-2)
    closure_calls = []
    steps = [(opt, lambda cf: opt.step([nan_grad], grad_scale=2.0, check_finite=cf)),
             (topt, lambda cf: topt.step(lambda: closure_calls.append(1), grad_scale=2.0,
                                         check_finite=cf))]
    for o, step in steps:
        if bad is None:                           # the default: checked, as grad_scale
            step(bad)                             # is given
            assert o.last_step_skipped and o.skipped_steps == 1
            continue
        with pytest.raises(OptimizerError, match=f"check_finite must be True or "
                                                 f"False, got {bad!r}") as info:
            step(bad)
        assert info.value.argument == "check_finite"
        assert o.skipped_steps == 0 and not o.last_step_skipped
        step(np.bool_(True))                      # numpy's bool is a bool
        assert o.last_step_skipped and o.skipped_steps == 1
    assert np.array_equal(p, np.ones(4, np.float32)) and opt.state[0]["step"] == 0
    assert torch.equal(t.detach(), torch.ones(4)) and not topt.state
    assert len(closure_calls) == 1                # a refused step ran no closure


@pytest.mark.parametrize("name", ["maximize", "amsgrad", "bias_correction"])
def test_a_switch_that_is_not_a_bool_is_refused_as_adam_update_refuses_it(name):
    # bool() of the keyword: maximize="no" (or "False" from a config file)
    # ascended, amsgrad="no" ran AMSGrad, silently; adam_update refuses them
    p = np.ones(4, np.float32)
    t = torch.ones(4, requires_grad=True)
    for make in (lambda: optim.NumpyAdam([p], **{name: "no"}),
                 lambda: optim.CPUAdam([t], **{name: "no"}),
                 lambda: optim.CPUAdamW([t], **{name: 0})):
        with pytest.raises(OptimizerError, match=f"^{name} must be True or False, "
                                                 f"got ('no'|0)$") as info:
            make()
        assert info.value.argument == name
    opt = optim.NumpyAdam([p], lr=1e-2)
    bad = opt.state_dict()
    bad["hyper"][name] = "False"
    with pytest.raises(OptimizerError, match=f"state_dict\\['hyper'\\]: {name} must be "
                                             f"True or False") as info:
        opt.load_state_dict(bad)
    assert info.value.argument == name and opt.hyper[name] is (name == "bias_correction")
    topt = optim.CPUAdam([t], lr=1e-2)
    with pytest.raises(OptimizerError, match=f"group 1: {name} must be True or False"):
        topt.add_param_group({"params": [torch.ones(2, requires_grad=True)], name: "no"})
    assert len(topt.param_groups) == 1
    saved = topt.state_dict()
    saved["param_groups"][0][name] = "no"
    with pytest.raises(OptimizerError, match=f"group 0 of the state dict: {name} must be"):
        topt.load_state_dict(saved)
    assert topt.param_groups[0][name] is (name == "bias_correction")
    topt.param_groups[0][name] = "no"                # edited by hand: the step refused
    with pytest.raises(OptimizerError, match=f"group 0: {name} must be True or False"):
        topt.step(grads=[torch.ones(4)])
    assert torch.equal(t.detach(), torch.ones(4)) and not topt.state
    topt.param_groups[0][name] = np.bool_(name == "bias_correction")   # numpy's is a bool
    topt.step(grads=[torch.ones(4)])
    torch.testing.assert_close(t.detach(), torch.full((4,), 1 - 1e-2))


def test_arrays_shared_between_params_of_one_step_are_refused(fresh_seed):
    # prepare_update checks the arrays of one update; across the updates of a
    # step a copy written for param 0 into param 1's memory (or its gradient)
    # silently changed param 1's step.
    rng = np.random.default_rng(fresh_seed)
    ps = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    opt = optim.NumpyAdam(ps, lr=1e-2)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    opt.step(grads)
    before = opt.state_dict()
    params_before = [p.copy() for p in ps]
    staging = np.empty(12, np.float32)
    cases = [(dict(copies=[ps[1], None, None]), "param 0 out and param 1 param", "copies"),
             (dict(copies=[None, None, opt.state[0]["exp_avg"]]),
              "param 0 exp_avg and param 2 out", "copies"),
             (dict(copies=[staging[:6], staging[3:9], None]),
              "param 0 out and param 1 out", "copies"),
             (dict(grads=[grads[0], ps[2], grads[2]]), "param 1 grad", "grads"),
             (dict(grads=[grads[0], staging[:6], grads[2]], copies=[staging[6:], None,
                                                                      staging[:6]]),
              "param 2 out and param 1 grad", "grads")]
    for kwargs, fragment, argument in cases:
        kwargs.setdefault("grads", grads)
        with pytest.raises(OptimizerError, match="overlap in memory") as info:
            opt.step(kwargs.pop("grads"), **kwargs)
        assert fragment in str(info.value) and info.value.argument == argument
        for p, b in zip(ps, params_before):
            assert p.tobytes() == b.tobytes()
        for st, ref in zip(opt.state, before["state"]):
            assert st["step"] == ref["step"] == 1
            assert st["exp_avg"].tobytes() == ref["exp_avg"].tobytes()
    # Disjoint views of one buffer are fine: one copy buffer for all params.
    copies = np.empty(18, np.float32)
    assert opt.step(grads, copies=[copies[:6], copies[6:12], copies[12:]])
    assert copies.tobytes() == np.concatenate(ps).tobytes()
    ts = [torch.tensor(p, requires_grad=True) for p in params_before]
    topt = optim.CPUAdam(ts, lr=1e-2)
    tgrads = [torch.from_numpy(g) for g in grads]
    with pytest.raises(OptimizerError, match="group 0 param 0 out and group 0 param 1 param"):
        topt.step(grads=tgrads, copies=[ts[1].detach(), None, None])
    with pytest.raises(OptimizerError, match="group 0 param 2 grad") as info:
        topt.step(grads=[tgrads[0], tgrads[1], ts[0].detach()])
    assert info.value.argument == "grads"
    for t, b in zip(ts, params_before):
        assert t.detach().numpy().tobytes() == b.tobytes()
    assert not topt.state                # refused steps leave no new state behind


def test_a_parameter_twice_in_a_group_is_refused_by_name():
    # torch.optim.Adam warns about it; CPUAdam took it, then refused every step
    # with "group 0 param 0 param and group 0 param 1 param overlap in memory ...
    # give each parameter its own gradient and copy buffers"
    import warnings
    torch = pytest.importorskip("torch")
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch's own warning about duplicates
        with pytest.raises(OptimizerError, match="param 2 of group 0 is param 0 again") \
                as info:
            optim.CPUAdam([p, q, p])
        assert info.value.argument == "params"
        opt = optim.CPUAdam([q])
        with pytest.raises(OptimizerError, match="param 1 of group 1 is param 0 again"):
            opt.add_param_group({"params": [p, p]})
    assert len(opt.param_groups) == 1       # the refused group is not kept


def test_parameters_overlapping_in_memory_are_refused_by_name():
    # two Parameters over overlapping views of one tensor: CPUAdam took them and
    # refused every step with advice about gradient and copy buffers
    torch = pytest.importorskip("torch")
    base = torch.ones(6)
    p, q = torch.nn.Parameter(base[:3]), torch.nn.Parameter(base[2:])
    with pytest.raises(OptimizerError, match=r"param 0 of group 0 and param 1 of group 0 "
                                             r"overlap in memory \(views of one tensor\)") \
            as info:
        optim.CPUAdam([p, q])
    assert info.value.argument == "params"
    opt = optim.CPUAdam([p])
    with pytest.raises(OptimizerError, match="param 0 of group 0 and param 0 of group 1 "
                                             "overlap in memory"):
        opt.add_param_group({"params": [q]})
    assert len(opt.param_groups) == 1       # the refused group is not kept
    # disjoint views of one tensor are fine
    r = torch.nn.Parameter(base[3:])
    opt.add_param_group({"params": [r]})
    p.grad, r.grad = torch.ones(3), torch.ones(3)
    assert opt.step() is None and not torch.equal(base, torch.ones(6))


def test_numpy_load_state_dict_of_the_wrong_structure_gets_an_optimizer_error():
    # A dict for 'state', a non-dict entry or a ragged array raised a bare
    # TypeError/ValueError; each is refused by name and loads nothing.
    rng = np.random.default_rng()
    opt = optim.NumpyAdam([rng.standard_normal(4).astype(np.float32)], lr=1e-2)
    opt.step([rng.standard_normal(4).astype(np.float32)])
    before = opt.state_dict()
    for change in (lambda sd: {**sd, "state": dict(enumerate(sd["state"]))},
                   lambda sd: {**sd, "state": None},
                   lambda sd: {**sd, "state": [None]},
                   lambda sd: {**sd, "state": [{**sd["state"][0], "step": 5,
                                                "exp_avg": [[1.0], [2.0, 3.0]]}]}):
        with pytest.raises(OptimizerError, match=r"state_dict\['state'\]|not an array") \
                as info:
            opt.load_state_dict(change(opt.state_dict()))
        assert info.value.argument == "state_dict"
        assert opt.state[0]["step"] == 1
        assert opt.state[0]["exp_avg"].tobytes() == before["state"][0]["exp_avg"].tobytes()


def test_refusals_of_copies_name_the_callers_keyword_in_the_text():
    # the kernel's own names reached the caller: "out has shape (8,) ... (with
    # out_format=)" for an array passed as copies= (with copy_format=)
    p = [np.zeros(7, np.float32)]
    opt = optim.NumpyAdam(p)
    g = [np.ones(7, np.float32)]
    with pytest.raises(OptimizerError, match=r"^param 0: copies has shape \(8,\)") as info:
        opt.step(g, copies=[np.zeros(8, np.float32)])
    assert info.value.argument == "copies"
    with pytest.raises(OptimizerError, match=r"copies has dtype float64.*copy_format=\)"):
        opt.step(g, copies=[np.zeros(7, np.float64)])


def test_a_state_written_by_a_step_on_non_finite_gradients_loads_back():
    # The load refused inf/NaN moments, which a step on an inf gradient writes
    # (as torch.optim.Adam's does): a save/load round trip of such a state
    # failed (TestCPUAdamStates found it)
    gen = torch.Generator().manual_seed(3)
    a = [torch.randn(4, generator=gen).requires_grad_()]
    opt = optim.CPUAdam(a, lr=0.1, betas=(0.0, 0.6))
    a[0].grad = torch.tensor([float("inf"), float("nan"), 1.0, -2.0])
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert not torch.isfinite(saved["state"][0]["exp_avg_sq"]).all()
    b = [torch.randn(4, generator=gen).requires_grad_()]
    again = optim.CPUAdam(b, lr=0.1, betas=(0.0, 0.6))
    again.load_state_dict(saved)
    for name, v in saved["state"][0].items():
        torch.testing.assert_close(again.state_dict()["state"][0][name], v, equal_nan=True)


@pytest.mark.parametrize("key, bad", [("exp_avg_sq", -1e-3), ("exp_avg_sq", -float("inf")),
                                      ("max_exp_avg_sq", -2.0),
                                      ("exp_avg_sq", -1e39)])     # -inf once in float32
def test_load_state_dict_refuses_moments_the_step_would_turn_into_nan(key, bad):
    # Loaded as given (as torch.optim.Adam loads them): the next step took the
    # square root of a negative second moment and the parameter became NaN,
    # silently. (Non-finite moments, which steps on non-finite gradients write,
    # load as they are: TestCPUAdamStates round-trips them.)
    gen = torch.Generator().manual_seed(31)
    a = [torch.randn(s, generator=gen, dtype=torch.float64).float().requires_grad_()
         for s in ((7, 3), (5,))]
    opt = optim.CPUAdam(a, lr=0.1, amsgrad=True)
    for p in a:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(good)
    sd["state"][1][key] = sd["state"][1][key].double()
    index = int(torch.randint(5, (), generator=gen))
    sd["state"][1][key][index] = bad
    old_groups, old_state = opt.param_groups, opt.state
    with pytest.raises(OptimizerError, match=rf"group 0 param 1: {key} has 1 negative "
                       rf"element\(s\).*at index \({index},\)") as info:
        opt.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    assert opt.param_groups is old_groups and opt.state is old_state
    for k, st in good["state"].items():
        for name, v in st.items():
            assert torch.equal(opt.state_dict()["state"][k][name], v), (k, name)
    sd["state"][1][key][index] = 0.0            # a zero moment is a moment
    opt.load_state_dict(sd)
    for p in a:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert all(torch.isfinite(p).all() for p in a)
