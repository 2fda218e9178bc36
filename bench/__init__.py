"""hpcdl's benchmarks, importable as hpcdl.bench (hpcdl/bench is a link to this
directory; an installed hpcdl carries a copy), so `hpcdl bench NAME` runs the
same code as `python bench/NAME.py`."""

import os


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
