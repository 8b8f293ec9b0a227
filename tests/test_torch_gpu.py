"""rtmem.torch on a real GPU (``pytest -m gpu``): the DLPack/CUDA-interface bridge over
device, pinned and mapped arenas, parameters placed in device memory and in mapped
host memory (DHA), the executor's remat and offload plans on CUDA streams, the
offloaded Adam loop against torch.optim.Adam, and the demo on the cuda backend.

Same checks as the CPU suite (tests/test_torch_*.py), with the cuda backend and CUDA
tensors; every test skips on a machine without a usable GPU."""

from __future__ import annotations

import copy
import gc
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rtmem  # noqa: E402
from _torch_precision import exact_fp32  # noqa: E402
from rtmem.planners import Schedule, sequential_schedule, store_all_schedule  # noqa: E402
from rtmem.torch import (OffloadedAdam, ScheduleExecutor, as_tensor,  # noqa: E402
                         from_tensor, gpt2_model, place_parameters)

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _no_gpu(why):
    # a GPU session (RTMEM_REQUIRE_GPU=1, bench/gpu_session.sh) must not pass by skipping
    if os.environ.get("RTMEM_REQUIRE_GPU") == "1":
        pytest.fail(f"RTMEM_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


@pytest.fixture
def cuda(monkeypatch):
    if not torch.cuda.is_available():
        _no_gpu("torch sees no CUDA device")
    from rtmem.backends import cuda_available
    if not cuda_available():
        _no_gpu("no usable CUDA GPU through CuPy")
    monkeypatch.setenv("RTMEM_BACKEND", "cuda")
    # Tensor.is_pinned() is False for every pointer until torch has initialized
    # CUDA (lazily, at its first CUDA op): tests must not depend on their order.
    torch.cuda.init()
    # exact fp32 matmuls: the reference and the plans then differ only by the
    # order of float32 additions, not by TF32 rounding of different operands
    with exact_fp32(torch):
        yield torch.device(DEV)
    gc.collect()
    torch.cuda.synchronize()


def _model(device, dropout=0.0, layers=3):
    torch.manual_seed(0)
    model, loss_fn, make = gpt2_model(layers=layers, hidden=64, heads=4, seq=32, vocab=128,
                                      dropout=dropout)
    model = model.to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [make(4, gen, device=device) for _ in range(20)]
    return model, loss_fn, batches


# ------------------------------------------------------------------ bridge
def test_device_buffer_is_a_cuda_tensor_zero_copy(cuda):
    arena = rtmem.DeviceArena(1 << 22)
    buf = arena.alloc(shape=(64, 33), dtype=np.float32)
    t = as_tensor(buf)
    assert t.is_cuda and t.shape == (64, 33)
    assert t.data_ptr() == buf.__cuda_array_interface__["data"][0]
    x = torch.randn(64, 33, device=cuda)
    t.copy_(x)
    torch.testing.assert_close(as_tensor(buf), x, rtol=0, atol=0)
    y = torch.randn(5, 7, device=cuda, dtype=torch.bfloat16)
    ybuf = from_tensor(y, arena, kind="weight")
    assert torch.equal(as_tensor(ybuf, dtype=torch.bfloat16), y)
    del t
    gc.collect()
    buf.free()
    ybuf.free()
    assert arena.stats().allocated_bytes == 0
    arena.close()


def test_pinned_buffer_is_a_pinned_cpu_tensor(cuda):
    arena = rtmem.HostArena(1 << 22)
    buf = arena.alloc(shape=(1000,), dtype=np.float32)
    buf.numpy()[:] = np.random.default_rng(0).standard_normal(1000)
    t = as_tensor(buf)
    assert t.device.type == "cpu" and t.is_pinned()
    d = t.to(cuda, non_blocking=True)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(d.cpu().numpy(), buf.numpy())
    del t
    gc.collect()
    buf.free()
    arena.close()


def test_mapped_buffer_device_alias_reads_and_writes_host_memory(cuda):
    arena = rtmem.HostArena(1 << 22, mapped=True)
    buf = arena.alloc(shape=(4096,), dtype=np.float32)
    host = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    buf.numpy()[:] = host
    g = as_tensor(buf, device_alias=True)
    assert g.is_cuda
    torch.testing.assert_close(g * 2, torch.from_numpy(host * 2).to(cuda), rtol=0, atol=0)
    g.mul_(3)                        # the GPU writes host memory over PCIe
    torch.cuda.synchronize()
    np.testing.assert_array_equal(buf.numpy(), host * 3)
    del g
    gc.collect()
    buf.free()
    arena.close()


def test_placed_parameters_train_like_the_original(cuda):
    model, loss_fn, batches = _model(cuda, layers=2)
    ref = copy.deepcopy(model)
    arena = rtmem.DeviceArena(64 << 20)
    placement = place_parameters(model, arena)
    x, y = batches[0]
    for m in (model, ref):
        loss_fn(m(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.is_cuda and p.data_ptr() == placement.weights[p].__cuda_array_interface__[
            "data"][0]
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    placement.release()
    gc.collect()
    assert arena.stats().allocated_bytes == 0
    arena.close()


@pytest.mark.parametrize("mode", ["dha_go", "dha", "gpu_go"])
def test_memferry_placements_train_like_the_original(cuda, mode):
    # MemFerry's modes: "dha_go", weights and gradients in mapped host memory,
    # read and written by the GPU over PCIe; "dha", mapped weights with gradients
    # in HBM; "gpu_go", weights in HBM with gradients written straight into
    # mapped host memory (GO-MemFerry).
    model, loss_fn, batches = _model(cuda, layers=2)
    ref = copy.deepcopy(model)
    device = rtmem.DeviceArena(64 << 20)
    mapped = rtmem.HostArena(64 << 20, mapped=True)
    placement = {
        "dha_go": lambda: place_parameters(model, mapped, device_alias=True),
        "dha": lambda: place_parameters(model, mapped, grad_arena=device, device_alias=True),
        "gpu_go": lambda: place_parameters(model, device, grad_arena=mapped)}[mode]()
    x, y = batches[0]
    for m in (model, ref):
        loss_fn(m(x), y).backward()
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.is_cuda and p.grad.is_cuda
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        grad = placement.grads[p]
        assert (grad.host_arena is mapped) == (mode != "dha")
        if mode != "dha":                          # the host view holds the gradient
            host = grad.numpy().reshape(q.grad.shape)
            np.testing.assert_allclose(host, q.grad.cpu().numpy(), rtol=1e-5, atol=1e-6)
    placement.release()
    gc.collect()
    device.close()
    mapped.close()


def test_as_tensor_under_a_torch_side_stream_waits_for_the_prefetch(cuda):
    # torch kernels on a side stream read the buffer only after its H2D copy:
    # as_tensor orders torch's current stream, not CuPy's legacy one, after it
    n = 64 << 20                                       # 256 MiB: a copy of ~5 ms
    d, h = rtmem.DeviceArena(n * 4 + (1 << 20)), rtmem.HostArena(n * 4 + (1 << 20))
    b = d.alloc(shape=(n,), dtype=np.float32)
    data = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    rtmem.offload(b, arena=h)
    rtmem.evict(b)
    rtmem.synchronize(b)
    b.numpy("host")[:] = data
    expect = float(data.astype(np.float64).sum())
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(side):
            rtmem.prefetch(b)
            total = as_tensor(b).double().sum()
        torch.cuda.synchronize()
        assert math.isclose(float(total), expect, rel_tol=1e-9, abs_tol=1e-6)
        rtmem.evict(b)
        rtmem.synchronize(b)
    b.free()
    gc.collect()
    d.close()
    h.close()


# ---------------------------------------------------------------- executor
def _reference(model, loss_fn, x, y, seed=7):
    ref = copy.deepcopy(model)
    torch.manual_seed(seed)
    loss = loss_fn(ref(x), y)
    loss.backward()
    return ref, loss.detach()


def _check_same(m, ex, loss, ref, ref_loss):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    host = ex.host_grads()
    for p, q in zip(m.parameters(), ref.parameters()):
        g = p.grad if p.grad is not None else 0
        g = g + host[p].to(q.device) if p in host else g
        torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("segments", [None, 1, 2])
def test_executor_remat_gradients_equal_plain_autograd(cuda, segments):
    model, loss_fn, batches = _model(cuda, dropout=0.1)
    x, y = batches[0]
    ref, ref_loss = _reference(model, loss_fn, x, y)
    n = len(model)
    sched = store_all_schedule(n) if segments is None else sequential_schedule(n, segments)
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, sched, loss_fn)
    torch.manual_seed(7)
    loss = ex.step(x, y)
    _check_same(m, ex, loss, ref, ref_loss)


def test_executor_runs_dha_stages_on_mapped_weights(cuda):
    # MemFerry's DHA layers inside a plan: the embedding and the head keep their
    # weights (and gradients) in mapped host memory, read and written by the GPU
    # over PCIe, while the blocks between them are rematerialized.
    model, loss_fn, batches = _model(cuda, dropout=0.1)
    x, y = batches[0]
    ref, ref_loss = _reference(model, loss_fn, x, y)
    m = copy.deepcopy(model)
    mapped = rtmem.HostArena(64 << 20, mapped=True)
    placements = [place_parameters(m[i], mapped, device_alias=True) for i in (0, len(m) - 1)]
    ex = ScheduleExecutor(m, sequential_schedule(len(m), 2), loss_fn)
    torch.manual_seed(7)
    loss = ex.step(x, y)
    torch.cuda.synchronize()
    _check_same(m, ex, loss, ref, ref_loss)
    for placement in placements:
        for p, buf in placement.grads.items():            # the gradient is in host memory
            assert p.grad.data_ptr() == buf.__cuda_array_interface__["data"][0]
        placement.release()
    gc.collect()
    mapped.close()


@pytest.mark.parametrize("side_stream", [False, True], ids=["default", "side-stream"])
def test_executor_offload_through_the_pinned_arena_on_streams(cuda, side_stream):
    # side-stream: the whole training step runs under torch.cuda.stream(s), so
    # torch's compute stream is not CuPy's (the arena's reuse order follows it)
    import contextlib
    model, loss_fn, batches = _model(cuda)
    x, y = batches[0]
    ref, ref_loss = _reference(model, loss_fn, x, y)
    n = len(model)
    text = ["offload a0", "F_all 0", "offload abar1", "F_all 1", "delete abar1",
            "w_delete 0"]
    text += [f"F_all {i}" for i in range(2, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(2, n))]
    text += ["prefetch abar1", "B 1", "g_offload 1", "w_prefetch 0", "B 0", "g_offload 0"]
    sched = Schedule.from_text(", ".join(text))
    arena = rtmem.HostArena(16 << 20)
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, sched, loss_fn, host_arena=arena)
    for k in range(5):
        for p in m.parameters():
            p.grad = None
        ex.zero_host_grads()
        torch.manual_seed(7)
        with torch.cuda.stream(torch.cuda.Stream()) if side_stream else \
                contextlib.nullcontext():
            loss = ex.step(x, y)
        torch.cuda.synchronize()
        if k == 0:
            _check_same(m, ex, loss, ref, ref_loss)
        gc.collect()
        assert arena.stats().allocated_bytes == 0     # host copies returned each step
    stats = arena.stats()
    assert stats.alloc_count >= 2 * 5 and stats.alloc_count == stats.free_count
    arena._check_invariants()
    arena.close()


def test_executor_offloaded_tensor_dropped_while_its_copy_runs(cuda):
    # F_none 1 drops a1 while its D2H copy may still read it; F_all 2 then
    # allocates on the compute stream. Without record_stream the allocator hands
    # a1's block to F_all 2's output and the host copy (prefetched later for
    # F_all 1) is garbage.
    model, loss_fn, batches = _model(cuda, layers=4)
    x, y = batches[0]
    ref, ref_loss = _reference(model, loss_fn, x, y)
    n = len(model)
    text = ["F_ck 0", "offload a1", "F_none 1"] + [f"F_all {i}" for i in range(2, n)]
    text += ["L"] + [f"B {i}" for i in reversed(range(2, n))]
    text += ["F_ck 0", "delete a1", "prefetch a1", "F_all 1", "B 1", "F_all 0", "B 0"]
    m = copy.deepcopy(model)
    ex = ScheduleExecutor(m, Schedule.from_text(", ".join(text)), loss_fn)
    for _ in range(3):
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(7)
        loss = ex.step(x, y)
        _check_same(m, ex, loss, ref, ref_loss)


def test_executor_weight_moves_across_optimizer_steps(cuda):
    # w_prefetch makes new device tensors: the host copy taken by w_delete in one
    # step must not come back after the optimizer changed the weights.
    model, loss_fn, batches = _model(cuda)
    x, y = batches[0]
    n = len(model)
    text = ["F_all 0", "w_delete 0"] + [f"F_all {i}" for i in range(1, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(1, n))] + ["w_prefetch 0", "B 0"]
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    ex = ScheduleExecutor(mine, Schedule.from_text(", ".join(text)), loss_fn)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (mine, ref)]
    for _ in range(3):
        ex.step(x, y)
        loss_fn(ref(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_executor_weight_and_gradient_copies_on_streams_accumulate(cuda):
    # w_offload / w_delete copy weights on the D2H stream and w_prefetch brings
    # them back on the H2D stream (compute waits only before the stage's next
    # F or B); g_offload copies gradients out on the D2H stream and host_grads()
    # adds them up once the copies end: three steps give three times the
    # reference gradient, and the weights are unchanged.
    model, loss_fn, batches = _model(cuda)
    x, y = batches[0]
    ref, _ = _reference(model, loss_fn, x, y)
    n = len(model)
    text = ["F_all 0", "w_delete 0", "F_all 1", "w_offload 1"]
    text += [f"F_all {i}" for i in range(2, n)] + ["L"]
    text += [f"B {i}" for i in reversed(range(2, n))]
    text += ["w_prefetch 1", "B 1", "g_offload 1", "w_prefetch 0", "B 0", "g_offload 0"]
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    ex = ScheduleExecutor(m, Schedule.from_text(", ".join(text)), loss_fn)
    for _ in range(3):
        torch.manual_seed(7)
        ex.step(x, y)
    host = ex.host_grads()
    moved = set(m[0].parameters()) | set(m[1].parameters())
    assert set(host) == moved
    for p, q, b in zip(m.parameters(), ref.parameters(), before):
        assert torch.equal(p, b)
        g = host[p].to(q.device) if p in moved else p.grad
        torch.testing.assert_close(g, 3 * q.grad, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------- offloaded Adam
def test_offloaded_adam_matches_torch_adam_on_cuda(cuda):
    model, loss_fn, batches = _model(cuda, layers=2)
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    off = OffloadedAdam(mine.parameters(), lr=2e-3, chunk_elements=3001)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=2e-3)
    curves = ([], [])
    for x, y in batches:
        for m, opt, curve in ((mine, off, curves[0]), (ref, ref_opt, curves[1])):
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
    for a, b in zip(*curves):
        assert math.isclose(a, b, rel_tol=1e-4)
    assert curves[1][-1] < curves[1][0]
    torch.cuda.synchronize()
    for p, q in zip(mine.parameters(), ref.parameters()):
        assert p.is_cuda
        torch.testing.assert_close(p, q, rtol=0, atol=5e-4)
    off.close()


def test_offloaded_adam_groups_clipping_loss_scale_and_resume_on_cuda(cuda):
    # the host-side paths of the CPU tests, with the D2H/H2D streams in play:
    # clip_grad_norm_ and the finite check read gradients the D2H stream
    # wrote, and a resumed optimizer continues bit for bit
    model, loss_fn, batches = _model(cuda, layers=2)

    def groups(m):
        ps = list(m.parameters())
        return [{"params": [p for p in ps if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0}]

    def run(m, opt, data, torch_ref=False):
        for x, y in data:
            (loss_fn(m(x), y) * (1 if torch_ref else 256.0)).backward()
            if torch_ref:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                opt.step()
            else:
                opt.clip_grad_norm_(0.5, grad_scale=256.0)
                opt.step(grad_scale=256.0)
            opt.zero_grad()

    mine, ref, resumed = (copy.deepcopy(model) for _ in range(3))
    off = OffloadedAdam(groups(mine), lr=2e-3, adamw=True)
    run(mine, off, batches)
    run(ref, torch.optim.AdamW(groups(ref), lr=2e-3), batches, torch_ref=True)
    torch.cuda.synchronize()
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-4)
    off.close()
    half = len(batches) // 2
    first = OffloadedAdam(groups(resumed), lr=2e-3, adamw=True)
    run(resumed, first, batches[:half])
    saved = first.state_dict()
    first.close()
    second = OffloadedAdam(groups(resumed), lr=2e-3, adamw=True)
    second.load_state_dict(saved)
    run(resumed, second, batches[half:])
    torch.cuda.synchronize()
    for p, q in zip(resumed.parameters(), mine.parameters()):     # (atomics in backward)
        torch.testing.assert_close(p, q, rtol=0, atol=5e-4)
    second.close()


# -------------------------------------------------------------------- demo
def test_demo_on_cuda_saves_memory_and_trains_the_same(cuda, tmp_path):
    from rtmem.demo import run_demo
    r = run_demo(layers=4, hidden=256, heads=4, seq=256, batch=8, vocab=512, steps=3,
                 device=DEV, out=str(tmp_path), say=lambda *a: None)
    assert r["plan_peak_bytes"] < r["plain_peak_bytes"]
    for a, b in zip(r["plain_losses"], r["plan_losses"]):
        assert math.isclose(a, b, rel_tol=1e-4)
    assert (tmp_path / "rotor_plan.png").exists()


def test_profile_command_on_cuda_measures_temporaries(cuda, tmp_path):
    # on a GPU the chain has the temporaries (o_f, o_b) the CPU cannot measure,
    # and a plan from it runs within its budget
    from rtmem.cli import main
    from rtmem.planners import Chain, plan_store_all
    path = tmp_path / "chain.json"
    assert main(["profile", "--layers", "2", "--hidden", "256", "--seq", "256", "--batch",
                 "8", "--device", DEV, "--repeats", "2", "--save", str(path)]) == 0
    chain = Chain.load(str(path))
    assert chain.n == 4 and (chain.o_f > 0).any() and (chain.o_b > 0).any()
    assert chain.o_loss > 0
    assert (chain.u_f > 0).all() and (chain.u_b > 0).all()
    peak = plan_store_all(chain, math.inf).peak
    assert main(["plan", "remat", str(path), "--memory", str(peak), "--json", "--quiet"]) == 0


def test_profiled_loss_temporaries_count_what_cross_entropy_keeps(cuda):
    # log_softmax saves its output (logits-sized) for backward and the backward
    # makes logits-sized intermediates: left at 0, a GPT-2 plan's peak was 6.2 GB
    # under the measured one on an H200 (bench/train.py). The store-all plan's
    # peak must now cover what the run allocates beyond the weights and batch.
    from rtmem.planners import plan_store_all
    from rtmem.torch import profile_sequential
    torch.manual_seed(0)
    vocab, hidden, tokens = 8192, 256, 4096
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, vocab)).to(DEV)
    x = torch.randn(tokens, hidden, device=DEV)
    y = torch.randint(0, vocab, (tokens,), device=DEV)
    loss_fn = torch.nn.functional.cross_entropy
    chain = profile_sequential(model, x, y, loss_fn, repeats=2)
    logits = tokens * vocab * 4
    assert chain.x[-1] == logits
    assert chain.o_loss >= logits
    plan = plan_store_all(chain, math.inf)
    ex = ScheduleExecutor(model, plan, loss_fn, track_memory=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()       # weights and the batch
    torch.cuda.reset_peak_memory_stats()
    ex.step(x, y)
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # the plan's peak counts the weights, their gradients and the input, of which
    # base holds the weights and the input; slack: cuBLAS's workspace (32 MiB on
    # Hopper), under the 2 x 128 MiB of logits that o_loss = 0 left out
    assert torch.cuda.max_memory_allocated() - base <= plan.peak - weights - x.nbytes \
        + (64 << 20)
