"""bench/train_gpu.py's orchestration, run on the CPU.

The GPU section of ``bench/train.py`` only runs on a GPU machine, where a slip in
its bookkeeping (the depth search, the budget, the throughput rows and ratios, the
ZeRO-Offload-shaped baseline) would cost scarce device time. Here it runs on the
CPU (``train_gpu.GPU_DEVICE = "cpu"``) with the handful of ``torch.cuda``
bookkeeping calls it makes stubbed (memory queries, synchronize, pinning), and
with "out of memory" injected above a fixed depth, so both searches double, fail
and bisect. What the executor and OffloadedAdam do on real CUDA streams is
tested by tests/test_torch_gpu.py on a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
FITS = 5          # the deepest model that "fits"; deeper ones raise OOM


@pytest.fixture
def train_gpu(monkeypatch):
    monkeypatch.setenv("RTMEM_BACKEND", "host")
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)
    import train_gpu as mod
    monkeypatch.setattr(mod, "GPU_DEVICE", "cpu")
    gib = 1 << 30
    cuda = torch.cuda
    for name, fn in {
            "is_available": lambda: True,
            "get_device_properties": lambda dev=None: argparse.Namespace(total_memory=20 * gib),
            "get_device_name": lambda dev=None: "stub (CPU)",
            "mem_get_info": lambda dev=None: (10 * gib, 20 * gib),
            "memory_reserved": lambda dev=None: 0,
            "memory_allocated": lambda dev=None: 0,
            "max_memory_allocated": lambda dev=None: 12345,
            "reset_peak_memory_stats": lambda dev=None: None,
            "empty_cache": lambda: None,
            "synchronize": lambda dev=None: None}.items():
        monkeypatch.setattr(cuda, name, fn)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    # torch.optim asks the (stubbed) CUDA device whether a graph capture is on;
    # a CUDA build of torch without a GPU then raises (the names vary by release)
    for name in ("_cuda_graph_capture_health_check", "_accelerator_graph_capture_health_check"):
        if hasattr(torch.optim.Optimizer, name):
            monkeypatch.setattr(torch.optim.Optimizer, name, lambda self: None)
    real = mod.gpt2_model

    def gpt2_model(layers, *args, **kwargs):
        if layers > FITS:
            raise torch.cuda.OutOfMemoryError(f"stub: {layers} layers do not fit")
        return real(layers, *args, **kwargs)
    monkeypatch.setattr(mod, "gpt2_model", gpt2_model)
    yield mod
    sys.modules.pop("train_gpu", None)


def _args(**override):
    """bench/train.py's GPU options for a tiny GPT-2 (depths 2..16 searched)."""
    opts = dict(gpu_hidden=32, gpu_heads=4, gpu_seq=16, gpu_vocab=64, gpu_batch=2,
                gpu_start_layers=2, gpu_max_layers=16, gpu_slots=50, gpu_reserve=0.06,
                gpu_repeats=1, gpu_time_s=300.0, gpu_deadline_s=600.0,
                gpu_matmul_precision="highest", seed=0)
    return argparse.Namespace(**{**opts, **override})


def test_gpu_section_searches_depths_and_compares_throughput(train_gpu, capsys):
    args = _args()
    saved = []
    out = train_gpu.gpu_section(args, save=lambda partial: saved.append(
        (sorted(partial), dict(partial["throughput"]) if "throughput" in partial else None)))
    assert out["measured"] and not out["time_limited"]
    # saved after each search (no throughput yet) and after the one throughput size
    assert len(saved) == 3 and saved[0][1] is None and saved[1][1] == {}
    assert "plain_torch" in saved[0][0] and "rtmem" not in saved[0][0]
    assert "rtmem" in saved[1][0] and list(saved[2][1]) == [str(FITS)]
    for name in ("plain_torch", "rtmem"):
        search = out[name]
        assert search["largest_layers"] == FITS and search["first_failing_layers"] == FITS + 1
        assert [layers for layers, _ in search["tried"]] == [2, 4, 8, 6, 5]
        assert search["at_largest"]["layers"] == FITS
    assert out["rtmem"]["at_largest"]["budget_bytes"] > 0
    row = out["throughput"][str(FITS)]
    for name in ("rtmem", "plain torch", "zero-offload-shaped"):
        assert row[name]["tokens_per_s"] > 0 and row[name]["layers"] == FITS
    assert row["rtmem_over_zero_tokens_per_s"] > 0
    assert row["rtmem_over_plain_tokens_per_s"] > 0
    assert out["params_per_block"] == 12 * 32 ** 2 + 13 * 32
    assert "8 layers -> OOM" in capsys.readouterr().out


