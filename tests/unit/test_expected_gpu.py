"""A rank the launcher gave a GPU that its framework cannot use fails at `import hpcdl.torch`
or `import hpcdl.tensorflow`, on every rank, naming the rank and the cure, instead of training
on the CPU unnoticed. The device named, 99, exists on no machine, so the check fails here and
on a GPU machine alike."""

import os
import sys

import pytest

from conftest import MPIEXEC, ROOT, finish_job, start_job

ADAPTERS = {"hpcdl.torch": "torch ", "hpcdl.tensorflow": "TensorFlow "}


def importing(module):
    return [sys.executable, "-c", f"import {module}; print('imported')"]


def child_env(**variables):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "HPCDL_EXPECT_GPU")}
    return dict(env, PYTHONPATH=ROOT, **variables)


@pytest.mark.parametrize("module", sorted(ADAPTERS))
def test_a_rank_without_its_gpu_fails_at_import_and_says_how_to_go_on(module):
    code, out, _ = finish_job(start_job(importing(module), cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES="99")), 180)
    assert code != 0 and "imported" not in out, out[-3000:]
    assert "HpcdlError: [hpcdl rank 0] CUDA_VISIBLE_DEVICES='99' gives this rank GPUs, but " + ADAPTERS[module] in out
    assert "HPCDL_EXPECT_GPU=0" in out, out[-3000:]


@pytest.mark.parametrize("module", sorted(ADAPTERS))
def test_expect_gpu_0_imports_and_unset_devices_expect_none(module):
    for env in (child_env(CUDA_VISIBLE_DEVICES="99", HPCDL_EXPECT_GPU="0"), child_env()):
        code, out, _ = finish_job(start_job(importing(module), cwd=ROOT, env=env), 180)
        assert code == 0 and "imported" in out, out[-3000:]


def test_under_mpiexec_every_rank_names_itself_and_the_job_ends():
    job = start_job([MPIEXEC, "-n", "2", *importing("hpcdl.torch")], cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES="99"))
    code, out, _ = finish_job(job, 120)
    assert code != 0 and "imported" not in out, out[-3000:]
    assert "[hpcdl rank 0] CUDA_VISIBLE_DEVICES='99'" in out and "[hpcdl rank 1] CUDA_VISIBLE_DEVICES='99'" in out, out[
        -3000:
    ]
