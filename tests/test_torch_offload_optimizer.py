"""OffloadedAdam as a torch.optim.Optimizer: param groups, lr schedulers, state
dicts (its own and torch.optim.Adam's), loss scaling with the finite check, and
gradient clipping, each against torch.optim.Adam/AdamW on the same model."""

import contextlib
import copy
import io
import pickle
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from rtmem.errors import OptimizerError  # noqa: E402
from rtmem.torch import OffloadedAdam  # noqa: E402


@pytest.fixture(autouse=True)
def host_backend(monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "host")


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def batches(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype))
            for _ in range(n)]


def train(model, opt, data, *, scale=1.0, step=None, clip=None, sched=None):
    """Steps of plain backward + opt.step; ``step``/``clip`` replace the plain
    step (the OffloadedAdam and torch spellings differ)."""
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float()) * scale
        loss.backward()
        if clip is not None:
            clip()
        (step or opt.step)()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def groups_of(model):
    """The GPT-2 recipe: weight decay on matrices only, another lr on the head."""
    decay = [model[0].weight]
    rest = [model[0].bias, model[1].weight, model[1].bias, model[3].bias]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0},
            {"params": [model[3].weight], "lr": 3e-2, "weight_decay": 0.05}]


def assert_same_params(a, b, atol=1e-5):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def test_is_a_torch_optimizer_with_groups_that_match_adamw():
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(groups_of(mine), lr=1e-2, adamw=True, chunk_elements=7)
    ref_opt = torch.optim.AdamW(groups_of(ref), lr=1e-2)
    assert isinstance(off, torch.optim.Optimizer)
    assert [g["weight_decay"] for g in off.param_groups] == [0.1, 0.0, 0.05]
    data = batches(6)
    train(mine, off, data)
    train(ref, ref_opt, data)
    assert_same_params(mine, ref)
    assert off.steps.tolist() == [6] * 6 and off.step_count == 6
    off.close()


def test_lr_schedulers_drive_the_groups():
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(groups_of(mine), lr=1e-2)
    ref_opt = torch.optim.Adam(groups_of(ref), lr=1e-2)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
              for o in (off, ref_opt)]
    data = batches(5)
    train(mine, off, data, sched=scheds[0])
    train(ref, ref_opt, data, sched=scheds[1])
    assert off.param_groups[2]["lr"] == ref_opt.param_groups[2]["lr"] == 3e-2 * (1 / 6)
    assert_same_params(mine, ref)
    off.close()


def test_named_parameters_are_taken():
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.named_parameters(), lr=1e-2)
    assert off.param_groups[0]["param_names"][0] == "0.weight"
    train(mine, off, batches(2))
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), batches(2))
    assert_same_params(mine, ref)
    off.close()


@pytest.mark.parametrize("model_first", [True, False], ids=["model-first", "opt-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_resumes_bit_identically(dtype, model_first):
    # 3 steps, save (through torch.save), load into a new model and optimizer, 3
    # more steps == 6 uninterrupted steps, bit for bit; with bf16 parameters
    # only the saved fp32 master weights can give that
    data = batches(6, dtype=dtype)
    whole = make_model(dtype)
    opt = OffloadedAdam(groups_of(whole), lr=1e-2, adamw=True)
    train(whole, opt, data)
    opt.close()

    first = make_model(dtype)
    opt = OffloadedAdam(groups_of(first), lr=1e-2, adamw=True)
    train(first, opt, data[:3])
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, blob)
    saved = opt.state_dict()
    opt.close()

    second = make_model(dtype)                          # the initial weights
    resumed = OffloadedAdam(groups_of(second), lr=1.0, adamw=False)   # overwritten
    blob.seek(0)
    ckpt = torch.load(blob)
    if model_first:
        second.load_state_dict(ckpt["model"])
        resumed.load_state_dict(ckpt["opt"])
    else:   # the model's bf16 weights, loaded after, must not replace the fp32 master
        resumed.load_state_dict(ckpt["opt"])
        second.load_state_dict(ckpt["model"])
    assert resumed.steps.tolist() == [3] * 6 and resumed.step_count == 3
    assert [g["lr"] for g in resumed.param_groups] == [1e-2, 1e-2, 3e-2]
    assert all(g["decoupled_weight_decay"] for g in resumed.param_groups)
    train(second, resumed, data[3:])
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)
    # the saved tensors are copies: the resumed run did not change them
    assert torch.equal(saved["state"][0]["exp_avg"], ckpt["opt"]["state"][0]["exp_avg"])
    resumed.close()


def test_state_dicts_move_between_torch_adam_and_offloaded_adam():
    data = batches(6)
    ref = make_model()
    ref_opt = torch.optim.Adam(groups_of(ref), lr=1e-2)
    train(ref, ref_opt, data)

    # torch for 3 steps, then OffloadedAdam (master weights read from the model)
    mine = make_model()
    torch_opt = torch.optim.Adam(groups_of(mine), lr=1e-2)
    train(mine, torch_opt, data[:3])
    off = OffloadedAdam(groups_of(mine), lr=1e-2)
    off.load_state_dict(torch_opt.state_dict())
    train(mine, off, data[3:])
    assert_same_params(mine, ref)
    off.close()

    # OffloadedAdam for 3 steps, then torch.optim.Adam
    back = make_model()
    off = OffloadedAdam(groups_of(back), lr=1e-2)
    train(back, off, data[:3])
    saved = off.state_dict()
    off.close()
    torch_opt = torch.optim.Adam(groups_of(back), lr=1e-2)
    torch_opt.load_state_dict(saved)
    train(back, torch_opt, data[3:])
    assert_same_params(back, ref)


def test_a_checkpoint_of_a_capturable_torch_adam_loads_as_capturable_false():
    # A GPU torch.optim.Adam(capturable=True)'s checkpoint (groups with
    # capturable=True, step tensors on the parameters' device): the switch was
    # kept in the groups, ignored, and saved again by state_dict(). Now it is
    # loaded as False (the same update), the steps kept as this class keeps them.
    data = batches(5)
    ref, mine = make_model(), make_model()
    ref_opt = torch.optim.Adam(groups_of(ref), lr=1e-2)
    train(ref, ref_opt, data[:3])
    saved = copy.deepcopy(ref_opt.state_dict())
    for group in saved["param_groups"]:
        group["capturable"] = True
    mine.load_state_dict(ref.state_dict())
    off = OffloadedAdam(groups_of(mine), lr=1e-2)
    off.load_state_dict(saved)
    assert [g["capturable"] for g in off.param_groups] == [False] * 3
    assert off.steps.tolist() == [3] * 6 and off.step_count == 3
    for p in mine.parameters():
        step = off.state[p]["step"]
        assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 3
    again = off.state_dict()
    assert [g["capturable"] for g in again["param_groups"]] == [False] * 3
    assert [int(st["step"]) for st in again["state"].values()] == [3] * 6
    train(mine, off, data[3:])
    train(ref, ref_opt, data[3:])
    assert_same_params(mine, ref)
    fresh = OffloadedAdam(groups_of(make_model()), lr=1e-2)   # its round trip
    fresh.load_state_dict(again)
    assert fresh.steps.tolist() == [3] * 6
    fresh.close()
    off.close()


