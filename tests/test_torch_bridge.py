"""DLPack/array-interface bridge and parameter placement on the host backend."""

import copy
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from rtmem.errors import DoubleFreeError, ResidencyError, UseAfterFreeError  # noqa: E402
from rtmem.torch import (ModulePlacement, as_tensor, from_tensor, gpt2_model,  # noqa: E402
                         place_parameters)


def test_zero_copy_both_ways(arena):
    buf = arena.alloc(shape=(4, 5), dtype=np.float32)
    rng = np.random.default_rng(0)
    buf.numpy()[:] = rng.standard_normal((4, 5))
    t = as_tensor(buf)
    assert t.shape == (4, 5) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), buf.numpy())
    t[1, 2] = 42.0
    assert buf.numpy()[1, 2] == 42.0
    assert t.data_ptr() == buf.numpy().ctypes.data


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_from_tensor_round_trip(arena, dtype):
    x = (torch.randn(3, 7) * 100).to(dtype)
    buf = from_tensor(x, arena, kind="weight")
    assert buf.kind == "weight" and buf.nbytes == x.numel() * x.element_size()
    assert torch.equal(as_tensor(buf, dtype=dtype), x)
    assert arena.stats().bytes_by_kind["weight"] >= buf.nbytes


def test_from_tensor_copies_the_values_of_strided_tensors_in_row_major_order(arena):
    # Carried question: from_tensor does not keep strides. It must not read a
    # transposed, channels_last, stepped or expanded tensor's storage as if it
    # were row-major (silently wrong values): the buffer holds the logical
    # elements in row-major order, checked against numpy's view of the same
    # fresh random data (torch plays no part in the reference).
    rng = np.random.default_rng()
    a2 = rng.standard_normal((6, 9)).astype(np.float32)
    a4 = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    col = rng.standard_normal((5, 1)).astype(np.float32)
    cases = [
        (torch.from_numpy(a2).t(), a2.T),
        (torch.from_numpy(a2)[1::2, ::3], a2[1::2, ::3]),
        (torch.from_numpy(a4).to(memory_format=torch.channels_last), a4),
        (torch.from_numpy(a4).permute(3, 1, 0, 2), a4.transpose(3, 1, 0, 2)),
        (torch.from_numpy(col).expand(5, 7), np.broadcast_to(col, (5, 7))),
    ]
    for t, ref in cases:
        assert not t.is_contiguous()
        buf = from_tensor(t, arena)
        assert buf.shape == ref.shape
        np.testing.assert_array_equal(buf.numpy(), ref)
        view = as_tensor(buf)
        assert view.is_contiguous() and torch.equal(view, t)
        del view
        buf.free()


def test_views_keep_the_block_until_collected(arena):
    buf = arena.alloc(shape=(1000,), dtype=np.float32)
    t = as_tensor(buf)
    view = t[10:20]              # a slice: only shares the storage
    del t
    gc.collect()
    buf.free()
    assert arena.stats().allocated_bytes > 0      # still reserved: a view lives
    other = arena.alloc(shape=(1000,), dtype=np.float32)
    assert not np.shares_memory(other.numpy(), view.numpy())
    with pytest.raises(DoubleFreeError):
        buf.free()
    with pytest.raises(UseAfterFreeError):
        as_tensor(buf)            # no new views of a freed buffer
    del view
    gc.collect()
    assert arena.stats().count_by_kind["activation"] == 1   # only `other` is left
    other.free()
    assert arena.stats().allocated_bytes == 0


