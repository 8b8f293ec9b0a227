"""CPUAdam / NumpyAdam on many small tensors (a GPT-2-like list of biases and
norms beside a few matrices): the per-tensor work a step repeats is done once
where it cannot differ, results stay those of one adam_update per tensor, and
every check still fires when what it checks changes between two steps."""

from __future__ import annotations

import numpy as np
import pytest

import rtmem.optim as optim
from rtmem.errors import OptimizerError
from rtmem.kernels import adam_update

# shapes of one GPT-2 block at hidden 8 (biases, norms, matrices), twice
_SHAPES = [(8,), (8,), (8, 24), (24,), (8, 8), (8,), (8,), (8,), (8, 32), (32,), (32, 8),
           (8,)] * 2


def _count_coefficients(monkeypatch):
    """Count the step's coefficient computations (the calls that pass a loss scale
    argument: _check_hyper's range check passes none)."""
    calls = []
    real = optim.adam_coefficients

    def counting(**kw):
        if "grad_scale" in kw:
            calls.append(kw["step"])
        return real(**kw)
    monkeypatch.setattr(optim, "adam_coefficients", counting)
    return calls


def _reference(params, grads_per_step, **kw):
    """float32 params after one adam_update per tensor per step (None: skipped)."""
    ps = [p.copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    steps = [0] * len(ps)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            if g is not None:
                steps[i] += 1
                adam_update(ps[i], g, ms[i], vs[i], step=steps[i], **kw)
    return ps


def test_numpy_adam_coefficients_once_per_step_count(monkeypatch):
    rng = np.random.default_rng()
    params = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    start = [p.copy() for p in params]
    opt = optim.NumpyAdam(params, lr=1e-2, weight_decay=0.1)
    calls = _count_coefficients(monkeypatch)
    history = []
    for step in range(3):
        grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
        if step == 0:       # half the tensors lag one step behind from now on
            grads[::2] = [None] * len(grads[::2])
        history.append(grads)
        calls.clear()
        opt.step(grads)
        # one vector per distinct step count, not one per tensor
        assert sorted(calls) == ([1] if step == 0 else [step, step + 1])
    ref = _reference(start, history, lr=1e-2, weight_decay=0.1)
    for p, r in zip(params, ref):
        assert p.tobytes() == r.tobytes()


def test_cpu_adam_coefficients_once_per_group_and_step_count(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    start = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    params = [torch.from_numpy(p.copy()) for p in start]
    half = len(params) // 2
    opt = optim.CPUAdam([{"params": params[:half]}, {"params": params[half:]}], lr=1e-2)
    calls = _count_coefficients(monkeypatch)
    history = []
    for step in range(3):
        grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
        if step == 0:
            grads[::2] = [None] * len(grads[::2])
        history.append(grads)
        calls.clear()
        opt.step(grads=[None if g is None else torch.from_numpy(g) for g in grads])
        assert sorted(calls) == ([1, 1] if step == 0 else [step, step, step + 1, step + 1])
    ref = _reference(start, history, lr=1e-2)
    for p, r in zip(params, ref):
        assert p.numpy().tobytes() == r.tobytes()


# What a test may change between two steps, and the error the second step must
# raise (each check of the first step runs again at every step: nothing about
# a tensor is taken as known because it held at the step before).
def _replace_param(opt, ps, torch):
    new = opt.param_groups[0]["params"][3] = torch.zeros(24, dtype=torch.float64)
    return {new: torch.ones(24)}


def _change_dtype(opt, ps, torch):
    ps[5].data = ps[5].data.double()


def _grad_wrong_shape(opt, ps, torch):
    return {ps[1]: torch.zeros(9)}       # p.grad cannot take another shape


def _grad_not_contiguous(opt, ps, torch):
    ps[2].grad = torch.zeros(24, 8).t()


def _resized_in_place(opt, ps, torch):
    ps[4].resize_(4, 4)
    ps[4].grad = torch.zeros(4, 4)


def _moment_replaced(opt, ps, torch):
    opt.state[ps[6]]["exp_avg_sq"] = torch.zeros(8, dtype=torch.float64)


def _views_overlap(opt, ps, torch):
    view = opt.param_groups[0]["params"][7] = ps[0].view(2, 4)[0]
    view.grad = torch.zeros(4)


_CPU_ADAM_CHANGES = [
    (_replace_param, r"param 3: param has dtype float64"),
    (_change_dtype, r"param 5: param has dtype float64"),
    (_grad_wrong_shape, r"param 1: grad has shape \(9,\) but param has shape \(8,\)"),
    (_grad_not_contiguous, r"param 2: grad is not contiguous"),
    (_resized_in_place, r"param 4: exp_avg has shape \(8, 8\) but param has shape \(4, 4\)"),
    (_moment_replaced, r"param 6: exp_avg_sq has dtype float64"),
    (_views_overlap, r"param 7 .*overlap in memory"),
]


@pytest.mark.parametrize("change, message", _CPU_ADAM_CHANGES,
                         ids=[c.__name__.strip("_") for c, _ in _CPU_ADAM_CHANGES])
def test_cpu_adam_checks_fire_when_a_tensor_changes_between_steps(change, message):
    torch = pytest.importorskip("torch")
    opt, ps, _ = _stepped_cpu_adam(torch, as_dot_grad=True)
    _assert_step_refused(torch, opt, message, grads=change(opt, ps, torch))


def _stepped_cpu_adam(torch, as_dot_grad=False):
    """A CPUAdam over tensors of _SHAPES after one step (gradients in ``.grad``
    or passed as ``grads=``): ``(opt, params, grads)``."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen) for s in _SHAPES]
    opt = optim.CPUAdam(ps, lr=1e-2)
    grads = [torch.randn(s, generator=gen) for s in _SHAPES]
    if as_dot_grad:
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()
    else:
        opt.step(grads=grads)
    return opt, ps, grads


def _assert_step_refused(torch, opt, message, **step_args):
    """``opt.step(**step_args)`` raises OptimizerError matching ``message``
    before writing any parameter."""
    params = opt.param_groups[0]["params"]
    held = [p.clone() for p in params]
    with pytest.raises(OptimizerError, match=message):
        opt.step(**step_args)
    for p, before in zip(params, held):
        assert torch.equal(p, before)


def test_cpu_adam_steps_from_moments_loaded_between_steps():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    start = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    ps = [torch.from_numpy(p.copy()) for p in start]
    opt = optim.CPUAdam(ps, lr=1e-2)
    grads = [[rng.standard_normal(s, dtype=np.float32) for s in _SHAPES] for _ in range(2)]
    opt.step(grads=[torch.from_numpy(g) for g in grads[0]])
    saved = opt.state_dict()
    moments = [(rng.standard_normal(s, dtype=np.float32),
                rng.uniform(0, 1, s).astype(np.float32)) for s in _SHAPES]
    for i, (m, v) in enumerate(moments):
        saved["state"][i] = {"step": torch.tensor(5.0), "exp_avg": torch.from_numpy(m),
                             "exp_avg_sq": torch.from_numpy(v)}
    opt.load_state_dict(saved)
    before = [p.numpy().copy() for p in ps]
    opt.step(grads=[torch.from_numpy(g) for g in grads[1]])
    # the loaded moments and step count, not the ones the first step used
    for p, b, (m, v), g in zip(ps, before, moments, grads[1]):
        m, v = m.copy(), v.copy()
        adam_update(b, g, m, v, lr=1e-2, step=6)
        assert p.numpy().tobytes() == b.tobytes()


def _np_grad_wrong_shape(opt, grads):
    grads[1] = np.zeros(9, np.float32)


def _np_grad_not_contiguous(opt, grads):
    grads[2] = np.zeros((24, 8), np.float32).T


def _np_resized_in_place(opt, grads):
    opt.params[4].resize(16, refcheck=False)
    grads[4] = np.zeros(16, np.float32)


def _np_moment_replaced(opt, grads):
    opt.state[6]["exp_avg"] = np.zeros(8, np.float64)


def _np_param_replaced(opt, grads):
    opt.params[3] = np.zeros(24, np.float64)


_NUMPY_CHANGES = [
    (_np_grad_wrong_shape, r"param 1: grad has shape \(9,\) but param has shape \(8,\)"),
    (_np_grad_not_contiguous, r"param 2: grad is not C-contiguous"),
    (_np_resized_in_place, r"param 4: exp_avg has shape \(8, 8\) but param has shape \(16,\)"),
    (_np_moment_replaced, r"param 6: exp_avg has dtype float64"),
    (_np_param_replaced, r"param 3: param has dtype float64"),
]


@pytest.mark.parametrize("change, message", _NUMPY_CHANGES,
                         ids=[c.__name__.strip("_") for c, _ in _NUMPY_CHANGES])
def test_numpy_adam_checks_fire_when_an_array_changes_between_steps(change, message):
    rng = np.random.default_rng()
    params = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    opt = optim.NumpyAdam(params, lr=1e-2)
    grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    opt.step(grads)
    change(opt, grads)
    held = [p.copy() for p in opt.params]
    with pytest.raises(OptimizerError, match=message):
        opt.step(grads)
    for p, before in zip(opt.params, held):
        assert p.tobytes() == before.tobytes()


def test_data_address_tries_numba_once_per_untyped_dtype(monkeypatch):
    # numba does not remember a failed typing: every call on a byte-swapped array
    # compiled again (~270 us where the array interface takes ~3 us)
    from rtmem.kernels import adam
    monkeypatch.setattr(adam, "_INTERFACE_ONLY", set())
    a = np.zeros(5, ">f4")[1:]
    assert adam._data_address(a) == a.__array_interface__["data"][0]
    tried = []
    monkeypatch.setattr(adam, "_jit_address", lambda x: tried.append(x) or 0)
    assert adam._data_address(a) == a.__array_interface__["data"][0] and tried == []
    native = np.zeros(4, np.float32)
    assert adam._data_address(native) == 0 and len(tried) == 1   # typed dtypes still jit


def test_data_address_is_the_array_interfaces():
    # the overlap checks' addresses: offset views, 16-bit formats, N-D, and
    # dtypes numba cannot type (byte-swapped, ml_dtypes' bfloat16) alike
    from rtmem.kernels.adam import _data_address
    base = np.zeros(64, np.float32)
    arrays = [base[3:], base.reshape(8, 8)[1:, 2:], base.view(np.uint16)[5:],
              base.view(np.int16)[7:], base.view(np.float16)[1:], base.reshape(2, 4, 8).T,
              np.zeros(5, ">f4")[1:], np.zeros(3, [("a", np.float32), ("b", np.int8)])]
    try:
        import ml_dtypes
        arrays.append(base.view(ml_dtypes.bfloat16)[9:])
    except ImportError:
        pass
    for a in arrays:
        assert _data_address(a) == a.__array_interface__["data"][0], a.dtype


# CPUAdam keeps the checked views of each parameter and its moments from one
# step to the next (NOTE [ Held views ] in rtmem/_optim_torch.py): each change
# below must make it take new ones, the updates landing in the tensors' memory
# as it is now, or the step refused as a fresh optimizer's would be.
def _param_data_replaced(opt, ps, torch):
    ps[2].data = torch.randn(ps[2].shape, dtype=torch.float32)


def _param_set_to_other_memory(opt, ps, torch):
    ps[4].set_(torch.randn(ps[4].shape, dtype=torch.float32))


def _moment_set_to_other_memory(opt, ps, torch):
    opt.state[ps[6]]["exp_avg"].set_(torch.randn(8, dtype=torch.float32))


def _moment_data_replaced(opt, ps, torch):
    opt.state[ps[3]]["exp_avg_sq"].data = torch.rand(24, dtype=torch.float32)


def _moment_swapped(opt, ps, torch):
    opt.state[ps[1]]["exp_avg"] = torch.randn(8, dtype=torch.float32)


def _amsgrad_turned_on(opt, ps, torch):
    opt.param_groups[0]["amsgrad"] = True


def _max_moment_swapped(opt, ps, torch):
    # (amsgrad on from the start) larger than any exp_avg_sq: the update uses it
    st = opt.state[ps[7]]
    st["max_exp_avg_sq"] = torch.rand_like(st["max_exp_avg_sq"]) + 10.0


_CPU_ADAM_MOVES = [_param_data_replaced, _param_set_to_other_memory,
                   _moment_set_to_other_memory, _moment_data_replaced, _moment_swapped,
                   _amsgrad_turned_on, _max_moment_swapped]


@pytest.mark.parametrize("change", _CPU_ADAM_MOVES,
                         ids=[c.__name__.strip("_") for c in _CPU_ADAM_MOVES])
def test_cpu_adam_steps_the_memory_a_tensor_has_after_a_change(change):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    ps = [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for s in _SHAPES]
    opt = optim.CPUAdam(ps, lr=1e-2, weight_decay=0.1,
                        amsgrad=change is _max_moment_swapped)
    for _ in range(2):
        opt.step(grads=[torch.from_numpy(rng.standard_normal(s, dtype=np.float32))
                        for s in _SHAPES])
    change(opt, ps, torch)
    amsgrad = opt.param_groups[0]["amsgrad"]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    expected = []
    for p, g in zip(ps, grads):
        st = opt.state[p]
        e, m, v = (t.numpy().copy() for t in (p, st["exp_avg"], st["exp_avg_sq"]))
        vmax = None if not amsgrad else (st["max_exp_avg_sq"].numpy().copy()
                                         if "max_exp_avg_sq" in st else np.zeros_like(e))
        adam_update(e, g, m, v, lr=1e-2, weight_decay=0.1, step=3, max_exp_avg_sq=vmax)
        expected.append((e, m, v, vmax))
    opt.step(grads=[torch.from_numpy(g) for g in grads])
    for p, (e, m, v, vmax) in zip(ps, expected):
        st = opt.state[p]
        assert p.numpy().tobytes() == e.tobytes()
        assert st["exp_avg"].numpy().tobytes() == m.tobytes()
        assert st["exp_avg_sq"].numpy().tobytes() == v.tobytes()
        if amsgrad:     # made at this step, or the one swapped in
            assert st["max_exp_avg_sq"].numpy().tobytes() == vmax.tobytes()


def _param_dtype_view(opt, ps, grads, torch):
    ps[5].data = ps[5].data.view(torch.int32)        # same memory, another dtype


def _param_strided_in_place(opt, ps, grads, torch):
    ps[2].as_strided_((8, 24), (1, 8))              # same memory, transposed walk


def _param_reshaped_in_place(opt, ps, grads, torch):
    ps[2].resize_(24, 8)                            # same memory and element count
    grads[2] = torch.zeros(24, 8)


def _moment_dtype_view(opt, ps, grads, torch):
    opt.state[ps[6]]["exp_avg_sq"].data = opt.state[ps[6]]["exp_avg_sq"].data.view(
        torch.int32)


# the gradient and copy are new at every step: checked against the held views
def _grad_is_a_moment(opt, ps, grads, torch):
    grads[9] = opt.state[ps[9]]["exp_avg"]


def _copy_is_a_moment(opt, ps, grads, torch):
    # float16 copy over the first half of the moment's bytes
    half = opt.state[ps[10]]["exp_avg_sq"].view(-1).view(torch.float16)[:256]
    return {ps[10]: half.view(32, 8)}


def _copy_is_the_param(opt, ps, grads, torch):
    return {ps[11]: ps[11]}


_CPU_ADAM_RELAYOUTS = [
    (_param_dtype_view, r"param 5: param has dtype int32"),
    (_param_strided_in_place, r"param 2: param is not C-contiguous"),
    (_param_reshaped_in_place, r"param 2: exp_avg has shape \(8, 24\) but param has "
                               r"shape \(24, 8\)"),
    (_moment_dtype_view, r"param 6: exp_avg_sq has dtype int32"),
    (_grad_is_a_moment, r"param 9: grad and exp_avg overlap in memory"),
    # (the kernel's name "out" left in the text: _named renames "out has/is")
    (_copy_is_a_moment, r"param 10: exp_avg_sq and out overlap in memory"),
    (_copy_is_the_param, r"param 11: param and out overlap in memory"),
]


@pytest.mark.parametrize("change, message", _CPU_ADAM_RELAYOUTS,
                         ids=[c.__name__.strip("_") for c, _ in _CPU_ADAM_RELAYOUTS])
def test_cpu_adam_checks_fire_when_a_tensor_is_seen_anew(change, message):
    torch = pytest.importorskip("torch")
    opt, ps, grads = _stepped_cpu_adam(torch)
    _assert_step_refused(torch, opt, message, grads=grads,
                         copies=change(opt, ps, grads, torch))


def test_cpu_adam_half_grads_amsgrad_and_decay_over_steps():
    # the held views' steps against one adam_update per tensor per step, with
    # bfloat16 gradients, amsgrad, weight decay and float16 copies
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    start = [rng.standard_normal(s, dtype=np.float32) for s in _SHAPES]
    ps = [torch.from_numpy(p.copy()) for p in start]
    opt = optim.CPUAdam(ps, lr=1e-2, weight_decay=0.05, amsgrad=True)
    ref = [p.copy() for p in start]
    ms, vs, vmaxs = ([np.zeros_like(p) for p in start] for _ in range(3))
    for step in range(1, 5):
        grads = [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).bfloat16()
                 for s in _SHAPES]
        copies = [torch.empty(s, dtype=torch.float16) for s in _SHAPES]
        opt.step(grads=grads, copies=copies)
        for i, g in enumerate(grads):
            out = np.empty(_SHAPES[i], np.float16)
            adam_update(ref[i], g.view(torch.int16).numpy().view(np.uint16), ms[i], vs[i],
                        lr=1e-2, weight_decay=0.05, step=step, max_exp_avg_sq=vmaxs[i],
                        grad_format="bfloat16", out=out)
            assert copies[i].numpy().tobytes() == out.tobytes()
    for p, r, vmax in zip(ps, ref, vmaxs):
        assert p.numpy().tobytes() == r.tobytes()
        assert opt.state[p]["max_exp_avg_sq"].numpy().tobytes() == vmax.tobytes()


def test_cpu_adam_holds_no_views_of_a_parameter_it_no_longer_steps():
    # NOTE [ Held views ]: only the parameters of the last applied step keep
    # their views; one dropped from the groups (its state deleted) is freed
    import gc
    import weakref
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    kept = torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
    dropped = torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
    opt = optim.CPUAdam([kept, dropped], lr=1e-2)
    opt.step(grads=[torch.ones(8), torch.ones(8)])
    gone = weakref.ref(dropped)
    opt.param_groups[0]["params"] = [kept]
    del opt.state[dropped], dropped
    opt.step(grads=[torch.ones(8)])
    gc.collect()
    assert gone() is None


def test_cpu_adam_lets_the_moments_a_loaded_state_dict_replaced_go():
    # the views of the replaced moments go with the load (NOTE [ Held views ]),
    # not at the next step
    import gc
    import weakref
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    p = torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
    opt = optim.CPUAdam([p], lr=1e-2)
    opt.step(grads=[torch.ones(8)])
    other = optim.CPUAdam([torch.zeros(8)], lr=1e-2)
    other.step(grads=[torch.ones(8)])
    old = [weakref.ref(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
    opt.load_state_dict(other.state_dict())
    gc.collect()
    assert [r() for r in old] == [None, None]


def test_cpu_adam_close_lets_the_moments_go():
    # close() drops the state, and the held views of it with it
    import gc
    import weakref
    torch = pytest.importorskip("torch")
    p = torch.zeros(8)
    opt = optim.CPUAdam([p], lr=1e-2)
    opt.step(grads=[torch.ones(8)])
    old = [weakref.ref(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
    opt.close()
    gc.collect()
    assert [r() for r in old] == [None, None]


def test_cpu_adam_takes_a_grad_that_ends_where_its_param_begins_at_every_step():
    # Touching is not overlapping: the checks against the held views
    # (_prepare_again) must let through, as prepare_update does, a gradient
    # whose bytes end where the parameter's begin (two halves of one buffer)
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    buf = torch.from_numpy(rng.standard_normal(16, dtype=np.float32))
    g, p = buf[:8], buf[8:]
    opt = optim.CPUAdam([p], lr=1e-2)
    e, m, v = p.numpy().copy(), np.zeros(8, np.float32), np.zeros(8, np.float32)
    for step in (1, 2, 3):
        g.copy_(torch.from_numpy(rng.standard_normal(8, dtype=np.float32)))
        adam_update(e, g.numpy().copy(), m, v, lr=1e-2, step=step)
        opt.step(grads=[g])
        assert p.numpy().tobytes() == e.tobytes()
