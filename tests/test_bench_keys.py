"""Labels of bench results: each size keeps its own ratios."""

import importlib
import json
import pathlib
import shlex
import statistics

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def bench_module(monkeypatch, name: str):
    """bench/NAME.py, imported as the scripts import each other: bench/ is on
    sys.path for the calling test only."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module(name)


def test_adam_ratio_keys_are_unique_per_size(monkeypatch):
    # 1e5 and 1.2e5 were both "1e5" (one size's ratios replaced the other's, and
    # the best-of-rounds ratios shifted onto the wrong sizes)
    adam = bench_module(monkeypatch, "adam")
    sizes = [100_000, 120_000, 1_000_000, 25_000_000, 50_000_000]
    keys = [adam._size_key(n) for n in sizes]
    assert keys == ["1e5", "120000", "1e6", "25000000", "5e7"]


def test_dha_crossover_interpolates_where_the_ratio_is_one(monkeypatch):
    import pytest
    dl = bench_module(monkeypatch, "dha_layers")
    tokens = [64, 256, 1024, 4096, 16384, 65536]
    # power laws: the log-log interpolation is exact; dha/copy = 0.01 sqrt(T) = 1 at 1e4
    dha = [1e-6 * t for t in tokens]
    copy = [1e-4 * t ** 0.5 for t in tokens]
    c = dl.crossover(tokens, dha, copy)
    assert c["verdict"] == "dha below" and c["dha_wins_at_tokens"] == [64, 256, 1024, 4096]
    assert len(c["crossings"]) == 1 and c["crossings"][0]["to"] == "copy"
    assert c["crossings"][0]["tokens"] == pytest.approx(1e4)
    assert c["dha_over_copy"][0] == pytest.approx(0.08)
    assert "below ~10000 tokens" in c["text"]
    up = dl.crossover(tokens, copy, dha)                 # the other way round
    assert up["verdict"] == "dha above" and up["crossings"][0]["to"] == "dha"
    assert up["crossings"][0]["tokens"] == pytest.approx(1e4)
    assert dl.crossover(tokens, dha, [1.0] * 6)["verdict"] == "dha"
    assert dl.crossover(tokens, [1.0] * 6, dha)["verdict"] == "copy"
    ties = dl.crossover([1, 2], [1.0, 1.0], [1.0, 1.0])  # a tie goes to the copy
    assert ties["verdict"] == "copy" and ties["crossings"] == []
    mixed = dl.crossover([1, 2, 4], [0.5, 2.0, 0.5], [1.0, 1.0, 1.0])
    assert mixed["verdict"] == "mixed" and [x["to"] for x in mixed["crossings"]] == \
        ["copy", "dha"] and mixed["text"] == "DHA wins at 1, 4 tokens"


def test_dha_crossover_refuses_what_it_cannot_read(monkeypatch):
    import pytest
    dl = bench_module(monkeypatch, "dha_layers")
    with pytest.raises(ValueError, match="one dha and one copy time"):
        dl.crossover([1, 2], [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="ascending"):
        dl.crossover([2, 1], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        dl.crossover([1, 2], [1.0, 0.0], [1.0, 1.0])
    assert dl.parse_tokens("64, 256,1024") == [64, 256, 1024]
    assert dl.parse_tokens("None") == []
    for bad, why in [("64,x", "comma-separated"), ("256,64", "ascending"),
                     ("0,4", ">= 1"), ("64", "at least two")]:
        with pytest.raises(ValueError, match=why):
            dl.parse_tokens(bad)


def test_dha_crossover_by_kind_agrees_or_says_mixed(monkeypatch):
    dl = bench_module(monkeypatch, "dha_layers")
    tokens = [10, 100, 1000]

    def layer(name, kind, dha):
        c = dl.crossover(tokens, dha, [1.0, 1.0, 1.0])
        return {"name": name, "kind": kind, "forward": c, "backward": c}
    layers = [layer("wte", "embedding", [0.1, 0.5, 0.9]),
              layer("a", "linear", [0.5, 2.0, 4.0]), layer("b", "linear", [0.9, 1.1, 3.0]),
              layer("ln", "layernorm", [0.5, 2.0, 0.5])]
    k = dl.by_kind(layers)
    assert list(k) == ["embedding", "linear", "layernorm"]
    assert k["embedding"]["forward"] == {"verdict": "dha", "crossing_tokens": None,
                                         "layers": {"wte": layers[0]["forward"]["text"]}}
    lo, hi = k["linear"]["backward"]["crossing_tokens"]
    assert k["linear"]["backward"]["verdict"] == "dha below" and 10 < lo < hi < 100
    assert k["layernorm"]["forward"]["verdict"] == "mixed"


@pytest.mark.parametrize("name, argv, fragment", [
    # each was a traceback (a median of nothing, int(float('garbage'))) after the
    # work before it, or ran and wrote a result for a model of no layers
    ("simulate", ["--ops", "12", "--repeats", "0"], "--repeats: must be at least 1"),
    ("simulate", ["--ops", "-5"], "--ops: must be at least 1"),
    ("adam", ["--sizes", "garbage"], "parameter counts >= 1"),
    ("adam", ["--sizes", "1e6,0"], "parameter counts >= 1"),
    ("adam", ["--budget", "nan"], "--budget: must be a finite number"),
    ("remat", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("remat", ["--fraction", "2"], "at most 1.0"),
    ("allocator", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("train", ["--layers", "0", "--skip-gpu"], "--layers: must be at least 1"),
    ("train", ["--repeats", "0", "--skip-gpu"], "--repeats: must be at least 1"),
    ("train", ["--out", "", "--skip-cpu", "--skip-gpu"],
     "give a file path such as out/train.json, or a result name"),
    ("train", ["--out", str(BENCH), "--skip-cpu", "--skip-gpu"], "is a folder"),
    ("pcie", ["--max-size", "lots"], "--max-size: cannot read 'lots'"),
    ("pcie", ["--plot", "x.txt"], "must end in .png"),
    # --out a folder: open() raised IsADirectoryError after the whole run
    ("adam", ["--sizes", "1000", "--repeats", "1", "--budget", "0", "--warm-cache",
              "--out", str(BENCH)], "is a folder"),
    ("remat", ["--out", str(BENCH)], "is a folder"),
    ("allocator", ["--out", str(BENCH)], "is a folder"),
    ("simulate", ["--out", str(BENCH)], "is a folder"),
    ("executor", ["--out", str(BENCH)], "is a folder"),
    # negative values reach the scripts' own checks (the parser is rtmem.cli's):
    # argparse took -inf and -1e3 for options ("expected one argument")
    ("pcie", ["--max-size", "-inf"],
     "--max-size: a size must be finite and >= 0 bytes, got '-inf'"),
    ("pcie", ["--max-size", "-1MiB"], "--max-size: a size must be finite and >= 0"),
    ("adam", ["--budget", "-inf"], "--budget: must be a finite number, at least 0.0"),
    ("remat", ["--python-budget", "-1e9"], "--python-budget: must be a finite number"),
    ("remat", ["--fraction", "-Infinity"], "--fraction: must be a finite number"),
    ("simulate", ["--ops", "-1e3"], "--ops: '-1e3' is not an integer"),
    ("train", ["--gpu-time-s", "-inf", "--skip-gpu"], "--gpu-time-s: must be a finite"),
])
def test_bench_scripts_refuse_bad_arguments_before_any_work(monkeypatch, capsys, tmp_path,
                                                            name, argv, fragment):
    if name in ("train", "executor"):
        pytest.importorskip("torch")        # they import it (an extra)
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))   # should one run, not here
    module = bench_module(monkeypatch, name)
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err


def test_allocator_quick_keeps_an_explicit_repeats(monkeypatch, tmp_path):
    # --quick replaced --repeats 9 by 3, silently
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    allocator = bench_module(monkeypatch, "allocator")
    seen = []

    class Stop(Exception):
        pass

    def time_pair(make_a, make_b, trace, repeats, loops):
        seen.append(repeats)
        raise Stop                     # before any timing
    monkeypatch.setattr(allocator, "time_pair", time_pair)
    for argv, repeats in ((["--quick", "--repeats", "9"], 9), (["--quick"], 3)):
        with pytest.raises(Stop):
            allocator.main(argv)
        assert seen.pop() == repeats


def test_allocator_json_keeps_every_repeat_beside_the_medians(monkeypatch, tmp_path, capsys):
    # allocator.json kept only medians: two runs could not be compared with their
    # spread (time_pair threw the per-repeat rates and ratios away)
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    allocator = bench_module(monkeypatch, "allocator")
    assert allocator.main(["--quick", "--repeats", "3"]) == 0
    doc = json.loads((tmp_path / "allocator.json").read_text())
    for section, pairs in (("random", [("rtmem_pairs_per_s", "naive_pairs_per_s",
                                        "speedup_vs_naive"),
                                       ("host_arena_pairs_per_s", "core_pairs_per_s_same_run",
                                        "host_arena_over_core")]),
                           ("gpt2", [("rtmem_pairs_per_s", "naive_pairs_per_s",
                                      "speedup_vs_naive")])):
        d = doc[section]
        for a, b, ratio in pairs:
            rates_a, rates_b = d[f"{a}_all"], d[f"{b}_all"]
            assert len(rates_a) == len(rates_b) == 3 and min(rates_a + rates_b) > 0
            assert d[f"{ratio}_all"] == [x / y for x, y in zip(rates_a, rates_b)]
            for key in (a, b, ratio):       # the medians stay under their keys
                assert d[key] == statistics.median(d[f"{key}_all"])
    # the table gives the speedups' spread
    out = capsys.readouterr().out
    runs = doc["random"]["speedup_vs_naive_all"]
    assert f"{min(runs):.2f}-{max(runs):.2f}x over 3 repeats" in out


def test_pcie_plot_makes_its_folder(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    pcie = bench_module(monkeypatch, "pcie")
    doc = {"device": "test", "curves": {"h2d_pinned": [
        {"bytes": 4096, "bytes_per_s": 1e9}, {"bytes": 8192, "bytes_per_s": 2e9}]}}
    path = tmp_path / "new" / "pcie.png"
    assert pcie.plot(doc, str(path)) == str(path) and path.stat().st_size > 0


def test_results_are_replaced_whole_when_a_write_is_interrupted(monkeypatch, tmp_path):
    # A partial document is rewritten after each section; a SIGINT landing during
    # a write left the file cut short, the document before it lost as well
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    common = bench_module(monkeypatch, "_common")
    path = common.write_results("x", {"done": [1]})

    class Interrupting(dict):            # a value whose encoding the SIGINT cuts
        def items(self):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        common.write_results("x", {"done": [1, 2], "more": Interrupting(a=1)})
    assert json.loads(pathlib.Path(path).read_text())["done"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt            # what gpu_session.sh's timeout (SIGINT) raises


def test_allocator_keeps_its_finished_sections_when_interrupted(monkeypatch, tmp_path,
                                                                capsys):
    # allocator.py wrote its JSON only at the end: a step stopped by its time
    # limit kept none of the sections it had measured
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    allocator = bench_module(monkeypatch, "allocator")
    monkeypatch.setattr(allocator, "pinned_check", _interrupt)     # the last section
    assert allocator.main(["--quick", "--repeats", "1"]) == 130
    doc = json.loads((tmp_path / "allocator.json").read_text())
    assert doc["partial"] is True and doc["interrupted"] == "the pinned section"
    assert doc["random"]["rtmem_pairs_per_s"] > 0 and doc["random"]["host_arena_over_core"] > 0
    assert doc["gpt2"]["static_layout_reserved_bytes"] > 0 and "gpu" in doc
    assert "pinned" not in doc
    err = capsys.readouterr().err
    assert "interrupted during the pinned section" in err and "Traceback" not in err


def test_adam_keeps_its_finished_sizes_when_interrupted(monkeypatch, tmp_path, capsys):
    # adam.py wrote its JSON only at the end: a time limit during the last size
    # took every size before it too
    adam = bench_module(monkeypatch, "adam")
    monkeypatch.setattr(adam, "_deepspeed_contenders",       # its import alone takes seconds
                        lambda n, seed: ({}, {"DeepSpeed CPUAdam": "not timed in tests"}))
    measure, sizes = adam.bench_size, []

    def second_size_interrupted(n, *args, **kwargs):
        sizes.append(n)
        return measure(n, *args, **kwargs) if len(sizes) == 1 else _interrupt()
    monkeypatch.setattr(adam, "bench_size", second_size_interrupted)
    out = tmp_path / "adam.json"
    argv = ["--sizes", "1000,2000", "--repeats", "1", "--budget", "0", "--warm-cache",
            "--out", str(out)]
    assert adam.main(argv) == 130
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["interrupted"] == "size 2,000"
    assert doc["sizes"] == [1000] and {r["size"] for r in doc["results"]} == {1000}
    assert doc["results"][0]["median_s"] > 0 and doc["ratios"]["1e3"]["rtmem_fp32_over_roofline"]
    err = capsys.readouterr().err
    assert "interrupted during size 2,000" in err and "Traceback" not in err
    # run to the end, the document is the complete one, without the marker
    monkeypatch.setattr(adam, "bench_size", measure)
    assert adam.main(argv) == 0
    doc = json.loads(out.read_text())
    assert "partial" not in doc and "interrupted" not in doc and doc["sizes"] == [1000, 2000]


def test_adam_table_shows_the_spread_of_each_medians_rounds(monkeypatch, tmp_path, capsys):
    # the JSON kept every round (times_s) but the printed table showed medians
    # only: a noisy run looked as trustworthy as a quiet one
    adam = bench_module(monkeypatch, "adam")
    monkeypatch.setattr(adam, "_deepspeed_contenders",       # its import alone takes seconds
                        lambda n, seed: ({}, {"DeepSpeed CPUAdam": "not timed in tests"}))
    out = tmp_path / "adam.json"
    assert adam.main(["--sizes", "1000", "--repeats", "3", "--budget", "0", "--warm-cache",
                      "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "implementation" in line)
    assert header.split()[-1] == "max/min"
    for r in doc["results"]:
        row = next(line for line in lines if f" {r['impl']} " in line and "1,000" in line)
        assert len(r["times_s"]) == 3
        assert row.split()[-1] == f"{max(r['times_s']) / min(r['times_s']):.2f}"


def test_a_benchmark_interrupted_before_any_section_keeps_an_earlier_result(
        monkeypatch, tmp_path, capsys):
    # nothing measured: an earlier (complete) result is not replaced by an empty one
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    common = bench_module(monkeypatch, "_common")
    common.write_results("x", {"done": True})
    assert common.PartialResults("x").interrupted("the first section") == 130
    assert "partial" not in json.loads((tmp_path / "x.json").read_text())
    assert "before any section finished; nothing written" in capsys.readouterr().err


def test_a_bench_script_given_json_it_does_not_take_prints_no_json(monkeypatch, capsys):
    # the shared parser prints a usage error as JSON only for a command that has
    # --json: a script without it names --json as unrecognized, in words only
    simulate = bench_module(monkeypatch, "simulate")
    with pytest.raises(SystemExit) as e:
        simulate.main(["--json"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "unrecognized arguments: --json" in err


HUGE = str(10**20)


@pytest.mark.parametrize("name, argv, fragment", [
    # plain argparse ints: 0 and negatives met a generic after-parse check
    # ("--tokens and --repeats must be at least 1"), huge values none at all
    # (10**20 repeats ran until killed; 10**20 threads: "Overflow when unpacking
    # long long" from torch after the imports)
    ("dha_layers", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("dha_layers", ["--repeats", "-3"], "--repeats: must be at least 1"),
    ("dha_layers", ["--tokens", "0"], "--tokens: must be at least 1"),
    ("dha_layers", ["--tokens", HUGE], "--tokens: must be at least 1 and at most"),
    ("dha_layers", ["--repeats", "2.5"], "--repeats: '2.5' is not an integer"),
    ("executor", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("executor", ["--threads", HUGE], "--threads: must be at least 1 and at most"),
    # huge repeats and counts were accepted by at_least(1), which had no ceiling
    ("simulate", ["--repeats", HUGE], "--repeats: must be at least 1 and at most"),
    ("simulate", ["--ops", HUGE], "--ops: must be at least 1 and at most"),
    ("remat", ["--repeats", HUGE], "--repeats: must be at least 1 and at most"),
    ("allocator", ["--repeats", HUGE], "--repeats: must be at least 1 and at most"),
    ("pcie", ["--repeats", HUGE], "--repeats: must be at least 1 and at most"),
    ("adam", ["--repeats", HUGE], "--repeats: must be at least 1 and at most"),
    ("train", ["--repeats", HUGE, "--skip-gpu"], "--repeats: must be at least 1 and at most"),
    ("train", ["--threads", HUGE, "--skip-gpu"], "--threads: must be at least 1 and at most"),
])
def test_bench_counts_are_checked_alike_when_parsed(monkeypatch, capsys, tmp_path,
                                                    name, argv, fragment):
    if name in ("train", "executor"):
        pytest.importorskip("torch")        # they import it (an extra)
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))   # should one run, not here
    module = bench_module(monkeypatch, name)
    _no_work_after_parsing(monkeypatch)
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err


class _Accepted(Exception):
    """Raised in place of the run that follows a parse that accepted the arguments."""


def _no_work_after_parsing(monkeypatch):
    # an accepted value must not start the run: 10**20 repeats went on until killed
    from rtmem.cli import CommandParser
    parse = CommandParser.parse_args

    def parse_only(self, args=None, namespace=None):
        result = parse(self, args, namespace)
        if self.prog == "rtmem":            # rtmem's own: the script's parser comes next
            return result
        raise _Accepted(f"{self.prog} accepted {args}")
    monkeypatch.setattr(CommandParser, "parse_args", parse_only)


@pytest.mark.parametrize("argv, fragment", [
    # `rtmem bench` read these as plain ints and handed them on: 0 reached the
    # script's generic check, 2.5 said "invalid int value", 10**20 ran
    (["bench", "dha", "--repeats", "0"], "argument --repeats: must be at least 1"),
    (["bench", "dha", "--tokens", HUGE], "argument --tokens: must be at least 1 and at most"),
    (["bench", "pcie", "--repeats", HUGE], "argument --repeats: must be at least 1 and at most"),
    (["bench", "pcie", "--repeats", "2.5"], "argument --repeats: '2.5' is not an integer"),
    (["bench", "adam", "--repeats", "0"], "argument --repeats: must be at least 1"),
    (["bench", "adam", "--budget", "-inf"], "argument --budget: must be a finite number"),
    (["bench", "allocator", "--repeats", "0"], "argument --repeats: must be at least 1"),
    (["bench", "allocator", "--out", str(BENCH)], "argument --out: "),
])
def test_rtmem_bench_counts_are_checked_by_its_own_parser(monkeypatch, capsys, argv,
                                                          fragment):
    from rtmem.cli import main
    _no_work_after_parsing(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err
    # refused by rtmem's parser, not the script's (whose usage names the script)
    assert f"usage: rtmem bench {argv[1]}" in err


def test_remat_bench_stopped_by_ctrl_c_keeps_the_cases_it_finished(monkeypatch, capsys,
                                                                   tmp_path):
    # a traceback, and every case solved before the stop lost (the file was
    # written once, at the end, after minutes of solving)
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    remat = bench_module(monkeypatch, "remat")
    _stub_remat_planning(monkeypatch, remat)
    done = []

    def run_case(chain, slots, fraction, repeats, python_budget):
        if len(done) == 3:
            raise KeyboardInterrupt
        done.append({"chain": chain.name, "L": chain.n, "S": slots, "M": slots,
                     "fill_s_median": 1.0, "plan_remat_s": 1.0, "python_s": None,
                     "speedup_vs_python": None, "table_bytes": 8,
                     "overhead_vs_no_remat": 0.1})
        return done[-1]
    monkeypatch.setattr(remat, "run_case", run_case)
    (tmp_path / "remat.json").write_text('{"earlier": true}\n')
    try:
        code = remat.main(["--repeats", "1"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped bench/remat.py's main")
    assert code == 130
    assert "Traceback" not in capsys.readouterr().err
    doc = json.loads((tmp_path / "remat.json").read_text())
    assert doc["partial"] is True and doc["rows"] == done and "interrupted" in doc


def test_executor_bench_stopped_by_ctrl_c_keeps_the_depths_it_finished(monkeypatch, capsys,
                                                                       tmp_path):
    # as remat: a traceback, and the depths measured before the stop lost
    pytest.importorskip("torch")
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    executor = bench_module(monkeypatch, "executor")
    done = []

    def measure(depth, repeats):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append({"depth": depth, "median_s": {"torch plain": 1.0},
                     "over_torch": {"torch plain": 1.0}, "gc": {},
                     "with_gc_over_torch": {}, "recount_over_ledger": {}})
        return done[-1]
    monkeypatch.setattr(executor, "measure", measure)
    (tmp_path / "executor.json").write_text('{"earlier": true}\n')
    try:
        code = executor.main(["--depths", "3,4,5", "--repeats", "1"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped bench/executor.py's main")
    assert code == 130
    assert "Traceback" not in capsys.readouterr().err
    doc = json.loads((tmp_path / "executor.json").read_text())
    assert doc["partial"] is True and doc["results"] == done and "interrupted" in doc


def test_simulate_bench_records_how_many_runs_each_median_took(monkeypatch, tmp_path):
    # "repeats": 4 was all the JSON said, while the pure-Python median was taken
    # over 2 runs (repeats // 2): a reader took both for medians of 4
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    simulate = bench_module(monkeypatch, "simulate")
    calls = []

    def repeat_times(fn, repeats, warmup=1):
        calls.append(repeats)
        return [1e-3 * len(calls)] * repeats
    monkeypatch.setattr(simulate, "repeat_times", repeat_times)
    monkeypatch.setattr(simulate, "simulate",
                        lambda c, s, p: type("R", (), {"peak": 1, "makespan": 1.0})())
    monkeypatch.setattr(simulate, "reference_simulate", lambda c, s, p: {"peak": 1})
    assert simulate.main(["--ops", "60", "--repeats", "5"]) == 0
    doc = json.loads((tmp_path / "simulate.json").read_text())
    assert [doc["jitted"]["repeats"], doc["pure_python"]["repeats"]] == calls


def test_adam_bench_size_too_large_for_the_machine_is_one_line(monkeypatch, capsys,
                                                                tmp_path):
    # --sizes 1e13 ended in numpy's "Unable to allocate 36.4 TiB" traceback
    # (exit 1, the partial document not marked with why it stopped)
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    adam = bench_module(monkeypatch, "adam")

    def bench_size(n, repeats, seed, budget_s, evict):
        if seed == 1:
            raise MemoryError("Unable to allocate 36.4 TiB for an array")
        return [{"size": n, "impl": "rtmem fp32", "median_s": 1.0, "min_s": 1.0}], {}
    monkeypatch.setattr(adam, "bench_size", bench_size)
    monkeypatch.setattr(adam, "CacheEvictor", lambda nbytes: None)
    assert adam.main(["--sizes", "1000,10000000000000", "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "out of host memory" in err and "--sizes" in err
    doc = json.loads((tmp_path / "adam.json").read_text())
    assert doc["partial"] is True and [r["size"] for r in doc["results"]] == [1000]
    assert "10,000,000,000,000" in doc["error"]


# A real SIGINT, sent by the bench's own process at a set point of its start (no
# timing): a child of a shell job started with & inherits SIGINT ignored, so the
# child's SIGINT is reset to the default, which Python turns into KeyboardInterrupt
SIGINT_AT = """
import atexit, importlib.abc, os, runpy, signal, sys
import rtmem._files, rtmem.planners, rtmem.planners.rotor
where, script, *args = sys.argv[1:]
if os.environ.get("ATEXIT_MARK"):       # a handler a normal exit would run
    atexit.register(lambda: open(os.environ["ATEXIT_MARK"], "w").write("ran"))

