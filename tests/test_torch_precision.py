"""tests/_torch_precision.py (TF32 off in the GPU tests) on a CPU build of torch,
whose TF32 flags are settable too. Each case runs in a fresh interpreter: a
mixed legacy/new flag state cannot be undone in this one."""

import pytest

from _subprocess import run_ok

torch = pytest.importorskip("torch")

PRELUDE = """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from _torch_precision import exact_fp32
    b = torch.backends
    def per_op():
        return [o.fp32_precision for o in (b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn)]
"""


def _run(body: str) -> None:
    import os
    import textwrap
    tests = os.path.dirname(os.path.abspath(__file__))
    run_ok(textwrap.dedent(PRELUDE.format(tests=tests)) + textwrap.dedent(body))


def _has_per_op_flags() -> bool:
    try:
        torch.backends.cuda.matmul.fp32_precision
        torch.backends.cudnn.conv.fp32_precision
    except AttributeError:
        return False
    return True


needs_per_op = pytest.mark.skipif(not _has_per_op_flags(),
                                  reason="torch < 2.9 has only the legacy allow_tf32 flags")


def test_tf32_is_off_inside_and_the_flags_are_restored_after():
    _run("""
        before = per_op() if hasattr(b.cudnn, "conv") else None
        with exact_fp32(torch):
            # the legacy getters, which torch._dynamo reads, agree (they raise when mixed)
            assert b.cuda.matmul.allow_tf32 is False and b.cudnn.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
            if before is not None:
                assert per_op()[0] == "ieee" and per_op()[1] == per_op()[2] != "tf32"
        assert b.cuda.matmul.allow_tf32 is False and b.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "highest"
        # the legacy setter writes "ieee" where "none" (inherit, no TF32) was
        assert before is None or per_op()[1:] == before[1:], (per_op(), before)
        print("ok")
    """)


@needs_per_op
@pytest.mark.parametrize("setup", ["b.fp32_precision = 'tf32'",
                                   "b.cuda.matmul.fp32_precision = 'tf32'",
                                   "b.cudnn.conv.fp32_precision = 'ieee'"])
def test_a_flag_state_set_through_the_new_api_is_kept(setup):
    # torch >= 2.9: after these the legacy getters raise ("mix of the legacy and
    # new APIs"); the fixture read them to save the flags and failed before its test
    _run(f"""
        {setup}
        before = per_op()
        with exact_fp32(torch):
            assert per_op() == ["ieee"] * 3, per_op()
        assert per_op() == before, (per_op(), before)
        print("ok")
    """)


def test_the_flags_are_restored_when_the_block_raises():
    _run("""
        before = per_op() if hasattr(b.cudnn, "conv") else None
        legacy = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32
        try:
            with exact_fp32(torch):
                raise KeyError("boom")
        except KeyError:
            pass
        assert (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32) == legacy
        assert before is None or per_op()[1:] == before[1:]
        print("ok")
    """)