@pytest.mark.parametrize("name", ["capturable", "differentiable"])
def test_switches_offloaded_adam_cannot_honour_are_refused_in_groups(name):
    # capturable/differentiable=True were taken in the constructor's groups, in
    # a loaded state dict and in a group edited by hand, kept there and ignored
    model = make_model()
    with pytest.raises(OptimizerError, match=f"param group 2 has {name}=True, which is "
                       f"not supported.*leave {name} out of the group") as info:
        OffloadedAdam([{**g, name: True} if i == 2 else g
                       for i, g in enumerate(groups_of(model))])
    assert info.value.argument == name
    off = OffloadedAdam(groups_of(model), lr=1e-2)
    train(model, off, batches(1))
    good = copy.deepcopy(off.state_dict())
    master = off.master.copy()

    def unchanged(groups=True):
        assert (off.master == master).all() and off.steps.tolist() == [1] * 6
        assert not groups or off.state_dict()["param_groups"] == good["param_groups"]
    with pytest.raises(OptimizerError, match="after construction"):
        off.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], name: True})
    assert len(off.param_groups) == 3
    unchanged()
    saved = copy.deepcopy(good)
    saved["param_groups"][1][name] = True
    if name == "differentiable":
        with pytest.raises(OptimizerError, match="group 1 of the state dict has "
                           "differentiable=True.*set it to False in the dict") as info:
            off.load_state_dict(saved)
        assert info.value.argument == name
        unchanged()
    else:                                          # taken as False (the test above)
        off.load_state_dict(saved)
        assert off.param_groups[1]["capturable"] is False
        del off.param_groups[1]["capturable"]
    x, y = batches(1, seed=2)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    off.param_groups[0][name] = True                 # edited by hand: the step refused
    with pytest.raises(OptimizerError, match=f"param group 0 has {name}=True"):
        off.step()
    unchanged(groups=False)
    off.param_groups[0][name] = False
    off.step()
    assert off.steps.tolist() == [2] * 6
    off.close()


@pytest.mark.parametrize("name", ["amsgrad", "maximize"])
def test_an_unsupported_switch_that_is_not_a_bool_is_named_as_given(name):
    # "no" is truthy: refused, but as "amsgrad=True is not supported" to a
    # caller who passed "no" (a value read from a config file)
    with pytest.raises(OptimizerError, match=f"{name}='no' is not a bool: pass "
                                             f"False") as info:
        OffloadedAdam(make_model().parameters(), **{name: "no"})
    assert info.value.argument == name
    with pytest.raises(OptimizerError, match=f"{name}=True is not supported"):
        OffloadedAdam(make_model().parameters(), **{name: True})
    OffloadedAdam(make_model().parameters(), **{name: np.bool_(False)}).close()


def through_torch_save(sd):
    blob = io.BytesIO()
    torch.save(sd, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


@pytest.mark.parametrize("other", ["Adam", "CPUAdam"])
def test_a_master_carried_through_another_optimizers_training_is_not_restored(other):
    # OffloadedAdam -> torch.optim.Adam or CPUAdam (which keep the unknown
    # "master" and train) -> OffloadedAdam: the 3-step-old master was taken as
    # of record and silently reverted the other optimizer's 3 steps. Its
    # master_step now tells it is stale, and it is read from the model instead.
    from rtmem.optim import CPUAdam
    cls = CPUAdam if other == "CPUAdam" else torch.optim.Adam
    data = batches(7)
    model = make_model()
    off = OffloadedAdam(groups_of(model), lr=1e-2)
    train(model, off, data[:3])
    saved = through_torch_save(off.state_dict())
    off.close()

    elsewhere = make_model()
    elsewhere.load_state_dict(model.state_dict())
    other_opt = cls(groups_of(elsewhere), lr=1e-2)
    other_opt.load_state_dict(saved)
    train(elsewhere, other_opt, data[3:6])
    carried = through_torch_save(other_opt.state_dict())

    back = make_model()
    back.load_state_dict(elsewhere.state_dict())
    resumed = OffloadedAdam(groups_of(back), lr=1e-2)
    resumed.load_state_dict(carried)
    weights = torch.cat([p.detach().reshape(-1) for p in resumed.params])  # back's ==
    assert torch.equal(torch.from_numpy(resumed.master), weights)         # elsewhere's
    assert resumed.steps.tolist() == [6] * 6
    train(back, resumed, data[6:])
    train(elsewhere, other_opt, data[6:])
    assert_same_params(back, elsewhere)
    resumed.close()
    # how: the other optimizer carried master and master_step (an int) unchanged,
    # through torch.save and a weights_only load, while its steps moved "step" on
    for i, st in carried["state"].items():
        assert st["master_step"] == saved["state"][i]["master_step"] == 3
        assert isinstance(st["master_step"], int) and float(st["step"]) == 6
        assert torch.equal(st["master"], saved["state"][i]["master"])


def test_a_master_without_master_step_is_still_of_record():
    # an older rtmem dict (no master_step): its master is of record, as before
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    train(model, off, batches(2))
    saved = off.state_dict()
    for st in saved["state"].values():
        st.pop("master_step", None)
    model[0].bias.data.add_(1.0)     # through .data: no write the optimizer sees
    off.load_state_dict(saved)
    assert torch.equal(off.state_dict()["state"][1]["master"], saved["state"][1]["master"])
    off.close()


def test_bad_state_dicts_are_refused_and_change_nothing():
    model = make_model()
    off = OffloadedAdam(groups_of(model), lr=1e-2)
    train(model, off, batches(2))
    good = off.state_dict()
    before = [a.copy() for a in (off.master, off.exp_avg, off.exp_avg_sq, off.steps)]
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                   for g in off.param_groups])

    def edited(change):
        sd = copy.deepcopy(good)
        change(sd)
        return sd

    def set_state(key, value):
        return lambda sd: sd["state"][1].__setitem__(key, value)
    sgd = torch.optim.SGD(make_model().parameters(), lr=0.1).state_dict()
    for bad, fragment in (
            ("nope", "must be a dict"),
            ({"state": {}}, "must be a dict"),
            (edited(lambda sd: sd["param_groups"].pop()), "groups of"),
            (edited(lambda sd: sd["param_groups"][0]["params"].append(99)), "groups of"),
            (sgd, "groups of"),
            (edited(lambda sd: [g.pop("betas") for g in sd["param_groups"]]), "not an Adam"),
            (edited(lambda sd: sd["param_groups"][1].__setitem__("lr", -1.0)), "group 1.*lr"),
            (edited(lambda sd: sd["param_groups"][1].__setitem__("amsgrad", True)),
             "amsgrad"),
            (edited(set_state("step", -2)), "step is -2"),
            (edited(set_state("step", 1.5)), "step is 1.5"),
            # beyond the int64 step counter: was a bare OverflowError after the
            # earlier parameters' state had been replaced
            (edited(set_state("step", torch.tensor(1e19))), "step counter holds"),
            (edited(set_state("exp_avg", torch.zeros(3))), "shape"),
            # the shape matched: it was blamed on "another model" all the same
            (edited(set_state("exp_avg", torch.zeros(8, dtype=torch.int64))),
             r"parameter 1: state exp_avg has dtype torch.int64; expected floating"),
            (edited(set_state("master", torch.zeros(8, 6))), "shape"),
            (edited(set_state("master_step", -1)), "master_step: step is -1"),
            (edited(set_state("master_step", "2")), "master_step: step is '2'"),
            (edited(set_state("max_exp_avg_sq", torch.zeros(8))), "amsgrad"),
            # a bare TypeError / RuntimeError from torch.as_tensor
            (edited(set_state("exp_avg", None)), "exp_avg=None; expected a tensor"),
            (edited(set_state("exp_avg_sq", "abc")), "exp_avg_sq='abc'; expected a tensor"),
            (edited(lambda sd: sd["state"][1].pop("exp_avg_sq")), "no exp_avg_sq"),
            # was read as step 0: a first step's bias correction of the saved
            # moments (~10x the update), silently
            (edited(lambda sd: sd["state"][1].pop("step")), "parameter 1: the state has "
             "master, exp_avg, exp_avg_sq, master_step but no step"),
            (edited(lambda sd: sd["state"].__setitem__(42, sd["state"][1])), "parameter 42"),
            (edited(lambda sd: sd["state"].__setitem__(1, [1, 2])), "dict of dicts"),
            (edited(lambda sd: sd.__setitem__("step_count", -1)), "step_count")):
        with pytest.raises(OptimizerError, match=fragment):
            off.load_state_dict(bad)
        after = (off.master, off.exp_avg, off.exp_avg_sq, off.steps)
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), fragment
        assert [{k: v for k, v in g.items() if k != "params"}
                for g in off.param_groups] == groups_before, fragment
    off.load_state_dict(good)                           # the real one still loads
    off.close()
    for call in (off.state_dict, lambda: off.load_state_dict(good)):
        with pytest.raises(OptimizerError, match="closed"):
            call()


