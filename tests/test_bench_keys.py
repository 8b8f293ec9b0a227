"""Labels of bench results: each size keeps its own ratios."""

import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def test_adam_ratio_keys_are_unique_per_size(monkeypatch):
    # 1e5 and 1.2e5 were both "1e5" (one size's ratios replaced the other's, and
    # the best-of-rounds ratios shifted onto the wrong sizes)
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)
    import adam
    sizes = [100_000, 120_000, 1_000_000, 25_000_000, 50_000_000]
    keys = [adam._size_key(n) for n in sizes]
    assert keys == ["1e5", "120000", "1e6", "25000000", "5e7"]
