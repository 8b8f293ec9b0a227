"""The figures of the benchmark scripts, from their pure helpers.

What the scripts report (medians, ratios against a named baseline, GB/s, peaks
of live bytes, crossovers, the JSON's ratios) is computed by small functions
that run without a GPU; here each gets inputs whose answer is worked out by
hand. Clocks are replaced by fakes where a figure is a time, so the expected
medians are exact.
"""

from __future__ import annotations

import gc
import json
import math
import types

import numpy as np
import pytest

from test_bench_keys import bench_module


def _clock(durations):
    """A ``time`` stand-in whose perf_counter makes consecutive start/stop pairs
    take ``durations`` (seconds), one pair per timed call."""
    ticks, now = [], 0.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1.0
    it = iter(ticks)
    return types.SimpleNamespace(perf_counter=lambda: next(it))


# ------------------------------------------------------------------ _common
def test_median_time_warms_up_then_takes_the_median(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    monkeypatch.setattr(common, "time", _clock([5.0, 1.0, 3.0]))
    calls = []
    assert common.median_time(lambda: calls.append(1), repeats=3, warmup=2) == 3.0
    assert len(calls) == 5                       # 2 untimed warm-up calls, 3 timed


def test_repeat_times_keeps_every_run_and_time_spread_summarises_them(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    durations = np.random.default_rng().uniform(0.1, 5.0, 6).tolist()
    monkeypatch.setattr(common, "time", _clock(durations[1:]))
    calls = []
    times = common.repeat_times(lambda: calls.append(1), repeats=5, warmup=1)
    assert times == pytest.approx(durations[1:]) and len(calls) == 6
    spread = common.time_spread(times)
    assert spread == {"median_s": sorted(times)[2], "min_s": min(times),
                      "max_s": max(times), "times_s": times}


@pytest.mark.parametrize("enabled", [True, False])
def test_timed_runs_without_the_collector_and_restores_its_state(monkeypatch, enabled):
    common = bench_module(monkeypatch, "_common")
    seen = []
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert common.timed(lambda: seen.append(gc.isenabled())) >= 0
        assert seen == [False] and gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_round_robin_takes_turns_with_before_ahead_of_every_call(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    log = []
    runs = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    times = common.round_robin(runs, 2, before=lambda: log.append("-"))
    assert log == ["-", "a", "-", "b"] * 3       # warm-up round, then 2 timed rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}


def test_gc_cost_is_per_call(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    clock = iter(range(1000))                    # every collection takes 1 "second"
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    out = common.gc_cost(gc.collect, 4)          # one full collection per call
    assert out["collections_per_call"][2] >= 1.0
    assert out["gc_s_per_call"] == pytest.approx(sum(out["collections_per_call"]))


def test_offload_everything_keeps_the_first_activations(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    from rtmem.planners import Op, Schedule
    F, Off, D, P, B, G = Op.F_ALL, Op.OFFLOAD, Op.DELETE, Op.PREFETCH, Op.B, Op.G_OFFLOAD
    ops = [(F, 0), (F, 1), (Off, 2, 1), (F, 2), (D, 2, 1), (Off, 3, 1), (F, 3), (D, 3, 1),
           (Op.LOSS, 0), (P, 3, 1), (B, 3), (G, 3), (P, 2, 1), (B, 2), (G, 2), (B, 1), (G, 1),
           (B, 0), (G, 0)]
    assert common.offload_everything(4, first=2) == Schedule.from_ops(ops)
    no_grads = [op for op in ops if op[0] != G]
    assert common.offload_everything(4, grads=False, first=2) == Schedule.from_ops(no_grads)


def test_write_results_lets_the_documents_machine_facts_win(monkeypatch, tmp_path):
    common = bench_module(monkeypatch, "_common")
    path = common.write_results("x", {"machine": {"cpus": -1, "gpu": "g"}},
                                path=tmp_path / "x.json")
    doc = json.loads(open(path).read())
    assert doc["machine"]["cpus"] == -1 and doc["machine"]["gpu"] == "g"
    assert "python" in doc["machine"]                      # the facts are still there


def test_partial_results_keep_what_was_saved_not_what_came_after(monkeypatch, tmp_path):
    common = bench_module(monkeypatch, "_common")
    partial = common.PartialResults("x", tmp_path / "x.json")
    doc = {"sizes": [1]}
    partial.save(doc)
    doc["sizes"].append(2)                   # the size the interrupt cut short
    assert partial.interrupted("size 2") == common.INTERRUPTED_EXIT
    saved = json.loads((tmp_path / "x.json").read_text())
    assert saved["sizes"] == [1] and saved["interrupted"] == "size 2"


def _git(cwd, *args):
    import subprocess
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_results_record_the_checkouts_commit_and_whether_it_was_changed(monkeypatch,
                                                                         tmp_path):
    # a results file named rtmem's version only: two runs between releases could
    # not be told apart, nor a run of uncommitted code from the commit's
    import shutil
    import subprocess
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    common = bench_module(monkeypatch, "_common")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))   # no enclosing repo
    for name in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(name, raising=False)
    ask = common.source_revision.__wrapped__                       # uncached
    repo = tmp_path / "checkout"
    (repo / "sub").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = _git(repo, "rev-parse", "HEAD")
    assert ask(str(repo)) == {"commit": head, "dirty": False}
    (repo / "new.txt").write_text("untracked files do not count\n")
    assert ask(str(repo)) == {"commit": head, "dirty": False}
    (repo / "a.txt").write_text("two\n")
    assert ask(str(repo)) == {"commit": head, "dirty": True}
    # not the top of a checkout: another repository's commit says nothing of it
    inner = ask(str(repo / "sub"))
    assert inner["commit"] is None and "inside the git checkout" in inner["reason"]
    plain = tmp_path / "plain"
    plain.mkdir()
    none = ask(str(plain))
    assert none["commit"] is None and "not a git checkout" in none["reason"]
    # git missing, or too slow: a reason, no error, no wait
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    gone = ask(str(repo))
    assert gone["commit"] is None and "git did not run" in gone["reason"]

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
    monkeypatch.setattr(common.subprocess, "run", slow)
    late = ask(str(repo))
    assert late["commit"] is None and f"over {common.GIT_TIMEOUT_S:g} s" in late["reason"]


def test_write_results_carry_this_checkouts_revision(monkeypatch, tmp_path):
    common = bench_module(monkeypatch, "_common")
    path = common.write_results("x", {}, path=tmp_path / "x.json")
    rev = json.loads(open(path).read())["machine"]["rtmem_git"]
    assert rev == common.source_revision(common.ROOT)
    root = common.ROOT
    if rev["commit"] is not None:       # tests run from a checkout: its HEAD
        assert rev["commit"] == _git(root, "rev-parse", "HEAD")
        assert rev["dirty"] == bool(_git(root, "status", "--porcelain",
                                         "--untracked-files=no"))
    else:                               # an sdist, no git: says why
        assert rev["reason"]


# --------------------------------------------------------------------- adam
def test_adam_ratios_are_speed_ratios_of_medians_and_of_best_rounds(monkeypatch):
    adam = bench_module(monkeypatch, "adam")
    rows = [{"size": 10, "impl": "rtmem fp32", "median_s": 2.0, "min_s": 1.0},
            {"size": 10, "impl": "roofline fp32", "median_s": 1.0, "min_s": 0.8},
            {"size": 20, "impl": "rtmem fp32", "median_s": 9.0, "min_s": 9.0}]
    assert adam._ratio(rows, 10, "rtmem fp32", "roofline fp32") == 0.5   # 2x slower
    assert adam._ratio(rows, 10, "rtmem fp32", "roofline fp32", stat="min_s") == 0.8
    assert adam._ratio(rows, 20, "rtmem fp32", "roofline fp32") is None
    ratios, best = adam._ratios(rows, [10])
    assert ratios["1e1"]["rtmem_fp32_over_roofline"] == 0.5
    assert ratios["1e1"]["rtmem_fp32_over_torch_fused"] is None
    assert best["1e1"]["rtmem_fp32_over_roofline"] == 0.8


def test_adam_goals_at_50m_say_met_and_whether_the_roofline_allows_them(monkeypatch):
    adam = bench_module(monkeypatch, "adam")
    n = adam.GOAL_SIZE
    rows = [{"size": n, "impl": "rtmem fp32", "median_s": 1.0, "min_s": 1.0},
            {"size": n, "impl": "torch fused", "median_s": 1.2, "min_s": 1.2},  # 1.2x
            {"size": n, "impl": "roofline fp32", "median_s": 0.95, "min_s": 0.95}]
    ratios, _ = adam._ratios(rows, [n])
    goals = adam._goals(ratios)
    fused = goals["rtmem_fp32_over_torch_fused"]
    assert fused["measured"] == pytest.approx(1.2) and fused["met"] is False
    # the roofline is 1.2 / 0.95 = 1.26x torch fused: 1.3x is out of reach
    assert fused["ceiling"] == pytest.approx(1.2 / 0.95) and fused["reachable"] is False
    roof = goals["rtmem_fp32_over_roofline"]
    assert roof["measured"] == pytest.approx(0.95) and roof["met"] is True
    assert roof["ceiling"] == 1.0 and roof["reachable"] is True
    # DeepSpeed did not run: nothing to decide
    assert goals["rtmem_fp32_over_deepspeed"] == dict(
        goal=1.1, measured=None, met=None, ceiling=None, reachable=None)
    assert adam._goals(adam._ratios(rows, [10])[0]) is None    # 50M not measured


def test_adam_rows_report_medians_params_per_s_and_gb_per_s(monkeypatch):
    adam = bench_module(monkeypatch, "adam")
    monkeypatch.setattr(adam, "_rtmem_contenders",
                        lambda n, rng: {"x": (lambda: None, adam.BYTES_FP32)})
    monkeypatch.setattr(adam, "_torch_contenders", lambda n, seed: ({}, {}))
    monkeypatch.setattr(adam, "_deepspeed_contenders", lambda n, seed: ({}, {}))
    # the second warm-up call (1 s), then 3 rounds of 5, 1 and 3 s
    monkeypatch.setattr(adam, "time", _clock([1.0, 5.0, 1.0, 3.0]))
    (row,), _ = adam.bench_size(3000, 3, seed=0, budget_s=0.0)
    assert (row["median_s"], row["min_s"], row["rounds"]) == (3.0, 1.0, 3)
    assert row["params_per_s"] == 1000.0
    assert row["gb_per_s"] == pytest.approx(28 * 3000 / 3.0 / 1e9)


def test_adam_sizes_are_distinct(monkeypatch):
    adam = bench_module(monkeypatch, "adam")
    assert adam._sizes("1e6,1000000,2e6") == [1_000_000, 2_000_000]


def test_last_level_cache_reads_sysfs_units(monkeypatch, tmp_path):
    adam = bench_module(monkeypatch, "adam")
    for index, text in (("index0", "48K"), ("index2", "2048K"), ("index3", "junk")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(text + "\n")
    monkeypatch.setattr(adam, "Path", lambda _: tmp_path)
    assert adam.last_level_cache_bytes() == 2048 * 1024
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("3M")
    assert adam.last_level_cache_bytes() == 3 << 20
    monkeypatch.setattr(adam, "Path", lambda _: tmp_path / "none")
    assert adam.last_level_cache_bytes(default=7) == 7


# ---------------------------------------------------------------- allocator
def test_naive_best_fit_takes_exact_fits_and_coalesces_both_sides(monkeypatch):
    al = bench_module(monkeypatch, "allocator")
    naive = al.NaiveBestFit(4096)
    a, b, c = naive.allocate(256), naive.allocate(300), naive.allocate(1)
    assert [(x.offset, x.size) for x in (a, b, c)] == [(0, 256), (256, 512), (768, 256)]
    naive.deallocate(a)
    assert naive.holes == [[0, 256], [1024, 3072]]
    a = naive.allocate(200)                  # the exact 256-byte hole, not the big one
    assert a.offset == 0 and naive.holes == [[1024, 3072]]
    naive.deallocate(a)
    naive.deallocate(c)                      # joins the hole after it
    assert naive.holes == [[0, 256], [768, 3328]]
    naive.deallocate(b)                      # joins the holes on both sides
    assert naive.holes == [[0, 4096]]


def test_peak_live_counts_aligned_sizes(monkeypatch):
    al = bench_module(monkeypatch, "allocator")
    trace = [("alloc", 1, 100, None), ("alloc", 2, 300, None), ("free", 1, 0, None),
             ("alloc", 3, 0, None), ("free", 2, 0, None), ("free", 3, 0, None)]
    assert al.peak_live_aligned(trace) == 256 + 512          # 100 -> 256, 300 -> 512
    assert al.max_holes(trace, 4096) == 2                    # [0, 256) and the tail


def test_sampled_fragmentation_and_extent(monkeypatch):
    al = bench_module(monkeypatch, "allocator")
    trace = [("alloc", 0, 1000, None), ("alloc", 1, 1000, None), ("free", 0, 0, None)]
    mean, most, extent = al.sampled_fragmentation(trace, 4096, every=1)
    assert extent == 2048                                   # two 1024-byte blocks
    # free [0, 1024) and [2048, 4096): 1 - 2048 / 3072 after the free, 0 before
    assert most == pytest.approx(1 / 3) and mean == pytest.approx(1 / 9)


def test_replay_rates_are_pairs_per_second_and_ratios_per_repeat(monkeypatch):
    al = bench_module(monkeypatch, "allocator")
    monkeypatch.setattr(al, "replay", lambda trace, a: types.SimpleNamespace(
        pairs=10, seconds=a, ooms=1))
    # each repeat: 2 loops of 10 pairs in 2 s each = 5 pairs/s
    assert al.time_replays(lambda: 2.0, [], 3, 2) == (5.0, 6)
    rate_a, rate_b, speedup = al.time_pair(lambda: 1.0, lambda: 4.0, [], 3, 1)
    assert (rate_a, rate_b, speedup) == ([10.0] * 3, [2.5] * 3, [4.0] * 3)


def test_pinned_check_computes_the_power_of_two_pool(monkeypatch):
    al = bench_module(monkeypatch, "allocator")
    for request, pool in ((4096, 4096), (4097, 8192), (5000, 8192)):
        out = al.pinned_check(request)
        assert "error" not in out, out
        assert out["power_of_two_pool_bytes"] == pool
        assert out["overhead_bytes"] == out["reserved_bytes"] - request >= 0


# --------------------------------------------------------------------- pcie
def test_pcie_elapsed_time_is_seconds_and_at_least_the_resolution(monkeypatch):
    pcie = bench_module(monkeypatch, "pcie")

    def cp(ms):
        return types.SimpleNamespace(cuda=types.SimpleNamespace(
            get_elapsed_time=lambda start, end: ms))
    assert pcie.elapsed_s(cp(2.0), None, None) == pytest.approx(2e-3)
    assert pcie.elapsed_s(cp(0.0), None, None) == pcie.EVENT_RESOLUTION_S


def test_pcie_timer_doubles_its_delay_up_to_the_longest(monkeypatch):
    pcie = bench_module(monkeypatch, "pcie")
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=object))
    timer = pcie.Timer(cp, 1, delay=(lambda seconds, *, stream: None, "test"))
    passed = types.SimpleNamespace(done=True)
    # 1 ms doubles 8 times to 256 ms, capped at 250 ms; each of those runs is repeated
    assert [timer.covered(passed) for _ in range(9)] == [False] * 8 + [True]
    assert timer.delay_s == 0.25 and timer.uncovered == 1
    assert timer.covered(types.SimpleNamespace(done=False)) and timer.uncovered == 1
    assert timer.summary() == {"final_delay_s": 0.25, "uncovered_runs": 1,
                               "delay_kernel": "test"}


def test_pcie_goals_take_the_best_of_every_copy_path(monkeypatch):
    pcie = bench_module(monkeypatch, "pcie")
    n = 64 << 20
    rates = {"h2d_pageable": 60, "d2h_pageable": 5, "h2d_pinned": 48, "d2h_pinned": 45}
    doc = {"sizes_bytes": [n], "curves": {p: [{"bytes": n, "bytes_per_s": r * 1e9}]
                                          for p, r in rates.items()}}
    g = pcie.goals(doc)
    assert g["best_copy_bytes_per_s"] == 60e9 and "dha_read_over_h2d_pinned" not in g
    assert g["h2d_pinned_over_best_copy"] == pytest.approx(48 / 60)


# --------------------------------------------------------------- dha_layers
def test_dha_crossover_refuses_zero_repeated_and_infinite_inputs(monkeypatch):
    dl = bench_module(monkeypatch, "dha_layers")
    with pytest.raises(ValueError, match="positive and ascending"):
        dl.crossover([0, 2], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive and ascending"):
        dl.crossover([4, 4], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        dl.crossover([1, 2], [1.0, math.inf], [1.0, 1.0])


def test_dha_by_kind_range_is_lowest_to_highest_crossing(monkeypatch):
    dl = bench_module(monkeypatch, "dha_layers")
    tokens = [10, 100, 1000]

    def layer(name, dha):
        c = dl.crossover(tokens, dha, [1.0, 1.0, 1.0])
        return {"name": name, "kind": "linear", "forward": c, "backward": c}
    # the first layer crosses at 10**2.5 (between 100 and 1000), the second at 10**1.5
    k = dl.by_kind([layer("late", [0.1, 0.5, 2.0]), layer("early", [0.5, 2.0, 4.0])])
    lo, hi = k["linear"]["forward"]["crossing_tokens"]
    assert lo == pytest.approx(10 ** 1.5) and hi == pytest.approx(10 ** 2.5)


def test_dha_sweep_backward_copy_pays_the_transfer(monkeypatch):
    dl = bench_module(monkeypatch, "dha_layers")
    monkeypatch.setattr(dl, "placements", lambda spec, rng: "placed")

    def point(spec, tokens, repeats, rng, placed):
        assert placed == "placed"                # made once per layer, not per point
        return {"tokens": tokens, "transfer_s": 2.0,
                "forward_s": {"gpu": 1.0, "copy": 3.0, "dha": 1.5 * tokens},
                "backward_s": {"gpu": 1.0, "dha": 2.0}}
    monkeypatch.setattr(dl, "sweep_point", point)
    spec = {"name": "l", "kind": "linear", "dims": {"in": 1, "out": 1}}
    s = dl.sweep_layer(spec, [1, 4], 1, None)
    assert s["backward"]["dha_over_copy"] == [2 / 3, 2 / 3]   # 2 s vs 2 s + 1 s
    assert s["forward"]["dha_over_copy"] == [0.5, 2.0]        # 1.5 T s vs 3 s
    assert s["forward"]["crossings"][0]["tokens"] == pytest.approx(2.0)


# -------------------------------------------------------------------- train
def _train(monkeypatch):
    pytest.importorskip("torch")
    return bench_module(monkeypatch, "train")


def test_train_budget_points_go_from_the_least_feasible_memory(monkeypatch):
    train = _train(monkeypatch)
    monkeypatch.setattr(train, "min_feasible_memory", lambda chain: 200)
    assert train.budget_points(None, 1201) == [("50%", 600), ("r80", 1000)]


def test_train_predicted_activation_peaks_leave_the_weights_out(monkeypatch):
    train = _train(monkeypatch)
    from rtmem.planners import Chain, store_all_schedule
    sizes = dict(u_f=[1.0, 1.0], u_b=[1.0, 1.0], x=[100, 100], xbar=[300, 300], x0=50)
    light, heavy = Chain(**sizes), Chain(**sizes, w=[1000, 7000])
    sched = store_all_schedule(2)
    between, during = train.predicted_activation_peaks(light, sched)
    assert train.predicted_activation_peaks(heavy, sched) == (between, during)
    assert 0 < between <= during < 1000


def _contender(median, cpu, sim, kind="executor", **more):
    return dict(median_s=median, median_cpu_s=cpu, sim_makespan_s=sim, kind=kind, **more)


def test_train_ratios_are_of_the_named_contender_over_its_baseline(monkeypatch):
    train = _train(monkeypatch)
    peaks = dict(exec_peak_bytes=60, pred_act_between_bytes=50, pred_act_during_bytes=75)
    c = {"torch plain": _contender(1.0, 1.0, 1.0, "torch", alloc_peak_bytes=1000),
         "exec store-all": _contender(1.25, 1.1, 1.0, alloc_peak_bytes=1000, **peaks),
         "torch ckseq 2": _contender(1.5, 1.5, 1.4, "torch", alloc_peak_bytes=800),
         "exec seq 2": _contender(1.8, 1.6, 1.4, alloc_peak_bytes=600, **peaks),
         "rotor @seq 2": _contender(1.35, 1.2, 1.05, budget_bytes=300,
                                    exact_dp_makespan_s=0.7, alloc_peak_bytes=540,
                                    exec_peak_bytes=45, pred_act_between_bytes=50,
                                    pred_act_during_bytes=75),
         # at 50% the best sequential count is 3, which torch's rows did not run
         "exec seq best @50%": _contender(2.0, 2.0, 1.6, segments=3, alloc_peak_bytes=500,
                                          **peaks),
         "rotor @50%": _contender(1.5, 1.0, 1.2, budget_bytes=250, exact_dp_makespan_s=None,
                                  alloc_peak_bytes=400, **peaks)}
    res = {"contenders": c, "ks": [2], "chain": types.SimpleNamespace(compute_time=0.8)}
    r = train.ratios(res)
    assert r["executor_over_native"] == {"store-all / torch plain": 1.25,
                                         "seq 2 / torch ckseq 2": pytest.approx(1.2)}
    k2 = r["rotor_over_sequential_equal_memory"]["k=2"]
    assert k2 == pytest.approx({
        "budget_bytes": 300, "measured_rotor_over_exec_seq": 0.75,
        "measured_rotor_over_torch_ckseq": 0.9, "cpu_time_rotor_over_exec_seq": 0.75,
        "predicted_rotor_over_seq": 0.75, "predicted_exact_dp_rotor_over_seq": 0.5,
        "alloc_peak_rotor_over_torch_ckseq": 0.675, "alloc_peak_rotor_over_exec_seq": 0.9,
        "exec_peak_rotor_over_exec_seq": 0.75})
    half = r["rotor_over_sequential_equal_memory"]["50% (seq best k=3)"]
    assert half["segments"] == 3 and half["measured_rotor_over_exec_seq"] == 0.75
    assert half["measured_rotor_over_torch_ckseq"] is None
    assert half["alloc_peak_rotor_over_torch_ckseq"] is None
    assert half["predicted_exact_dp_rotor_over_seq"] is None
    assert set(r["predicted_vs_measured_time"]) == {"exec store-all", "exec seq 2",
                                                    "rotor @seq 2", "exec seq best @50%",
                                                    "rotor @50%"}
    assert r["predicted_vs_measured_time"]["exec seq 2"] == pytest.approx({
        "predicted_over_store_all": 1.4, "measured_over_exec_store_all": 1.44,
        "cpu_time_over_exec_store_all": 1.6 / 1.1})
    assert r["peaks"]["exec seq 2"] == pytest.approx({
        "exec_peak_bytes": 60, "pred_between_bytes": 50, "pred_during_bytes": 75,
        "measured_over_pred_between": 1.2, "measured_over_pred_during": 0.8})
    assert r["compute_time_check"]["measured_over_profiled"] == pytest.approx(1.25)


def test_train_json_has_plain_types(monkeypatch):
    train = _train(monkeypatch)
    out = train._jsonable({"a": (np.int64(1), np.float32(0.5)), 2: np.arange(2)})
    assert out == {"a": [1, 0.5], "2": [0, 1]}
    assert type(out["a"][0]) is int and json.loads(json.dumps(out)) == out


def test_a_run_replacing_another_runs_result_says_so_once(monkeypatch, tmp_path, capsys):
    # two runs wrote bench/results/NAME.json in turn, the second silently replacing
    # the first's figures (in a checkout: the committed ones)
    common = bench_module(monkeypatch, "_common")
    monkeypatch.setattr(common, "_OWN_FILES", set())
    path = tmp_path / "x.json"
    common.write_results("x", {"command": "python bench/x.py --one"}, path=path)
    assert capsys.readouterr().err == ""               # nothing there before
    monkeypatch.setattr(common, "_OWN_FILES", set())   # a second run
    common.PartialResults("x", path).save({"command": "python bench/x.py --two"})
    err = capsys.readouterr().err
    assert err.startswith(f"x: replacing {path}, the result of python bench/x.py --one at ")
    assert "set RTMEM_BENCH_RESULTS" in err
    common.write_results("x", {"command": "python bench/x.py --two"}, path=path)
    assert capsys.readouterr().err == ""               # its own partial document
    assert json.loads(path.read_text())["command"] == "python bench/x.py --two"


def test_adam_gpt2_shapes_are_gpt2_smalls_at_hidden_768(monkeypatch):
    adam = bench_module(monkeypatch, "adam")
    shapes = adam.gpt2_shapes(768)
    sizes = [math.prod(s) for s in shapes]
    # GPT-2 small: 148 tensors, 124,439,808 parameters, 98 biases / norms <= 3072
    assert (len(shapes), sum(sizes), sum(n <= 3072 for n in sizes)) == (148, 124_439_808, 98)
    assert len(adam.gpt2_shapes(64)) == 148


def test_adam_gpt2_row_steps_every_contender_and_reports_ratios(monkeypatch):
    pytest.importorskip("torch")
    adam = bench_module(monkeypatch, "adam")
    section, notes = adam.bench_gpt2(8, 1, seed=0, budget_s=0.0)
    impls = [r["impl"] for r in section["results"]]
    assert impls[0] == "rtmem NumpyAdam" and "rtmem CPUAdam (A/A)" in impls
    assert section["tensors"] == 148 and section["params"] == sum(
        math.prod(s) for s in adam.gpt2_shapes(8))
    for r in section["results"]:
        assert r["params_per_s"] == section["params"] / r["median_s"]
    expected = {"rtmem_cpuadam_over_torch_fused", "rtmem_numpyadam_over_torch_fused",
                "rtmem_cpuadam_over_torch_foreach", "a_over_a_rtmem_cpuadam"}
    assert set(section["ratios"]) == expected
    if "torch fused" in impls and "torch foreach" in impls:
        assert all(v > 0 for v in section["ratios"].values()), notes
