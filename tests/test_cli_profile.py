"""``rtmem profile``: a model (the demo's or the user's) measured into a chain file
that ``rtmem plan remat`` plans from."""

import json
import re
import sys
import textwrap
import uuid

import pytest

torch = pytest.importorskip("torch")

from rtmem.cli import main  # noqa: E402
from rtmem.planners import Chain  # noqa: E402
from rtmem.torch import gpt2_model, profile_sequential, resnet_model  # noqa: E402

GPT2 = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64"]
SIZE_ARRAYS = ("x", "xbar", "w", "o_f", "o_b")


def run(capsys, *argv):
    code = main(["profile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def isolated_imports(monkeypatch):
    """load_factory puts folders on sys.path; give each test its own copy."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def _sizes_equal(a: Chain, b: Chain):
    assert a.n == b.n and a.x0 == b.x0
    for name in SIZE_ARRAYS:
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def _profiled(model, loss_fn, make_batch, batch):
    x, y = make_batch(batch, torch.Generator().manual_seed(1))
    return profile_sequential(model, x, y, loss_fn, repeats=1)


@pytest.mark.parametrize("model, argv, build", [
    ("gpt2", GPT2, lambda: gpt2_model(layers=2, hidden=32, heads=4, seq=16, vocab=64)),
    ("resnet", ["--blocks", "1,1", "--width", "4", "--image", "8"],
     lambda: resnet_model(blocks=(1, 1), width=4, image=8)),
])
def test_a_built_in_model_is_saved_as_profile_sequential_measures_it(
        capsys, tmp_path, model, argv, build):
    path = tmp_path / "chain.json"
    code, out, _ = run(capsys, "--model", model, *argv, "--batch", "2", "--repeats", "1",
                       "--device", "cpu", "--save", str(path))
    assert code == 0
    saved = Chain.load(str(path))
    torch.manual_seed(0)
    _sizes_equal(saved, _profiled(*build(), 2))
    assert saved.name.startswith(model) and saved.name.endswith("-b2")
    assert (saved.u_f > 0).all() and (saved.u_b > 0).all() and saved.u_loss > 0
    # the table: a row per stage and the loss, then the summary
    rows = [line.split()[0] for line in out.splitlines()[2:saved.n + 3]]
    assert rows == [str(i) for i in range(saved.n)] + ["loss"]
    assert f"{saved.n} stages" in out and f"wrote {path}" in out


def test_the_suggested_budget_plans(capsys, tmp_path):
    path = tmp_path / "chain.json"
    code, out, _ = run(capsys, *GPT2, "--repeats", "1", "--save", str(path))
    assert code == 0
    command = re.search(r"plan it with: rtmem plan remat (\S+) --memory (\d+)", out)
    assert command and command.group(1) == str(path)
    budget = int(command.group(2))
    code = main(["plan", "remat", str(path), "--memory", str(budget), "--json", "--quiet"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    rotor = next(p for p in doc["plans"] if p["planner"] == "rotor")
    assert rotor["peak_bytes"] <= budget


@pytest.mark.parametrize("json_", [False, True])
def test_save_makes_a_missing_folder(capsys, tmp_path, json_):
    path = tmp_path / "new" / "sub" / "c.json"
    code, out, err = run(capsys, *GPT2, "--repeats", "1", "--quiet", "--save", str(path),
                         *(["--json"] if json_ else []))
    assert code == 0 and err == ("" if not json_ else f"wrote {path}\n")
    assert Chain.load(str(path)).n == 4


def test_json_prints_the_chain_it_saves(capsys, tmp_path):
    path = tmp_path / "c.json"
    code, out, err = run(capsys, *GPT2, "--repeats", "1", "--json", "--save", str(path),
                         "--name", "mine")
    assert code == 0 and f"wrote {path}" in err
    # progress on stderr (no bar: not a terminal), the JSON alone on stdout
    assert "profiling mine on cpu, 1 timed runs per pass" in err
    assert "measured 4 stages and the loss" in err
    printed = Chain.from_json(out)
    assert printed.name == "mine" and printed == Chain.load(str(path))


def test_quiet_prints_no_progress(capsys):
    code, out, err = run(capsys, *GPT2, "--repeats", "1", "--quiet")
    assert code == 0 and err == "" and "4 stages" in out


def _write_factory(folder, body: str) -> str:
    """A module of a fresh name in ``folder``; returns its name."""
    name = f"factory_{uuid.uuid4().hex[:10]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return name


_MLP = """
    import torch
    from torch import nn

    def build():
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        def make_batch(batch, generator=None):
            return (torch.randn(batch, 16, generator=generator),
                    torch.randn(batch, 4, generator=generator))
        return model, nn.functional.mse_loss, make_batch

    def blocks():
        model, loss_fn, make_batch = build()
        return list(model), loss_fn, make_batch
"""


@pytest.mark.parametrize("how", ["module", "file", "blocks"])
def test_a_users_factory_is_profiled(capsys, tmp_path, monkeypatch, isolated_imports, how):
    src = tmp_path / "src"
    src.mkdir()
    name = _write_factory(src, _MLP)
    if how == "module":
        monkeypatch.chdir(src)                 # found in the current folder, as python -m
        spec = f"{name}:build"
    else:
        monkeypatch.chdir(tmp_path)
        spec = f"src/{name}.py:{'build' if how == 'file' else 'blocks'}"
    path = tmp_path / "mlp.json"
    code, out, _ = run(capsys, "--model", spec, "--batch", "8", "--repeats", "1",
                       "--save", str(path))
    assert code == 0, out
    chain = Chain.load(str(path))
    f32 = 4
    # weights: Linear(16, 32) and Linear(32, 4) with biases; the ReLU has none
    assert chain.w.tolist() == [(16 * 32 + 32) * f32, 0, (32 * 4 + 4) * f32]
    assert chain.x.tolist() == [8 * 32 * f32, 8 * 32 * f32, 8 * 4 * f32]
    assert chain.x0 == 8 * 16 * f32
    assert chain.name == f"{'build' if how != 'blocks' else 'blocks'}-b8"


def test_a_factory_without_a_name_names_the_chain_after_the_spec(capsys, tmp_path, monkeypatch,
                                                                 isolated_imports):
    # a functools.partial and an object with __call__ have no __name__
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, _MLP + """
    import functools

    small = functools.partial(build)

    class Factory:
        def __call__(self):
            return build()

    made = Factory()
    """)
    for attr in ("small", "made"):
        code, out, _ = run(capsys, "--model", f"{m}:{attr}", "--batch", "2", "--repeats", "1",
                           "--json", "--quiet")
        assert code == 0 and Chain.from_json(out).name == f"{attr}-b2"


@pytest.mark.parametrize("file", ["model.v2.py", "my model-1.py"])
def test_a_factory_files_classes_can_be_pickled(capsys, tmp_path, monkeypatch,
                                               isolated_imports, file):
    # pickle imports a class's module by name: "model.v2" named a package "model"
    (tmp_path / file).write_text(textwrap.dedent(_MLP + """
    import dataclasses
    import pickle

    @dataclasses.dataclass
    class Config:
        width: int = 16

    def pickled():
        assert pickle.loads(pickle.dumps(Config())) == Config()
        return build()
    """))
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--model", f"{file}:pickled", "--repeats", "1", "--json",
                         "--quiet")
    assert code == 0 and Chain.from_json(out).n == 3, err


def test_a_module_already_imported_under_the_name_is_named(capsys, tmp_path, monkeypatch,
                                                          isolated_imports):
    # torch imported the standard library's profile before ./profile.py is looked for
    import profile
    (tmp_path / "profile.py").write_text(textwrap.dedent(_MLP))
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--model", "profile:build", "--quiet")
    assert code == 2
    assert err == (f"rtmem profile: error: --model 'profile:build': profile has no 'build' "
                   f"(found {profile.__file__}; for a file of yours of that name give its "
                   f"path: path/to/file.py:build)\n")
    code, out, _ = run(capsys, "--model", "profile.py:build", "--repeats", "1", "--json",
                       "--quiet")
    assert code == 0 and Chain.from_json(out).n == 3


def test_a_failed_profile_with_json_prints_json_on_stdout(capsys, tmp_path, monkeypatch,
                                                        isolated_imports):
    # its own error returns (exit 2 for a bad --model) printed only the stderr line
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--model", "no_such_module:build", "--quiet", "--json")
    assert code == 2 and err.startswith("rtmem profile: error: ")
    assert json.loads(out) == {"error": err.split("error: ", 1)[1].rstrip("\n"),
                               "kind": "FactoryError"}


def test_a_factory_file_imports_the_modules_beside_it(capsys, tmp_path, monkeypatch,
                                                    isolated_imports):
    # as `python src/file.py` finds src/helper.py
    src = tmp_path / "src"
    src.mkdir()
    helper = _write_factory(src, _MLP)
    name = _write_factory(src, f"from {helper} import build\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--model", f"src/{name}.py:build", "--repeats", "1", "--json")
    assert code == 0 and Chain.from_json(out).n == 3


@pytest.mark.parametrize("spec, body, fragment", [
    ("nomodule_{u}:build", None, "no module named 'nomodule_"),
    ("{m}:nope", _MLP, "{m} has no 'nope'\n"),       # the file found is the user's
    ("{m}:torch", _MLP, "is a module, not a function"),
    ("{m}", _MLP, "give gpt2, resnet, MODULE:FUNCTION or PATH.py:FUNCTION"),
    ("{m}:", _MLP, "give gpt2, resnet"),
    ("missing_{u}.py:build", None, "no file 'missing_"),
    ("./{m}:build", _MLP, "'./{m}' is a relative module name; give the module as python -m"),
    (".{m}:build", _MLP, "'.{m}' is a relative module name"),
    ("{m}:build", "def build():\n    return 1, 2\n", "returned tuple, not (model, loss_fn"),
    ("json:dumps", None, "dumps() is called with no arguments: missing a required argument: "
     "'obj'"),
    ("{m}:build", "def build(size):\n    return 1, 2\n",
     "build() is called with no arguments: missing a required argument: 'size'"),
    ("{m}:build", "def build():\n    return None, None, print\n",
     "returned a NoneType as loss_fn; it must be callable"),
    ("{m}:build", "def build():\n    return None, print, lambda b, g: 7\n",
     "make_batch of {m}:build returned int, not (inputs, target)"),
])
def test_a_factory_that_cannot_be_used_is_named(capsys, tmp_path, monkeypatch,
                                                isolated_imports, spec, body, fragment):
    monkeypatch.chdir(tmp_path)
    u = uuid.uuid4().hex[:8]
    m = _write_factory(tmp_path, body) if body else "unused"
    spec, fragment = spec.format(u=u, m=m), fragment.format(u=u, m=m)
    code, out, err = run(capsys, "--model", spec, "--repeats", "1")
    assert code == 2 and out == ""
    assert fragment in err and err.startswith("rtmem profile: error: --model" if
                                              "returned" not in fragment else "rtmem profile")


def test_a_make_batch_without_the_generator_argument_is_named(capsys, tmp_path, monkeypatch,
                                                              isolated_imports):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, "import torch\ndef build():\n"
                                 "    return torch.nn.Sequential(torch.nn.ReLU()), print, "
                                 "lambda b: (torch.ones(b), 1)\n")
    code, out, err = run(capsys, "--model", f"{m}:build", "--quiet")
    assert code == 2 and out == ""
    assert err == (f"rtmem profile: error: the make_batch of {m}:build is called as "
                   f"make_batch(batch, generator): too many positional arguments\n")


@pytest.mark.parametrize("body, fragment", [
    ("import torch\ndef build():\n"
     "    return torch.nn.Sequential(torch.nn.ReLU()), print, lambda b, g: (1, 2)\n",
     "inputs must be a torch.Tensor (the first stage's input), got int"),
    ("import torch\ndef build():\n    return 5, print, lambda b, g: (torch.ones(1), 2)\n",
     "profile_sequential needs an nn.Sequential of stages or a list of modules, got int"),
    ("import torch\ndef build():\n"
     "    return [torch.nn.ReLU(), 3], print, lambda b, g: (torch.ones(1), 2)\n",
     "or a list of modules, got list"),
])
def test_what_profile_sequential_refuses_is_named(capsys, tmp_path, monkeypatch,
                                                 isolated_imports, body, fragment):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, body)
    code, _, err = run(capsys, "--model", f"{m}:build", "--quiet")
    assert code == 1 and err.startswith("rtmem profile: error: ") and fragment in err


def test_tensors_nested_in_the_batch_are_moved_to_the_device(capsys, tmp_path, monkeypatch,
                                                            isolated_imports):
    # the loss records the containers and devices it is given (this machine has
    # only the cpu; test_to_device_keeps_the_containers... checks each tensor moves)
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, """
        import collections
        import torch
        from torch import nn

        Pair = collections.namedtuple("Pair", "labels weights")
        seen = []

        def loss(out, target):
            pair, extra = target["pair"], target["extra"]
            seen.append((type(target).__name__, type(pair).__name__, [
                t.device.type for t in (pair.labels, pair.weights, extra[0])]))
            return ((out - pair.labels) ** 2 * pair.weights).mean() + 0 * extra[0].sum()

        def build():
            def make_batch(batch, generator):
                x = torch.randn(batch, 4, generator=generator)
                return x, {"pair": Pair(torch.randn(batch, 2), torch.rand(batch, 2)),
                           "extra": [torch.ones(1)]}
            return nn.Sequential(nn.Linear(4, 2)), loss, make_batch
    """)
    code, out, err = run(capsys, "--model", f"{m}:build", "--repeats", "1", "--json",
                         "--quiet", "--device", "cpu")
    assert code == 0, err
    seen = sys.modules[m].seen
    assert seen and all(s == ("dict", "Pair", ["cpu", "cpu", "cpu"]) for s in seen)


def test_to_device_keeps_the_containers_and_moves_every_tensor():
    from collections import namedtuple

    from rtmem.cli_profile import _to_device
    pair = namedtuple("pair", "a b")
    moved = []

    class Spy(torch.Tensor):
        def to(self, *args, **kwargs):
            moved.append(args)
            return torch.zeros(1)

    def spy():
        return torch.ones(1).as_subclass(Spy)

    obj = {"p": pair(spy(), [spy(), (spy(), 3)]), "s": "text"}
    out = _to_device(obj, "somewhere")
    assert len(moved) == 3 and all(a == ("somewhere",) for a in moved)
    assert type(out) is dict and type(out["p"]) is pair and type(out["p"].b) is list
    assert type(out["p"].b[1]) is tuple and out["p"].b[1][1] == 3 and out["s"] == "text"
    assert all(type(t) is torch.Tensor for t in (out["p"].a, out["p"].b[0], out["p"].b[1][0]))


@pytest.mark.parametrize("body, fragment", [
    ("def build():\n"
     "    with torch.device('meta'):\n"
     "        model = torch.nn.Sequential(torch.nn.Linear(4, 2))\n"
     "    return model, print, lambda b, g: (torch.ones(b, 4), torch.ones(b, 2))\n",
     "build() returned a model on the meta device (shapes, no data), which cannot run; "
     "build it on a real device, or model.to_empty(device='cpu') and initialize its "
     "weights"),
    ("def build():\n"
     "    return [torch.nn.Linear(4, 2)], print, "
     "lambda b, g: (torch.ones(b, 4), {'y': [torch.ones(b, 2, device='meta')]})\n",
     "the make_batch of {m}:build returned tensors on the meta device (shapes, no data); "
     "return real tensors"),
])
def test_a_meta_device_model_or_batch_is_refused(capsys, tmp_path, monkeypatch,
                                                 isolated_imports, body, fragment):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, "import torch\n" + body)
    code, out, err = run(capsys, "--model", f"{m}:build", "--quiet")
    assert code == 2 and out == ""
    assert err.startswith("rtmem profile: error: ") and fragment.format(m=m) in err


def test_with_json_what_the_users_code_prints_goes_to_stderr(capsys, tmp_path, monkeypatch,
                                                            isolated_imports):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, _MLP.replace("    import torch\n", "    import torch\n"
                                              "    print('importing the model')\n", 1) + """
    def chatty():
        print("building")
        model, loss_fn, make_batch = build()
        def loud_loss(out, target):
            print("loss", float(loss_fn(out, target).detach()))
            return loss_fn(out, target)
        return model, loud_loss, make_batch
    """)
    code, out, err = run(capsys, "--model", f"{m}:chatty", "--repeats", "1", "--json",
                         "--quiet")
    assert code == 0 and Chain.from_json(out).n == 3
    assert "importing the model\nbuilding\nloss " in err
    # without --json it stays on stdout, with the table
    code, out, err = run(capsys, "--model", f"{m}:chatty", "--repeats", "1", "--quiet")
    assert code == 0 and err == "" and out.startswith("building\nloss ")


def test_the_plan_command_is_quoted_for_the_shell(capsys, tmp_path):
    path = tmp_path / "my chain.json"
    code, out, _ = run(capsys, *GPT2, "--repeats", "1", "--quiet", "--save", str(path))
    assert code == 0 and f"rtmem plan remat '{path}' --memory " in out


def test_a_factory_failing_is_not_taken_for_a_missing_module(capsys, tmp_path, monkeypatch,
                                                             isolated_imports):
    # a module the factory's module imports is missing: the user's error, as it is
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, "import not_installed_anywhere_xyz\n")
    code, _, err = run(capsys, "--model", f"{m}:build")
    assert code == 1 and "No module named 'not_installed_anywhere_xyz'" in err
    assert "run from the folder" not in err


def test_a_factory_running_out_of_memory_is_one_line(capsys, tmp_path, monkeypatch,
                                                     isolated_imports):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, """
        def build():
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 10 bytes")
    """)
    code, _, err = run(capsys, "--model", f"{m}:build")
    assert code == 1
    assert err.strip() == ("rtmem profile: error: out of host memory (DefaultCPUAllocator: "
                           f"can't allocate memory: you tried to allocate 10 bytes) in the "
                           f"model factory {m}:build; make the model or --batch smaller")


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "x:build", "--layers", "3"],
     "--layers sizes the gpt2 model; --model x:build builds its own model: size it there"),
    (["--blocks", "2,2"], "--blocks sizes the resnet model; with --model gpt2 use --layers"),
    (["--hidden", "30", "--heads", "4"], "--hidden 30 must be a multiple of --heads 4"),
    (["--model", "resnet", "--batch", "1", "--image", "1"], "batch norm needs more than one"),
    (["--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["--device", "meta"], "--device 'meta': profiling runs on cpu or cuda"),
    (["--repeats", "0"], "argument --repeats: must be at least 1 and at most 100000, got 0"),
    (["--save", "."], "argument --save: '.' is a folder; give a file name"),
])
def test_bad_usage_is_refused_before_any_work(capsys, argv, fragment):
    if "--repeats" in argv or "--save" in argv:     # argparse's own refusals
        with pytest.raises(SystemExit) as e:
            main(["profile", *argv])
        code, err = e.value.code, capsys.readouterr().err
    else:
        code, _, err = run(capsys, *argv)
    assert code == 2 and fragment in err


def test_profile_is_listed_by_rtmem_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+profile\s+measure a model", capsys.readouterr().out, flags=re.M)


def test_build_model_fills_in_the_defaults_and_refuses_other_options():
    from rtmem.demo import MODEL_OPTIONS, build_model
    net, _, make_batch, name = build_model("gpt2", batch=3, layers=1)
    o = {**MODEL_OPTIONS["gpt2"], "layers": 1}
    assert name == f"gpt2-L1-h{o['hidden']}-s{o['seq']}-b3"
    assert len(net) == 1 + 2                    # embedding, one block, head
    x, _ = make_batch(3)
    assert tuple(x.shape) == (3, o["seq"])
    _, _, _, name = build_model("resnet", batch=2, blocks=[1, 2])
    o = MODEL_OPTIONS["resnet"]
    assert name == f"resnet-1.2-w{o['width']}-i{o['image']}-b2"
    with pytest.raises(ValueError, match="blocks do not size the gpt2 model; its options "
                                         "are layers, hidden, heads, seq, vocab"):
        build_model("gpt2", blocks=(1,))
    with pytest.raises(ValueError, match="model must be one of gpt2, resnet, got 'vgg'"):
        build_model("vgg")


@pytest.mark.parametrize("chain, budget, why", [
    # least 50, peak 230 (both from the planners): half the peak
    (dict(n=20, x=10), 115, "half the peak"),
    # least 105, peak 125: halfway between them
    (dict(n=6, x=10, w=5), 115, "half the peak is below the least feasible 105 B"),
    # least = peak = 840: nothing is saved by a schedule
    (dict(n=4, x=10, w=100), 840, "no schedule needs less than the peak"),
])
def test_the_default_budget_is_half_the_peak_when_feasible(chain, budget, why):
    import math

    from rtmem.demo import default_budget
    from rtmem.planners import min_feasible_memory, plan_store_all
    c = Chain.homogeneous(chain.pop("n"), **chain)
    peak = plan_store_all(c, math.inf).peak
    assert default_budget(min_feasible_memory(c), peak) == (budget, why)
    assert min_feasible_memory(c) <= budget <= peak


@pytest.mark.parametrize("name", ["", "  "])
def test_a_blank_chain_name_is_refused_before_profiling(capsys, name):
    # `--name "$NAME"` with NAME unset was taken for no name: the chain got the
    # model's name, silently
    with pytest.raises(SystemExit) as info:
        main(["profile", "--model", "gpt2:layers=1", "--name", name])
    assert info.value.code == 2 and "chain name is empty" in capsys.readouterr().err


_FAILING = """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_in, n_out))

        def forward(self, x):
            return x @ self.weight                          # line 11

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("no gradient for you")         # line 20

    class BadBackward(nn.Module):
        def forward(self, x):
            return Fails.apply(x)

    def batch(b, generator):
        return torch.randn(b, 16, generator=generator), torch.randn(b, 4, generator=generator)

    def forward():
        # 32 outputs into a block of 31 inputs: a shape mismatch in stage 2
        return nn.Sequential(Block(16, 32), nn.ReLU(), Block(31, 4)), nn.functional.mse_loss, batch

    def backward():
        named = nn.Sequential()
        named.add_module("up", Block(16, 4))
        named.add_module("odd", BadBackward())
        return named, nn.functional.mse_loss, batch

    def loss():
        def loss_fn(output, target):
            return (output - target[:, :3]).sum()           # line 41
        return nn.Sequential(Block(16, 4)), loss_fn, batch

    def factory():
        raise KeyError("size")                              # line 45

    def maker():
        def make_batch(b, generator):
            return torch.ones(b, 16).view(3, -1), None      # line 49
        return nn.Sequential(Block(16, 4)), nn.functional.mse_loss, make_batch
