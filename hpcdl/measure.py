"""Figures from measured values, the one place benchmarks turn amounts and
seconds into rates (and write their plots: save_figure).

A figure that was not measured is ``None`` (written as an empty CSV cell and
shown as ``missing``, with its reason beside it), never 0: a clock that read
no time, a phase that was skipped or a tool that saw nothing gives no rate.
"""

import math
import os

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
