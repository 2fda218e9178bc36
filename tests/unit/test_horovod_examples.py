"""examples/horovod/: Horovod scripts with only the import changed, each run as a
2-rank mpiexec job (its own session, killed whole if it outlives its bound)."""

import os
import re
import sys

from conftest import MPIEXEC, ROOT, finish_job, start_job

BOUND_S = 240


def run_example(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = start_job(
        [MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "examples", "horovod", script), *args],
        cwd=ROOT,
        env=env,
    )
    code, out, _ = finish_job(proc, BOUND_S)
    assert code == 0, out[-4000:]
    return out


def test_pytorch_synthetic_benchmark_on_two_ranks():
    out = run_example(
        "pytorch_synthetic_benchmark.py", "--num-iters", "2", "--num-batches-per-iter", "2", "--fp16-allreduce"
    )
    rates = [float(v) for v in re.findall(r"Iter #\d: ([\d.]+) img/sec per rank", out)]
    assert "number of ranks 2" in out and len(rates) == 2 and all(r > 0 for r in rates), out[-2000:]
    assert "Total img/sec on 2 ranks" in out and "Ranks whose weights differ from rank 0's: 0" in out, out[-2000:]


def test_keras_digits_on_two_ranks_learns(tmp_path):
    out = run_example("tensorflow2_keras_digits.py", "--epochs", "4", "--checkpoint-dir", str(tmp_path))
    accuracy = re.search(r"test accuracy ([\d.]+)", out)
    assert accuracy and float(accuracy.group(1)) > 0.8, out[-3000:]
    assert "averaged over 2 ranks" in out and (tmp_path / "checkpoint-4.keras").exists(), out[-3000:]