@pytest.mark.parametrize("replaced", [1, 3], ids=["no-saved-state", "saved-state"])
def test_a_load_with_a_replaced_parameter_is_refused_and_changes_nothing(replaced):
    # A parameter whose data was replaced (another size) after construction: the
    # load wrote the parameters before it, then raised numpy's "could not
    # broadcast" (no saved state for it) or blamed the dict ("belongs to another
    # model"). Refused up front, by name, as step() refuses it.
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    model[0].bias.requires_grad_(False)      # parameter 1: never steps, no saved state
    train(model, off, batches(2))
    saved = off.state_dict()
    assert 1 not in saved["state"] and 3 in saved["state"]
    train(model, off, batches(2, seed=3))
    before = [a.copy() for a in (off.master, off.exp_avg, off.exp_avg_sq, off.steps)]
    p = off.params[replaced]
    kept = p.data
    p.data = torch.zeros(p.numel() + 1)
    with pytest.raises(OptimizerError, match=f"parameter {replaced} is now .* 9 elements"
                       f".*replaced after construction.*new OffloadedAdam"):
        off.load_state_dict(saved)
    after = (off.master, off.exp_avg, off.exp_avg_sq, off.steps)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert off.step_count == 4
    p.data = kept                            # restored: the load goes through
    off.load_state_dict(saved)
    assert off.steps.tolist() == [2, 0, 2, 2, 2, 2]
    off.close()


def test_loss_scale_unscaled_in_the_step_and_overflow_skips_it():
    data = batches(4)
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(mine, off, data, scale=1024.0, step=lambda: off.step(grad_scale=1024.0))
    train(ref, ref_opt, data)
    assert_same_params(mine, ref)
    # an overflowed gradient: nothing changes, the step is counted as skipped,
    # and its gradients are used up (the next step starts from new ones)
    before = [a.copy() for a in (off.master, off.exp_avg, off.exp_avg_sq, off.steps)]
    params = [p.detach().clone() for p in mine.parameters()]
    x, y = data[0]
    (torch.nn.functional.mse_loss(mine(x), y) * float("inf")).backward()
    off.step(grad_scale=1024.0)
    assert off.last_step_skipped and off.skipped_steps == 1 and off.step_count == 4
    assert all(np.array_equal(a, b) for a, b in zip(before, (
        off.master, off.exp_avg, off.exp_avg_sq, off.steps)))
    assert all(torch.equal(p, q) for p, q in zip(params, mine.parameters()))
    off.step()                                   # no gradient left: nothing to do
    assert off.step_count == 4 and not off.last_step_skipped
    with pytest.raises(OptimizerError, match="grad_scale"):
        off.step(grad_scale=-1.0)
    # refused with gradients waiting: they stay for the next step
    def refused_then_applied():
        with pytest.raises(OptimizerError, match="grad_scale"):
            off.step(grad_scale=float("nan"))
        off.step(grad_scale=8.0)
    train(mine, off, data[:1], scale=8.0, step=refused_then_applied)
    train(ref, ref_opt, data[:1])
    assert off.step_count == 5
    assert_same_params(mine, ref)
    off.close()


@pytest.mark.parametrize("bad", ["no", "False", 0.0, 1])
def test_a_check_finite_that_is_not_a_bool_is_refused_and_changes_nothing(bad):
    # taken by truthiness, as adam_update no longer takes it: 0.0 with a loss
    # scale turned the check off and a NaN gradient made the parameters NaN,
    # "no" (or "False" from a command line) checked
    mine = make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2, chunk_elements=16)
    x, y = batches(1)[0]
    (torch.nn.functional.mse_loss(mine(x), y) * float("nan")).backward()
    before = [a.copy() for a in (off.master, off.exp_avg, off.exp_avg_sq, off.steps)]
    params = [p.detach().clone() for p in mine.parameters()]
    with pytest.raises(OptimizerError, match=f"check_finite must be True or False, "
                                             f"got {bad!r}") as info:
        off.step(grad_scale=2.0, check_finite=bad)
    assert info.value.argument == "check_finite"
    assert all(np.array_equal(a, b) for a, b in zip(before, (
        off.master, off.exp_avg, off.exp_avg_sq, off.steps)))
    assert all(torch.equal(p, q) for p, q in zip(params, mine.parameters()))
    assert off.skipped_steps == 0 and not off.last_step_skipped
    rtmem.LossScaler(2.0).step(off)              # the gradients waited: skipped now
    assert off.last_step_skipped and off.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(params, mine.parameters()))
    off.step(check_finite=np.bool_(True))        # numpy's bool is a bool
    off.close()


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_matches_torch(norm_type):
    data = batches(4)
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    norms = ([], [])
    train(mine, off, data, scale=64.0, step=lambda: off.step(grad_scale=64.0),
          clip=lambda: norms[0].append(off.clip_grad_norm_(0.05, norm_type,
                                                           grad_scale=64.0)))
    train(ref, ref_opt, data, clip=lambda: norms[1].append(
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)))
    torch.testing.assert_close(torch.stack(norms[0]), torch.stack(norms[1]), rtol=1e-5,
                               atol=0)
    assert all(n > 0.05 for n in norms[1])          # every step was clipped
    assert_same_params(mine, ref)
    off.close()


