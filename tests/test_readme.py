"""Every Python example of the README runs (RMM's test_doc_examples habit)."""

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
