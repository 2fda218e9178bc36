"""Real DLIO (dlio_benchmark, installed by scripts/bootstrap.sh) driving hpcdl's
DLIO plugin (hpcdl.contrib.dlio) on a tiny workload: one DLIO invocation
generates the files, the plugin packs them (HPCDL_DLIO_PACK=1) and serves two
epochs on 2 ranks. Checks that every sample DLIO asks for is delivered, in the
prefetcher's documented order, and that DLIO's metrics files are written.
DLIO is not imported here: its import pulls TensorFlow, which the rest of the
suite should not pay for."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpcdl.prefetch import rank_stream

from conftest import ROOT

RANKS, FILES, BATCH, EPOCHS, SEED = 2, 52, 4, 2, 7


def dlio_executable():
    if importlib.util.find_spec("dlio_benchmark") is None:
        pytest.fail("DLIO is not installed: run scripts/bootstrap.sh (pip install --no-deps -r requirements-dlio.txt)")
    path = shutil.which("dlio_benchmark") or os.path.join(os.path.dirname(sys.executable), "dlio_benchmark")
    assert os.path.exists(path), f"dlio_benchmark not found next to {sys.executable}"
    return path


def test_dlio_plugin_delivers_every_sample(tmp_path):
    data, output = tmp_path / "data", tmp_path / "out"
    cmd = [
        "mpiexec",
        "-n",
        str(RANKS),
        dlio_executable(),
        "workload=default",
        f"++workload.dataset.data_folder={data}",
        f"++workload.output.folder={output}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "++workload.workflow.generate_data=True",
        "++workload.workflow.evaluation=False",
        f"++workload.dataset.num_files_train={FILES}",
        "++workload.dataset.num_files_eval=0",
        "++workload.dataset.num_subfolders_train=0",
        "++workload.dataset.num_subfolders_eval=0",
        "++workload.dataset.record_length=2048",
        f"++workload.reader.batch_size={BATCH}",
        f"++workload.train.epochs={EPOCHS}",
        "++workload.train.computation_time=0.002",
        f"++workload.train.seed={SEED}",
        "++workload.reader.data_loader_classname=hpcdl.contrib.dlio.HpcdlDataLoader",
        "++workload.reader.data_loader_sampler=none",
    ]
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        HPCDL_DLIO_PACK="1",
        HPCDL_DLIO_RAM="16M",
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"DLIO failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (data / "train.hpcdl" / "manifest.h5").exists(), "the plugin did not pack DLIO's files"

    # What DLIO asks for: floor(N / batch / ranks) steps of `batch` samples per rank and epoch.
    steps = math.floor(FILES / BATCH / RANKS)
    for rank in range(RANKS):
        report = json.loads((output / f"hpcdl_train_rank{rank}.json").read_text())
        assert report["steps_per_epoch"] == steps and report["batch_size"] == BATCH
        assert [len(e) for e in report["delivered"]] == [steps * BATCH] * EPOCHS
        expected = rank_stream(FILES, BATCH * RANKS, RANKS, rank, EPOCHS, SEED)
        assert np.array_equal(np.concatenate(report["delivered"]), expected), f"rank {rank} order"
        served = sum(report["stats"]["hits"].values())
        assert served == EPOCHS * steps * BATCH, report["stats"]
        # DLIO's own record: every expected step processed on this rank.
        dlio_rank = json.loads((output / f"{rank}_output.json").read_text())
        for epoch in range(1, EPOCHS + 1):
            assert len(dlio_rank[str(epoch)]["proc"]["block1"]) == steps
    for epoch in range(EPOCHS):  # across ranks: no sample twice in an epoch
        seen = np.concatenate(
            [json.loads((output / f"hpcdl_train_rank{r}.json").read_text())["delivered"][epoch] for r in range(RANKS)]
        )
        assert len(np.unique(seen)) == len(seen) == steps * BATCH * RANKS

    metric = json.loads((output / "summary.json").read_text())["metric"]
    assert len(metric["train_au_percentage"]) == EPOCHS
    assert all(0 < au <= 100 for au in metric["train_au_percentage"]), metric
    assert all(s > 0 for s in metric["train_throughput_samples_per_second"]), metric
    assert metric["train_io_mean_MB_per_second"] > 0
    assert "[METRIC] Training Accelerator Utilization" in proc.stdout + proc.stderr