def test_clip_grad_norm_of_non_finite_or_no_gradients():
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    assert float(off.clip_grad_norm_(1.0)) == 0.0       # no gradient yet
    x, y = batches(1)[0]
    (torch.nn.functional.mse_loss(model(x), y) * float("nan")).backward()
    with pytest.raises(RuntimeError, match="non-finite") as exc:  # what torch raises
        off.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert isinstance(exc.value, rtmem.NonFiniteGradientError)
    assert not torch.isfinite(off.clip_grad_norm_(1.0))
    with pytest.raises(OptimizerError, match="max_norm"):
        off.clip_grad_norm_(-1.0)
    before = off.master.copy()
    off.step(check_finite=True)                         # left as they were: skipped
    assert off.last_step_skipped and np.array_equal(before, off.master)
    off.close()


def test_what_the_host_buffers_cannot_follow_is_refused():
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    with pytest.raises(OptimizerError, match="after construction"):
        off.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(off.param_groups) == 1
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="state_dict"):
            copier(off)
    off.close()
    with pytest.raises(OptimizerError, match="group 0: maximize"):
        OffloadedAdam([{"params": model.parameters(), "maximize": True}])
    with pytest.raises(OptimizerError, match="decoupled_weight_decay"):
        OffloadedAdam(model.parameters(), adamw="yes")
    arena = rtmem.HostArena(1 << 20)
    OffloadedAdam(model.parameters(), host_arena=arena).close()
    assert arena.stats().allocated_bytes == 0
    arena.close()


def test_state_dict_keeps_last_step_skipped_and_a_torch_dict_resets_the_counters():
    # skipped_steps was saved, last_step_skipped not: a round trip after a
    # skipped step said the last step was applied
    mine = make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2)
    train(mine, off, batches(1))
    x, y = batches(1)[0]
    (torch.nn.functional.mse_loss(mine(x), y) * float("inf")).backward()
    off.step(grad_scale=8.0)
    saved = off.state_dict()
    assert (saved["skipped_steps"], saved["last_step_skipped"]) == (1, True)
    off.close()
    other = make_model()
    back = OffloadedAdam(other.parameters(), lr=1e-2)
    back.load_state_dict(saved)
    assert (back.step_count, back.skipped_steps, back.last_step_skipped) == (1, 1, True)
    ref = torch.optim.Adam(make_model().parameters(), lr=1e-2)
    ref.load_state_dict(copy.deepcopy(saved))     # the extra keys are ignored
    back.load_state_dict(ref.state_dict())       # and torch keeps no skip record
    assert (back.step_count, back.skipped_steps, back.last_step_skipped) == (1, 0, False)
    with pytest.raises(OptimizerError, match="last_step_skipped"):
        back.load_state_dict({**saved, "last_step_skipped": "yes"})
    assert (back.skipped_steps, back.last_step_skipped) == (0, False)
    back.close()


def test_state_dict_hooks_run_and_loaded_groups_are_copies():
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=torch.tensor(1e-2))
    train(model, off, batches(1))
    calls = []
    off.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    off.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": calls.append("post")})
    off.register_load_state_dict_pre_hook(
        lambda o, sd: calls.append("load-pre") or {**sd, "step_count": 7})
    off.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    saved = off.state_dict()
    assert "tag" in saved and calls == ["pre", "post"]
    other = OffloadedAdam(make_model().parameters())
    other.register_load_state_dict_pre_hook(lambda o, sd: {**sd, "step_count": 7})
    other.load_state_dict(saved)
    assert other.step_count == 7
    # a tensor lr is copied, as torch does: a scheduler's in-place fill_ on one
    # optimizer's lr does not reach the other's (or the saved dict's)
    other.param_groups[0]["lr"].fill_(0.5)
    assert float(saved["param_groups"][0]["lr"]) == float(off.param_groups[0]["lr"]) == \
        float(torch.tensor(1e-2))
    off.load_state_dict(saved)
    assert calls[-2:] == ["load-pre", "load-post"]
    other.close()
    off.close()


def test_clip_grad_norm_edge_orders_and_finite_overflowing_gradients():
    # the 0-"norm" counts non-zero gradients: a loss scale does not change it
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters())
    x, y = batches(1)[0]
    (torch.nn.functional.mse_loss(mine(x), y) * 8.0).backward()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, 0)
    assert float(off.clip_grad_norm_(1e9, 0, grad_scale=8.0)) == float(want) > 0
    off.zero_grad()
    # finite gradients of 1e20 (a loss spike): their float32 norm overflows, but
    # they are clipped with the float64 norm, not applied unclipped (and not
    # zeroed, as torch's inf norm does)
    (torch.nn.functional.mse_loss(mine(x), y) * 1e20).backward()
    grads = off._grad_t.double().clone()
    norm = off.clip_grad_norm_(1.0)
    torch.testing.assert_close(float(norm), float(torch.linalg.vector_norm(grads)), rtol=1e-6,
                               atol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(off._grad_t.double()),
                               torch.tensor(1.0, dtype=torch.float64), rtol=1e-5, atol=0)
    off.step(check_finite=True)
    assert not off.last_step_skipped and off.exp_avg_sq.max() < 1.0
    off.close()


def test_clip_grad_norm_takes_the_norm_types_torch_takes():
    # torch documents norm_type='inf' (a string) for the infinity norm; it reached
    # torch.linalg.vector_norm as it was: a bare TypeError, after the gradients
    # were gathered
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters())
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(mine(x), y).backward()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for norm_type in ("inf", "2", 3):
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type)
        assert float(off.clip_grad_norm_(1e9, norm_type)) == pytest.approx(float(want),
                                                                         rel=1e-6)
    with pytest.raises(OptimizerError, match="norm_type must be a real number") as info:
        off.clip_grad_norm_(1.0, "two")
    assert info.value.argument == "norm_type"
    off.close()


def test_state_holds_live_views_and_checkpoint_utilities_see_it():
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    assert not off.state
    train(model, off, batches(2))
    p = model[0].weight
    st = off.state[p]
    assert float(st["step"]) == 2 and st["exp_avg"].shape == p.shape
    assert torch.equal(st["exp_avg"], off.state_dict()["state"][0]["exp_avg"])
    before = st["exp_avg"].clone()
    train(model, off, batches(1, seed=5))
    assert float(off.state[p]["step"]) == 3 and not torch.equal(st["exp_avg"], before)
    # torch.distributed.checkpoint "initializes" an optimizer with an empty
    # state by stepping it with zero gradients: that must not happen here
    dcp = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    steps = off.steps.copy()
    sd = dcp.get_optimizer_state_dict(model, off)
    assert np.array_equal(off.steps, steps) and "0.weight" in sd["state"]
    off.close()
    assert not off.state


def test_an_optimizer_dropped_without_close_frees_its_buffers_in_the_callers_arena():
    import gc
    model = make_model()
    arena = rtmem.HostArena(1 << 20)
    for _ in range(3):
        off = OffloadedAdam(model.parameters(), host_arena=arena)
        train(model, off, batches(1))
        del off
        gc.collect()
        assert arena.stats().allocated_bytes == 0
    arena.close()