def test_bad_requests(arena):
    buf = arena.alloc(shape=(8,), dtype=np.float32)
    with pytest.raises(TypeError, match="item sizes"):
        as_tensor(buf, dtype=torch.float16)
    with pytest.raises(ResidencyError, match="mapped host buffer on the cuda backend"):
        as_tensor(buf, device_alias=True)
    with pytest.raises(TypeError, match="Buffer"):
        as_tensor(np.zeros(3))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        as_tensor(buf, dtype="float32")
    with pytest.raises(TypeError, match="cannot hold torch.quint8 tensors"):
        as_tensor(buf, dtype=torch.quint8)
    with pytest.raises(TypeError, match="dense tensors.*sparse_coo.*to_dense"):
        from_tensor(torch.eye(3).to_sparse(), arena)
    with pytest.raises(rtmem.OutOfMemoryError):
        from_tensor(torch.zeros(1 << 21), arena)      # 8 MiB into a 4 MiB arena
    # no data to copy: refused before allocating (it was torch's bare
    # NotImplementedError from the copy)
    with pytest.raises(TypeError, match="meta tensor has none"):
        from_tensor(torch.empty(3, device="meta"), arena)
    assert arena.stats().count_by_kind["activation"] == 1   # nothing leaked
    # numpy dtypes torch lacks get rtmem's message, not torch's
    for dtype in (np.longdouble, ">f4", "U2", [("a", "i4")]):
        odd = arena.alloc(shape=(2,), dtype=dtype)
        with pytest.raises(TypeError, match="torch has no dtype.*buf.numpy"):
            as_tensor(odd)
        odd.free()


