"""Run a test's worker on several threads and surface their failures."""

from __future__ import annotations

import sys
import threading

#: Seconds between the interpreter's thread switches while workers run. Python's
#: default, 5 ms, almost never interrupts a thread inside a short critical
#: section, so a missing lock would pass.
SWITCH_INTERVAL = 1e-6


def run_on_threads(work, n: int = 8) -> None:
    """Call ``work(tid)`` for ``tid`` in ``range(n)``, each on its own thread, and
    fail here with every exception a worker raised (a worker's assertion would
    otherwise only be printed by the thread). Threads switch every
    ``SWITCH_INTERVAL`` seconds meanwhile."""
    errors = []

    def guarded(tid):
        try:
            work(tid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert not errors, errors


def collect_holding(lock, timeout: float = 10.0) -> None:
    """Run a garbage collection while ``lock`` is held, as one that starts at an
    allocation inside rtmem's allocator would (NOTE [ Frees from finalizers ]),
    on a daemon thread; fail if it does not finish (a finalizer deadlocked)."""
    import gc

    def collect():
        with lock:
            gc.collect()
    t = threading.Thread(target=collect, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "a free from a finalizer deadlocked on the allocator lock"