@pytest.mark.parametrize("how", ["close", "drop"])
def test_master_and_moments_kept_by_the_caller_survive_the_optimizer(how):
    # The public arrays were unpinned views: after close() (or a drop) the
    # caller's arena handed their bytes out again, and a kept opt.master read
    # whatever the next buffer held.
    import gc
    model = make_model()
    arena = rtmem.HostArena(1 << 20)
    off = OffloadedAdam(model.parameters(), host_arena=arena)
    train(model, off, batches(1))
    kept = (off.master, off.exp_avg, off.exp_avg_sq)
    before = [a.copy() for a in kept]
    if how == "close":
        off.close()
    else:
        del off
        gc.collect()
    junk = arena.alloc(shape=(1 << 16,), dtype=np.float32)
    junk.numpy()[:] = 12345.0
    for a, b in zip(kept, before):
        assert np.array_equal(a, b)
    junk.free()
    del kept, a
    gc.collect()
    assert arena.stats().allocated_bytes == 0   # the frees waited for the views only
    arena.close()


def test_empty_param_groups():
    model = make_model()
    off = OffloadedAdam([{"params": []}, {"params": model.parameters(), "lr": 1e-2}])
    train(model, off, batches(1))
    assert off.steps.tolist() == [1] * 6
    off.close()
    with pytest.raises(OptimizerError, match="every param group is empty"):
        OffloadedAdam([{"params": []}])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_in_place_after_construction_are_trained_not_reverted(dtype):
    # build, make the optimizer, then load pretrained weights (a common order):
    # the first step's upload wrote the master weights of construction back over
    # them, silently. Now the master weights take what was written in place.
    pretrained = make_model(dtype)
    torch.nn.init.normal_(pretrained[0].weight)
    data = batches(3, dtype=dtype)
    mine = make_model(dtype)
    off = OffloadedAdam(mine.parameters(), lr=1e-2)
    mine.load_state_dict(pretrained.state_dict())
    assert off.state_dict()["state"] == {}              # nothing stepped yet, but ...
    loaded = pretrained[0].weight.detach().float().reshape(-1)
    assert torch.equal(torch.from_numpy(off.master[:loaded.numel()]), loaded)   # ... taken
    with torch.no_grad():                               # one by hand, seen by step()
        mine[3].bias.copy_(torch.tensor([1.5, -2.0, 0.25]))
        pretrained[3].bias.copy_(mine[3].bias)
    if dtype == torch.float32:      # against torch Adam on the written weights
        ref_opt = torch.optim.Adam(pretrained.parameters(), lr=1e-2, foreach=False)
        train(pretrained, ref_opt, data)
        train(mine, off, data)
        assert_same_params(mine, pretrained)
    else:                           # one Adam step (of at most lr) away from them
        train(mine, off, data[:1])
        lo, hi = off._span(len(off.params) - 1)
        for got, want in ((off.master[lo:hi], [1.5, -2.0, 0.25]),
                          (off.master[:loaded.numel()], loaded.numpy())):
            assert 0 < abs(got - want).max() <= 1.1e-2
    # a write through .data moves no version counter: overwritten, as documented
    before = mine[0].bias.detach().clone()
    mine[0].bias.data.fill_(7.0)
    train(mine, off, data[:1])
    assert (mine[0].bias - before).abs().max() <= 1.1e-2
    # a write before load_state_dict is kept, as after it (and as torch keeps it):
    # the loaded master weights are of record only where the parameter agrees
    saved = off.state_dict()
    with torch.no_grad():
        mine[0].bias.add_(1.0)
    off.load_state_dict(saved)
    now = off.state_dict()["state"]
    assert torch.equal(now[1]["master"], mine[0].bias.detach().float())
    assert not torch.equal(now[1]["master"], saved["state"][1]["master"])
    assert torch.equal(now[0]["master"], saved["state"][0]["master"])   # not written
    off.close()


def test_steps_like_adam_under_compiled_autograd():
    # Compiled autograd calls the post-accumulate-grad hooks from the backward
    # graph it compiles: traced by dynamo, the hook's host bookkeeping failed
    # inside torch ("AssertionError: sources must not be empty for symbol s41")
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2)
    data = batches(3)
    torch._dynamo.reset()
    try:
        ca = torch._dynamo.compiled_autograd   # _enable: torch >= 2.6, enable before
        with (getattr(ca, "_enable", None) or ca.enable)(torch.compile(backend="aot_eager")):
            train(mine, off, data)
    finally:
        torch._dynamo.reset()
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), data)
    assert_same_params(mine, ref)
    assert off.step_count == 3
    off.close()


def test_gradients_left_in_p_grad_until_the_step():
    # flush_in_backward=False (for DistributedDataParallel, tests/test_torch_ddp.py):
    # no hooks, p.grad accumulates on the device, step() and clipping take it
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(mine.parameters(), lr=1e-2, flush_in_backward=False)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    data = batches(4)
    for model in (mine, ref):
        for x, y in data[:2]:                       # accumulated over two backwards
            torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(p.grad is not None for p in mine.parameters()) and all(off._fresh)
    norm = off.clip_grad_norm_(0.5)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(norm, want)
    off.step()
    ref_opt.step()
    assert_same_params(mine, ref)
    off.zero_grad()
    ref_opt.zero_grad()
    train(mine, off, data[2:])
    train(ref, ref_opt, data[2:])
    assert_same_params(mine, ref)
    off.close()
    with pytest.raises(OptimizerError, match="flush_in_backward must be True, False or None"):
        OffloadedAdam(mine.parameters(), flush_in_backward="no")


@pytest.mark.parametrize("ranks, flush", [(None, True), (1, True), (2, False), (8, False)])
def test_the_default_keeps_gradients_in_p_grad_in_a_process_group(monkeypatch, ranks, flush):
    # None: no process group. With more than one rank, DDP (or the caller) may
    # all-reduce p.grad after backward: the default leaves it there
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: ranks is not None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: ranks)
    model = make_model()
    off = OffloadedAdam(model.parameters())
    assert off.flush_in_backward is flush
    torch.nn.functional.mse_loss(model(batches(1)[0][0]), batches(1)[0][1]).backward()
    assert all((p.grad is None) is flush for p in model.parameters())
    off.close()
    # an override; in a group of several ranks it says what DDP would do with it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explicit = OffloadedAdam(model.parameters(), flush_in_backward=True)
    assert explicit.flush_in_backward is True
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if flush:
        assert said == []
    else:
        assert len(said) == 1 and f"group of {ranks} ranks" in said[0]
        assert "flush_in_backward=False" in said[0]
    explicit.close()


def _scaler_twins(out_features, scaler_kwargs=(), **offloaded):
    """A Linear(4, out_features) under torch.optim.Adam and its copy under an
    OffloadedAdam(flush_in_backward=False, **offloaded), and a GradScaler each."""
    torch.manual_seed(0)
    ref, mine = torch.nn.Linear(4, out_features), torch.nn.Linear(4, out_features)
    mine.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    off = OffloadedAdam(mine.parameters(), lr=1e-2, flush_in_backward=False, **offloaded)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, **dict(scaler_kwargs))
               for _ in range(2)]
    return ref, mine, ref_opt, off, scalers


def _scaled_backward(it, models, scalers):
    """Iteration ``it``'s scaled MSE backward through both models."""
    out_features = models[0].out_features
    gen = torch.Generator().manual_seed(it)
    x, y = torch.randn(5, 4, generator=gen), torch.randn(5, out_features, generator=gen)
    for m, sc in zip(models, scalers):
        sc.scale(torch.nn.functional.mse_loss(m(x), y)).backward()