def interrupting(fn):
    def call(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return fn(*a, **kw)
    return call

class InterruptTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None

if where == "import torch":
    sys.meta_path.insert(0, InterruptTorchImport())
else:                                   # a function the bench's warm-up calls first
    module, name = where.rsplit(".", 1)
    module = sys.modules[module]
    setattr(module, name, interrupting(getattr(module, name)))
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script, where, args", [
    # compiling (or loading) the DP before the first case
    ("remat", "rtmem.planners.rotor.persistent_table", []),
    # the jitted simulator's first (compiling) call
    ("simulate", "rtmem.planners.simulate", ["--ops", "600", "--repeats", "1"]),
    # torch loading (seconds) before any depth
    ("executor", "import torch", ["--depths", "2", "--repeats", "1"]),
    # train imported torch before _common: a traceback, exit -2 (killed by SIGINT)
    ("train", "import torch", ["--skip-gpu"]),
])
def test_ctrl_c_before_the_first_result_is_one_line_and_exit_130(tmp_path, script, where,
                                                                  args):
    import os
    import signal
    import subprocess
    import sys
    if script in ("executor", "train"):
        pytest.importorskip("torch")
    earlier = tmp_path / f"{script}.json"
    earlier.write_text('{"earlier": true}\n')
    env = dict(os.environ, RTMEM_BENCH_RESULTS=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-c", SIGINT_AT, where, str(BENCH / f"{script}.py"), *args],
        capture_output=True, text=True, env=env, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "nothing written" in lines[0], \
        res.stderr[-2000:]
    assert earlier.read_text() == '{"earlier": true}\n'          # the earlier result stays


def test_ctrl_c_during_the_final_results_write_is_one_line_and_exit_130(tmp_path):
    # the write is atomic (the file stays whole), but the stop was a traceback
    # and exit -2 (Python's SIGINT death): outside every script's own handling
    import os
    import signal
    import subprocess
    import sys
    earlier = tmp_path / "simulate.json"
    earlier.write_text('{"earlier": true}\n')
    mark = tmp_path.parent / f"{tmp_path.name}-atexit"
    env = dict(os.environ, RTMEM_BENCH_RESULTS=str(tmp_path), ATEXIT_MARK=str(mark))
    res = subprocess.run(
        [sys.executable, "-c", SIGINT_AT, "rtmem._files.write_text",
         str(BENCH / "simulate.py"), "--ops", "600", "--repeats", "1"],
        capture_output=True, text=True, env=env, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    # first the line saying that an earlier run's file is being replaced
    assert lines[0] == (f"simulate: replacing {earlier}, the result of an earlier run; to "
                        f"keep both, set RTMEM_BENCH_RESULTS to another folder (or give "
                        f"--out where the script takes it)"), res.stderr[-2000:]
    lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("simulate: interrupted while writing "), \
        res.stderr[-2000:]
    assert str(earlier) in lines[0]
    # stopped before its rename: the earlier document, whole, and no stray temp file
    assert earlier.read_text() == '{"earlier": true}\n'
    assert [f.name for f in tmp_path.iterdir()] == ["simulate.json"]
    # the exit code comes from os._exit, which skips atexit: the hook runs them
    assert mark.read_text() == "ran"


@pytest.mark.parametrize("argv, fragment", [
    (["--sizes", "1e6,0"], "parameter counts >= 1"),
    (["--sizes", "garbage"], "parameter counts >= 1"),
])
def test_rtmem_bench_adam_sizes_are_checked_by_the_script_under_its_name(capsys, argv,
                                                                         fragment):
    from rtmem.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "adam", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "usage: rtmem bench adam" in err


def test_rtmem_bench_adam_and_allocator_run_on_cpu_and_write_the_scripts_json(
        monkeypatch, capsys, tmp_path):
    # `rtmem bench` exposed pcie and dha only: the CPU benchmarks were scripts alone
    from rtmem.cli import main
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    adam = bench_module(monkeypatch, "adam")        # the module rtmem bench loads anew
    out = tmp_path / "a.json"
    assert main(["bench", "adam", "--sizes", "1000", "--repeats", "1", "--budget", "0",
                 "--warm-cache", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["sizes"] == [1000] and "partial" not in doc and doc["caches"] == "warm"
    assert {r["impl"] for r in doc["results"]} >= {"rtmem fp32", "roofline fp32"}
    assert all(r["median_s"] > 0 and r["rounds"] >= 1 for r in doc["results"])
    assert adam._size_key(1000) in doc["ratios"]
    # what ran, to run it again, and which rtmem (a script's name was recorded)
    assert doc["command"] == (f"rtmem bench adam --warm-cache --sizes=1000 --repeats=1 "
                              f"--budget=0.0 --out={out}")
    from rtmem import __version__
    assert doc["machine"]["rtmem"] == __version__
    assert main(["bench", "allocator", "--quick", "--repeats", "1"]) == 0
    doc = json.loads((tmp_path / "allocator.json").read_text())
    assert doc["repeats"] == 1 and "partial" not in doc
    assert doc["command"] == "rtmem bench allocator --quick --repeats=1"
    assert doc["machine"]["rtmem"] == __version__
    assert doc["random"]["rtmem_pairs_per_s"] > 0 and doc["gpt2"]["speedup_vs_naive"] > 0
    assert doc["gpu"]["measured"] is False and doc["pinned"]["reserved_bytes"] > 0
    assert "wrote " + str(tmp_path / "allocator.json") in capsys.readouterr().out


def test_rtmem_bench_loads_a_script_under_a_name_numbas_cache_can_import(monkeypatch):
    # Loaded outside sys.modules, bench/adam.py's cache=True roofline kernels were
    # cached under the module name "<dynamic>": every later run that loaded that
    # cache (rtmem bench adam again, python bench/adam.py, these tests) failed with
    # ModuleNotFoundError: No module named '<dynamic>'.
    import inspect
    import sys

    from rtmem import cli_bench
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    sys.modules.pop("adam", None)
    module = cli_bench._load("adam.py")
    home = inspect.getmodule(module.roofline_fp32.py_func)
    assert home is module and home.__name__ == "adam"
    assert importlib.import_module("adam") is module     # what the cache will import
    assert cli_bench._load("adam.py") is module           # and loaded once


def _stub_remat_planning(monkeypatch, remat):
    """bench/remat.py's planning calls made instant (a plan of method "dp")."""
    class Plan:
        info = {"method": "dp"}
    monkeypatch.setattr(remat, "persistent_table", lambda *a: None)
    monkeypatch.setattr(remat, "discretized", lambda *a: (None, 1))
    monkeypatch.setattr(remat, "budget_for", lambda *a: 1)
    monkeypatch.setattr(remat, "plan_remat", lambda *a: Plan())


def _stub_measurements(monkeypatch, name, module):
    """Replace ``name``'s measuring by constant figures: only its document is
    under test."""
    if name == "simulate":
        monkeypatch.setattr(module, "repeat_times",
                            lambda fn, repeats, warmup=1: [1e-3] * repeats)
        monkeypatch.setattr(module, "simulate",
                            lambda c, s, p: type("R", (), {"peak": 1, "makespan": 1.0})())
        monkeypatch.setattr(module, "reference_simulate", lambda c, s, p: {"peak": 1})
    elif name == "remat":
        _stub_remat_planning(monkeypatch, module)
        monkeypatch.setattr(module, "run_case", lambda chain, slots, *a: {
            "chain": chain.name, "L": chain.n, "S": slots, "M": slots,
            "fill_s_median": 1.0, "plan_remat_s": 1.0, "python_s": None,
            "speedup_vs_python": None, "table_bytes": 8, "overhead_vs_no_remat": 0.1})
    elif name == "executor":
        monkeypatch.setattr(module, "measure", lambda depth, repeats: {
            "depth": depth, "median_s": {"torch plain": 1.0},
            "over_torch": {"torch plain": 1.0}, "gc": {}, "with_gc_over_torch": {},
            "recount_over_ledger": {}})


def test_simulate_bench_records_every_runs_time_beside_the_median(monkeypatch, tmp_path):
    # simulate.json held medians only: two runs could not be compared with their spread
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    simulate = bench_module(monkeypatch, "simulate")
    rng = np.random.default_rng()
    drawn = []

    def repeat_times(fn, repeats, warmup=1):
        drawn.append(rng.uniform(1e-4, 1e-2, repeats).tolist())
        return drawn[-1]
    monkeypatch.setattr(simulate, "repeat_times", repeat_times)
    monkeypatch.setattr(simulate, "simulate",
                        lambda c, s, p: type("R", (), {"peak": 1, "makespan": 1.0})())
    monkeypatch.setattr(simulate, "reference_simulate", lambda c, s, p: {"peak": 1})
    assert simulate.main(["--ops", "60", "--repeats", str(int(rng.integers(2, 9)))]) == 0
    doc = json.loads((tmp_path / "simulate.json").read_text())
    for key, times in zip(("jitted", "pure_python"), drawn):
        part = doc[key]
        assert part["times_s"] == times and len(times) == part["repeats"]
        assert part["median_s"] == statistics.median(times)
        assert (part["min_s"], part["max_s"]) == (min(times), max(times))
        assert part["ops_per_s"] == doc["ops"] / part["median_s"]


def test_executor_bench_records_every_rounds_time_beside_the_median(monkeypatch, tmp_path):
    # executor.json held each contender's median only
    pytest.importorskip("torch")
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    executor = bench_module(monkeypatch, "executor")
    rng = np.random.default_rng()
    drawn = {}

    def round_robin(runs, repeats, before=lambda: None):
        drawn.update({name: rng.uniform(1e-4, 1e-2, repeats).tolist() for name in runs})
        return drawn
    monkeypatch.setattr(executor, "round_robin", round_robin)
    monkeypatch.setattr(executor, "gc_cost", lambda fn, calls, before=None: {
        "gc_s_per_call": 0.0, "collections_per_call": [0, 0, 0]})
    assert executor.main(["--depths", "3", "--repeats", "3"]) == 0
    result, = json.loads((tmp_path / "executor.json").read_text())["results"]
    assert result["times_s"] == drawn and "exec store-all" in drawn
    assert result["median_s"] == {name: statistics.median(t) for name, t in drawn.items()}


def test_train_bench_out_takes_a_json_path_or_a_result_name(monkeypatch, tmp_path, capsys):
    # train's --out took a result name only (x.json was refused, a/b went under
    # bench/results as a/b.json), where every other script's --out is the file written
    pytest.importorskip("torch")
    folder = tmp_path / "folder"
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(folder))
    train = bench_module(monkeypatch, "train")
    out = tmp_path / "new" / "train run 2.json"
    assert train.main(["--skip-cpu", "--skip-gpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "train" and shlex.split(doc["command"])[-1] == str(out)
    assert not folder.exists()
    assert train.main(["--skip-cpu", "--skip-gpu", "--out", str(tmp_path / "a" / "b")]) == 0
    assert json.loads((tmp_path / "a" / "b").read_text())["benchmark"] == "train"
    # the documented older form: a result name, NAME.json in the results folder
    assert train.main(["--skip-cpu", "--skip-gpu", "--out", "train_gpu"]) == 0
    assert json.loads((folder / "train_gpu.json").read_text())["benchmark"] == "train_gpu"
    # a path that cannot be written is bad usage before any work
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(SystemExit) as e:
        train.main(["--skip-cpu", "--skip-gpu", "--out", str(tmp_path / "dir.json")])
    assert e.value.code == 2 and "folder" in capsys.readouterr().err


@pytest.mark.parametrize("name, argv, written", [
    ("simulate", [], "simulate.json"),
    ("simulate", ["--ops", "60", "--repeats", "2"], "simulate.json"),
    ("remat", [], "remat.json"),
    ("remat", ["--repeats", "1", "--out", "{tmp}/a b.json"], "a b.json"),
    ("executor", [], "executor.json"),
    ("executor", ["--depths", "3, 4", "--repeats", "1"], "executor.json"),
    ("train", ["--skip-cpu", "--skip-gpu"], "train.json"),
    ("train", ["--skip-cpu", "--skip-gpu", "--out", "t 1"], "t 1.json"),
])
def test_bench_results_record_the_command_main_was_given_quoted(monkeypatch, tmp_path,
                                                                name, argv, written):
    # simulate.json had no command; remat, executor and train joined `argv or
    # sys.argv[1:]` unquoted, so main([]) recorded the test runner's arguments and
    # a value with a space could not be typed again
    if name in ("executor", "train"):
        pytest.importorskip("torch")
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["pytest", "-n", "2", "-k", "not this"])
    module = bench_module(monkeypatch, name)
    _stub_measurements(monkeypatch, name, module)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert module.main(argv) == 0
    doc = json.loads((tmp_path / written).read_text())
    assert doc["command"] == f"python bench/{name}.py" + "".join(
        " " + shlex.quote(a) for a in argv)
    assert shlex.split(doc["command"])[2:] == argv          # typed again, the same words


@pytest.mark.parametrize("name, argv", [
    ("allocator", ["--quick", "--repeats", "1"]),
    ("simulate", ["--ops", "60", "--repeats", "1"]),
    ("executor", ["--depths", "3", "--repeats", "1"]),
])
def test_bench_out_writes_the_results_where_it_says(monkeypatch, tmp_path, name, argv):
    # allocator, simulate and executor took no --out (only RTMEM_BENCH_RESULTS, a
    # folder), so a second run replaced the first's file or needed its own folder
    if name == "executor":
        pytest.importorskip("torch")
    folder = tmp_path / "folder"
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(folder))
    module = bench_module(monkeypatch, name)
    _stub_measurements(monkeypatch, name, module)
    out = tmp_path / "new" / f"{name} run 2.json"
    assert module.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] and "partial" not in doc
    assert shlex.split(doc["command"])[-2:] == ["--out", str(out)]
    assert not folder.exists()                  # nothing went to the default place


def test_rtmem_bench_allocator_passes_out_to_the_script(monkeypatch, tmp_path, capsys):
    from rtmem.cli import main
    monkeypatch.setenv("RTMEM_BENCH_RESULTS", str(tmp_path / "folder"))
    out = tmp_path / "alloc.json"
    assert main(["bench", "allocator", "--quick", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == f"rtmem bench allocator --quick --repeats=1 --out={out}"
    assert doc["random"]["rtmem_pairs_per_s"] > 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert not (tmp_path / "folder").exists()


def test_bench_command_line_is_quoted_and_names_how_it_ran(monkeypatch):
    common = bench_module(monkeypatch, "_common")
    assert common.command_line("adam.py", ["--sizes", "1e3", "--out", "a b.json"]) == \
        "python bench/adam.py --sizes 1e3 --out 'a b.json'"
    assert common.command_line("adam.py", [], "rtmem bench adam") == "rtmem bench adam"
    monkeypatch.setattr("sys.argv", ["bench/allocator.py", "--quick"])
    assert common.command_line("allocator.py") == "python bench/allocator.py --quick"
