import importlib.util
import json
import os
import sys
from argparse import ArgumentTypeError

import pytest

from _plots import fail_saves_half_way
from _remat_cases import OVERLAPPING_TRANSFERS, two_stage_chain
from rtmem.cli import load_chain, main


def needs(*modules):
    """A mark skipping a case unless every one of ``modules`` is installed: the
    optional extras (torch; matplotlib) a command checks for before its arguments."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)} "
                              f"(an extra: pip install 'rtmem[torch,plot]')")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_chains_table_and_json(capsys):
    code, out, _ = run(capsys, "chains")
    assert code == 0 and "gpt2-small" in out and "resnet1001" in out
    code, out, _ = run(capsys, "chains", "--json")
    docs = json.loads(out)
    assert {d["name"] for d in docs} >= {"gpt2-small", "resnet50"}
    assert all(d["store_all_peak_bytes"] > 0 for d in docs)


def test_simulate_table_json_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")   # --plot (an extra: rtmem[plot])
    plot = tmp_path / "g.png"
    code, out, _ = run(capsys, "simulate", "gpt2:layers=2,hidden=64,heads=4,seq=16,batch=2,"
                       "vocab=50", "sequential:2", "--memory", "1GiB", "--bandwidth",
                       "12 GB/s", "--plot", str(plot))
    assert code == 0 and "makespan" in out and plot.stat().st_size > 1000
    code, out, _ = run(capsys, "simulate", "resnet50", "store-all", "--memory", "inf",
                       "--json")
    doc = json.loads(out)
    assert doc["peak_bytes"] > 6 * 2**30 and doc["channel"] == "shared"


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     KeyboardInterrupt()])
def test_a_plot_that_fails_while_written_leaves_the_previous_plot(capsys, tmp_path,
                                                                   monkeypatch, failure):
    # savefig wrote straight into --plot's file: a full disk or a Ctrl-C half-way
    # left a truncated image in place of the plot of the previous run
    pytest.importorskip("matplotlib")
    plot = tmp_path / "g.png"
    argv = ["simulate", "gpt2:layers=2,hidden=64,heads=4,seq=16,batch=2,vocab=50",
            "sequential:2", "--memory", "1GiB", "--plot", str(plot)]
    assert run(capsys, *argv)[0] == 0
    previous = plot.read_bytes()
    fail_saves_half_way(monkeypatch, failure)
    code = run(capsys, *argv)[0]
    assert code == (130 if isinstance(failure, KeyboardInterrupt) else 1)
    assert plot.read_bytes() == previous
    assert os.listdir(tmp_path) == ["g.png"]       # no temporary file left beside it


def test_simulate_schedule_file_and_text(capsys, tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("F_all 0\nF_all 1\nL\nB 1\nB 0\n")
    chain = tmp_path / "c.json"
    from rtmem.planners import Chain
    Chain.homogeneous(2, x=10).save(chain)
    code, out, _ = run(capsys, "simulate", str(chain), str(path), "--memory", "100")
    assert code == 0
    code, out, _ = run(capsys, "simulate", str(chain), "F_all 0, F_all 1, L, B 1, B 0",
                       "--memory", "100", "--json")
    assert json.loads(out)["makespan_s"] == 4.0


@pytest.mark.parametrize("text", ["Fall 0", "F_none 0", "loss", "w_prefetch 0"])
def test_load_schedule_reads_every_op_word_as_text(text):
    # a one-op schedule has no comma: its first word must be known as an operation
    # (alias spellings included) or it is taken for a missing file
    from rtmem.cli import load_schedule
    from rtmem.planners import Chain, Schedule
    assert load_schedule(text, Chain.homogeneous(2, x=10)) == Schedule.from_text(text)


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "gpt2-small", "store-all", "--memory", "1GiB"], "exceed the limit"),
    (["simulate", "nochain", "store-all", "--memory", "1GiB"], "unknown chain"),
    (["simulate", "resnet50", "sequential:x", "--memory", "1GiB"], "integer K"),
    # non-ASCII digits: str.isdigit accepts them, int() raised or read "٣" as 3
    (["simulate", "resnet50", "sequential:\u00b2", "--memory", "1GiB"], "digits 0-9"),
    (["simulate", "resnet50", "sequential:\u0663", "--memory", "1GiB"], "digits 0-9"),
    (["simulate", "resnet50", "sequential:", "--memory", "1GiB"], "integer K"),
    (["simulate", "resnet50", "sequential:99999999999999999999", "--memory", "1GiB"],
     "segments must be"),
    (["simulate", "resnet50", "bogus", "--memory", "1GiB"], "no schedule file"),
])
def test_errors_exit_1_with_message(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 1 and fragment in err


def _files(tmp_path):
    (tmp_path / "empty.json").write_text("{}")
    # finite times whose sum overflows: the chain is refused, not simulated to inf
    (tmp_path / "big.json").write_text(json.dumps(
        {"u_f": [1e308, 1e308], "u_b": [1, 1], "x": [4, 5], "xbar": [8, 9]}))
    (tmp_path / "slow.json").write_text(json.dumps(
        {"u_f": [1e306], "u_b": [1], "x": [1], "xbar": [1], "x0": 1}))
    (tmp_path / "binary.json").write_bytes(bytes(range(128, 256)))
    # json.loads recurses once per level: a RecursionError traceback
    (tmp_path / "deep.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    return tmp_path


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "gpt2-small", "", "--memory", "8GiB"], "schedule is empty"),
    (["simulate", "gpt2-small", "   ", "--memory", "8GiB"], "schedule is empty"),
    (["simulate", "gpt2-small", "B 0", "--memory", "8GiB"], "next backward step"),
    (["simulate", "gpt2-small", "F_all 99999999999999999999", "--memory", "8GiB"],
     "below 10**18"),
    (["simulate", "{tmp}/missing.json", "store-all", "--memory", "8GiB"], "no chain file"),
    (["simulate", "{tmp}/empty.json", "store-all", "--memory", "8GiB"], "lacks the field"),
    (["simulate", "{tmp}/binary.json", "store-all", "--memory", "8GiB"], "not UTF-8"),
    (["simulate", "{tmp}", "store-all", "--memory", "8GiB"], "Is a directory"),
    (["simulate", "{tmp}/big.json", "store-all", "--memory", "100", "--json"],
     "times are too large"),
    # a valid chain, but a hand-written schedule repeating a 1e306 s forward
    (["simulate", "{tmp}/slow.json", ", ".join(["F_ck 0"] * 300) + ", F_all 0, L, B 0",
      "--memory", "inf", "--json"], "overflows a float64"),
    (["plan", "remat", "{tmp}/big.json", "--memory", "100", "--json"],
     "times are too large"),
    (["simulate", "gpt2-small", "{tmp}/binary.json", "--memory", "8GiB"], "not UTF-8"),
    (["simulate", "{tmp}/deep.json", "store-all", "--memory", "8GiB"], "nested too deeply"),
    (["simulate", "gpt2-small", "{tmp}/deep.json", "--memory", "8GiB"], "nested too deeply"),
    (["plan", "remat", "{tmp}/deep.json", "--memory", "8GiB"], "nested too deeply"),
    (["plan", "remat", "gpt2:layers=5000", "--memory", "400GiB", "--slots", "50"],
     "use at most 20 slots"),
])
def test_bad_input_files_and_texts_get_one_line(capsys, tmp_path, argv, fragment):
    # a one-line message naming the problem, never a traceback (and the too-large
    # DP table is refused before the minutes-long least-memory pass)
    argv = [a.replace("{tmp}", str(_files(tmp_path))) for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]      # (plan prints progress lines before it)
    assert last.startswith("rtmem ") and "error:" in last and fragment in last


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "gpt2-small", "store-all", "--memory", "8GiB", "--plot", "x.txt"],
     "must end in .png"),
    (["simulate", "gpt2-small", "store-all", "--memory", "8GiB", "--plot", "{tmp}/"],
     "is a folder"),
    (["plan", "remat", "gpt2-small", "--memory", "8GiB", "--save", "{tmp}"], "is a folder"),
    # --save '' was accepted, then skipped: exit 0 and no file
    (["plan", "remat", "gpt2-small", "--memory", "8GiB", "--save", ""], "file name is empty"),
    # run_demo's makedirs said "[Errno 17] File exists" (exit 1) after importing torch
    (["demo", "--out", "{tmp}/file"], "is not a folder"),
    (["demo", "--out", ""], "is not a folder"),
    # an output path that cannot be written failed only after the work ("[Errno 17]
    # File exists" after the whole solve for --save); "file" is a file here
    (["plan", "remat", "gpt2-small", "--memory", "8GiB", "--save", "{tmp}/file/a/x.json"],
     "argument --save: cannot write '{tmp}/file/a/x.json': '{tmp}/file' is not a folder"),
    (["plan", "remat", "gpt2-small", "--memory", "8GiB", "--plot", "{tmp}/file/x.png"],
     "argument --plot: cannot write"),
    (["simulate", "gpt2-small", "store-all", "--memory", "8GiB", "--plot",
      "{tmp}/file/x.png"], "argument --plot: cannot write"),
    (["bench", "pcie", "--plot", "{tmp}/file/x.png"], "'{tmp}/file' is not a folder"),
    (["demo", "--out", "{tmp}/file/out"], "cannot write there: '{tmp}/file' is not a folder"),
    # the bench scripts' usage named "rtmem [-h] [--quick] ..."; --max-size garbage was
    # an exit 1 naming no option; --plot x.txt failed only after the sweep (GPU)
    (["bench", "pcie", "--max-size", "lots"], "usage: rtmem bench pcie"),
    (["bench", "pcie", "--max-size", "lots"], "argument --max-size: cannot read 'lots'"),
    (["bench", "pcie", "--plot", "x.txt"], "must end in .png"),
    (["bench", "pcie", "--plot", "{tmp}/"], "is a folder"),
    (["bench", "dha", "--tokens", "0"], "usage: rtmem bench dha"),
    (["demo", "--steps", "0"], "at least 1"),
    (["plan", "remat", "gpt2-small", "--memory", "4GiB", "--slots", "0"], "at least 1"),
    (["plan", "remat", "gpt2-small", "--memory", "4GiB", "--slots", "-3"], "at least 1"),
    (["demo", "--vocab", "1"], "at least 2"),
    (["demo", "--layers", "x"], "not an integer"),
    (["demo", "--heads", "3"], "multiple of --heads"),
    # --device is read by torch.device: without torch (or matplotlib) the demo says
    # that extra is missing
    pytest.param(["demo", "--device", "tpu"], "cpu or cuda",
                 marks=needs("torch", "matplotlib")),    # the demo checks both first
    # checked before profiling, not after; the value named once
    (["demo", "--memory", "abc"], "--memory: invalid memory: cannot read 'abc'"),
    (["demo", "--model", "vgg"], "invalid choice"),
    # as for demo: plan remat and simulate refused these with exit 1, after loading
    # the chain
    (["simulate", "resnet50", "store-all", "--memory", "lots"],
     "argument --memory: invalid memory: cannot read 'lots'"),
    (["simulate", "resnet50", "store-all", "--memory", "1GiB", "--bandwidth", "0"],
     "argument --bandwidth: invalid bandwidth '0'"),
    (["plan", "remat", "{tmp}/missing.json", "--memory", "0"],
     "argument --memory: memory must be > 0 bytes"),
    # a negative size is a value, not an option: argparse (before Python 3.13) said
    # "expected one argument" unless written --memory=-1GiB
    (["plan", "remat", "gpt2-small", "--memory", "-1GiB"],
     "argument --memory: memory must be > 0 bytes, got '-1GiB'"),
    (["simulate", "resnet50", "store-all", "--memory", "1GiB", "--bandwidth", "-.5GB/s"],
     "argument --bandwidth: invalid bandwidth '-.5GB/s'"),
    (["demo", "--memory", "-1MiB"], "--memory: memory must be > 0 bytes, got '-1MiB'"),
    # -inf, -Infinity and -nan too: Python 3.13's test still takes them for options,
    # so every option taking a quantity said "expected one argument"
    (["plan", "remat", "gpt2-small", "--memory", "-inf"],
     "argument --memory: memory must be > 0 bytes, got '-inf'"),
    (["simulate", "resnet50", "store-all", "--memory", "-Infinity"],
     "argument --memory: memory must be > 0 bytes, got '-Infinity'"),
    (["simulate", "resnet50", "store-all", "--memory", "1GiB", "--bandwidth", "-inf"],
     "argument --bandwidth: invalid bandwidth '-inf': a bandwidth must be > 0 bytes/s"),
    (["demo", "--memory", "-nan"], "--memory: memory must be > 0 bytes, got '-nan'"),
    # through rtmem bench's parser to bench/pcie.py's own
    (["bench", "pcie", "--max-size", "-inf"],
     "argument --max-size: a size must be finite and >= 0 bytes, got '-inf'"),
    (["bench", "pcie", "--max-size", "-1MiB"], "argument --max-size: a size must be finite"),
    (["demo", "--model", "resnet", "--layers", "4"],
     "--layers sizes the gpt2 model; with --model resnet use --blocks --width --image"),
    (["demo", "--width", "4"], "--width sizes the resnet model"),
    (["demo", "--model", "resnet", "--blocks", "2,0"], "positive integers"),
    (["demo", "--model", "resnet", "--blocks", "two"], "e.g. 2,2,2"),
    # batch norm cannot train on one value per channel: a ValueError traceback
    # from profiling (the last group of 2,2,2 sees 1x1 images of a 4x4 input)
    (["demo", "--model", "resnet", "--batch", "1", "--image", "4"],
     "more than one value per channel"),
    (["demo", "--model", "resnet", "--batch", "1", "--image", "2", "--blocks", "1,1"],
     "sees 1x1 images"),
])
def test_bad_arguments_exit_2_before_any_work(capsys, tmp_path, argv, fragment):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    fragment = fragment.replace("{tmp}", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err


def test_simulate_reads_a_saved_plan_and_huge_budgets(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "remat", "gpt2-small", "--memory", "8GiB",
                     "--save", str(plan))
    assert code == 0
    code, out, _ = run(capsys, "simulate", "gpt2-small", str(plan), "--memory", "8GiB",
                       "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] <= 8 * 2**30
    code, out, _ = run(capsys, "simulate", "gpt2-small", "store-all", "--memory",
                       "1e30GiB", "--json")          # beyond int64: unlimited
    assert code == 0 and json.loads(out)["memory_bytes"] is None


def test_simulate_a_plan_for_another_chain_says_so(capsys, tmp_path):
    # A plan for a shorter chain failed at its loss with "needs a26 ... compute it
    # again or prefetch it first", nothing pointing at the chain it was made for
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "remat", "gpt2:layers=6", "--memory", "64GiB",
                     "--save", str(plan), "--quiet")
    assert code == 0
    for chain, stages in (("gpt2:layers=24", 26), ("gpt2:layers=2", 4)):
        code, _, err = run(capsys, "simulate", chain, str(plan), "--memory", "inf")
        assert code == 1 and err.count("\n") == 1
        assert err.rstrip().endswith(f"(was the plan made for another chain? its forward "
                                     f"and backward steps cover 8 stages, this chain has "
                                     f"{stages})")
    # another error of a schedule for the chain gets no such hint
    code, _, err = run(capsys, "simulate", "gpt2:layers=6", str(plan), "--memory", "1GiB")
    assert code == 1 and "memory" in err and "another chain" not in err


def test_simulate_an_old_plan_for_another_chain_of_the_same_length_notes_it(capsys,
                                                                           tmp_path):
    # Same number of stages, other sizes: the schedule simulates, and the plan's
    # recorded peak (which the simulator gave on its own chain) differed silently.
    # A plan saved before plans recorded their chain's digest is told by its peak.
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "remat", "gpt2:layers=6", "--memory", "64GiB",
                     "--save", str(plan), "--quiet")
    assert code == 0
    doc = json.loads(plan.read_text())
    del doc["info"]["chain_sha256"]
    plan.write_text(json.dumps(doc))
    recorded = doc["peak"]
    code, out, err = run(capsys, "simulate", "gpt2:layers=6", str(plan), "--memory", "inf",
                         "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] == recorded and err == ""
    code, out, err = run(capsys, "simulate", "gpt2:layers=6,batch=16", str(plan),
                         "--memory", "inf", "--json")
    peak = json.loads(out)["peak_bytes"]
    assert code == 0 and peak != recorded
    assert err == (f"note: the plan records a peak of {recorded:,} B; on "
                   f"{load_chain('gpt2:layers=6,batch=16').name} it peaks at {peak:,} B: "
                   f"was it made for another chain (or another batch size)?\n")


def _saved_chain_and_plan(capsys, tmp_path):
    """gpt2:layers=4 saved as tmp_path/chain.json and its rotor plan under 64 GiB
    saved by `rtmem plan remat` as tmp_path/plan.json: (chain, plan's path)."""
    chain = load_chain("gpt2:layers=4")
    chain.save(tmp_path / "chain.json")
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "remat", str(tmp_path / "chain.json"), "--memory",
                     "64GiB", "--save", str(plan), "--quiet")
    assert code == 0
    return chain, plan


