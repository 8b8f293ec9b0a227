"""Arena tensors meeting pickling, torch.save/load, deepcopy and shared memory.

The rules these tests pin are in the README ("Saving, copying and sharing
arena tensors"): a pickle or deepcopy of an arena tensor is a copy with the
same values outside the arena; loading a state dict copies into the placed
parameters in place; what would silently move a placed parameter out of its
arena is refused where rtmem can see it.
"""

import copy
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rtmem.errors import ResidencyError  # noqa: E402
from rtmem.optim import CPUAdam  # noqa: E402
from rtmem.torch import as_tensor, place_parameters  # noqa: E402


def _model():
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _views(p, buf) -> bool:
    """Whether tensor ``p`` reads the bytes of ``buf``."""
    return p.data_ptr() == buf.numpy().ctypes.data


def _in_arena(model, placement) -> bool:
    return all(_views(p, placement.weights[p]) and _views(p.grad, placement.grads[p])
               for p in model.parameters())


def _saved_and_loaded(obj):
    b = io.BytesIO()
    torch.save(obj, b)
    b.seek(0)
    return torch.load(b)


def test_state_dict_saves_the_arena_values_and_loads_back_in_place(arena):
    model = _model()
    placement = place_parameters(model, arena)
    loaded = _saved_and_loaded(model.state_dict())
    for name, p in model.named_parameters():
        # the values, read through the buffer (not through torch), in a copy
        np.testing.assert_array_equal(loaded[name].numpy(), placement.weights[p].numpy())
        assert not _views(loaded[name], placement.weights[p])
    fresh = {k: torch.randn_like(v) for k, v in loaded.items()}
    model.load_state_dict(fresh)
    assert _in_arena(model, placement)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(placement.weights[p].numpy(), fresh[name].numpy())


@pytest.mark.parametrize("swap", [False, True])
def test_load_state_dict_assign_is_refused_and_leaves_the_module_unchanged(arena, swap):
    model = _model()
    placement = place_parameters(model, arena)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = {k: torch.randn_like(v) for k, v in before.items()}
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        with pytest.raises(ResidencyError, match=r"assign=True.*'0\.weight'.*release\(\)"):
            model.load_state_dict(fresh, assign=True)
        with pytest.raises(ResidencyError, match=r"'weight' \(and 1 more\) placed"):
            model[2].load_state_dict({"weight": fresh["2.weight"], "bias": fresh["2.bias"]},
                                     assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert _in_arena(model, placement)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # once released, assign=True is the caller's to use
    placement.release()
    assert not any(m._load_state_dict_pre_hooks for m in model.modules())
    model.load_state_dict(fresh, assign=True)
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())


def test_the_assign_refusal_counts_the_other_placed_parameters_only_when_there_are(arena):
    # one placed parameter read "(and 0 more)"
    lone = torch.nn.Linear(4, 3, bias=False)
    placement = place_parameters(lone, arena)
    with pytest.raises(ResidencyError, match=r"replace parameter 'weight' placed in an arena"):
        lone.load_state_dict({"weight": torch.randn(3, 4)}, assign=True)
    placement.release()


def test_pickle_and_deepcopy_of_arena_tensors_copy_the_values(arena):
    buf = arena.alloc(shape=(7, 4), dtype=np.float32)
    buf.numpy()[:] = np.random.default_rng().standard_normal((7, 4))
    t = as_tensor(buf)
    for copied in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t), _saved_and_loaded(t),
                   pickle.loads(pickle.dumps(buf.numpy())), copy.deepcopy(buf.numpy(pin=True))):
        np.testing.assert_array_equal(np.asarray(copied), buf.numpy())
        assert not np.shares_memory(np.asarray(copied), buf.numpy())
    assert _views(t, buf)      # the original still views its buffer
    for obj in (buf, arena):
        for how in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                how(obj)


def test_deepcopy_of_a_placed_model_and_its_optimizer_is_an_independent_copy(arena):
    model = _model()
    placement = place_parameters(model, arena)
    opt = CPUAdam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    twin, twin_opt = copy.deepcopy((model, opt))
    b = io.BytesIO()
    torch.save(model, b)                 # the whole module, its pre-hooks included
    b.seek(0)
    saved = torch.load(b, weights_only=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters()))
    # the copy lives outside the arena and is no placed module: placing it works
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and not _views(q, placement.weights[p])
    assert twin_opt.param_groups[0]["params"][0] is next(twin.parameters())
    other = place_parameters(twin, arena)
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad(set_to_none=False)
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert _in_arena(model, placement) and _in_arena(twin, other)


def test_share_memory_moves_placed_parameters_out_without_losing_data(arena):
    # torch swaps the storage in C++ (no hook to refuse it): the parameters then
    # live in new shared memory, the buffers go stale; training and release()
    # keep the values (they read the parameters), as the README says.
    model = _model()
    placement = place_parameters(model, arena)
    model.share_memory()
    assert not any(_views(p, placement.weights[p]) for p in model.parameters())
    opt = CPUAdam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    placement.release()
    for p, a in zip(model.parameters(), after):
        assert torch.equal(p, a)


def test_execution_error_shows_its_public_path_and_pickles():
    # help() and tracebacks showed rtmem.torch._stages.ExecutionError, a
    # private path; pickle must still find the class under the public one
    from rtmem.torch import ExecutionError
    assert ExecutionError.__module__ == "rtmem.torch"
    err = pickle.loads(pickle.dumps(ExecutionError("stage 2 refused")))
    assert type(err) is ExecutionError and str(err) == "stage 2 refused"
