"""bench/pipeline_model.py's invariants, single process: the simulated schedule gives the
closed-form bubble (P-1)/(M+P-1) for equal stages and free links (GPipe and 1F1B),
1F1B holds at most P - s micro-batches on stage s, more cores are never slower,
fewer cores than stages slow the all-busy pipeline by P / cores, a host's CPU quota caps
each stage where a shared pool of the same cores does not, link costs lengthen the step, and `predict` / `validate` write their CSV (and PNG); bench/pipeline.py --replot redraws a
run's PNG from its CSVs. No timings are asserted."""

import csv
import os
import shutil
import subprocess
import sys

import pytest

from hpcdl.pipeline import bubble_fraction

import pipeline_model as pm  # bench/pipeline_model.py (tests/conftest.py puts bench/ on sys.path)
from conftest import ROOT

SCHEDULES = ("gpipe", "1f1b")
UNEVEN_F = [1.0, 1.7, 0.6, 1.2, 0.9, 1.4, 0.8, 1.1]  # made-up seconds per micro-batch
UNEVEN_B = [2.1, 2.9, 1.5, 2.2, 1.6, 3.1, 1.8, 2.0]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(1, 4), (2, 8), (3, 5), (4, 4), (4, 16), (8, 32)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_equal_stages_and_free_links_give_the_closed_form_bubble(schedule, p, m, backward):
    out = pm.simulate(schedule, [1.0] * p, [backward] * p, [0] * (p - 1), m, cores=p, steps=3)
    assert out["bubble"] == pytest.approx(bubble_fraction(p, m), abs=1e-9)
    assert out["step_s"] == pytest.approx((m + p - 1) * (1.0 + backward), rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_holds_at_most_p_minus_s_micro_batches_gpipe_all(p):
    m = 4 * p
    f, b = UNEVEN_F[:p], UNEVEN_B[:p]
    one = pm.simulate("1f1b", f, b, [1000] * (p - 1), m, cores=p, alpha=0.1, beta=1e-4)
    gpipe = pm.simulate("gpipe", f, b, [1000] * (p - 1), m, cores=p, alpha=0.1, beta=1e-4)
    assert one["peak_in_flight"] == [p - s for s in range(p)]
    assert gpipe["peak_in_flight"] == [m] * p


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_more_cores_are_never_slower(schedule):
    p, m = 8, 16
    times = [
        pm.simulate(
            schedule,
            UNEVEN_F,
            UNEVEN_B,
            [4096] * (p - 1),
            m,
            cores=c,
            alpha=0.05,
            beta=1e-5,
            optimizer=[0.3] * p,
            steps=2,
        )["seconds"]
        for c in (0.5, 1, 1.5, 2, 3, 4, 6, 8, 10)
    ]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(times, times[1:])), times
    assert times[-1] == pytest.approx(times[-2])  # beyond a core per stage nothing changes
    assert times[0] > times[-1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_core_runs_the_total_work_back_to_back(schedule):
    p, m = 4, 8
    out = pm.simulate(schedule, UNEVEN_F[:p], UNEVEN_B[:p], [0] * (p - 1), m, cores=1, optimizer=[0.5] * p, steps=2)
    assert out["seconds"] == pytest.approx(2 * (m * sum(UNEVEN_F[:p] + UNEVEN_B[:p]) + 0.5 * p), rel=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,cores", [(4, 2), (4, 1), (8, 2), (8, 4)])
def test_fewer_cores_than_stages_slow_the_all_busy_pipeline_by_p_over_cores(schedule, p, cores):
    m = 400  # the fill and drain, where fewer stages are busy, become negligible
    one_each = pm.simulate(schedule, [1.0] * p, [2.0] * p, [0] * (p - 1), m, cores=p)["seconds"]
    shared = pm.simulate(schedule, [1.0] * p, [2.0] * p, [0] * (p - 1), m, cores=cores)["seconds"]
    assert shared / one_each == pytest.approx(p / cores, rel=0.03)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_host_quota_caps_each_stage_where_a_shared_pool_does_not(schedule):
    p, m = 4, 8
    full = pm.simulate(schedule, UNEVEN_F[:p], UNEVEN_B[:p], [0] * (p - 1), m, cores=p)
    # P hosts of half a core each: every action takes twice as long, the bubble is the same
    half = pm.simulate(schedule, UNEVEN_F[:p], UNEVEN_B[:p], [0] * (p - 1), m, cores=p / 2, speed=0.5)
    assert half["seconds"] == pytest.approx(2 * full["seconds"], rel=1e-9)
    assert half["bubble"] == pytest.approx(full["bubble"], rel=1e-9)
    # the same P / 2 cores as one pool: a stage runs faster while others wait (the fill and drain)
    pool = pm.simulate(schedule, UNEVEN_F[:p], UNEVEN_B[:p], [0] * (p - 1), m, cores=p / 2)
    assert pool["seconds"] < half["seconds"] * (1 - 1e-3)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_link_costs_lengthen_the_step(schedule):
    p, m, alpha, beta, n = 4, 8, 0.2, 1e-4, 2000
    free = pm.simulate(schedule, [1.0] * p, [2.0] * p, [n] * (p - 1), m, cores=p)
    paid = pm.simulate(schedule, [1.0] * p, [2.0] * p, [n] * (p - 1), m, cores=p, alpha=alpha, beta=beta)
    # at least one message per boundary each way lies on the critical path
    assert paid["seconds"] >= free["seconds"] + 2 * (p - 1) * (alpha + n * beta) - 1e-9
    assert paid["bubble"] > free["bubble"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2 stages need 2 backward times and 1 message sizes"):
        pm.simulate("gpipe", [1.0, 1.0], [1.0], [0], 4, cores=2)
    with pytest.raises(ValueError, match="cores and speed must be > 0"):
        pm.simulate("gpipe", [1.0], [1.0], [], 4, cores=0)
    with pytest.raises(ValueError, match="cores and speed must be > 0"):
        pm.simulate("gpipe", [1.0], [1.0], [], 4, cores=1, speed=0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pm.simulate("zb", [1.0], [1.0], [], 4, cores=1)


def test_fit_link_recovers_alpha_and_beta():
    alpha, beta = pm.fit_link([(n, 3e-5 + n * 2e-10) for n in pm.LINK_SIZES])
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-10)


def test_predict_writes_csv_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    pm.main(
        [
            "predict",
            "--one-process",
            "--stages",
            "2",
            "4",
            "--hidden",
            "32",
            "--layers",
            "4",
            "--batch",
            "32",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--alpha",
            "1e-5",
            "--beta",
            "1e-10",
            "--out",
            str(tmp_path),
            "--tag",
            "t",
        ]
    )
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["system"], r["stages"], r["micro_batches"]) for r in rows] == [
        ("hpcdl gpipe", "2", "8"),
        ("hpcdl 1f1b", "2", "8"),
        ("hpcdl gpipe", "4", "16"),
        ("hpcdl 1f1b", "4", "16"),
    ]
    for r in rows:
        assert float(r["predicted_samples_per_s"]) > 0
        assert 0 < float(r["predicted_bubble"]) < 1
        theory = bubble_fraction(int(r["stages"]), int(r["micro_batches"]))
        assert float(r["theoretical_bubble"]) == pytest.approx(theory)
        assert len(r["stage_forward_backward_s"].split()) == int(r["stages"])
    assert (tmp_path / "t.png").stat().st_size > 0


def test_validate_tabulates_predicted_over_measured(tmp_path):
    run = tmp_path / "run.csv"
    with open(run, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "system",
                "ranks",
                "micro_batches",
                "median_samples_per_s",
                "measured_bubble",
                "predicted_samples_per_s",
                "predicted_bubble",
                "model_cores",
                "predicted_samples_per_s_inrun",
                "predicted_bubble_inrun",
                "conditions",
            ]
        )
        w.writerow(["single process", "1", "", "100.0", "", "", "", "", "", "", "c"])
        w.writerow(["hpcdl gpipe", "2", "8", "50.0", "0.120", "60.0", "0.100", "2.00", "55.0", "0.110", "c"])
    pm.main(["validate", str(run), "--out", str(tmp_path)])
    with open(tmp_path / "pipeline-model-validation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["system"] == "hpcdl gpipe"
    assert float(rows[0]["predicted_over_measured"]) == pytest.approx(1.2)
    assert float(rows[0]["predicted_over_measured_inrun"]) == pytest.approx(1.1)
    assert rows[0]["predicted_over_measured_run_share"] == ""  # not in this run's CSV: empty, not 0


def test_bench_pipeline_replot_redraws_a_run_from_its_csvs(tmp_path):
    pytest.importorskip("matplotlib")
    for suffix in (".csv", "-memory.csv"):
        shutil.copy(
            os.path.join(ROOT, "bench", "results", "pipeline-2stages-heavy" + suffix), tmp_path / ("t" + suffix)
        )
    with open(tmp_path / "t.csv", newline="") as f:  # a system that failed is drawn as such
        rows = list(csv.DictReader(f))
    rows[-1].update(status="did not complete in 600 s", median_samples_per_s="", runs_samples_per_s="")
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "pipeline.py"), "--replot", "--out", str(tmp_path), "--tag", "t"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.png").stat().st_size > 10000
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "pipeline.py"),
            "--replot",
            "--out",
            str(tmp_path),
            "--tag",
            "missing",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "missing.csv" in done.stderr
