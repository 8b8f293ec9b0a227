"""``rtmem plan remat`` (rtmem/cli_plan.py)."""

import argparse
import json
import math

import pytest

from rtmem.cli_plan import register
from rtmem.planners import Platform, from_spec, simulate, store_all_schedule
from rtmem.planners.plan import Plan
from rtmem.planners.remat import min_feasible_memory
from rtmem.units import format_bytes

SPEC = "gpt2:layers=4,hidden=64,heads=4,seq=16,batch=2,vocab=50"


def run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="rtmem")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def budget(fraction):
    chain = from_spec(SPEC)
    lo = min_feasible_memory(chain)
    hi = simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak
    return str(int(lo + fraction * (hi - lo)))


def test_table_lists_rotor_and_every_baseline(capsys):
    code, out, err = run(capsys, "plan", "remat", SPEC, "--memory", budget(0.3),
                         "--slots", "200")
    assert code == 0
    for name in ("rotor", "store-all", "sequential", "sqrt", "revolve"):
        assert name in out
    # store-all cannot fit at 30 %: its row says the least budget it needs, its peak
    chain = from_spec(SPEC)
    peak = simulate(chain, store_all_schedule(chain.n), Platform(math.inf)).peak
    store_all = next(line for line in out.splitlines() if line.startswith("store-all"))
    assert store_all.endswith(f"infeasible: needs {format_bytes(peak)}")
    rotor = next(line for line in out.splitlines() if line.startswith("rotor"))
    assert "method=" in rotor and "slots=" in rotor  # the notes say which candidate won
    assert "planning rotor" in err                   # progress on stderr


def test_a_slow_solve_is_told_in_the_command_lines_words(capsys, monkeypatch):
    # Python's display of plan_remat's warning named a line of rtmem/cli_plan.py
    # and advised progress= (the bar is drawn already) and slots=, not --slots.
    # Told on the status stream, with --quiet too
    from rtmem.planners import remat
    chain = from_spec(SPEC)
    monkeypatch.setattr(remat, "SLOW_SOLVE_SECONDS",
                        remat._predicted_seconds(chain.n, 200) / 4)
    code, out, err = run(capsys, "plan", "remat", SPEC, "--memory", budget(0.3),
                         "--slots", "200", "--quiet")
    assert code == 0 and "rotor" in out
    told = [line for line in err.splitlines() if "warning:" in line]
    assert len(told) == 1, err
    assert f"{chain.n:,} stages with " in told[0] and "--slots " in told[0]
    assert "progress=" not in err and "cli_plan.py" not in err


def test_json_save_and_chain_file(capsys, tmp_path):
    chain_path = tmp_path / "c.json"
    from_spec(SPEC).save(chain_path)
    saved = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "remat", str(chain_path), "--memory", budget(0.5),
                         "--json", "--quiet", "--save", str(saved))
    assert code == 0 and err == ""
    doc = json.loads(out)
    rotor = next(p for p in doc["plans"] if p["planner"] == "rotor")
    assert rotor["peak_bytes"] <= int(budget(0.5))
    assert Plan.load(saved).makespan == rotor["makespan_s"]


def test_a_chain_too_long_for_revolve_still_gets_its_table(capsys, tmp_path):
    # plan_revolve refuses its table beyond 4,410 stages (2,712 before it needed only
    # the argmins): the command failed with that error although rotor and the other
    # baselines had plans
    from rtmem.planners import Chain
    path = tmp_path / "long.json"
    Chain.homogeneous(4500, name="long").save(path)
    code, out, err = run(capsys, "plan", "remat", str(path), "--memory", "inf", "--quiet")
    assert code == 0
    revolve = next(line for line in out.splitlines() if line.startswith("revolve"))
    assert "not attempted: 4,500 stages, plan_revolve plans at most 4,410" in revolve
    assert "infeasible" not in revolve                     # more memory would not help
    code, out, err = run(capsys, "plan", "remat", str(path), "--memory", "inf", "--quiet",
                         "--json")
    docs = {p["planner"]: p for p in json.loads(out)["plans"]}
    assert docs["revolve"]["min_feasible_bytes"] is None
    assert docs["revolve"]["message"].startswith("not attempted:")
    assert docs["rotor"]["peak_bytes"] == 4503


def test_infeasible_budget_raises_with_minimum(capsys):
    from rtmem.errors import InfeasibleError
    with pytest.raises(InfeasibleError) as err:
        run(capsys, "plan", "remat", SPEC, "--memory", "1000", "--quiet")
    assert err.value.min_feasible == min_feasible_memory(from_spec(SPEC))


def test_errors_name_the_command_as_typed(capsys):
    # "rtmem plan: error: ..." for `rtmem plan remat`; argparse's own errors name
    # the whole command
    from rtmem.cli import main
    assert main(["plan", "remat", SPEC, "--memory", "1000", "--quiet"]) == 1
    assert capsys.readouterr().err.startswith("rtmem plan remat: error: no persistent")


