import json

import pytest

from rtmem.cli import main


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
    plot = tmp_path / "g.png"
    code, out, _ = run(capsys, "simulate", "gpt2:layers=2,hidden=64,heads=4,seq=16,batch=2,"
                       "vocab=50", "sequential:2", "--memory", "1GiB", "--bandwidth",
                       "12 GB/s", "--plot", str(plot))
    assert code == 0 and "makespan" in out and plot.stat().st_size > 1000
    code, out, _ = run(capsys, "simulate", "resnet50", "store-all", "--memory", "inf",
                       "--json")
    doc = json.loads(out)
    assert doc["peak_bytes"] > 6 * 2**30 and doc["channel"] == "shared"


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


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "gpt2-small", "store-all", "--memory", "1GiB"], "exceed the limit"),
    (["simulate", "nochain", "store-all", "--memory", "1GiB"], "unknown chain"),
    (["simulate", "resnet50", "sequential:x", "--memory", "1GiB"], "integer K"),
    (["simulate", "resnet50", "bogus", "--memory", "1GiB"], "no schedule file"),
    (["simulate", "resnet50", "store-all", "--memory", "lots"], "invalid memory"),
])
def test_errors_exit_1_with_message(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 1 and fragment in err


def test_demo(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--layers", "2", "--hidden", "32", "--heads", "4",
                       "--seq", "32", "--batch", "2", "--vocab", "64", "--steps", "2",
                       "--device", "cpu", "--out", str(tmp_path))
    assert code == 0
    assert "rotor" in out and "sequential" in out and "no rematerialization" in out
    assert "differ by at most 0.00e+00" in out        # same losses with and without
    for name in ("rotor_plan.png", "no_remat.png", "rotor_plan.json", "chain.json"):
        assert (tmp_path / name).exists()


def test_demo_result_values(tmp_path):
    pytest.importorskip("torch")
    from rtmem.demo import run_demo
    from rtmem.planners import Plan
    r = run_demo(layers=2, hidden=32, heads=4, seq=32, batch=2, vocab=64, steps=3,
                 out=str(tmp_path), device="cpu", say=lambda *a: None)
    assert r["plain_losses"] == r["plan_losses"]
    assert r["plan_peak_bytes"] <= r["plan"].peak <= r["budget"]
    assert r["plan_peak_bytes"] < r["plain_peak_bytes"]
    assert Plan.load(tmp_path / "rotor_plan.json").schedule == r["plan"].schedule


def test_no_command_prints_help(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "simulate" in out
