"""bench/train.py with tiny sizes under mpiexec -n 2: every system it was asked
for is a CSV row, either measured (step time and accuracy > 0) or missing with
the reason it did not run, never a zero; the no-exchange floor is timed and not
trained, and says so. Hidden 512: 2.7 MB of gradients, more
than DDP's 1 MiB first bucket, so PowerSGD would meet the two-bucket deadlock
over gloo that the bench avoids."""

import csv
import os
import re
import sys

import pytest
import torch

from conftest import MPIEXEC, ROOT, finish_job, start_job

SYSTEMS = {
    "ddp-gloo",
    "ddp-fp16",
    "ddp-bf16",
    "ddp-powersgd-r1",
    "ddp-powersgd-r4",
    "hpcdl-dense",
    "hpcdl-int8",
    "hpcdl-topk",
    "hpcdl-powersgd",
    "no-exchange",
}
STEP_FIGURES = ("median_step_ms", "samples_per_s", "throughput_vs_ddp", "throughput_vs_fastest_hook")
FIGURES = (*STEP_FIGURES, "test_acc", "test_loss")


def test_every_system_is_measured_or_missing_with_its_reason(tmp_path):
    command = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        os.path.join(ROOT, "bench", "train.py"),
        "--hidden",
        "512",
        "--layers",
        "2",
        "--batch",
        "8",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--train-steps",
        "12",
        "--seeds",
        "2",
        "--out",
        str(tmp_path),
        "--tag",
        "tiny",
    ]
    code, output, _ = finish_job(start_job(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1")), 300)
    assert code == 0, output[-3000:]
    with open(tmp_path / "tiny.csv", newline="") as fh:
        rows = {row["system"]: row for row in csv.DictReader(fh)}
    assert set(rows) == SYSTEMS, output[-3000:]
    for name, row in rows.items():
        figures = [row[key] for key in FIGURES]
        if name == "no-exchange":
            assert row["note"] == "step-time floor: no gradient exchange, not trained", row
            assert all(float(row[key]) > 0 for key in STEP_FIGURES) and row["test_acc"] == row["test_loss"] == "", row
        elif row["note"]:
            assert row["note"].startswith("did not run: ") and len(row["note"]) > len("did not run: "), row
            assert figures == [""] * len(FIGURES), row
        else:
            assert all(float(value) > 0 for value in figures), row
            assert int(row["steps_timed"]) == 2 and int(row["train_steps"]) == 12, row
            # two timed steps: the CPU median is their mean, of which the kernel's is a part
            assert 0 <= float(row["kernel_cpu_ms_per_step_mean"]) <= float(row["cpu_ms_per_step"]) + 1, row
            # two training seeds: the mean of the per-seed accuracies, between their min and max
            seeds = [float(a) for a in row["test_acc_per_seed"].split()]
            assert int(row["acc_seeds"]) == len(seeds) == 2, row
            assert float(row["test_acc_min"]) == min(seeds) and float(row["test_acc_max"]) == max(seeds), row
            assert abs(float(row["test_acc"]) - sum(seeds) / 2) < 1e-12 and row["test_acc_sd"] != "", row
    assert rows["ddp-gloo"]["note"] == "" and float(rows["ddp-gloo"]["throughput_vs_ddp"]) == 1.0
    hooks = [row for name, row in rows.items() if name.startswith("ddp-") and name != "ddp-gloo" and not row["note"]]
    assert max(float(row["throughput_vs_fastest_hook"]) for row in hooks) == 1.0, rows
    assert os.path.getsize(tmp_path / "tiny.png") > 5000


def test_profile_step_times_one_system_and_refuses_an_unknown_one(tmp_path):
    """bench/profile_step.py: the step of one system alone, with its wall and CPU time per step
    (and the part of that CPU outside the training thread) and the bytes its allreduces
    received (none without an exchange); --csv appends each run's figures unrounded."""
    script = os.path.join(ROOT, "bench", "profile_step.py")
    table = tmp_path / "profile.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    printed = []
    for system in ("topk", "topk-reuse", "no-exchange"):
        command = [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            script,
            system,
            "--steps",
            "3",
            "--hidden",
            "64",
            "--layers",
            "1",
            "--batch",
            "4",
            "--csv",
            str(table),
        ]
        code, output, _ = finish_job(start_job(command, cwd=ROOT, env=env), 300)
        assert code == 0, output[-3000:]
        found = re.search(
            rf"\[hpcdl rank 0\] {system}(?: \(reuse_steps=20\))?: ([0-9.]+) ms/step, ([0-9.]+) ms CPU per rank and "
            r"step \(([0-9.]+) of it in threads other than training's: the engine's, MPI's\), "
            r"([0-9.]+) kB received per rank and step \(2 ranks, 3 timed steps after 20\)",
            output,
        )
        assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0, output[-3000:]
        assert 0 <= float(found.group(3)) <= float(found.group(2)), output[-3000:]
        assert (float(found.group(4)) > 0) == (system != "no-exchange"), output[-3000:]
        printed.append(found)
    with open(table, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["system"] for row in rows] == ["topk", "topk-reuse (reuse_steps=20)", "no-exchange"], rows
    columns = ("ms_per_step", "cpu_ms_per_rank_step", "other_threads_cpu_ms_per_rank_step")
    for row, found in zip(rows, printed):
        assert row["ranks"] == "2" and row["steps"] == "3", row
        for i, column in enumerate(columns, start=1):  # the printed figure is the row's, rounded
            assert abs(float(row[column]) - float(found.group(i))) <= 0.005 + 1e-9, (column, row, found.group(0))
        assert abs(float(row["kb_received_per_rank_step"]) - float(found.group(4))) <= 0.05 + 1e-9, row
    code, output, _ = finish_job(start_job([sys.executable, script, "fp8"], cwd=ROOT, env=env), 120)
    assert code == 2 and "unknown system 'fp8'" in output, output[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists: the refusal is for machines without")
def test_the_gpu_benchmark_refuses_clearly_without_a_cuda_device(tmp_path):
    for command in (
        [sys.executable, os.path.join(ROOT, "bench", "train_gpu.py"), "--out", str(tmp_path)],
        [os.path.join(ROOT, "bench", "gpu.sh"), str(tmp_path)],
    ):
        code, output, _ = finish_job(start_job(command, cwd=ROOT), 120)
        assert code == 2 and "no CUDA device" in output, (command, code, output[-2000:])
        assert not os.listdir(tmp_path)


def test_the_gpu_benchmark_summarizes_runs_by_their_medians(tmp_path):
    """bench/train_gpu.py's summary (runnable without a GPU): a run's figures are its medians, its
    ratios those of its medians; the summary is the median over runs of each figure, so a ratio is
    the median of the runs' ratios (here 2.0), not the ratio of the median times (1.0)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import train_gpu
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    systems = ["no-exchange", "hpcdl-dense", "ddp-gloo"]
    floor, dense, ddp = [0.001, 0.002, 0.004], [0.002, 0.002, 0.012], [0.004, 0.004, 0.004]
    # each run: 3 steps per system, one an outlier (9 s) the median ignores
    times = [{s: [t[run], 9.0, t[run]] for s, t in zip(systems, (floor, dense, ddp))} for run in range(3)]
    runs = [(run_times, {s: [0.5] for s in systems}, {}) for run_times in times]
    setting = {"ranks": 2, "gpus": 1, "gpu": "none", "batch_per_rank": 4}
    per_run, summary = train_gpu.summarize(runs, systems, "ddp-gloo", setting)
    assert [(r["system"], r["run"]) for r in per_run] == [(s, run) for run in (1, 2, 3) for s in systems]
    assert [r["median_step_ms"] for r in per_run if r["system"] == "hpcdl-dense"] == pytest.approx([2, 2, 12])
    median = {r["system"]: r for r in summary}
    assert [r["run"] for r in summary] == ["median"] * 3
    assert median["hpcdl-dense"]["step_vs_floor"] == pytest.approx(2.0)
    assert median["hpcdl-dense"]["median_step_ms"] == pytest.approx(2.0)
    assert median["no-exchange"]["step_vs_ddp"] == pytest.approx(0.5)
    assert median["hpcdl-dense"]["samples_per_s"] == pytest.approx(8 / 0.002)
    assert median["hpcdl-dense"]["steps_timed"] == 9 and median["hpcdl-dense"]["cpu_ms_per_step"] == 500
    from hpcdl.measure import save_figure

    path = tmp_path / "gpu.png"
    save_figure(str(path), lambda plt: train_gpu.draw(plt, per_run, summary, "test"))
    assert path.stat().st_size > 1000
