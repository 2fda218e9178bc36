"""Figures from measured values, the one place benchmarks turn amounts and
seconds into rates (and write their plots: save_figure).

A figure that was not measured is ``None`` (written as an empty CSV cell and
shown as ``missing``, with its reason beside it), never 0: a clock that read
no time, a phase that was skipped or a tool that saw nothing gives no rate.
"""

import math
import os
import statistics

MISSING = "missing"


def rate(amount, seconds):
    """amount / seconds, or None when either is missing or the time is zero or not finite."""
    if amount is None or seconds is None:
        return None
    if not math.isfinite(seconds) or seconds <= 0 or not math.isfinite(amount):
        return None
    return amount / seconds


def ratio(numerator, denominator):
    """numerator / denominator for two measured figures, None when either is missing or zero."""
    if numerator is None or denominator is None or not denominator:
        return None
    return numerator / denominator


def show(value, spec="", missing=MISSING):
    """value formatted with spec, or the word for a figure that was not measured."""
    return missing if value is None else format(value, spec)


def cell(value):
    """A CSV cell: the unrounded value, empty when it was not measured."""
    return "" if value is None else value


def save_figure(path, draw, dpi=110):
    """Write the figure that draw(pyplot) returns to path (PNG, atomically) and return True; without
    matplotlib, an optional dependency (hpcdl[bench]), say that the plot was skipped and return False."""
    try:
        import matplotlib
    except ImportError:
        print(f"skipped the plot {path}: matplotlib is not installed (pip install 'hpcdl[bench]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def medians_and_ratios(rows, ops, sizes, systems):
    """{(op, size): (median of systems[0], median of systems[1], their ratio)}: per system
    the median over runs of rows' ``median_s`` (rows: dicts with op, size_bytes, system,
    median_s); None for a figure with no row."""
    out = {}
    for op in ops:
        for size in sizes:
            med = [
                statistics.median(
                    [r["median_s"] for r in rows if r["op"] == op and r["size_bytes"] == size and r["system"] == s]
                    or [None]
                )
                for s in systems
            ]
            out[(op, size)] = (med[0], med[1], ratio(med[0], med[1]))
    return out


def plot_ratios(path, summary, ops, sizes, title, ylabel, line, line_label, xlabel):
    """save_figure of each op's ratio (medians_and_ratios) against size in MiB (log 2),
    with a dashed reference at ``line``."""

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for op in ops:
            points = [(s, summary[(op, s)][2]) for s in sizes if summary[(op, s)][2] is not None]
            ax.plot([s / 2**20 for s, _ in points], [r for _, r in points], marker="o", label=op)
        ax.axhline(line, color="grey", linestyle="--", label=line_label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        return fig

    return save_figure(path, draw)


def slowest(comm, call):
    """Seconds call() took on the slowest rank of comm (mpi4py), timed from a barrier."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = MPI.Wtime()
    call()
    return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)


def interleaved_runs(comm, calls, runs, iters, **labels):
    """Rows of ``runs`` runs: per run and system, the median and min (median_s, min_s) of
    ``iters`` calls of calls[system], the systems interleaved call by call (each call
    timed by slowest); every row also holds ``labels`` and its run."""
    rows = []
    for run in range(runs):
        times = {system: [] for system in calls}
        for _ in range(iters):
            for system, call in calls.items():
                times[system].append(slowest(comm, call))
        rows.extend(
            {**labels, "system": s, "run": run, "median_s": statistics.median(t), "min_s": min(t)}
            for s, t in times.items()
        )
    return rows


def ratio_lines(summary, size_text):
    """One line per (op, size) of medians_and_ratios' summary: op, size_text(size), both
    medians in ms and their ratio, or ``missing``."""
    return [
        f"{op:<14}{size_text(size):>12}{show(a and a * 1e3, '12.2f')}{show(b and b * 1e3, '12.2f')}{show(r, '12.3f')}"
        for (op, size), (a, b, r) in summary.items()
    ]
