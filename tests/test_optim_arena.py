"""CPUAdam / CPUAdamW with ``state_arena=``: the moments in a host arena (NOTE
[ Optimizer state in an arena ] in rtmem/_optim_arena.py)."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest

import rtmem
import rtmem.optim as optim
from rtmem.errors import OptimizerError, OutOfMemoryError

torch = pytest.importorskip("torch")

SHAPES = ((64, 33), (33,), (4_000,))
KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _params(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def _twin(params, dtype=torch.float32):
    return [p.detach().to(dtype).clone().requires_grad_() for p in params]


def _in_arena(t, arena) -> bool:
    """``t``'s bytes lie inside one of the arena's slabs."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for slab in arena.slabs:
        base = slab.host_array.__array_interface__["data"][0]
        if base <= lo and hi <= base + slab.host_array.nbytes:
            return True
    return False


def _state_bytes(arena):
    st = arena.stats()
    return st.requested_by_kind["optimizer-state"], st.count_by_kind["optimizer-state"]


def _moments(opt):
    return [(id(p), key, opt.state[p][key])
            for g in opt.param_groups for p in g["params"] for key in KEYS
            if key in opt.state.get(p, {})]


def _grads(params, gen):
    return [torch.randn(p.shape, generator=gen) for p in params]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_arena_state_steps_bit_identically_and_matches_torch_adam(
        arena, amsgrad, decoupled, maximize, fresh_seed):
    ours = _params(fresh_seed)
    plain, ref = _twin(ours), _twin(ours, torch.float64)
    Ours = optim.CPUAdamW if decoupled else optim.CPUAdam
    Ref = torch.optim.AdamW if decoupled else torch.optim.Adam
    kw = dict(lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05, amsgrad=amsgrad,
              maximize=maximize)
    opt = Ours(ours, state_arena=arena, **kw)
    plain_opt = Ours(plain, **kw)
    ref_opt = Ref(ref, **kw)
    assert _state_bytes(arena) == (0, 0)         # made lazily, at the first step
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    for _ in range(6):
        for p, q, r, g in zip(ours, plain, ref, _grads(ours, gen)):
            g = torch.where(g < 0, g - 1.0, g + 1.0)    # as test_optim: |g| >= 1
            p.grad, q.grad, r.grad = g, g.clone(), g.double()
        opt.step()
        plain_opt.step()
        ref_opt.step()
    n_keys = 3 if amsgrad else 2
    elements = sum(p.numel() for p in ours)
    assert _state_bytes(arena) == (4 * elements * n_keys, len(ours) * n_keys)
    for p, q, r in zip(ours, plain, ref):
        assert torch.equal(p, q)                 # bit for bit
        for key in KEYS[:n_keys]:
            mine, theirs = opt.state[p][key], plain_opt.state[q][key]
            assert _in_arena(mine, arena) and not _in_arena(theirs, arena)
            assert mine.dtype == torch.float32 and mine.is_contiguous()
            assert mine.numpy().tobytes() == theirs.numpy().tobytes()
            ref_v = ref_opt.state[r][key].numpy()
            scale = np.sqrt(np.mean(ref_v ** 2))
            assert np.max(np.abs(mine.numpy() - ref_v) / (np.abs(ref_v) + scale)) < 1e-5
        ref_p = r.detach().numpy()
        scale = np.sqrt(np.mean(ref_p ** 2))
        assert np.max(np.abs(p.detach().numpy() - ref_p) / (np.abs(ref_p) + scale)) < 1e-5
        assert float(opt.state[p]["step"]) == 6.0