def test_placed_module_trains_like_the_original(arena):
    torch.manual_seed(0)
    model, loss_fn, make = gpt2_model(layers=2, hidden=32, heads=4, seq=16, vocab=64)
    ref = copy.deepcopy(model)
    placement = place_parameters(model, arena)
    assert isinstance(placement, ModulePlacement)
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    stats = arena.stats()
    assert stats.requested_by_kind["weight"] == n_bytes
    assert stats.requested_by_kind["gradient"] == n_bytes
    x, y = make(3, torch.Generator().manual_seed(1))
    for m in (model, ref):
        loss_fn(m(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        # the gradient accumulated in place, inside the arena's gradient buffer
        assert p.grad.data_ptr() == placement.grads[p].numpy().ctypes.data
    placement.release()
    gc.collect()
    assert arena.stats().allocated_bytes == 0
    loss_fn(model(x), y)          # the module still works on ordinary memory


def test_placement_keeps_existing_gradients_and_is_all_or_nothing(arena):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model(torch.randn(2, 64)).sum().backward()
    data = [p.data for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    # room for the first layer's weight, gradient and bias only: placement fails
    small = rtmem.HostArena(3 * 16384 + 2 * 256)
    with pytest.raises(rtmem.errors.OutOfMemoryError):
        place_parameters(model, small)
    for p, d, g in zip(model.parameters(), data, grads):
        # the very same memory and gradient tensors, untouched
        assert p.data.data_ptr() == d.data_ptr() and p.grad is g
    gc.collect()
    assert small.stats().allocated_bytes == 0
    # when it succeeds, the arena gradients start from the gradients p had
    placement = place_parameters(model, arena)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
        assert p.grad.data_ptr() == placement.grads[p].numpy().ctypes.data
    placement.release()


def test_a_failed_placement_gives_its_bytes_back_while_the_error_is_handled():
    # The first layer fits, the second does not. The error's traceback keeps
    # place_parameters' frame alive through the caller's except clause: no view
    # left in it may pin a buffer there (the last gradient's stayed allocated).
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
    small = rtmem.HostArena(90_000)
    try:
        place_parameters(model, small)
    except rtmem.errors.OutOfMemoryError:
        gc.collect()
        assert small.stats().allocated_bytes == 0
        assert small.stats().bytes_by_kind["gradient"] == 0
    else:
        pytest.fail("the second layer should not fit")


@pytest.mark.parametrize("grads", [True, False])
def test_a_lazy_module_is_placed_only_once_initialized(arena, grads):
    # An uninitialized parameter's data is an empty placeholder: grads=False
    # placed it (the first forward then made the weight outside the arena) and
    # grads=True failed half-way with torch's error about load_state_dict.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyLinear(3))
    first = [p.data_ptr() for p in model[0].parameters()]
    with pytest.raises(ValueError, match="parameter 2 is not initialized.*forward pass"):
        place_parameters(model, arena, grads=grads)
    assert [p.data_ptr() for p in model[0].parameters()] == first      # nothing moved
    assert all(p.grad is None for p in model[0].parameters())
    assert torch.nn.parameter.is_lazy(model[1].weight)
    assert arena.stats().allocated_bytes == 0
    model(torch.ones(2, 4))                  # initializes it
    placement = place_parameters(model, arena, grads=grads)
    weight = model[1].weight
    assert weight.data_ptr() == placement.weights[weight].numpy().ctypes.data
    assert placement.weights[weight].shape == (3, 4)
    placement.release()


def test_gradients_go_where_the_parameters_compute(arena):
    # Host backend: every tensor is a CPU tensor, so a DeviceArena's weights take
    # gradients in a pinned HostArena as well.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    host = rtmem.HostArena("1MiB", backend="host")
    placement = place_parameters(model, arena, grad_arena=host)
    x = torch.randn(5, 4)
    for m in (model, ref):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert placement.grads[p].host_arena is host
    placement.release()
    # Weights the GPU reads (device_alias) need gradients the GPU can write: an
    # unmapped host arena is refused before anything moves.
    before = [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()]
    mapped = rtmem.HostArena("1MiB", mapped=True, backend="host")
    with pytest.raises(ValueError, match=r"DeviceArena or a HostArena\(mapped=True\)"):
        place_parameters(model, mapped, grad_arena=host, device_alias=True)
    assert [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()] == before
    assert mapped.stats().allocated_bytes == host.stats().allocated_bytes == 0
    # device_alias on a DeviceArena (or an unmapped host one) is refused by its
    # cause, before anything moves; it was "no host copy; prefetch or offload it"
    dev = rtmem.DeviceArena("1MiB", backend="host")
    for wrong in (dev, host):
        with pytest.raises(ValueError, match=r"device_alias=True .*HostArena\(nbytes, "
                                             r"mapped=True\), got"):
            place_parameters(model, wrong, device_alias=True)
    assert [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()] == before
    with pytest.raises(ResidencyError, match="mapped host buffer on the cuda backend"):
        as_tensor(dev.alloc(16), device_alias=True)
    gc.collect()
    host.close()
    mapped.close()
    dev.close()


def test_wrong_argument_types_are_named(arena):
    from rtmem.errors import OptimizerError
    from rtmem.planners import store_all_schedule
    from rtmem.torch import ExecutionError, OffloadedAdam, ScheduleExecutor
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    loss = torch.nn.functional.mse_loss
    for call, error, fragment in (
            (lambda: from_tensor(np.zeros(3), arena), TypeError, "torch.Tensor"),
            (lambda: place_parameters([1], arena), TypeError, "nn.Module"),
            (lambda: place_parameters(m, None), TypeError, "DeviceArena or HostArena"),
            (lambda: ScheduleExecutor(m, store_all_schedule(1), None), ExecutionError,
             "callable"),
            (lambda: ScheduleExecutor(m, store_all_schedule(1), loss, host_arena="x"),
             ExecutionError, "HostArena"),
            (lambda: OffloadedAdam(m.parameters(), host_arena="x"), OptimizerError,
             "HostArena")):
        with pytest.raises(error, match=fragment):
            call()
    assert arena.stats().allocated_bytes == 0


def test_a_placed_module_cannot_be_placed_again_until_released(arena):
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    placement = place_parameters(m, arena)
    used = arena.stats().allocated_bytes
    with pytest.raises(ValueError, match="already in an arena"):
        place_parameters(m, arena)
    assert arena.stats().allocated_bytes == used
    placement.release()
    again = place_parameters(m, arena)          # fine once released
    # converted after placing: out of the arena, still registered; the message
    # says so (it read "already in an arena" only)
    m.double()
    with pytest.raises(ValueError, match=r"or was and has been converted out of it since "
                                         r"\(module.half\(\), .to\(\)\); call release\(\)"):
        place_parameters(m, arena)
    again.release()
    place_parameters(m, arena).release()        # converted, released, placed


def test_a_dropped_placement_frees_its_buffers_once_the_parameters_let_go(arena):
    # place_parameters(model, arena) with the result not kept (README's GPU line):
    # the parameters counted as placed no more, so placing again was accepted and
    # the first placement's buffers stayed allocated forever (no release possible).
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    want = m(x).detach().clone()
    place_parameters(m, arena)
    gc.collect()
    used = arena.stats().allocated_bytes
    assert used > 0
    torch.testing.assert_close(m(x), want)     # the module keeps working meanwhile
    again = place_parameters(m, arena)          # the old buffers go as p.data moves
    gc.collect()
    assert arena.stats().allocated_bytes == used
    torch.testing.assert_close(m(x), want)
    again.release()
    gc.collect()
    assert arena.stats().allocated_bytes == 0
    place_parameters(m, arena)
    del m
    gc.collect()
    assert arena.stats().allocated_bytes == 0


def test_on_torch_stream_is_a_no_op_without_cuda():
    # The README wraps rtmem calls in it; on CPU-only torch it raised torch's
    # "Torch not compiled with CUDA enabled" AssertionError.
    from rtmem.torch import on_torch_stream
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    with on_torch_stream():
        pass
    with on_torch_stream(0):
        pass


@pytest.mark.parametrize("which", ["weights", "grads"])
def test_release_completes_after_a_buffer_was_freed_by_hand(arena, which):
    # A placed buffer freed by hand (the free waits for the parameter's view)
    # used to make release() raise DoubleFreeError at that buffer, leaving the
    # other parameters in the arena, still "placed", and every later release()
    # failing the same way: their buffers leaked and the module could never be
    # placed again.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model(torch.randn(3, 8)).sum().backward()
    values = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    placement = place_parameters(model, arena)
    next(iter(getattr(placement, which).values())).free()
    placement.release()
    placement.release()                 # and again: nothing left to do
    for p, (v, g) in zip(model.parameters(), values):
        assert torch.equal(p.detach(), v) and torch.equal(p.grad, g)
    gc.collect()
    assert arena.stats().allocated_bytes == 0
    place_parameters(model, arena).release()     # placeable again


@pytest.mark.parametrize("dtype", [getattr(torch, name) for name in (
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32")
    if hasattr(torch, name)])                        # the last float formats came in 2.8
@pytest.mark.filterwarnings("ignore::UserWarning")     # complex32 is experimental
def test_every_float_format_round_trips_as_bits(arena, dtype):
    # Only bfloat16 and two float8 formats were mapped to integer bits; the other
    # float formats without a numpy twin raised torch's "Got unsupported
    # ScalarType" TypeError from from_tensor and place_parameters.
    bits = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[dtype.itemsize]
    x = torch.arange(6 * dtype.itemsize, dtype=torch.uint8).view(bits).view(dtype)
    buf = from_tensor(x.view(2, -1), arena, kind="weight")
    assert buf.nbytes == x.numel() * dtype.itemsize
    t = as_tensor(buf, dtype=dtype)
    assert t.dtype == dtype and torch.equal(t.view(bits), x.view(2, -1).view(bits))
    del t
    buf.free()
    m = torch.nn.Linear(2, 2, bias=False)
    m.weight = torch.nn.Parameter(x[:4].view(2, 2).clone(), requires_grad=False)
    placement = place_parameters(m, arena)
    assert m.weight.dtype == dtype
    assert torch.equal(m.weight.view(bits), x[:4].view(2, 2).view(bits))
    placement.release()


@pytest.mark.filterwarnings("ignore::UserWarning")     # prototype / deprecated APIs
def test_tensors_without_a_buffer_layout_are_refused_with_rtmem_messages(arena):
    # a nested tensor's layout reads strided: its shape raised torch's "Internal
    # error ... Please file an issue"; a quantized one raised "Got unsupported
    # ScalarType QInt8"
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with pytest.raises(TypeError, match="nested one.*unbind"):
        from_tensor(nested, arena)
    quantized = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="cannot hold torch.qint8.*dequantize"):
        from_tensor(quantized, arena)
    assert arena.stats().allocated_bytes == 0


def test_placement_keeps_a_sparse_gradient_as_a_dense_one(arena):
    # nn.Embedding(sparse=True) leaves a sparse p.grad: placement raised torch's
    # "copy_() between dense and sparse Tensors is not implemented"
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    ref = copy.deepcopy(emb)
    for m in (emb, ref):
        m(torch.tensor([1, 2, 1])).sum().backward()
    placement = place_parameters(emb, arena)
    for m in (emb, ref):
        m(torch.tensor([1, 3])).sum().backward()     # accumulates in the arena buffer
    assert emb.weight.grad.data_ptr() == placement.grads[emb.weight].numpy().ctypes.data
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad.to_dense())
    placement.release()


def test_on_torch_stream_adopts_torch_s_stream_on_the_asked_device(monkeypatch):
    # CuPy's current stream becomes torch's current stream of that device: by
    # Stream.from_external (CuPy >= 14) or ExternalStream(ptr, device index)
    # (CuPy 13); nothing to switch when the two are already one stream
    import contextlib
    import types

    import rtmem.backends.cuda as cuda_backend
    from rtmem.torch import on_torch_stream

    class Stream:                               # CuPy 13: no from_external
        pass
    cupy_ptr, asked = [0], []
    cuda = types.SimpleNamespace(
        Stream=Stream, ExternalStream=lambda ptr, index: ("ExternalStream", ptr, index),
        get_current_stream=lambda: types.SimpleNamespace(ptr=cupy_ptr[0]))
    monkeypatch.setattr(cuda_backend, "import_cupy", lambda: types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: asked.append(device) or
                        types.SimpleNamespace(cuda_stream=77))
    assert on_torch_stream(torch.device("cuda", 1)) == ("ExternalStream", 77, 1)
    assert on_torch_stream(2) == ("ExternalStream", 77, 2)
    assert on_torch_stream() == ("ExternalStream", 77, 3)          # torch's current one
    assert on_torch_stream(torch.device("cuda")) == ("ExternalStream", 77, 3)
    assert asked == [torch.device("cuda", 1), torch.device("cuda", 2), None,
                     torch.device("cuda")]
    Stream.from_external = staticmethod(lambda handle: ("from_external",
                                                        handle.__cuda_stream__()))
    cuda.ExternalStream = None                  # CuPy >= 14 deprecates it
    assert on_torch_stream(1) == ("from_external", (0, 77))
    cupy_ptr[0] = 77
    assert isinstance(on_torch_stream(1), contextlib.nullcontext)


def test_as_tensor_refuses_a_wider_dtype_too(arena):
    buf = arena.alloc(shape=(8,), dtype=np.float16)
    with pytest.raises(TypeError, match="item sizes differ"):
        as_tensor(buf, dtype=torch.float32)        # 8 halves are not 4 floats
    assert as_tensor(buf, dtype=torch.bfloat16).shape == (8,)
    buf.free()


def test_a_dtype_of_another_item_size_is_refused_before_any_view(arena):
    # The item-size check ran after the view was made: the pinned view lived on
    # in the error's traceback, so a free() while the caller held the error was
    # postponed (and evict refused). The message did not say what to pass.
    rng = np.random.default_rng()
    buf = arena.alloc(shape=(8,), dtype=np.float32)
    data = rng.standard_normal(8).astype(np.float32)
    buf.numpy()[:] = data
    with pytest.raises(TypeError, match=r"float32 memory .4 bytes per item. as torch.float16 "
                       r".2 bytes.*the item sizes differ.*pass dtype=None or one of "
                       r"4 bytes.*torch.int32") as caught:
        as_tensor(buf, dtype=torch.float16)
    assert "dtype=" in as_tensor.__doc__.split("Raises")[1]   # documented
    np.testing.assert_array_equal(buf.numpy(), data)          # unchanged
    buf.free()                                 # the error (and its traceback) is held
    assert buf.is_freed and arena.stats().allocated_bytes == 0
    del caught


def test_from_tensor_frees_its_buffer_when_the_copy_fails(arena, monkeypatch):
    import rtmem.torch.bridge as bridge

    def failing(buf, **kwargs):                   # as a CPU tensor into CUDA memory
        raise RuntimeError("the copy failed")
    monkeypatch.setattr(bridge, "as_tensor", failing)
    with pytest.raises(RuntimeError, match="the copy failed"):
        from_tensor(torch.ones(16), arena)
    assert arena.stats().allocated_bytes == 0


def test_a_frozen_parameter_gets_no_gradient_buffer(arena):
    m = torch.nn.Linear(4, 3)
    m.bias.requires_grad_(False)
    placement = place_parameters(m, arena)
    assert m.bias.grad is None and list(placement.grads) == [m.weight]
    assert arena.stats().requested_by_kind["gradient"] == 3 * 4 * 4
    placement.release()


def test_new_gradient_buffers_start_from_zero_in_reused_memory(arena):
    # the gradient buffers land in bytes a freed buffer left NaN
    dirty = arena.alloc(shape=(1 << 14,), dtype=np.float32)      # 64 KiB from offset 0
    dirty.numpy()[:] = np.nan
    dirty.free()
    torch.manual_seed(0)
    lin, emb = torch.nn.Linear(8, 8), torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 1])).sum().backward()              # a sparse gradient
    sparse = emb.weight.grad.to_dense()
    placement = place_parameters(torch.nn.ModuleList([lin, emb]), arena)
    for p in lin.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))         # none before: zeros
    assert torch.equal(emb.weight.grad, sparse)
    placement.release()