def test_a_refused_step_under_grad_scaler_leaves_no_scale_behind_for_the_retry():
    # GradScaler.step sets grad_scale/found_inf on the optimizer and deletes them
    # only after a step that returns; it multiplies a grad_scale it finds into the
    # next one, so the retry of a refused step unscaled by S**2
    ref, mine, ref_opt, off, scalers = _scaler_twins(2)
    for it in range(3):
        _scaled_backward(it, (ref, mine), scalers)
        scalers[0].step(ref_opt)
        if it == 1:
            off.param_groups[0]["lr"] = -1.0          # refused before anything changes
            with pytest.raises(OptimizerError, match="lr=-1.0"):
                scalers[1].step(off)
            assert "grad_scale" not in off.__dict__ and "found_inf" not in off.__dict__
            off.param_groups[0]["lr"] = 1e-2
        scalers[1].step(off)
        for sc, opt in zip(scalers, (ref_opt, off)):
            sc.update()
            opt.zero_grad()
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    off.close()


@pytest.mark.parametrize("used", [(0,), (0, 2)])
def test_an_interrupted_step_under_grad_scaler_keeps_zeroed_gradients_it_did_not_reach(
        monkeypatch, used):
    # zero_grad(set_to_none=False), then parameters unused in a step: torch steps
    # them with their zero p.grad. Interrupted before reaching them, the step put
    # back only what it had taken from p.grad: its note said the step was done
    # (the zeroed ones then missed their step), or the documented retry was
    # refused as if clip_grad_norm_ had taken the gradients
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(n)) for n in (3, 2, 2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    off = OffloadedAdam(mine, lr=0.1, flush_in_backward=False, chunk_elements=3)
    ref_opt = torch.optim.Adam(ref, lr=0.1, foreach=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0) for _ in range(2)]
    for it in range(2):
        for ps, sc in zip((ref, mine), scalers):
            sc.scale(sum(ps[k].sum() for k in (range(3) if it == 0 else used))).backward()
        scalers[0].step(ref_opt)
        if it == 1:
            real, calls = OffloadedAdam._upload_on, []

            def upload(self, h2d, a, b):
                real(self, h2d, a, b)
                calls.append(1)
                if len(calls) == 1:
                    raise KeyboardInterrupt          # after chunk [0, 3): mine[0] only
            monkeypatch.setattr(OffloadedAdam, "_upload_on", upload)
            with pytest.raises(KeyboardInterrupt) as info:
                scalers[1].step(off)
            monkeypatch.undo()
            notes = " ".join(getattr(info.value, "__notes__", []))
            assert sys.version_info < (3, 11) or "call scaler.step(optimizer) again" in notes
            assert [p.grad is not None for p in mine] == [False, True, True]
        scalers[1].step(off)
        for sc, opt in zip(scalers, (ref_opt, off)):
            sc.update()
            opt.zero_grad(set_to_none=False)
    assert off.steps.tolist() == [2, 2, 2]
    for p, q in zip(mine, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    off.close()


def test_a_clip_before_grad_scalers_check_is_refused_and_the_documented_loop_works():
    # clip_grad_norm_ moves the gradients from p.grad to the host; clipped before
    # scaler.step (no unscale_), they escaped GradScaler's inf check, the step ran
    # and scaler.update() asserted "No inf checks were recorded prior to update".
    ref, mine, ref_opt, off, scalers = _scaler_twins(3)
    for it in range(3):
        _scaled_backward(it, (ref, mine), scalers)
        scalers[0].unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        scalers[0].step(ref_opt)
        if it == 1:                           # the clip before unscale_: refused
            off.clip_grad_norm_(0.05, grad_scale=scalers[1].get_scale())
            with pytest.raises(OptimizerError, match=r"unscale_\(optimizer\) before"):
                scalers[1].step(off)
            assert all(p.grad is not None for p in mine.parameters())
            assert off.steps.tolist() == [1, 1]               # nothing stepped
        scalers[1].unscale_(off)
        off.clip_grad_norm_(0.05)
        scalers[1].step(off)
        for sc, opt in zip(scalers, (ref_opt, off)):
            sc.update()
            opt.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale()
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    off.close()


def test_a_scaler_step_after_an_interrupted_plain_step_says_what_happened(monkeypatch):
    # A plain optimizer.step() interrupted after the weight's chunk left the
    # bias's gradient on the host; the scaler.step that followed was refused
    # with the clip_grad_norm_ message ("nothing has stepped", though the
    # weight had). Now the refusal says which step left them and how to go on.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    off = OffloadedAdam(lin.parameters(), lr=1e-2, flush_in_backward=False,
                        chunk_elements=4)        # the weight's 12 elements, then the bias
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(lin(torch.randn(5, 4)).pow(2).mean()).backward()
    real = OffloadedAdam._upload_on

    def upload(self, h2d, a, b):
        if a == 8:
            raise KeyboardInterrupt                       # at the weight's last chunk
        real(self, h2d, a, b)
    monkeypatch.setattr(OffloadedAdam, "_upload_on", upload)
    with pytest.raises(KeyboardInterrupt):
        off.step()
    monkeypatch.undo()
    assert off.steps.tolist() == [1, 0] and lin.bias.grad is None
    with pytest.raises(OptimizerError, match=r"an optimizer\.step\(\) called without the "
                       r"scaler was interrupted.*call scaler\.step\(optimizer\) again") as info:
        scaler.step(off)
    assert "nothing has stepped" not in str(info.value)
    assert lin.bias.grad is not None and off.steps.tolist() == [1, 0]
    scaler.step(off)                                      # as the message says
    scaler.update()
    assert off.steps.tolist() == [1, 1] and scaler.get_scale() == 2.0 ** 10
    off.close()


def test_a_step_updates_runs_of_parameters_chunk_by_chunk_not_one_call_each(monkeypatch):
    # NOTE [ Offloaded Adam ]: consecutive parameters of one group and one step
    # count form one run, chunked by chunk_elements. The run's key was compared
    # as a list to a tuple, never equal: every parameter was a run of its own,
    # one kernel call and one upload each however small it was.
    mine, ref = make_model(), make_model()
    off = OffloadedAdam(groups_of(mine), lr=1e-2, chunk_elements=20)
    ref_opt = torch.optim.Adam(groups_of(ref), lr=1e-2)
    uploads = []
    original = OffloadedAdam._upload_on
    monkeypatch.setattr(OffloadedAdam, "_upload_on",
                        lambda self, h2d, a, b: (uploads.append((a, b)),
                                                 original(self, h2d, a, b))[1])
    train(mine, off, batches(1))
    train(ref, ref_opt, batches(1))
    assert_same_params(mine, ref)
    # parameters in group order: [w0] (48 elements), [b0, ln.w, ln.b, b3]
    # (8 + 8 + 8 + 3), [w3] (24): three runs, chunked at 20 elements each
    assert [int(n) for n in off.offsets] == [0, 48, 56, 64, 72, 75, 99]
    assert uploads == [(0, 20), (20, 40), (40, 48), (48, 68), (68, 75), (75, 95),
                       (95, 99)]
    off.close()