def test_zero_offload_shaped_baseline_is_adam(train_gpu):
    # the baseline is a correct optimizer: the same steps as torch.optim.Adam on
    # the model itself (the same implementation, fused where torch has it: its
    # rounding differs from the single-tensor loop's)
    import copy
    torch.manual_seed(0)
    model, loss_fn, make = train_gpu.gpt2_model(2, 32, 4, 16, 64, dropout=0.0)
    ref = copy.deepcopy(model)
    z = train_gpu.ZeroOffloadShaped(model, loss_fn, lr=1e-3)
    opt, kind = train_gpu._host_adam(list(ref.parameters()), 1e-3)
    assert kind == z.adam == "fused"         # torch 2.13's CPU build has it
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = make(2, gen)
        loss = z.step(x, y)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    # the device copy is refreshed at the start of each step: compare the masters
    for m, q in zip(z.master, ref.parameters()):
        torch.testing.assert_close(m.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_gpu_section_stops_timing_at_the_deadline_and_counts_host_oom(train_gpu,
                                                                      monkeypatch):
    # a pinned-memory failure (rtmem's OutOfMemoryError is a MemoryError) ends a
    # depth like a CUDA OOM; past --gpu-deadline-s no timed run starts
    from rtmem.errors import OutOfMemoryError
    class PinnedLimited(train_gpu.OffloadedAdam):
        def __init__(self, params, **kw):
            params = list(params)
            if sum(p.numel() for p in params) > 50_000:     # 4 layers and more
                raise OutOfMemoryError("stub: pinned memory exhausted", requested=1)
            super().__init__(params, **kw)
    monkeypatch.setattr(train_gpu, "OffloadedAdam", PinnedLimited)
    args = _args(gpu_deadline_s=0.0)
    out = train_gpu.gpu_section(args)
    assert out["rtmem"]["largest_layers"] == 3           # host memory bound first
    for row in out["throughput"].values():
        assert all(v is None or v == "skipped: --gpu-deadline-s reached"
                   for k, v in row.items() if not k.startswith("rtmem_over"))


def test_rtmem_setup_closes_its_optimizer_when_setup_fails(train_gpu, monkeypatch):
    # OffloadedAdam pins tens of GB at the searched depths: a failure after it was
    # built (here the executor, but an OOM or a SIGINT alike) must not leave it
    # pinned until exit, since trial() only sees what setup returned
    made = []

    class Recorded(train_gpu.OffloadedAdam):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            made.append(self)

    def broken_executor(*args, **kwargs):
        raise KeyboardInterrupt("stub: stopped while building the executor")
    monkeypatch.setattr(train_gpu, "OffloadedAdam", Recorded)
    monkeypatch.setattr(train_gpu, "ScheduleExecutor", broken_executor)
    args = _args(gpu_max_layers=2)
    with pytest.raises(KeyboardInterrupt, match="stub: stopped"):
        train_gpu.gpu_section(args)
    assert len(made) == 1 and made[0]._bufs == [] and made[0]._hooks == []


def test_cuda_library_allocation_failures_count_as_out_of_memory(train_gpu, monkeypatch):
    # cuBLAS near the limit fails with a plain RuntimeError, which ended the depth
    # search instead of counting as "does not fit"; other RuntimeErrors still end it
    real = train_gpu.gpt2_model

    def gpt2_model(layers, *args, **kwargs):
        if layers > FITS:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                               "`cublasCreate(handle)`")
        return real(layers, *args, **kwargs)
    monkeypatch.setattr(train_gpu, "gpt2_model", gpt2_model)
    out = train_gpu.gpu_section(_args(gpu_deadline_s=0.0))
    assert out["plain_torch"]["largest_layers"] == out["rtmem"]["largest_layers"] == FITS

    def broken(layers, *args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(train_gpu, "gpt2_model", broken)
    with pytest.raises(RuntimeError, match="shapes"):
        train_gpu.gpu_section(_args(gpu_deadline_s=0.0))


def test_train_keeps_the_finished_search_when_interrupted(train_gpu, monkeypatch, tmp_path,
                                                          capsys):
    # a SIGINT (gpu_session.sh's time limit) in rtmem's depth search took plain
    # torch's finished search with it, and ended in a traceback
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    monkeypatch.delitem(sys.modules, "train", raising=False)
    import train
    monkeypatch.setitem(sys.modules, "train", train)   # dropped after the test
    assert train.gpu_section is train_gpu.gpu_section

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_gpu, "plan_remat", interrupt)     # only rtmem's search plans
    opts = {f"--{k.replace('_', '-')}": str(v)
            for k, v in vars(_args(gpu_max_layers=2)).items()}      # one depth each
    argv = ["--skip-cpu", "--out", "train_gpu"] + [x for kv in opts.items() for x in kv]
    assert train.main(argv) == 130
    doc = json.loads((tmp_path / "train_gpu.json").read_text())
    assert doc["partial"] is True and doc["interrupted"] == "the GPU section"
    assert doc["gpu"]["plain_torch"]["largest_layers"] == 2 and "rtmem" not in doc["gpu"]
    err = capsys.readouterr().err
    assert "interrupted during the GPU section" in err and "Traceback" not in err


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_train_keeps_the_cpu_section_when_the_gpu_section_stops(train_gpu, monkeypatch,
                                                                tmp_path, capsys, stop):
    # With both sections, a SIGINT or an error in the GPU section before its
    # first depth search finished took the finished CPU section with it
    # ("before any section finished; nothing written")
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    monkeypatch.delitem(sys.modules, "train", raising=False)
    import train
    monkeypatch.setitem(sys.modules, "train", train)   # dropped after the test

    # the CPU section as cpu_report returns it (its minutes of timing are not
    # what is tested here)
    monkeypatch.setattr(train, "cpu_report", lambda args: {"cpu": {"ratios": {"k": 1.0}}})

    def stopped(*args, **kwargs):
        raise stop("CUDA error: an illegal memory access")
    monkeypatch.setattr(train_gpu, "profile_sequential", stopped)   # the GPU block profile
    opts = {f"--{k.replace('_', '-')}": str(v) for k, v in vars(_args()).items()}
    argv = ["--out", "t"] + [x for kv in opts.items() for x in kv]
    assert train.main(argv) == (130 if stop is KeyboardInterrupt else 1)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["partial"] is True and doc["gpu"]["measured"] is False
    assert doc["cpu"] == {"ratios": {"k": 1.0}}
    err = capsys.readouterr().err
    if stop is KeyboardInterrupt:
        assert doc["interrupted"] == "the GPU section" and "error" not in doc
        assert "interrupted during the GPU section; what was measured" in err
    else:
        assert doc["error"] == ("the GPU section: RuntimeError: CUDA error: an illegal "
                                "memory access")
        assert "the GPU section failed" in err and "Traceback" in err


def test_a_flagged_block_stays_flagged_in_every_copy(train_gpu):
    # _chain_for_layers rebuilt the chain from seven named columns and dropped
    # no_recompute: a block that modifies its input in place was then planned
    # to be recomputed, and the executor refused the plan
    from rtmem.planners import Chain
    block = Chain(u_f=[1, 2, 2, 1], u_b=[2, 4, 4, 2], x=[8, 8, 8, 4], xbar=[8, 16, 16, 4],
                  w=[3, 5, 5, 3], x0=2, u_loss=0.5, no_recompute=[False, True, True, False])
    for layers in (1, 3, 7):
        chain = train_gpu._chain_for_layers(block, layers)
        assert chain.n == layers + 2
        assert chain.no_recompute.tolist() == [False] + [True] * layers + [False]
        assert chain.u_f.tolist() == [1] + [2] * layers + [1]