"""


@pytest.mark.parametrize("function, where, error, line", [
    ("forward", "the forward of stage 2 (Block)", "RuntimeError: mat1 and mat2 shapes cannot "
     "be multiplied (8x32 and 31x4)", 11),
    ("backward", "the backward of stage 1 'odd' (BadBackward)",
     "ValueError: no gradient for you", 20),
    ("loss", "the loss function", "RuntimeError: The size of tensor a (4) must match", 41),
    ("factory", "the model factory {spec}", "KeyError: 'size'", 45),
    ("maker", "the make_batch of {spec}", "RuntimeError: shape '[3, -1]' is invalid", 49),
])
def test_an_error_in_the_users_model_is_one_line_naming_the_stage_and_the_place(
        capsys, tmp_path, monkeypatch, isolated_imports, function, where, error, line):
    # it was torch's traceback through rtmem's profiler, the user's line lost in it
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, _FAILING)
    spec = f"{m}.py:{function}"
    code, out, err = run(capsys, "--model", spec, "--batch", "8", "--repeats", "1", "--quiet")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"rtmem profile: error: {where.format(spec=spec)} raised {error}")
    assert f"(at {m}.py:{line}); rerun with --traceback for the full traceback\n" in err
    # the full traceback on request, then the same line without the hint
    code, out, err = run(capsys, "--model", spec, "--batch", "8", "--repeats", "1", "--quiet",
                         "--traceback")
    assert code == 1 and err.startswith("Traceback (most recent call last)")
    assert f'{m}.py", line {line}' in err
    assert err.splitlines()[-1].endswith(f"(at {m}.py:{line})")


def test_an_error_raised_while_importing_the_factory_file_names_its_line(
        capsys, tmp_path, monkeypatch, isolated_imports):
    monkeypatch.chdir(tmp_path)
    m = _write_factory(tmp_path, "import torch\n\nsize = undefined_name\n")
    code, _, err = run(capsys, "--model", f"{m}:build", "--quiet", "--json")
    assert code == 1 and err == (f"rtmem profile: error: the import of {m} raised NameError: "
                                 f"name 'undefined_name' is not defined (at {m}.py:3); rerun "
                                 f"with --traceback for the full traceback\n")


def test_profile_sequential_notes_the_stage_an_error_came_from():
    # the library's exception is unchanged, with a note the traceback prints
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(2, 1))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as e:
        profile_sequential(model, torch.randn(5, 4), torch.randn(5, 1),
                           torch.nn.functional.mse_loss, repeats=1)
    assert "rtmem: raised in the forward of stage 1 (Linear)" in e.value.__notes__
