"""The DHA kernels compile for a real GPU (PTX for sm_90), checked on a machine
without one: the CUDA simulator runs kernels as Python and never types them, so
this is the CPU suite's only check that numba can compile them."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def _nvvm_present() -> bool:
    # numba-cuda plus the NVVM and NVRTC libraries (the `ptx` extra); the
    # simulator-only setup of a plain numba install cannot compile.
    try:
        return all(importlib.util.find_spec(m) is not None
                   for m in ("numba_cuda", "cuda.bindings", "nvidia"))
    except ModuleNotFoundError:     # a parent package ("cuda") is missing
        return False


@pytest.mark.skipif(not _nvvm_present(), reason="needs numba-cuda and NVVM: "
                    "pip install 'rtmem[ptx]'")
@pytest.mark.parametrize("numpy_has_row_stack", [True, False])
def test_every_dha_kernel_compiles_to_ptx(numpy_has_row_stack):
    # without: numpy >= 2.5 (the GPU machine's 2.5.2), where numba-cuda <= 0.30.4
    # failed every compile unless rtmem.kernels imported its array support first
    script = os.path.join(os.path.dirname(__file__), "_ptx_compile.py")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    flags = [] if numpy_has_row_stack else ["--without-row-stack"]
    proc = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["missing"], f"kernels without a signature in _ptx_compile.py: " \
                                  f"{report['missing']}"
    assert not report["failed"], "\n\n".join(f"{k}: {v}" for k, v in
                                             report["failed"].items())
    assert len(report["compiled"]) >= 16
    if not numpy_has_row_stack:
        assert not report["row_stack"], "numpy was left with an np.row_stack"


def _device_functions(tree):
    """The functions of a module that numba.cuda compiles: decorated with
    cuda.jit, or passed to a cuda.jit(...) call (the GEMM factory's kernel)."""
    import ast
    passed = {node.args[0].id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and ast.unparse(node.func) == "cuda.jit"
              and node.args and isinstance(node.args[0], ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (
                node.name in passed
                or any("cuda.jit" in ast.unparse(d) for d in node.decorator_list)):
            yield node


def test_no_kernel_calls_builtin_min_or_max():
    # numba >= 0.66 made min() and max() *args overloads, which numba.cuda fails
    # to compile (numba issue #10753; numba 0.68.1 + numba-cuda 0.30.4: "Signature
    # mismatch: 2 argument types given, but function takes 1 arguments"). The PTX
    # test above sees it only where such a numba is installed; this looks at the
    # source, so a new min()/max() in a kernel fails on every machine.
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    found, kernels = [], 0
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in _device_functions(tree):
            kernels += 1
            found += [f"{path.name}:{call.lineno} {fn.name} calls {call.func.id}()"
                      for call in ast.walk(fn) if isinstance(call, ast.Call)
                      and isinstance(call.func, ast.Name) and call.func.id in ("min", "max")]
    assert kernels >= 16        # the walk found the kernels (dha.py, _dha_kernels.py)
    assert not found, "use an explicit comparison in device code (NOTE [ No min() / " \
                      "max() in device code ] in kernels/_dha_kernels.py):\n" + "\n".join(found)
