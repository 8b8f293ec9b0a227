"""Plots of a simulated schedule: a Gantt chart and memory over time.

matplotlib is imported lazily (``pip install rtmem[plot]``); figures are written
to files with the non-interactive Agg backend, so this works on headless machines.
"""

from __future__ import annotations

import os

import numpy as np

from rtmem._files import replace_with

__all__ = ["plot_schedule"]

_COLORS = {"F_none": "#9ecae1", "F_ck": "#4292c6", "F_all": "#08519c", "L": "#636363",
           "B": "#e6550d", "offload": "#31a354", "prefetch": "#756bb1", "delete": "#bdbdbd",
           "w_offload": "#74c476", "w_delete": "#d9d9d9", "w_prefetch": "#9e9ac8",
           "g_offload": "#a1d99b"}


def _matplotlib():
    try:
        import matplotlib
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError(
            "plotting needs matplotlib: pip install 'rtmem[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def memory_curve(result, schedule) -> tuple[np.ndarray, np.ndarray]:
    """Step curve (times in s, bytes) of device memory from a SimResult timeline.

    Each compute op contributes its usage while it runs (``mem``, from its start)
    and the usage once it is over (``mem_after``, from its end). Transfers and frees
    show up in the next compute op's values, so the curve is exact at op
    boundaries and may miss a free that lands in the middle of an op.
    """
    from rtmem.planners.schedule import COMPUTE_OPS
    tl = result.timeline
    compute = np.isin(schedule.op, [int(o) for o in COMPUTE_OPS])
    starts, ends = tl["start"][compute], tl["end"][compute]
    t = np.empty(2 * len(starts) + 1)
    m = np.empty_like(t)
    t[0], m[0] = 0.0, (tl["mem"][compute][0] if len(starts) else 0)
    t[1::2], m[1::2] = starts, tl["mem"][compute]
    t[2::2], m[2::2] = ends, tl["mem_after"][compute]
    return t, m


def plot_schedule(chain, schedule, platform, path, title: str | None = None,
                  result=None) -> str:
    """Draw the Gantt chart and the memory-over-time curve of ``schedule``.

    ``result`` is the :class:`~rtmem.planners.SimResult` when already simulated.
    Writes an image to ``path`` (format from its extension, e.g. ``.png``),
    whole or not at all (a failure while writing leaves the file that was
    there), and returns the path. Memory is plotted in the binary unit that suits its peak
    (GiB, MiB, KiB or bytes), time in seconds.
    """
    from rtmem.planners import simulate
    from rtmem.units import format_bytes, format_seconds

    plt = _matplotlib()
    result = result if result is not None else simulate(chain, schedule, platform)
    tl = result.timeline
    lanes = ["compute", "H2D", "D2H"] if platform.channel == "duplex" else ["compute", "link"]
    fig, (ax_g, ax_m) = plt.subplots(2, 1, figsize=(12, 6), sharex=True,
                                     gridspec_kw={"height_ratios": [1, 2]})
    bars = {}       # (lane, kind) -> [(start, duration)]: one collection each
    for k in range(len(schedule)):
        text = schedule.op_text(k)
        kind = text.split()[0]
        if kind in ("F_none", "F_ck", "F_all", "L", "B"):
            lane = 0
        elif kind in ("delete", "w_delete"):
            continue
        elif kind in ("prefetch", "w_prefetch"):
            lane = 1
        else:
            lane = len(lanes) - 1
        start, end = float(tl["start"][k]), float(tl["end"][k])
        if end > start:
            bars.setdefault((lane, kind), []).append((start, end - start))
    seen = set()
    for (lane, kind), spans in bars.items():
        ax_g.broken_barh(spans, (lane - 0.4, 0.8), facecolors=_COLORS[kind],
                         edgecolor="white", linewidth=0.3,
                         label=kind if kind not in seen else None)
        seen.add(kind)
    ax_g.set_yticks(range(len(lanes)), lanes)
    ax_g.invert_yaxis()
    ax_g.legend(ncol=6, fontsize=7, loc="upper right")
    t, m = memory_curve(result, schedule)
    top = max(float(m.max()) if len(m) else 1.0, 1.0)
    scale, unit = next((2.0**k, u) for k, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                       if top >= 2.0**k)
    ax_m.step(t, m / scale, where="post", color="#08519c", label="device memory")
    if platform.memory_limit < 2**62:
        ax_m.axhline(platform.memory_limit / scale, color="#e6550d", linestyle="--",
                     label=f"limit {format_bytes(platform.memory_limit)}")
    ax_m.set_ylabel(f"memory ({unit})")
    ax_m.set_xlabel("time (s)")
    ax_m.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or f"{chain.name or 'chain'}: makespan "
                 f"{format_seconds(result.makespan)}, peak {format_bytes(result.peak)}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        # written beside it and renamed over it: a failure while writing (a full
        # disk, Ctrl-C) left a truncated image where the previous plot was
        replace_with(path, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)
    return os.fspath(path)