def test_an_arena_too_small_refuses_the_step_and_changes_nothing(monkeypatch, fresh_seed):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    params = _params(fresh_seed, ((1000,), (1000,)))
    before = [p.detach().clone() for p in params]
    # room for both parameters' three moments, less what the filler takes: then
    # the first parameter's fit, the second's not
    small = rtmem.HostArena(6 * 4096)
    filler = small.alloc(2 * 4096, kind="workspace")
    opt = optim.CPUAdam(params, lr=1e-2, amsgrad=True, state_arena=small)
    grads = _grads(params, torch.Generator().manual_seed(fresh_seed))
    with pytest.raises(OutOfMemoryError) as caught:
        opt.step(grads=grads)
    assert len(opt.state) == 0                   # no half-made state, not even p0's
    # given back at once: the traceback, still held, keeps no view of it
    assert caught.traceback is not None and _state_bytes(small) == (0, 0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # one parameter alone whose three moments do not all fit: none is installed
    lone = rtmem.HostArena(2 * 2000 * 4 + 1024)
    big = torch.zeros(2000, requires_grad=True)
    opt1 = optim.CPUAdam([big], amsgrad=True, state_arena=lone)
    with pytest.raises(OutOfMemoryError):
        opt1.step(grads=[torch.ones(2000)])
    assert len(opt1.state) == 0 and _state_bytes(lone) == (0, 0)
    # with room, the same optimizer steps as one that never failed
    roomy = optim.CPUAdam(_twin(params), lr=1e-2, amsgrad=True)
    filler.free()
    opt.step(grads=grads)
    roomy.step(grads=grads)
    for p, q in zip(params, roomy.param_groups[0]["params"]):
        assert torch.equal(p, q)


def test_load_state_dict_copies_into_the_arena_and_reuses_its_buffers(arena, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    a = _params(fresh_seed)
    src = optim.CPUAdamW(a, lr=1e-2, amsgrad=True)
    for _ in range(3):
        src.step(grads=_grads(a, gen))
    b = _twin(a)
    dst = optim.CPUAdamW(b, lr=1e-2, amsgrad=True, state_arena=arena)
    dst.load_state_dict(src.state_dict())
    held = {(i, key): t.data_ptr() for i, key, t in _moments(dst)}
    assert len(held) == 3 * len(b)
    for (_, key, mine), (_, _, theirs) in zip(_moments(dst), _moments(src)):
        assert _in_arena(mine, arena)
        assert mine.numpy().tobytes() == theirs.numpy().tobytes()
    used = _state_bytes(arena)
    assert used == (4 * 3 * sum(p.numel() for p in b), 3 * len(b))
    grads = _grads(a, gen)
    src.step(grads=grads)
    dst.step(grads=grads)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    # loading again writes into the same buffers: the arena holds one copy
    src.step(grads=grads)
    dst.load_state_dict(src.state_dict())
    assert {(i, key): t.data_ptr() for i, key, t in _moments(dst)} == held
    assert _state_bytes(arena) == used
    for (_, _, mine), (_, _, theirs) in zip(_moments(dst), _moments(src)):
        assert mine.numpy().tobytes() == theirs.numpy().tobytes()
    # a torch.optim.Adam dict loads into the arena too
    ref = torch.optim.AdamW(_twin(a), lr=1e-2, amsgrad=True)
    ref.load_state_dict(src.state_dict())
    dst.load_state_dict(ref.state_dict())
    assert all(_in_arena(t, arena) for _, _, t in _moments(dst))


def test_a_refused_load_changes_nothing_and_leaks_nothing(monkeypatch, fresh_seed):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    gen = torch.Generator().manual_seed(fresh_seed)
    params = _params(fresh_seed, ((500,), (700,)))
    arena = rtmem.HostArena(4 * 3072)
    filler = arena.alloc(2 * 2048, kind="workspace")     # leaves room for p1's moments
    opt = optim.CPUAdam(params, lr=1e-2, state_arena=arena)
    opt.step(grads=[None, torch.randn(700, generator=gen)])   # p1 has state, p0 none
    src = optim.CPUAdam(_twin(params), lr=1e-2)
    src.step(grads=_grads(params, gen))

    def snapshot():
        return ([(i, k, t.data_ptr(), t.numpy().tobytes()) for i, k, t in _moments(opt)],
                _state_bytes(arena), [g.copy() for g in opt.param_groups])

    before = snapshot()
    bad = copy.deepcopy(src.state_dict())
    bad["state"][1]["exp_avg_sq"][3] = -1.0          # corrupt: refused by the checks
    with pytest.raises(OptimizerError, match="negative"):
        opt.load_state_dict(bad)
    assert snapshot() == before
    # p0's two new moments do not fit in the arena: refused before any write
    with pytest.raises(OutOfMemoryError):
        opt.load_state_dict(src.state_dict())
    assert snapshot() == before
    filler.free()
    opt.load_state_dict(src.state_dict())
    assert all(_in_arena(t, arena) for _, _, t in _moments(opt))


def test_state_dict_of_arena_state_survives_torch_save_and_load(arena, fresh_seed):
    params = _params(fresh_seed)
    opt = optim.CPUAdam(params, lr=1e-2, amsgrad=True, state_arena=arena)
    gen = torch.Generator().manual_seed(fresh_seed)
    for _ in range(2):
        opt.step(grads=_grads(params, gen))
    f = io.BytesIO()
    torch.save(opt.state_dict(), f)
    f.seek(0)
    loaded = torch.load(f)
    for i, p in enumerate(params):
        for key in KEYS:
            saved, live = loaded["state"][i][key], opt.state[p][key]
            assert _in_arena(live, arena) and not _in_arena(saved, arena)
            assert saved.numpy().tobytes() == live.numpy().tobytes()
    fresh = optim.CPUAdam(_twin(params), lr=1e-2, amsgrad=True, state_arena=arena)
    fresh.load_state_dict(loaded)
    g = _grads(params, gen)
    opt.step(grads=g)
    fresh.step(grads=g)
    assert all(torch.equal(p, q) for p, q in zip(params, fresh.param_groups[0]["params"]))


def test_copies_and_pickles_are_independent_and_outside_the_arena(arena, fresh_seed):
    params = _params(fresh_seed)
    opt = optim.CPUAdamW(params, lr=1e-2, state_arena=arena)
    gen = torch.Generator().manual_seed(fresh_seed)
    opt.step(grads=_grads(params, gen))
    used = _state_bytes(arena)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.state_arena is None and _state_bytes(arena) == used
        assert not any(_in_arena(t, arena) for _, _, t in _moments(clone))
        for (_, _, mine), (_, _, theirs) in zip(_moments(opt), _moments(clone)):
            assert mine.numpy().tobytes() == theirs.numpy().tobytes()
        twin = copy.deepcopy(opt)
        g = _grads(params, gen)
        clone.step(grads=g)              # the original is not touched by the copy's step
        assert float(opt.state[params[0]]["step"]) == 1.0
        twin.step(grads=g)
        for (_, _, x), (_, _, y) in zip(_moments(clone), _moments(twin)):
            assert torch.equal(x, y)
        del clone, twin
    assert _state_bytes(arena) == used


def test_add_param_group_puts_the_new_groups_state_in_the_arena(arena):
    a, b = torch.zeros(10, requires_grad=True), torch.zeros(20, requires_grad=True)
    opt = optim.CPUAdam([a], lr=1e-2, state_arena=arena)
    opt.add_param_group({"params": [b], "lr": 1e-1})
    opt.step(grads=[torch.ones(10), torch.ones(20)])
    assert all(_in_arena(t, arena) for _, _, t in _moments(opt))
    assert _state_bytes(arena) == (4 * 2 * 30, 4)


def test_close_gives_the_buffers_back_and_later_use_is_refused(arena):
    p = torch.zeros(100, requires_grad=True)
    opt = optim.CPUAdam([p], lr=1e-2, state_arena=arena)
    opt.step(grads=[torch.ones(100)])
    sd = opt.state_dict()                # its live tensors keep the bytes while held
    opt.close()
    opt.close()                          # idempotent
    assert len(opt.state) == 0 and _state_bytes(arena)[1] == 2
    del sd
    assert _state_bytes(arena) == (0, 0)
    for call, what in ((lambda: opt.step(grads=[torch.ones(100)]), "cannot step"),
                       (opt.state_dict, "cannot save"),
                       (lambda: opt.load_state_dict({}), "cannot load")):
        with pytest.raises(OptimizerError, match=f"{what}.*closed"):
            call()
    assert _state_bytes(arena) == (0, 0) and len(opt.state) == 0
    with pytest.raises(OptimizerError, match="closed"):
        copy.deepcopy(opt).step(grads=[torch.ones(100)])   # a copy stays closed


@pytest.mark.parametrize("cls", ["CPUAdam", "CPUAdamW", "NumpyAdam"])
def test_a_state_arena_that_is_no_host_arena_is_refused_by_kind(monkeypatch, cls):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    Opt = getattr(optim, cls)
    param = (torch.zeros(4, requires_grad=True) if cls != "NumpyAdam"
             else np.zeros(4, np.float32))
    device = rtmem.DeviceArena(1 << 16)
    with pytest.raises(OptimizerError, match="DeviceArena .device memory.*HostArena") as e:
        Opt([param], state_arena=device)
    assert e.value.argument == "state_arena"
    with pytest.raises(OptimizerError, match="str, not an rtmem arena.*HostArena"):
        Opt([param], state_arena="64MiB")
    mapped = rtmem.HostArena(1 << 16, mapped=True)      # host memory: taken
    Opt([param], state_arena=mapped)