def test_an_infeasible_budget_with_json_prints_a_json_verdict(capsys):
    # only the stderr line was printed: a script piping `--json` had nothing to parse
    from rtmem.cli import main
    from rtmem.errors import InfeasibleError
    from rtmem.planners.remat import plan_remat
    with pytest.raises(InfeasibleError) as expected:
        plan_remat(from_spec(SPEC), 1000)
    assert main(["plan", "remat", SPEC, "--memory", "1000", "--quiet", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": str(expected.value), "kind": "InfeasibleError",
                               "infeasible": True,
                               "budget_bytes": 1000,
                               "min_feasible_bytes": min_feasible_memory(from_spec(SPEC))}
    assert err == f"rtmem plan remat: error: {expected.value}\n"


def test_an_infeasible_budget_is_reported_before_any_baseline_is_planned(capsys, monkeypatch):
    # compare_remat planned store-all, sequential, sqrt and Revolve (its O(n^3)
    # table) before the command raised rotor's InfeasibleError: none of them fits
    # below rotor's least budget, and their table was never printed
    from rtmem.cli import main
    from rtmem.errors import InfeasibleError
    from rtmem.planners import remat, revolve
    from rtmem.planners.remat import plan_remat
    with pytest.raises(InfeasibleError) as expected:
        plan_remat(from_spec(SPEC), 1000)

    def planned(*args, **kwargs):
        raise AssertionError("a baseline was planned")
    for module, name in ((remat, "plan_store_all"), (remat, "plan_sequential"),
                         (remat, "plan_sqrt"), (revolve, "plan_revolve")):
        monkeypatch.setattr(module, name, planned)
    assert main(["plan", "remat", SPEC, "--memory", "1000"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    # the same message and exit code as before; only rotor's progress line precedes it
    assert err.splitlines()[-1] == f"rtmem plan remat: error: {expected.value}"
    assert "planning rotor" in err and "planning store-all" not in err


def test_plot_calls_plot_schedule(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")   # the CLI refuses --plot without it, before planning
    import rtmem.plot
    calls = []
    monkeypatch.setattr(rtmem.plot, "plot_schedule",
                        lambda chain, schedule, platform, path, title=None:
                        calls.append((len(schedule), platform.memory, path)))
    path = str(tmp_path / "p.png")
    code, _, _ = run(capsys, "plan", "remat", SPEC, "--memory", budget(0.4), "--plot", path,
                     "--quiet")
    assert code == 0 and calls and calls[0][2] == path
    assert calls[0][1] == int(budget(0.4))


def test_plan_without_planner_prints_help(capsys):
    code, out, _ = run(capsys, "plan")
    assert code == 2 and "remat" in out


def test_progress_bar_draws_on_a_terminal_only():
    import io

    from rtmem.cli_plan import ProgressBar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = ProgressBar(stream=stream, width=10)
        bar("planning rotor ...")
        bar.update(0.5)
        bar.update(1.0)
        bar("done")
    assert "[#####.....]  50%" in tty.getvalue() and "[##########] 100%" in tty.getvalue()
    assert "DP table" not in log.getvalue() and "planning rotor" in log.getvalue()
    quiet = io.StringIO()
    ProgressBar(quiet=True, stream=quiet)("hidden")
    assert quiet.getvalue() == ""
    assert "] DP table [#####.....]" in tty.getvalue()      # the default label
    tty = Tty()
    ProgressBar(stream=tty, width=4, label="stages").update(0.5)
    assert tty.getvalue().endswith("] stages [##..]  50%")


def test_store_all_is_not_shown_faster_than_no_remat(capsys):
    # store-all sums the stage times in another order than chain.compute_time:
    # an overhead of -1e-16 was printed as "-0.0%"
    code, out, _ = run(capsys, "plan", "remat", "gpt2:layers=2", "--memory", "inf",
                       "--slots", "50", "--quiet")
    assert code == 0 and "-0.0%" not in out
    assert [line.split()[5] for line in out.splitlines() if line.startswith("store-all")] \
        == ["+0.0%"]                 # store-all, 27.492, ms, 4.53, GiB, overhead


def test_progress_bar_clamps_the_fraction_and_ends_its_line_before_a_message():
    import io

    from rtmem.cli_plan import ProgressBar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = ProgressBar(stream=tty, width=8)
    bar.update(1.5)                  # the bar stays 8 wide outside 0..1
    assert "[########] 150%" in tty.getvalue()
    bar.update(-0.5)
    assert "[........] -50%" in tty.getvalue()
    bar("done")
    # the message starts its own line after the bar's \r-redrawn one
    last_bar, message = tty.getvalue().split("\r")[-1].split("\n")[:2]
    assert last_bar.endswith("-50%") and message.endswith("] done")


def test_slots_default_to_500(capsys):
    # the DP's slot is floor(activation budget / 500) bytes unless --slots says otherwise
    from rtmem.planners.remat import DEFAULT_SLOTS
    chain = from_spec(SPEC)
    memory = int(budget(0.3))
    code, out, _ = run(capsys, "plan", "remat", SPEC, "--memory", str(memory), "--quiet",
                       "--json")
    info = next(p for p in json.loads(out)["plans"] if p["planner"] == "rotor")["info"]
    activations = memory - int(chain.x0) - int(chain.w.sum())
    assert DEFAULT_SLOTS == 500 and not info["refined"]
    assert info["slot_bytes"] == activations // 500


def test_simulate_given_the_json_report_says_which_files_it_reads(capsys, tmp_path):
    # the report of `plan remat --json` holds no schedule; simulate said only
    # "expected 'rtmem.schedule'", though it reads `plan remat --save`'s plans too
    from rtmem.cli import main
    assert main(["plan", "remat", "gpt2-small", "--memory", "8GiB", "--json",
                 "--quiet"]) == 0
    report = tmp_path / "report.json"
    report.write_text(capsys.readouterr().out)
    assert main(["simulate", "gpt2-small", str(report), "--memory", "inf"]) == 1
    err = capsys.readouterr().err
    assert "neither a schedule nor a plan" in err and "--save" in err