def test_simulate_a_plan_on_an_edited_chain_notes_it(capsys, tmp_path):
    # The user saved chain.json and plan.json, then edited the chain's times (or
    # profiled the model again): the peak is the same, so nothing said that the
    # plan's numbers were another chain's
    import numpy as np

    from rtmem.planners import Plan
    chain, plan = _saved_chain_and_plan(capsys, tmp_path)
    code, out, err = run(capsys, "simulate", str(tmp_path / "chain.json"), str(plan),
                         "--memory", "inf", "--json")
    assert code == 0 and json.loads(out)["chain_matches_plan"] is True and err == ""
    doc = json.loads((tmp_path / "chain.json").read_text())
    rng = np.random.default_rng()
    doc["u_f"][int(rng.integers(0, chain.n))] *= float(rng.uniform(1.5, 3))
    (tmp_path / "chain.json").write_text(json.dumps(doc))
    code, out, err = run(capsys, "simulate", str(tmp_path / "chain.json"), str(plan),
                         "--memory", "inf", "--json")
    report = json.loads(out)
    recorded = Plan.load(plan)
    assert code == 0 and report["chain_matches_plan"] is False
    assert report["peak_bytes"] == recorded.peak and report["makespan_s"] != recorded.makespan
    assert err.startswith("note: this rotor plan was made for another chain")
    assert err.count("\n") == 1 and err.rstrip().endswith("the numbers below are this chain's")
    # a schedule that is not a plan records no chain
    code, out, _ = run(capsys, "simulate", str(tmp_path / "chain.json"), "store-all",
                       "--memory", "inf", "--json")
    assert code == 0 and json.loads(out)["chain_matches_plan"] is None


