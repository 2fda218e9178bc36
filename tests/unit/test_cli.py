"""`hpcdl bench allreduce|store|prefetch` as a new user types them (tiny sizes):
each prints a table and writes a CSV and a PNG with sane numbers."""

import csv
import os
import re
import shutil
import subprocess
import sys

from conftest import MPIEXEC, ROOT


def bench(*args, prefix=()):
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "hpcdl", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def assert_png(path):
    with open(path, "rb") as fh:
        head = fh.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000, path


def test_bench_allreduce_launches_its_ranks(tmp_path):
    out = bench(
        "allreduce", "-n", "2", "--out", str(tmp_path), "--sizes", "4KiB,256KiB", "--budget", "0.05", "--max-iters", "5"
    )
    assert "mpiexec -n 2" in out and "allreduce: 2 ranks" in out
    table = out[out.index("allreduce: 2 ranks") :].splitlines()
    assert table[1].split() == ["size", "hpcdl", "busbw", "mpi", "busbw", "hpcdl/mpi"]
    assert [line.split()[0] for line in table[2:4]] == ["4KiB", "256KiB"]
    rows = read_csv(tmp_path / "allreduce.csv")
    assert {(r["system"], int(r["bytes"])) for r in rows} == {(s, b) for s in ("hpcdl", "mpi") for b in (4096, 262144)}
    for r in rows:
        assert r["correct"] == "True" and r["ranks"] == "2" and 3 <= int(r["iters"]) <= 5
        assert 0 < float(r["time_min_s"]) <= float(r["time_median_s"]) < 10
        assert float(r["busbw_MBps"]) == float(r["algbw_MBps"])  # 2(p-1)/p = 1 for p = 2
    assert_png(tmp_path / "allreduce.png")


def test_bench_allreduce_in_process_under_mpiexec(tmp_path):
    out = bench(
        "allreduce",
        "--out",
        str(tmp_path),
        "--sizes",
        "4KiB",
        "--budget",
        "0.05",
        "--max-iters",
        "3",
        prefix=(MPIEXEC, "-n", "3"),
    )
    assert "allreduce: 3 ranks" in out and "mpiexec" not in out  # no second launch
    assert {r["ranks"] for r in read_csv(tmp_path / "allreduce.csv")} == {"3"}


def test_bench_store_without_root(tmp_path):
    out = bench(
        "store", "-n", "2", "--out", str(tmp_path), "--files", "300", "--cold-samples", "100", "--strace-samples", "100"
    )
    assert "plain local directory (no throttle)" in out
    rows = read_csv(tmp_path / "store.csv")
    reads = [r for r in rows if r["mode"] != "scan (hpcdl verify)"]
    assert {(r["mode"], r["ranks"]) for r in reads} == {
        (m, n) for m in ("files", "vlen", "store", "store-batch") for n in ("1", "2")
    }
    for r in reads:
        assert float(r["cold_samples_per_s"]) > 0 and float(r["warm_samples_per_s"]) > 0
        assert f"{float(r['cold_samples_per_s']):.0f}" in out  # the table shows it
    assert float(next(r for r in rows if r["mode"].startswith("scan"))["cold_MB_per_s"]) > 0
    if shutil.which("strace"):  # one open per sample against a few shard opens
        meta = {r["mode"]: float(r["metadata_calls_per_10k"]) for r in reads if r["ranks"] == "1"}
        assert meta["files"] >= 10000 > 10 * meta["store"], meta
    for r in reads:  # a figure not measured is an empty cell with its reason, never 0
        assert (r["metadata_calls_per_10k"] == "") == ("metadata calls:" in r["missing"]), r
    assert_png(tmp_path / "store.png")


def test_bench_store_on_a_store_that_verifies_in_microseconds(tmp_path):
    """Three small files verify far below a millisecond on a quiet machine: every rate still
    comes from unrounded values, and nothing is reported as 0."""
    out = bench(
        "store",
        "-n",
        "1",
        "--out",
        str(tmp_path),
        "--files",
        "3",
        "--classes",
        "3",
        "--cold-samples",
        "3",
        "--strace-samples",
        "3",
        "--repeats",
        "2",
    )
    rows = read_csv(tmp_path / "store.csv")
    scan = next(r for r in rows if r["mode"].startswith("scan"))
    assert scan["samples"] == "3"
    assert (scan["cold_MB_per_s"] == "" and scan["missing"]) or float(scan["cold_MB_per_s"]) > 0, scan
    for r in rows:
        for key in (
            "cold_samples_per_s",
            "cold_MB_per_s",
            "warm_samples_per_s",
            "warm_MB_per_s",
            "metadata_calls_per_10k",
        ):
            assert r.get(key, "") == "" or float(r[key]) > 0, (key, r)
    assert "sequential scan (hpcdl verify): " in out


def test_bench_prefetch_without_root(tmp_path):
    out = bench("prefetch", "-n", "2", "--out", str(tmp_path), "--files", "200", "--compute", "0.001")
    assert "the store was a plain temporary directory" in out
    rows = read_csv(tmp_path / "prefetch.csv")
    assert [(r["variant"], r["loader"], r["epoch"]) for r in rows if not r["loader"].startswith("model")] == [
        ("emulated", "dataloader", "1"),
        ("emulated", "dataloader", "2"),
        ("emulated", "hpcdl", "1"),
        ("emulated", "hpcdl", "2"),
    ]
    for r in rows:
        assert 0 < float(r["epoch_s"]) < 100
        assert 0 <= float(r["stall_fraction"]) <= 1
    assert re.search(r"emulated epochs 2\.\.2 dataloader/hpcdl: \d+\.\d+x", out), out
    assert_png(tmp_path / "prefetch.png")


def test_bench_errors_are_clear(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl", "bench", "allreduce", "-n", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "-n must be at least 1" in proc.stderr
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "hpcdl", "bench", "store"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "run it as one process" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl", "ls", "--no-such-option", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-option" in proc.stderr


def test_info_says_whether_the_mpi_is_cuda_aware():
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl", "info"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"^CUDA-aware MPI: (yes|no|unknown) ", proc.stdout, re.M)
    assert found, proc.stdout
    if "MPICH" in proc.stdout:  # MPICH exports MPIX_Query_cuda_support: the answer is known
        assert found.group(1) in ("yes", "no"), proc.stdout
