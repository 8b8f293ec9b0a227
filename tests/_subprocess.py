"""Running a snippet in a fresh interpreter (what a fresh install or a blocked
import looks like), for the tests that must not share the suite's modules."""
import subprocess
import sys
import textwrap


def run_ok(code: str, timeout: float = 120) -> None:
    """Run ``code`` (dedented) with this Python; it must exit 0 having printed
    exactly ``ok`` (its last line), and its stderr is the failure message."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok", res.stdout