def test_simulate_a_plan_refused_on_an_edited_chain_says_the_chain_is_another(capsys,
                                                                               tmp_path):
    # A plan replayed on its chain re-profiled at a larger batch (same stages,
    # larger activations) at the plan's budget fails with "exceeds the memory";
    # the note that the plan was made for another chain came only after a
    # successful simulation, so the error did not say what the digest knew.
    import numpy as np
    chain, plan = _saved_chain_and_plan(capsys, tmp_path)
    budget = str(json.loads(plan.read_text())["peak"])     # the plan's own peak, bytes
    code, out, _ = run(capsys, "simulate", str(tmp_path / "chain.json"), str(plan),
                       "--memory", budget, "--json")
    assert code == 0 and json.loads(out)["chain_matches_plan"] is True
    doc = json.loads((tmp_path / "chain.json").read_text())
    scale = int(np.random.default_rng().integers(2, 5))
    for key in ("x", "xbar"):
        doc[key] = [v * scale for v in doc[key]]
    (tmp_path / "chain.json").write_text(json.dumps(doc))
    code, out, err = run(capsys, "simulate", str(tmp_path / "chain.json"), str(plan),
                         "--memory", budget, "--json")
    report = json.loads(out)
    assert code == 1 and report["kind"] == "ScheduleError" and "memory" in report["error"]
    assert "the plan was made for another chain" in report["error"], report["error"]
    assert "op_index" in report                 # still the simulator's error
    code, _, err = run(capsys, "simulate", str(tmp_path / "chain.json"), str(plan),
                       "--memory", budget)
    assert code == 1 and err.count("\n") == 1 and "made for another chain" in err