@pytest.mark.parametrize("where", ["check", "update", "last"])
def test_an_interrupted_step_under_grad_scaler_recovers_as_documented(monkeypatch, where):
    # The step took the gradients out of p.grad, then was interrupted: the retried
    # scaler.step(opt) applied the ones left on the host, but GradScaler's inf
    # check found no p.grad and scaler.update() asserted "No inf checks were
    # recorded prior to update" (torch's optimizers keep p.grad, so their retry is
    # checked again). Now the unused gradients go back to p.grad; when none is left
    # the exception says to update without stepping, and a retry is refused clearly.
    from rtmem.kernels.adam import PreparedUpdate
    # chunks of 4 elements: the weight's 12 in three, the bias's 3 in the fourth
    ref, mine, ref_opt, off, scalers = _scaler_twins(3, {"growth_interval": 2},
                                                     chunk_elements=4)
    # interrupted before the update (in the finite check), after the weight's last
    # chunk (the bias not reached), after the bias's (every parameter reached)
    target, name, when = {"check": (PreparedUpdate, "_grads_finite", 1),
                          "update": (OffloadedAdam, "_upload_on", 3),
                          "last": (OffloadedAdam, "_upload_on", 4)}[where]
    for it in range(3):
        _scaled_backward(it, (ref, mine), scalers)
        scalers[0].step(ref_opt)
        if it == 1:
            original, calls = getattr(target, name), []

            def interrupt(*args, **kwargs):
                calls.append(1)
                result = original(*args, **kwargs) if target is OffloadedAdam else None
                if len(calls) == when:
                    raise KeyboardInterrupt
                return result if target is OffloadedAdam else original(*args, **kwargs)
            monkeypatch.setattr(target, name, interrupt)
            with pytest.raises(KeyboardInterrupt) as info:
                scalers[1].step(off)
            monkeypatch.undo()
            notes = " ".join(getattr(info.value, "__notes__", []))
            left = [p.grad is not None for p in mine.parameters()]
            if where == "last":
                assert left == [False, False] and off.steps.tolist() == [2, 2]
                assert sys.version_info < (3, 11) or "without calling scaler.step" in notes
                # the retry the note warns of (by another scaler, whose record
                # of this iteration does not matter): refused, naming the way out
                other = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
                other.scale(torch.ones(()))             # its scale made lazily
                with pytest.raises(OptimizerError, match="new_scale=scaler.get_scale"):
                    other.step(off)
                other.update(new_scale=other.get_scale())
            else:
                assert left == ([True, True] if where == "check" else [False, True])
                assert sys.version_info < (3, 11) or "call scaler.step" in notes
                scalers[1].step(off)                        # the documented retry
        else:
            scalers[1].step(off)
        for sc, opt in zip(scalers, (ref_opt, off)):
            sc.update()
            opt.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale()
        assert off.steps.tolist() == [it + 1] * 2
        for p, q in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert scalers[1]._growth_tracker.item() == scalers[0]._growth_tracker.item()
    off.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_before_a_load_are_kept_as_torch_keeps_them(dtype):
    # load_state_dict declared the loaded master agreed with the parameter, so a
    # layer re-initialised before the load was written back over by the next step
    def run(make):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2).to(dtype)
        opt = make(m.parameters())
        gen = torch.Generator().manual_seed(1)
        m(torch.randn(4, 3, generator=gen, dtype=dtype)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        saved = opt.state_dict()
        torch.nn.init.zeros_(m.weight)           # re-initialise, then restore the state
        opt.load_state_dict(saved)
        m(torch.randn(4, 3, generator=gen, dtype=dtype)).float().square().sum().backward()
        opt.step()
        return m.weight.detach().float()
    ref = run(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    mine = run(lambda ps: OffloadedAdam(ps, lr=1e-3))
    assert mine.abs().max() < 1e-2          # from the zeros, not the old weights
    torch.testing.assert_close(mine, ref, rtol=2e-2, atol=2e-3)


@contextlib.contextmanager
def _interrupted_at(function, fragment, interrupt):
    """Trace ``function``; at the first line holding ``fragment`` call
    ``interrupt()`` (raise KeyboardInterrupt, or send SIGINT). Yields the list of
    line numbers it fired at (one, once it has)."""
    import linecache
    code, fired = function.__code__, []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and not fired and \
                    fragment in linecache.getline(code.co_filename, frame.f_lineno):
                fired.append(frame.f_lineno)
                interrupt()
            return local
        return local

    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(None)


def _raise_interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("line", ["st = self.state.get(p)", "st[\"step\"] = torch.zeros",
                                  "st[\"step\"].fill_"])
def test_an_interrupt_in_the_state_update_neither_repeats_the_step_nor_breaks_state(line):
    # The step counted (steps += 1), then built state[p], then consumed the
    # gradients: an interrupt in between left them unconsumed (the next step
    # applied every gradient again, steps counted twice) or left a state[p]
    # without "step" (every later step raised KeyError after updating).
    from rtmem.torch import offload
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    off = OffloadedAdam(ps, lr=1.0)
    for p in ps:
        p.grad = torch.ones(4)
    off.step()                               # state exists: the steady case too
    off.zero_grad()
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.ones(4)
    if "zeros" in line:
        off.state.clear()                    # reach the lines that build an entry
    with _interrupted_at(offload.OffloadedAdam._sync_state, line, _raise_interrupt) as fired, \
            pytest.raises(KeyboardInterrupt):
        off.step()
    assert fired
    off.step()                               # nothing left to apply
    assert off.steps.tolist() == [2, 2, 2] and off.step_count == 2
    for p, b in zip(ps, before):             # one update of lr=1 from one gradient
        torch.testing.assert_close((p.detach() - b).abs(), torch.ones(4))
    assert all(float(off.state[p]["step"]) == 2 for p in ps)
    assert all(st["step"] == 2 for st in off.state_dict()["state"].values())
    off.close()


def test_an_interrupt_in_a_flush_leaves_the_gradient_in_one_place():
    # _flush marked the gradient as on the host, then dropped p.grad: a SIGINT in
    # between left it in both, and the next flush added it again as a later
    # micro-batch's (the step applied 2 g)
    import signal
    import threading
    from rtmem.torch import _offload_grads
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("KeyboardInterrupt comes from SIGINT only in the main thread")
    p = torch.nn.Parameter(torch.zeros(4))
    off = OffloadedAdam([p], lr=1.0)
    p.grad = torch.ones(4)
    with _interrupted_at(_offload_grads._Gradients._flush, "self._had_grad[k] = True",
                         lambda: signal.raise_signal(signal.SIGINT)) as fired, \
            pytest.raises(KeyboardInterrupt):
        off.step()
    assert fired
    off.step()
    assert off.steps.tolist() == [1]
    torch.testing.assert_close(torch.as_tensor(off.exp_avg), torch.full((4,), 0.1))
    off.close()


def test_interrupts_are_held_across_the_bookkeeping_and_raised_after_it():
    import signal
    import threading
    from rtmem.torch.offload import _interrupts_held
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("KeyboardInterrupt comes from SIGINT only in the main thread")
    done = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupts_held():
            signal.raise_signal(signal.SIGINT)
            with _interrupts_held():         # nested: held by the outer one
                done.append(1)
            done.append(2)
    assert done == [1, 2] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_master_cast_to_the_parameters_dtype_by_torch_adam_is_not_taken_silently():
    # torch.optim.Adam's load casts every state tensor to a bf16 parameter's dtype,
    # master included, and keeps master_step: after a trip through it (no step)
    # the rounded master was loaded as of record, unnoticed
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    off = OffloadedAdam([p], lr=1e-3)
    p.grad = torch.randn(64).to(torch.bfloat16)
    off.step()
    saved = off.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    through = torch.optim.Adam([q], lr=1e-3)
    through.load_state_dict(copy.deepcopy(saved))
    assert through.state[q]["master"].dtype == torch.bfloat16
    with pytest.warns(RuntimeWarning, match=r"parameter\(s\) 0 were cast to torch.bfloat16"):
        off.load_state_dict(through.state_dict())
    assert torch.equal(torch.from_numpy(off.master), p.detach().float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off.load_state_dict(saved)                   # the fp32 master: no warning
    assert torch.equal(torch.from_numpy(off.master), saved["state"][0]["master"])
    off.close()


def _pair(wd=0.0):
    """A parameter with an OffloadedAdam (lr 0.1, weight decay ``wd``), and its
    copy with torch.optim.Adam."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(2, 3))
    q = torch.nn.Parameter(p.detach().clone())
    return p, q, OffloadedAdam([p], lr=0.1, weight_decay=wd), \
        torch.optim.Adam([q], lr=0.1, weight_decay=wd)


def _two():
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))


def test_clip_to_zero_and_clip_of_zero_gradients_as_torch():
    p, q, off, ref = _pair()
    w = torch.tensor([[1.0, -2.0, 2.0], [0.0, 4.0, 0.0]])     # gradient norm 5
    for t in (p, q):
        (t * w).sum().backward()
    # max_norm=0 is torch's too: the gradients become zeros
    assert float(off.clip_grad_norm_(0.0)) == 5.0
    assert float(torch.nn.utils.clip_grad_norm_([q], 0.0)) == 5.0
    assert not off._grad_t.any() and not q.grad.any()
    off.step()
    ref.step()
    assert torch.equal(p, q) and off.steps.tolist() == [1]
    # zero gradients (zero_grad(set_to_none=False)) have norm 0: nothing to
    # scale, and no division by it
    off.zero_grad(set_to_none=False)
    ref.zero_grad(set_to_none=False)
    assert float(off.clip_grad_norm_(1.0)) == 0.0
    assert float(torch.nn.utils.clip_grad_norm_([q], 1.0)) == 0.0
    off.step()
    ref.step()
    assert torch.equal(p, q) and off.steps.tolist() == [2]
    off.close()


def test_a_norm_equal_to_max_norm_is_scaled_by_torch_s_epsilon():
    p, q, off, ref = _pair()
    w = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])     # gradient norm 5
    for t in (p, q):
        (t * w).sum().backward()
    assert float(off.clip_grad_norm_(5.0)) == 5.0
    torch.nn.utils.clip_grad_norm_([q], 5.0)
    # scaled by 5 / (5 + 1e-6), as torch's: a little, but every element moves
    g = off._grad_t.view(2, 3)
    torch.testing.assert_close(g, w * (5 / (5 + 1e-6)), rtol=2e-7, atol=0)
    assert (g.abs() < w.abs())[w != 0].all() and (q.grad.abs() < w.abs())[w != 0].all()
    off.close()


def test_zero_grad_keeping_tensors_zeroes_a_gradient_set_by_hand():
    # p.grad assigned (not flushed by a hook): zero_grad(set_to_none=False)
    # leaves torch a zero gradient, which Adam steps (weight decay moves p)
    p, q, off, ref = _pair(wd=0.1)
    for t, opt in ((p, off), (q, ref)):
        t.grad = torch.ones(2, 3)
        opt.zero_grad(set_to_none=False)
        opt.step()
    assert off.steps.tolist() == [1] and int(ref.state[q]["step"]) == 1
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    off.close()


def test_zero_grad_drops_a_staged_micro_batch_gradient():
    # two backward passes (the second lands in the staging buffer), zero_grad,
    # one more: the step sees only the last one, as torch's
    p, q, off, ref = _pair()
    ws = [torch.full((2, 3), 1.0), torch.full((2, 3), 10.0), torch.arange(6.0).view(2, 3)]
    for t, opt in ((p, off), (q, ref)):
        for i, w in enumerate(ws):
            if i == 2:
                opt.zero_grad()
            (t * w).sum().backward()
    off.step()
    ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    off.close()


def test_loading_an_older_state_dict_without_a_parameter_s_state_starts_it_over():
    a, b = _two()
    off = OffloadedAdam([a, b], lr=0.1)
    (a.sum() + (b * b).sum()).backward()
    off.step()
    saved = off.state_dict()
    moments = [m[:3].copy() for m in (off.exp_avg, off.exp_avg_sq)]
    (a.sum() + (b * b).sum()).backward()
    off.step()
    assert off.steps.tolist() == [2, 2]
    del saved["state"][1]          # parameter 1 had no state then
    off.load_state_dict(saved)
    # the saved step (1, not the later 2) and moments for a; b starts over
    assert off.steps.tolist() == [1, 0]
    assert (off.exp_avg[:3] == moments[0]).all() and (off.exp_avg_sq[:3] == moments[1]).all()
    assert not off.exp_avg[3:].any() and not off.exp_avg_sq[3:].any()
    assert b not in off.state and int(off.state[a]["step"]) == 1
    off.close()


def test_a_torch_dict_with_parameters_at_different_steps_counts_the_largest():
    a, b = _two()
    ref = torch.optim.Adam([a, b], lr=0.1)
    for use_b in (True, False, False):
        (a.sum() + (b.sum() if use_b else 0)).backward()
        ref.step()
        ref.zero_grad()
    off = OffloadedAdam([a, b], lr=0.1)
    off.load_state_dict(ref.state_dict())
    assert off.steps.tolist() == [3, 1] and off.step_count == 3
    off.close()


@pytest.mark.parametrize("key, bad", [("exp_avg_sq", -1e-3), ("exp_avg_sq", -float("inf"))])
def test_a_moment_the_next_step_would_turn_into_nan_is_refused(key, bad):
    # Loaded into the host arena as given (torch.optim.Adam loads it too): the
    # next step took sqrt of a negative second moment and the weight became NaN.
    model = make_model()
    off = OffloadedAdam(model.parameters(), lr=1e-2)
    train(model, off, batches(1))
    good = off.state_dict()
    before = [a.copy() for a in (off.master, off.exp_avg, off.exp_avg_sq, off.steps)]
    sd = copy.deepcopy(good)
    gen = torch.Generator().manual_seed(7)
    index = (int(torch.randint(8, (), generator=gen)), int(torch.randint(6, (), generator=gen)))
    sd["state"][0][key][index] = bad
    with pytest.raises(OptimizerError, match=rf"parameter 0: {key} has 1 negative element\(s\)"
                       rf".*at index \({index[0]}, {index[1]}\)") as info:
        off.load_state_dict(sd)
    assert info.value.argument == "state_dict"
    after = (off.master, off.exp_avg, off.exp_avg_sq, off.steps)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    sd["state"][0][key][index] = 0.0
    off.load_state_dict(sd)
    train(model, off, batches(1, seed=2))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    off.close()