def test_placed_parameters_keep_their_memory_format(arena):
    # A channels_last weight came back row-major (the convolution chose other
    # kernels; is_contiguous(memory_format=channels_last) turned False), and a
    # transposed one contiguous; their gradients too.
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.Flatten(),
                                torch.nn.Linear(5 * 4 * 4, 2))
    model[0].to(memory_format=torch.channels_last)
    model[2].weight.data = model[2].weight.data.t().contiguous().t()
    model[2].weight.grad = torch.randn(model[2].weight.shape).t().contiguous().t()
    grad = model[2].weight.grad.clone()
    ref = copy.deepcopy(model)
    strides = [p.stride() for p in model.parameters()]
    placement = place_parameters(model, arena)
    w = model[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last)
    assert [p.stride() for p in model.parameters()] == strides
    assert [p.grad.stride() for p in model.parameters()] == strides
    assert placement.weights[w].shape == (5, 3, 3, 3)       # (N, H, W, C) in memory
    np.testing.assert_array_equal(placement.weights[w].numpy(),
                                  ref[0].weight.detach().permute(0, 2, 3, 1).numpy())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert placement.weights[p].numpy().ctypes.data == p.data_ptr()
    assert torch.equal(model[2].weight.grad, grad)
    ref[2].weight.grad = grad
    x = torch.randn(4, 3, 6, 6).to(memory_format=torch.channels_last)
    for m in (model, ref):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.data_ptr() == placement.grads[p].numpy().ctypes.data   # in place
    placement.release()
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert arena.stats().allocated_bytes == 0


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("convert", ["half", "float64"])
def test_a_placed_module_converts_out_of_the_arena_as_documented(arena, swap, convert):
    # With torch.__future__.set_swap_module_params_on_conversion(True), .half()
    # and .to(dtype) swap each parameter's tensor in place
    # (torch.utils.swap_tensors), which refuses a tensor with weak references:
    # the placement's registry held one, and the conversion failed with
    # "_apply(): Couldn't swap Linear.weight". Now it converts as without the
    # flag: out of the arena, the buffers reserved until release().
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    placement = place_parameters(model, arena)
    model(torch.randn(5, 4)).square().sum().backward()
    params = list(model.parameters())
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    used = arena.stats().allocated_bytes
    dtype = torch.float16 if convert == "half" else torch.float64
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model.half() if convert == "half" else model.to(dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)
    assert list(model.parameters()) == params        # the same Parameter objects
    for p, (data, grad) in zip(params, before):
        assert p.dtype == p.grad.dtype == dtype
        assert torch.equal(p, data.to(dtype)) and torch.equal(p.grad, grad.to(dtype))
        assert p.data_ptr() != placement.weights[p].numpy().ctypes.data
    assert arena.stats().allocated_bytes == used     # reserved until release()
    with pytest.raises(ValueError, match="converted out of it.*release"):
        place_parameters(model, arena)
    placement.release()
    assert arena.stats().allocated_bytes == 0
    placement.release()                              # again: nothing to do
    again = place_parameters(model, arena)            # converted, placed again
    assert all(p.dtype == dtype for p in model.parameters())
    again.release()
    assert arena.stats().allocated_bytes == 0