def test_simulate_a_plan_with_transfers_on_its_own_chain_gets_no_note(capsys, tmp_path):
    # A schedule with transfers peaks higher where a slower link frees offloaded
    # bytes later (and no memory limit makes an operation wait for them): the
    # plan's recorded peak is then not its chain's alone, and a plan simulated on
    # its own chain with another link was told it was made for another chain
    import math

    from rtmem.planners import Platform, Schedule, simulate
    from rtmem.planners.baselines import simulated_plan
    chain = load_chain("gpt2:layers=2")
    assert chain.n == 4
    schedule = Schedule.from_text(
        "F_all 0, offload abar1, F_all 1, delete abar1, offload abar2, F_all 2, "
        "delete abar2, offload abar3, F_all 3, delete abar3, L, prefetch abar3, B 3, "
        "prefetch abar2, B 2, prefetch abar1, B 1, B 0")
    plan = simulated_plan(chain, schedule, math.inf, "offload")
    plan.save(str(tmp_path / "plan.json"))
    slow = simulate(chain, schedule, Platform(math.inf, bandwidth=1e9)).peak
    assert slow != plan.peak            # the case: the peak depends on the link
    code, out, err = run(capsys, "simulate", "gpt2:layers=2", str(tmp_path / "plan.json"),
                         "--memory", "inf", "--bandwidth", "1 GB/s", "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] == slow and err == ""


def test_simulate_json_is_strict_json(capsys):
    # The default bandwidth is unlimited: it was written as Infinity (not JSON),
    # and unlimited memory as rtmem's internal 2**62.
    code, out, _ = run(capsys, "simulate", "gpt2-small", "store-all", "--memory", "inf",
                       "--json")

    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    doc = json.loads(out, parse_constant=refuse)
    assert code == 0 and doc["bandwidth_Bps"] is None and doc["memory_bytes"] is None
    code, out, _ = run(capsys, "simulate", "gpt2-small", "store-all", "--memory", "16GiB",
                       "--bandwidth", "12 GB/s", "--json")
    doc = json.loads(out, parse_constant=refuse)
    assert doc["memory_bytes"] == 16 * 2**30 and doc["bandwidth_Bps"] == 12e9


def test_a_failed_json_command_prints_json_on_stdout_too(capsys, tmp_path):
    # stdout was empty on an error: a script piping `--json` had nothing to parse
    code, out, err = run(capsys, "simulate", "gpt2-small", "store-all", "--memory", "1MiB",
                         "--json")
    doc = json.loads(out)
    assert code == 1 and err == f"rtmem simulate: error: {doc['error']}\n"
    assert doc["reason"] == "memory-limit" and doc["op_index"] is None
    # "kind" names the error class: a script tells a refused schedule, a
    # missing file and bad usage apart without matching the message's words
    assert doc["kind"] == "ScheduleError"
    assert doc["over_bytes"] > 0 and str(f"{doc['over_bytes']:,}") in doc["error"]
    missing = str(tmp_path / "missing.json")
    code, out, err = run(capsys, "simulate", missing, "store-all", "--memory", "1GiB",
                         "--json")
    assert code == 1 and json.loads(out) == {"error": err.split("error: ", 1)[1].strip(),
                                             "kind": "ChainError"}
    # without --json stdout stays empty
    code, out, err = run(capsys, "simulate", missing, "store-all", "--memory", "1GiB")
    assert code == 1 and out == "" and missing in err


@pytest.mark.parametrize("argv", [
    ["chains", "--json", "--bogus"],                                  # unknown option
    ["simulate", "gpt2-small", "--memory", "1GiB", "--json"],         # missing argument
    ["simulate", "gpt2-small", "store-all", "--memory", "1GiB", "--channel", "x",
     "--json"],                                                       # bad choice
    ["plan", "remat", "gpt2-small", "--memory", "lots", "--json"],    # bad value
    ["--json", "chains"],                                             # --json misplaced
    ["simulate", "gpt2-small", "--memory", "1GiB", "--js"],           # abbreviated
])
def test_bad_usage_with_json_prints_json_on_stdout_too(capsys, argv):
    # argparse printed its message on stderr only: a script parsing --json's stdout
    # got nothing; the exit code stays argparse's 2
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2
    assert json.loads(out) == {"error": err.strip().splitlines()[-1].split("error: ", 1)[1],
                               "kind": "UsageError"}



def test_the_shared_parser_prints_usage_errors_as_json_when_asked(capsys):
    # bench/ scripts build their parsers from CommandParser: one implementation
    # of negative values and JSON usage errors with `rtmem`'s
    from rtmem.cli import CommandParser, at_least
    p = CommandParser(prog="script")
    p.add_argument("--count", type=at_least(1))
    p.add_argument("--json", action="store_true")
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--count", "-inf", "--json"])
    out, err = capsys.readouterr()
    message = "argument --count: '-inf' is not an integer"
    assert e.value.code == 2 and f"script: error: {message}" in err
    assert json.loads(out) == {"error": message, "kind": "UsageError"}


def test_bad_usage_without_json_leaves_stdout_empty(capsys):
    with pytest.raises(SystemExit) as e:
        main(["chains", "--bogus"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "unrecognized arguments: --bogus" in err


def test_a_missing_extra_is_one_line(capsys, monkeypatch):
    import rtmem.plot

    def missing():
        raise ModuleNotFoundError("plotting needs matplotlib: pip install 'rtmem[plot]'")
    monkeypatch.setattr(rtmem.plot, "_matplotlib", missing)
    code = main(["simulate", "gpt2-small", "store-all", "--memory", "inf", "--plot",
                 "x.png"])
    err = capsys.readouterr().err
    assert code == 1 and "rtmem[plot]" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["plan", "remat", "gpt2-small", "--memory", "8GiB", "--quiet"],
    ["simulate", "gpt2-small", "store-all", "--memory", "inf"],
])
def test_a_missing_plot_extra_is_reported_before_the_work(capsys, monkeypatch, tmp_path,
                                                           argv):
    # `plan remat --plot` without matplotlib planned (minutes on a long chain) and
    # wrote --save, then failed with no table; `simulate --plot` printed its table
    # before exiting 1
    import rtmem.plot
    import rtmem.planners.remat

    def missing():
        raise ModuleNotFoundError("plotting needs matplotlib: pip install 'rtmem[plot]'")

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before finding matplotlib missing")
    monkeypatch.setattr(rtmem.plot, "_matplotlib", missing)
    monkeypatch.setattr(rtmem.planners.remat, "compare_remat", no_planning)
    extra = ["--save", str(tmp_path / "plan.json")] if argv[0] == "plan" else []
    code = main(argv + extra + ["--plot", str(tmp_path / "x.png")])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "rtmem[plot]" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("missing, install", [
    ({"torch", "matplotlib"}, "pip install 'rtmem[torch,plot]'"),
    ({"matplotlib"}, "pip install 'rtmem[plot]'"),
    ({"torch"}, "pip install 'rtmem[torch]'"),
])
def test_the_demo_names_every_missing_extra(capsys, monkeypatch, tmp_path, missing, install):
    # without torch and matplotlib it named matplotlib alone: installing the plot
    # extra then ran into torch
    for name in sorted({"torch", "matplotlib"} - missing):   # those the case says are there
        pytest.importorskip(name)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else find_spec(name, *a))
    code = main(["demo", "--out", str(tmp_path / "demo")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().endswith(install), err
    assert not os.path.exists(tmp_path / "demo")


def test_demo(capsys, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    code, out, _ = run(capsys, "demo", "--layers", "2", "--hidden", "32", "--heads", "4",
                       "--seq", "32", "--batch", "2", "--vocab", "64", "--steps", "2",
                       "--device", "cpu", "--out", str(tmp_path))
    assert code == 0
    assert "rotor" in out and "sequential" in out and "no rematerialization" in out
    assert "differ by at most 0.00e+00" in out        # same losses with and without
    for name in ("rotor_plan.png", "no_remat.png", "rotor_plan.json", "chain.json"):
        assert (tmp_path / name).exists()


def test_demo_trains_the_resnet_too(capsys, tmp_path):
    # batch norm in training mode: the replayed plan still gives the same losses
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    code, out, _ = run(capsys, "demo", "--model", "resnet", "--blocks", "1,2", "--width",
                       "4", "--image", "8", "--batch", "2", "--steps", "2", "--device",
                       "cpu", "--out", str(tmp_path))
    assert code == 0
    assert "resnet-1.2-w4-i8-b2: 5 stages" in out           # stem, 3 blocks, head
    assert "differ by at most 0.00e+00" in out
    assert (tmp_path / "rotor_plan.json").exists()


def test_demo_defaults_are_the_clis():
    # the CLI fills in MODEL_OPTIONS; run_demo's own defaults must be the same
    import inspect

    from rtmem.demo import MODEL_OPTIONS, run_demo
    params = inspect.signature(run_demo).parameters
    for options in MODEL_OPTIONS.values():
        for name, default in options.items():
            assert params[name].default == default, name


def test_demo_result_values(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")       # run_demo plots
    from rtmem.demo import run_demo
    from rtmem.planners import Plan
    r = run_demo(layers=2, hidden=32, heads=4, seq=32, batch=2, vocab=64, steps=3,
                 out=str(tmp_path), device="cpu", say=lambda *a: None)
    assert r["plain_losses"] == r["plan_losses"]
    assert r["plan_peak_bytes"] <= r["plan"].peak <= r["budget"]
    assert r["plan_peak_bytes"] < r["plain_peak_bytes"]
    assert Plan.load(tmp_path / "rotor_plan.json").schedule == r["plan"].schedule


def test_a_failed_demo_removes_the_folder_it_made_and_keeps_one_given(capsys, tmp_path):
    # an infeasible budget is found only after profiling; the folder made for the plots
    # used to stay behind empty
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    argv = ["demo", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8",
            "--batch", "1", "--vocab", "16", "--steps", "1", "--device", "cpu",
            "--memory", "1B"]
    code, _, err = run(capsys, *argv, "--out", str(tmp_path / "new" / "demo"))
    assert code == 1 and "no persistent schedule" in err
    # its missing parents too ("new" stayed behind), up to the folder that existed
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()
    (tmp_path / "mine").mkdir()
    code, _, _ = run(capsys, *argv, "--out", str(tmp_path / "mine"))
    assert code == 1 and (tmp_path / "mine").is_dir()


def test_demo_folders_made_are_absolute_deepest_first(tmp_path, monkeypatch):
    from rtmem.demo import missing_folders
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    assert missing_folders("a/b/c") == [str(tmp_path / "a" / "b" / "c"),
                                        str(tmp_path / "a" / "b")]
    assert missing_folders("a") == []


def test_an_interrupted_demo_removes_the_empty_folders_it_made(tmp_path):
    # a Ctrl-C is a KeyboardInterrupt, not an Exception; a folder written into stays
    from rtmem.demo import _output_folder
    with pytest.raises(KeyboardInterrupt):
        with _output_folder(str(tmp_path / "new" / "demo")):
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with _output_folder(str(tmp_path / "new" / "demo")):
            (tmp_path / "new" / "kept").write_text("x")
            raise RuntimeError
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["kept"]


def test_demo_trains_as_plain_adam_and_falls_back_to_halfway(tmp_path, monkeypatch):
    # when half the peak is below the least feasible memory the budget is halfway
    # between the two; both runs train as a plain torch loop with Adam would
    torch = pytest.importorskip("torch")
    pytest.importorskip("matplotlib")       # run_demo plots
    import math

    import rtmem.planners
    from rtmem.demo import run_demo
    from rtmem.planners import plan_store_all
    from rtmem.torch import gpt2_model
    least, real = [], rtmem.planners.min_feasible_memory

    def min_feasible_memory(chain):      # above half the peak: the fallback
        least.append(max(real(chain), plan_store_all(chain, math.inf).peak // 2 + 1))
        return least[-1]
    monkeypatch.setattr(rtmem.planners, "min_feasible_memory", min_feasible_memory)
    said = []
    r = run_demo(layers=1, hidden=16, heads=2, seq=8, vocab=16, batch=2, steps=3,
                 out=str(tmp_path), device="cpu", say=said.append)
    peak = plan_store_all(r["chain"], math.inf).peak
    assert r["budget"] == (least[0] + peak) // 2
    assert "half the peak is below the least feasible" in said[0]
    torch.manual_seed(0)
    net, loss_fn, make_batch = gpt2_model(layers=1, hidden=16, heads=2, seq=8, vocab=16)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    expected = []
    for x, y in [make_batch(2, gen) for _ in range(3)]:
        loss = loss_fn(net(x), y)
        expected.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert r["plain_losses"] == pytest.approx(expected, rel=1e-5)
    assert r["plan_losses"] == pytest.approx(expected, rel=1e-5)


def test_no_command_prints_help(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "simulate" in out


def test_python_dash_m_rtmem_runs_the_cli():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "rtmem", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("rtmem ")


@pytest.mark.parametrize("argv", [("bench", "dha", "--tokens", "0"),
                                  ("bench", "dha", "--repeats", "0"),
                                  ("bench", "pcie", "--repeats", "0")])
def test_zero_bench_counts_are_refused_not_replaced(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_a_reader_that_goes_away_is_not_an_error_message(capsys, monkeypatch):
    # `rtmem chains --json | head -1` printed "rtmem chains: error: [Errno 32]
    # Broken pipe" on stderr
    import io
    import sys

    class ClosedPipe(io.TextIOBase):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = main(["chains", "--json"])
    assert code == 1 and capsys.readouterr().err == ""


def test_a_folder_named_like_a_built_in_does_not_hide_it(capsys, tmp_path, monkeypatch):
    # an output folder "resnet50" (or "store-all") in the working directory made
    # `rtmem simulate resnet50 store-all` fail with "[Errno 21] Is a directory"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "resnet50").mkdir()
    (tmp_path / "store-all").mkdir()
    (tmp_path / "sequential:2").mkdir()
    code, out, err = run(capsys, "simulate", "resnet50", "store-all", "--memory", "inf",
                         "--json")
    assert code == 0 and json.loads(out)["chain"] == "resnet50", err
    code, out, err = run(capsys, "simulate", "gpt2-small", "sequential:2", "--memory",
                         "inf", "--json")
    assert code == 0, err
    code, out, err = run(capsys, "plan", "remat", "resnet50", "--memory", "inf",
                         "--quiet", "--json")
    assert code == 0, err
    # a folder that names no built-in is still reported as one
    (tmp_path / "mine").mkdir()
    code, _, err = run(capsys, "simulate", "mine", "store-all", "--memory", "inf")
    assert code == 1 and "Is a directory" in err


def test_plan_save_makes_a_missing_folder_as_plot_does(capsys, tmp_path):
    # --plot made its folder; --save failed on one with "[Errno 2]" after the solve
    pytest.importorskip("matplotlib")   # --plot (an extra: rtmem[plot])
    save, plot = tmp_path / "a" / "plan.json", tmp_path / "b" / "plan.png"
    code, _, err = run(capsys, "plan", "remat", "gpt2:layers=2", "--memory", "inf",
                       "--quiet", "--save", str(save), "--plot", str(plot))
    assert code == 0, err
    assert save.is_file() and plot.is_file()


def test_writable_leaves_nothing_when_makedirs_fails_part_way(tmp_path):
    # makedirs made "new", then failed on the name too long below it: the clean-up
    # stopped at that missing folder and left "new" behind
    from rtmem.cli import writable
    problem = writable(str(tmp_path / "new" / ("y" * 300) / "plan.json"))
    assert problem and "too long" in problem
    assert list(tmp_path.iterdir()) == []


def test_writable_refuses_a_folder_and_checks_a_replaced_file_s_folder(tmp_path, monkeypatch):
    # A folder read as writable (a demo's <out>/chain.json that is a folder failed
    # only when written). A file the bench scripts replace (written beside it,
    # then renamed over) was checked by its own mode: a read-only result, which
    # the rename replaces fine, was refused, and a read-only folder passed.
    import os

    from rtmem.cli import writable
    assert "folder" in writable(str(tmp_path))
    result = tmp_path / "adam.json"
    result.write_text("{}")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)   # a read-only file (root
    assert writable(str(result)) == "permission denied"        # passes every access check)
    assert writable(str(result), replace=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adam.json"]
    assert result.read_text() == "{}"


def test_output_paths_are_checked_before_the_solve_and_leave_nothing(capsys, tmp_path,
                                                                     monkeypatch):
    # --save /proc/x.json failed with "[Errno 2]" only after the whole solve; the
    # check makes the missing folders and the file, then removes them again
    pytest.importorskip("matplotlib")   # --plot (an extra: rtmem[plot])
    import os

    import rtmem.planners.remat as remat
    if os.path.isdir("/proc/self"):
        with pytest.raises(SystemExit) as e:
            main(["plan", "remat", "gpt2-small", "--memory", "8GiB", "--save",
                  "/proc/rtmem-test/x.json"])
        assert e.value.code == 2 and "argument --save: cannot write" in capsys.readouterr().err
    save, plot = tmp_path / "a" / "b" / "plan.json", tmp_path / "c" / "plan.png"

    def fails(*args, **kwargs):
        assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
        raise remat.InfeasibleError("stand-in for a failed solve", min_feasible=None)
    monkeypatch.setattr(remat, "compare_remat", fails)
    code, _, err = run(capsys, "plan", "remat", "gpt2:layers=2", "--memory", "8GiB",
                       "--quiet", "--save", str(save), "--plot", str(plot))
    assert code == 1 and "stand-in" in err
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "kept.json"
    existing.write_text("old")
    code, _, err = run(capsys, "plan", "remat", "gpt2:layers=2", "--memory", "8GiB",
                       "--quiet", "--save", str(existing))
    assert code == 1 and existing.read_text() == "old"


def test_a_demo_model_too_large_for_memory_is_one_line(capsys, monkeypatch, tmp_path):
    # torch's CPU allocator raises a RuntimeError, not a MemoryError: `rtmem demo
    # --hidden 99999999999 --heads 1` ended in its traceback
    torch = pytest.importorskip("torch")
    pytest.importorskip("matplotlib")           # _demo_problem asks for it
    import rtmem.demo

    def too_large(**kwargs):
        torch.empty(2**62, dtype=torch.uint8)   # the embedding's allocation, in effect
    monkeypatch.setattr(rtmem.demo, "run_demo", too_large)
    code, _, err = run(capsys, "demo", "--device", "cpu", "--out", str(tmp_path))
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "rtmem demo: error: out of host memory" in err and "can't allocate" in err
    assert "make the model smaller (--batch and the sizes of --model gpt2: --layers" in err

    def other(**kwargs):
        raise RuntimeError("a bug")             # other RuntimeErrors are not hidden
    monkeypatch.setattr(rtmem.demo, "run_demo", other)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo", "--device", "cpu", "--out", str(tmp_path)])


def test_a_problem_too_large_for_host_memory_is_one_line(capsys, monkeypatch):
    # `rtmem simulate gpt2:layers=999999999 ...` ended in numpy's MemoryError
    # traceback; it is said in one line with what to do
    import rtmem.cli as cli

    def too_large(spec):
        raise MemoryError("Unable to allocate 7.45 GiB for an array with shape "
                          "(999999999,) and data type float64")
    monkeypatch.setattr(cli, "load_chain", too_large)
    code, out, err = run(capsys, "simulate", "gpt2:layers=999999999", "store-all",
                         "--memory", "inf")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "out of host memory (Unable to allocate 7.45 GiB" in err
    assert "make it smaller" in err


@pytest.mark.parametrize("command", ["doctor", "bench"])
def test_help_descriptions_print_no_rest_markup(capsys, command):
    # the description is the module docstring's first line: --help printed
    # "``rtmem doctor``: report what the runtime finds on this machine."
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "``" not in out and f"rtmem {command}" in out


def _two_stage_chain():
    # w1 = 30 bytes prefetched, abar1 = 10 bytes offloaded: h2d 30, d2h 10
    return two_stage_chain(w=(10, 30))


def test_at_least_bounds_are_inclusive_and_finite():
    from rtmem.cli import at_least
    assert at_least(1)("1") == 1
    unit = at_least(0.0, float, 1.0)
    assert unit("0") == 0.0 and unit("1") == 1.0
    for bad in ("1.5", "-0.1", "nan", "inf"):
        with pytest.raises(ArgumentTypeError):
            unit(bad)
    with pytest.raises(ArgumentTypeError, match="finite"):
        at_least(0.0, float)("inf")


def test_output_file_takes_upper_case_suffixes(tmp_path):
    from rtmem.cli import PLOT_SUFFIXES, output_file
    path = str(tmp_path / "g.PNG")
    assert output_file(*PLOT_SUFFIXES)(path) == path


def test_load_chain_and_schedule_read_specs(tmp_path):
    from rtmem.cli import load_chain, load_schedule
    from rtmem.errors import ChainError
    from rtmem.planners import Chain, sequential_schedule
    chain = Chain.homogeneous(6, x=10)
    assert load_schedule("sequential:3", chain) == sequential_schedule(6, 3)
    with pytest.raises(ChainError, match="no chain file"):
        load_chain(str(tmp_path / "missing.JSON"))


def test_simulate_reports_each_quantity_in_its_row_and_field(capsys, tmp_path):
    # the chain of test_channel_models with w1 = 30: w_prefetch 1 (30 B at 10 B/s)
    # waits for the offload of abar1 [1, 2] on a shared link ([2, 5]) and not on a
    # duplex one ([1, 4]); then F_all 1, B 1, B 0 (1 s each, L takes none)
    path = tmp_path / "c.json"
    _two_stage_chain().save(path)
    for channel, makespan in (("shared", 8.0), ("duplex", 7.0)):
        code, out, _ = run(capsys, "simulate", str(path), OVERLAPPING_TRANSFERS, "--memory",
                           "1000000", "--bandwidth", "10", "--channel", channel, "--json")
        doc = json.loads(out)
        assert code == 0 and doc["channel"] == channel and doc["makespan_s"] == makespan
        assert doc["h2d_bytes"] == 30 and doc["d2h_bytes"] == 10
        assert doc["compute_s"] == 4.0 and doc["idle_s"] == makespan - 4.0
        assert doc["memory_bytes"] == 10**6 and type(doc["memory_bytes"]) is int
        assert doc["bandwidth_Bps"] == 10
    code, out, _ = run(capsys, "simulate", str(path), OVERLAPPING_TRANSFERS, "--memory", "1000000",
                       "--bandwidth", "10", "--channel", "duplex")
    rows = {line[:14].strip(): line[14:].strip() for line in out.splitlines()[2:]}
    assert rows["makespan"] == "7.000 s" and rows["compute time"] == "4.000 s"
    assert rows["idle time"] == "3.000 s" and rows["memory limit"] == "976.56 KiB"
    assert rows["host->device"] == "30 B" and rows["device->host"] == "10 B"


def test_chains_columns_are_each_chains_figures(capsys):
    from rtmem.planners import builtin
    from rtmem.units import format_bytes
    code, out, _ = run(capsys, "chains", "--json")
    for doc in json.loads(out):
        c = builtin(doc["name"])
        assert doc["weight_bytes"] == int(c.w.sum()) != doc["sum_xbar_bytes"]
        assert doc["sum_xbar_bytes"] == int(c.xbar.sum()) and doc["stages"] == c.n
    code, out, _ = run(capsys, "chains")
    header = out.splitlines()[0].split()
    row = next(line.split("  ") for line in out.splitlines() if line.startswith("resnet50 "))
    row = [cell.strip() for cell in row if cell.strip()]
    c = builtin("resnet50")
    assert header[:6] == ["chain", "stages", "compute", "sum(xbar)", "weights", "no-remat"]
    assert row[3] == format_bytes(c.xbar.sum()) and row[4] == format_bytes(c.w.sum())


def test_demo_passes_every_option_to_run_demo(capsys, monkeypatch, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import rtmem.demo
    seen = []
    monkeypatch.setattr(rtmem.demo, "run_demo", lambda **kw: seen.append(kw))
    code, _, err = run(capsys, "demo", "--layers", "3", "--batch", "2", "--steps", "7",
                       "--slots", "9", "--memory", "40MiB", "--device", "cpu",
                       "--out", str(tmp_path))
    assert code == 0, err
    assert seen == [{"model": "gpt2", "batch": 2, "steps": 7, "memory": "40MiB", "slots": 9,
                     "out": str(tmp_path), "device": "cpu", "layers": 3, "hidden": 128,
                     "heads": 4, "seq": 128, "vocab": 512}]


def test_demo_resnet_image_halves_rounding_up(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from rtmem.cli import _demo_problem, build_parser
    # 5x5 -> 3x3 -> 2x2 (stride 2, rounded up): 4 values per channel, trainable
    args = build_parser().parse_args(["demo", "--model", "resnet", "--batch", "1",
                                      "--image", "5", "--out", str(tmp_path)])
    assert _demo_problem(args) is None


# tables, bench front end and plots
def test_format_table_pads_aligns_and_rules_every_column():
    from rtmem._table import format_table
    # widths 5 and 2 (the longest cell of each column); 2 spaces between columns;
    # default: the first column left, the others right; trailing blanks stripped
    assert format_table(["name", "n"], [["a", 1], ["bbbbb", 22]]).splitlines() == [
        "name    n",
        "-----  --",
        "a       1",
        "bbbbb  22"]
    assert format_table(["name", "n"], [["a", 1]], align="rl").splitlines() == [
        "name  n", "----  -", "   a  1"]
    with pytest.raises(ValueError, match="one cell per header"):
        format_table(["a", "b"], [["x"]])


def test_format_table_aligns_escaped_and_wide_names_on_their_display_width():
    from rtmem._table import format_table
    # a tab or newline split or shifted the row; a wide character (two terminal
    # columns) or a combining accent (none) was counted as one column
    rows = [["a\tb", 1], ["\u65e5\u672c", 22], ["e\u0301", 3], ["x\u202ey", 4]]
    assert format_table(["name", "n"], rows).splitlines() == [
        "name       n",
        "--------  --",
        "a\\tb       1",
        "\u65e5\u672c      22",             # 4 columns wide
        "e\u0301          3",            # 1 column wide
        "x\\u202ey   4"]                 # a bidirectional override, shown
    # what the stream's encoding cannot write is measured as the \uXXXX it is printed as
    assert format_table(["name", "n"], [["\u65e5", 1]], encoding="ascii").splitlines() == [
        "name    n", "------  -", "\\u65e5  1"]


def test_simulate_table_keeps_a_chain_name_with_a_newline_on_its_row(capsys, tmp_path):
    from rtmem.planners import Chain, from_spec
    doc = from_spec("gpt2:layers=1").to_dict()
    doc["name"] = "two\nlines\tand a tab"
    Chain.from_dict(doc).save(tmp_path / "c.json")
    code, out, _ = run(capsys, "simulate", str(tmp_path / "c.json"), "store-all",
                       "--memory", "inf")
    lines = out.splitlines()
    assert code == 0 and lines[2] == "chain         two\\nlines\\tand a tab (3 stages)"
    assert len({len(line) for line in lines}) == 1     # right-aligned: one width


class _FakeScript:
    def __init__(self, code=3, error=None):
        self.calls, self.code, self.error = [], code, error

    def main(self, argv, prog):
        self.calls.append((argv, prog))
        if self.error:
            raise self.error
        return self.code


@pytest.mark.parametrize("argv, script, expected", [
    (["bench", "pcie"], "pcie.py", []),
    (["bench", "pcie", "--quick", "--max-size", "16MiB", "--repeats", "2",
      "--plot=-run1.png"], "pcie.py", ["--quick", "--max-size=16MiB", "--repeats=2",
                                "--plot=-run1.png"]),
    (["bench", "dha", "--model", "gpt2-xl", "--tokens", "64", "--repeats", "1", "--sweep",
      "none"], "dha_layers.py", ["--model=gpt2-xl", "--tokens=64", "--repeats=1",
                                 "--sweep=none"]),
    (["bench", "dha", "--quick"], "dha_layers.py", ["--quick"]),
    (["bench", "adam"], "adam.py", []),
    (["bench", "adam", "--sizes", "1e3,2e3", "--repeats", "2", "--budget", "0.5",
      "--warm-cache", "--out=-a.json"], "adam.py",
     ["--warm-cache", "--sizes=1e3,2e3", "--repeats=2", "--budget=0.5", "--out=-a.json"]),
    (["bench", "allocator", "--quick", "--repeats", "2"], "allocator.py",
     ["--quick", "--repeats=2"]),
])
def test_bench_passes_its_options_to_the_script_and_returns_its_code(capsys, monkeypatch,
                                                                     argv, script, expected):
    import rtmem.cli_bench as cb
    fake, loaded = _FakeScript(code=3), []
    monkeypatch.setattr(cb, "_load", lambda name: loaded.append(name) or fake)
    assert main(argv) == 3
    assert loaded == [script]
    assert fake.calls == [(expected, f"rtmem bench {argv[1]}")]


def test_bench_errors_name_the_command_and_a_missing_script_is_exit_1(capsys, monkeypatch,
                                                                      tmp_path):
    import rtmem.cli_bench as cb
    monkeypatch.setattr(cb, "_load", lambda name: _FakeScript(error=OSError("disk full")))
    code, _, err = run(capsys, "bench", "dha")
    assert code == 1 and err == "rtmem bench dha: error: disk full\n"
    monkeypatch.undo()
    monkeypatch.setattr(cb, "bench_dir", lambda: str(tmp_path))
    code, out, err = run(capsys, "bench", "pcie")
    assert code == 1 and f"{tmp_path}/pcie.py not found" in err
    code, out, _ = run(capsys, "bench")            # no benchmark named: help, bad usage
    assert code == 2 and all(name in out for name in ("pcie", "dha", "adam", "allocator"))


def _tree(root, pyproject, markers=("_common.py", "gpu_session.sh")):
    """A folder ``root`` as a checkout (or site-packages) holding rtmem/cli_bench.py,
    a pyproject.toml of ``pyproject`` (None: none), and bench/ with ``markers`` and
    a pcie.py that records that it ran; returns the path cli_bench would have."""
    (root / "rtmem").mkdir(parents=True)
    (root / "bench").mkdir()
    if pyproject is not None:
        (root / "pyproject.toml").write_text(pyproject)
    for name in markers:
        (root / "bench" / name).write_text("")
    (root / "bench" / "pcie.py").write_text(
        "import pathlib\n"
        "def main(argv, prog):\n"
        "    pathlib.Path(__file__).with_name('ran').write_text(prog)\n"
        "    return 0\n")
    return str(root / "rtmem" / "cli_bench.py")


@pytest.mark.parametrize("pyproject, markers", [
    # an installed rtmem: site-packages/bench is some other distribution's
    (None, ("_common.py", "gpu_session.sh")),
    ('[project]\nname = "bench-tools"\n', ("_common.py", "gpu_session.sh")),
    ('[project]\nname = "rtmem"\n', ("_common.py",)),
    ('[project]\nname = "rtmem"\n', ("gpu_session.sh",)),
])
def test_bench_refuses_a_bench_folder_that_is_not_rtmems(capsys, monkeypatch, tmp_path,
                                                        pyproject, markers):
    # bench_dir() took whatever bench/ sat beside the rtmem package: installed, that
    # is site-packages/bench, and `rtmem bench pcie` ran another package's pcie.py
    import rtmem.cli_bench as cb
    monkeypatch.setattr(cb, "__file__", _tree(tmp_path / "site", pyproject, markers))
    with pytest.raises(FileNotFoundError, match="not in a checkout of rtmem"):
        cb.bench_dir()
    code, _, err = run(capsys, "bench", "pcie")
    assert code == 1 and err.startswith("rtmem bench pcie: error: this rtmem (")
    assert "run this from a checkout" in err
    assert not (tmp_path / "site" / "bench" / "ran").exists()


def test_bench_runs_the_scripts_of_an_rtmem_checkout(capsys, monkeypatch, tmp_path):
    import rtmem.cli_bench as cb
    assert os.path.isfile(os.path.join(cb.bench_dir(), "pcie.py"))   # this checkout's
    # _load registers the fake as sys.modules["pcie"] and puts its folder on sys.path,
    # as the CLI's one-shot process wants: undone here, or a later test of this worker
    # that imports bench/pcie.py got the fake (main() missing 'prog')
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "pcie", None)
    monkeypatch.setattr(cb, "__file__", _tree(tmp_path / "checkout",
                                              '[project]\nname = "rtmem"  # us\n'))
    assert cb.bench_dir() == str(tmp_path / "checkout" / "bench")
    assert main(["bench", "pcie"]) == 0
    assert (tmp_path / "checkout" / "bench" / "ran").read_text() == "rtmem bench pcie"


def test_memory_curve_steps_through_each_compute_ops_usage():
    # from t = 0 at the first compute op's usage; then, for each compute op, its
    # usage from its start and its usage once over from its end
    from rtmem.planners import Platform, Schedule, simulate
    from rtmem.planners.schedule import COMPUTE_OPS
    from rtmem.plot import memory_curve
    chain, sched = _two_stage_chain(), Schedule.from_text(OVERLAPPING_TRANSFERS)
    r = simulate(chain, sched, Platform(10**6, bandwidth=10))
    t, m = memory_curve(r, sched)
    k = [i for i in range(len(sched)) if sched.op[i] in [int(o) for o in COMPUTE_OPS]]
    assert len(k) == 5                                   # F_all 0, F_all 1, L, B 1, B 0
    tl = r.timeline
    assert t.tolist() == [0.0] + [x for i in k for x in (tl["start"][i], tl["end"][i])]
    assert m.tolist() == [tl["mem"][k[0]]] + [x for i in k
                                                for x in (tl["mem"][i], tl["mem_after"][i])]
    assert m[0] > 0 and m.max() == r.peak
    assert any(tl["mem"][i] != tl["mem_after"][i] for i in k)


def test_plot_schedule_lanes_units_and_limit(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from rtmem.planners import Chain, Platform, Schedule
    from rtmem.plot import plot_schedule
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)     # keep the figure to inspect it
    # sizes in MiB: the memory axis is in MiB, the limit line at 16 (MiB)
    chain = Chain(u_f=[1, 1], u_b=[1, 1], x=[2**20, 2**20], xbar=[2**20, 2**20],
                  w=[2**20, 3 * 2**20], x0=0)
    sched = Schedule.from_text(OVERLAPPING_TRANSFERS)
    plot_schedule(chain, sched, Platform(16 * 2**20, bandwidth=2**20, channel="duplex"),
                  str(tmp_path / "p.png"))
    fig = figs[0]
    ax_g, ax_m = fig.axes[:2]
    assert ax_m.get_ylabel() == "memory (MiB)"
    limit = [ln for ln in ax_m.get_lines() if ln.get_label().startswith("limit")]
    assert [ln.get_ydata()[0] for ln in limit] == [16.0]
    assert [t.get_text() for t in ax_g.get_yticklabels()] == ["compute", "H2D", "D2H"]
    lanes = {c.get_label(): c.get_paths()[0].vertices[:, 1].min()
             for c in ax_g.collections}
    # bars span lane +- 0.4
    assert lanes["w_prefetch"] == pytest.approx(0.6)       # H2D, lane 1
    assert lanes["offload"] == pytest.approx(1.6)          # D2H, lane 2
    assert lanes["F_all"] == pytest.approx(-0.4)
    monkeypatch.undo()
    plt.close(fig)


@pytest.mark.parametrize("argv", [["simulate", "{chain}", "store-all", "--memory", "inf"],
                                  ["plan", "remat", "{chain}", "--memory", "1GiB", "--quiet"]])
def test_names_outside_stdouts_encoding_are_escaped_not_a_traceback(monkeypatch, tmp_path,
                                                                      argv):
    # PYTHONIOENCODING=ascii, or a Windows code page on a redirected stdout: the
    # table of a chain named "模型" ended in a UnicodeEncodeError traceback (the
    # progress lines on stderr printed it escaped); now stdout escapes it too,
    # and its error handler is back afterwards
    import io
    import sys
    import dataclasses
    path = tmp_path / "chain.json"
    dataclasses.replace(two_stage_chain(), name="模型-µ").save(path)
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main([str(path) if a == "{chain}" else a for a in argv]) == 0
    stdout.flush()
    text = stdout.buffer.getvalue().decode("ascii")
    # the whole table: 2 stages of 1 s forward and 1 s backward, no remat
    assert "\\u6a21\\u578b-\\xb5" in text and "4.000 s" in text
    assert stdout.errors == "strict"


@pytest.mark.parametrize("how", ["plain", "inside a jitted call"])
def test_ctrl_c_exits_130_with_one_line_not_a_traceback(capsys, monkeypatch, how):
    # Ctrl-C in a long solve ended in a KeyboardInterrupt traceback, or, landing
    # inside a numba call, in "SystemError: CPUDispatcher(...) returned a result
    # with an exception set" and exit 1: an internal-looking crash
    import rtmem.planners

    def interrupted(*args, **kwargs):
        if how == "plain":
            raise KeyboardInterrupt
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise SystemError("CPUDispatcher(<function f>) returned a result with an "
                              "exception set") from e
    monkeypatch.setattr(rtmem.planners, "simulate", interrupted)
    code, out, err = run(capsys, "simulate", "resnet50", "store-all", "--memory", "inf")
    assert code == 130 and out == "" and err == "rtmem: interrupted\n"


def test_a_system_error_of_another_cause_is_not_taken_for_ctrl_c(capsys, monkeypatch):
    import rtmem.planners

    def broken(*args, **kwargs):
        raise SystemError("an internal error")
    monkeypatch.setattr(rtmem.planners, "simulate", broken)
    with pytest.raises(SystemError, match="internal"):
        main(["simulate", "resnet50", "store-all", "--memory", "inf"])


@pytest.mark.parametrize("which, text, fragment", [
    ("chain", '{"u_f": [1, 1], "u_b": [1, 1], "x": [4, -5], "xbar": [8, 9]}', "x[1] = -5"),
    ("chain", '{"u_f": [1], "u_b": [1], "x": [4], "xbar": [8], "xbarr": [8]}', "xbarr"),
    ("chain", "", "malformed chain JSON"),
    ("plan", '{"format": "rtmem.plan", "version": 1, "algorithm": "rotor", "makespan": 1, '
             '"peak": -1, "budget": 9, "schedule": "F_all 0, L, B 0"}', "peak -1 bytes"),
    ("plan", "{", "malformed schedule JSON"),
    ("schedule", "F_all 0, L, B zero", "'B zero'"),
])
def test_an_error_in_a_file_names_the_file(capsys, tmp_path, which, text, fragment):
    # "x[1] = -5 is negative" did not say which of `simulate CHAIN SCHEDULE`'s two
    # files holds it
    bad = tmp_path / "edited.json"
    bad.write_text(text)
    chain = str(bad) if which == "chain" else "gpt2-small"
    schedule = "store-all" if which == "chain" else str(bad)
    code, _, err = run(capsys, "simulate", chain, schedule, "--memory", "8GiB")
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err
    assert f"error: {bad}: " in last and fragment in last


def test_an_empty_schedule_file_is_called_empty(capsys, tmp_path):
    # it was read as a schedule of no operations: "the schedule ends before the
    # backward pass is complete"
    (tmp_path / "plan.json").write_text("\n")
    code, _, err = run(capsys, "simulate", "gpt2-small", str(tmp_path / "plan.json"),
                       "--memory", "8GiB")
    assert code == 1 and f"{tmp_path / 'plan.json'}: the file is empty" in err
