"""Every Python example of the README runs (RMM's test_doc_examples habit), and so
does the example of the testing API's docstring."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_python_examples_run(index, monkeypatch, tmp_path):
    code = _blocks()[index]
    if "torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})


def test_readme_has_exactly_two_setup_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    setup = text.split("## Set-up commands", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^make \w+", setup, flags=re.M)
    assert commands == ["make demo", "make test"]


def _command_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("## Command line", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split(" #", 1)[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("line", _command_lines())
def test_readme_command_lines_parse(line, monkeypatch, tmp_path):
    # every option the README shows exists and takes the value shown (parsed, not
    # run: the demo trains, bench wants a GPU); types that check files check here
    import shlex

    from rtmem.cli import build_parser
    monkeypatch.chdir(tmp_path)     # --plot out/r.png is checked by making out/
    words = shlex.split(line)
    assert words[0] == "rtmem"
    args = build_parser().parse_args(words[1:])
    assert callable(args.func)


def _docstring_example(module) -> str:
    """The first ``::`` code block of ``module``'s docstring, dedented."""
    import textwrap
    block = module.__doc__.split("::\n", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break                   # the text after the block
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def test_testing_api_docstring_example_survives_a_slow_first_call(monkeypatch):
    # The example of rtmem.planners.testing, as a user copies it: its first
    # simulate() loads the JIT cache (seconds in a fresh process), which under
    # hypothesis's default 200 ms deadline ended in DeadlineExceeded /
    # FlakyFailure. A first call of 0.3 s stands in for that load here, where
    # the suite has already loaded it and runs with no deadline.
    import time

    from hypothesis import HealthCheck, settings

    import rtmem.planners
    import rtmem.planners.testing as testing
    code = _docstring_example(testing)
    assert "@given(simulation_cases())" in code and "def test_my_invariant" in code
    real, calls = rtmem.planners.simulate, []

    def first_call_slow(*args, **kwargs):
        if not calls:
            time.sleep(0.3)
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(rtmem.planners, "simulate", first_call_slow)
    namespace = {"__name__": "docstring"}
    # hypothesis's own defaults (deadline 200 ms), not the suite's profile; few
    # examples to stay fast, and no health check on a loaded machine's slow draws
    # (the deadline is what the example must survive). get_current_profile_name
    # is newer than the oldest hypothesis supported
    suite_profile = getattr(settings, "get_current_profile_name",
                            lambda: settings._current_profile)()
    settings.register_profile("rtmem-docstring", parent=settings.get_profile("default"),
                              max_examples=3, suppress_health_check=list(HealthCheck))
    settings.load_profile("rtmem-docstring")
    try:
        exec(compile(code, "rtmem.planners.testing docstring", "exec"), namespace)
        namespace["test_my_invariant"]()
    finally:
        settings.load_profile(suite_profile)
    assert calls


def test_readme_names_every_extra():
    # the README named no extra: a pip user learnt `rtmem[plot]` from an error
    try:
        import tomllib
    except ModuleNotFoundError:     # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads TOML with tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Installing with pip", 1)[-1].split("\n## ", 1)[0]
    assert [name for name in extras if f"`{name}`" not in section] == []
