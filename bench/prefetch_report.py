"""Table and plot of bench/prefetch.py's CSV: epoch time and stall fraction per
loader and epoch, next to the simulator's predictions.

    python bench/prefetch_report.py bench/results/prefetch.csv   # writes prefetch.png beside it
"""

import csv
import os
import sys


def report(csv_path):
    """Print the table and write the PNG beside csv_path; return the PNG's path."""
    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    loaders = list(dict.fromkeys(r["loader"] for r in rows))
    epochs = sorted({int(r["epoch"]) for r in rows})
    seconds = {(r["loader"], int(r["epoch"])): float(r["epoch_s"]) for r in rows}
    stalls = {(r["loader"], int(r["epoch"])): float(r["stall_fraction"]) for r in rows if r["stall_fraction"]}
    print(f"{'epoch':>5}  " + "  ".join(f"{name:>16}" for name in loaders) + "   (s per epoch, stall %)")
    for e in epochs:
        cells = []
        for name in loaders:
            stall = f" {stalls[name, e]:4.0%}" if (name, e) in stalls else "     "
            cells.append(f"{seconds[name, e]:11.2f}{stall}" if (name, e) in seconds else f"{'-':>16}")
        print(f"{e:>5}  " + "  ".join(cells))
    measured = [n for n in loaders if not n.startswith("model-")]
    if len(measured) == 2:
        a, b = measured
        print(f"total {a}/{b}: {sum(seconds[a, e] for e in epochs) / sum(seconds[b, e] for e in epochs):.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(loaders)
    for k, name in enumerate(loaders):
        xs = [e for e in epochs if (name, e) in seconds]
        ax.bar([e + (k - (len(loaders) - 1) / 2) * width for e in xs], [seconds[name, e] for e in xs], width,
               label=name, hatch="//" if name.startswith("model-") else None)
    ax.set_xticks(epochs)
    ax.set_xlabel("epoch")
    ax.set_ylabel("epoch time (s)")
    ax.set_title("prefetch benchmark: measured loaders and the simulator's model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.splitext(csv_path)[0] + ".png"
    fig.savefig(png + ".tmp.png", dpi=110)
    os.replace(png + ".tmp.png", png)
    print(f"wrote {csv_path} and {png}")
    return png


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    report(sys.argv[1])
