"""hpcdl.torch in one process: DistributedOptimizer, buckets, accumulation, AMP and
bad arguments (under MPI: tests/mpi/test_torch_adapter_mpi.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt

from conftest import ROOT
from helpers.torch_adapter import (
    full_batch,
    loss_of,
    make_model,
    max_difference,
    params_digest,
    train_amp,
    train_distributed,
    train_reference,
)


def test_wrapper_is_the_optimizer_class_and_schedulers_work():
    model = make_model()
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), comm=MPI.COMM_SELF
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = full_batch(0, 4, 1)
    loss_of(model, x, y).backward()
    opt.step()
    sched.step()
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.state_dict()["param_groups"][0]["lr"] == 0.5
    opt.remove_hooks()


def test_buckets_follow_reverse_registration_order_and_size():
    model = make_model(hidden=32)
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        bucket_bytes=32 * 32 * 4,
        comm=MPI.COMM_SELF,
        name="layout",
    )
    layout = opt.bucket_layout()
    shapes = [s for _, _, bucket in layout for s in bucket]
    assert shapes == [tuple(p.shape) for p in reversed(list(model.parameters()))]
    # the 32x32 weight fills a bucket on its own terms: it closes the bucket it lands in
    assert [name for name, _, _ in layout] == [f"layout.bucket.{i}" for i in range(len(layout))]
    assert layout[0][2] == [(5,), (5, 32), (32,), (32, 32)] and len(layout) == 2
    opt.remove_hooks()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_single_process_equals_plain_sgd(dtype):
    got = train_distributed(MPI.COMM_SELF, 3, 8, dtype=dtype)
    want = train_reference(3, 8, 1, dtype=dtype)
    assert params_digest(got) == params_digest(want)


def test_gradient_accumulation_over_backward_passes():
    got = train_distributed(MPI.COMM_SELF, 3, 4, passes=2)
    want = train_reference(3, 8, 1)
    assert max_difference(got, want) < 1e-5


def test_backward_returns_reduced_gradients_and_a_second_backward_reduces_again():
    """The allreduce finishes at the end of backward, so .grad is already reduced
    when backward() returns; a second backward before step() adds its gradients
    and reduces again (one allreduce per backward), and step() applies the total."""
    got, want = make_model(), make_model()
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(got.parameters(), lr=0.1), got.named_parameters(), comm=MPI.COMM_SELF, name="twice"
    )
    ref = torch.optim.SGD(want.parameters(), lr=0.1)
    x, y = full_batch(0, 4, 1)
    hpcdl.stats(reset=True)
    for model in (got, want):
        loss_of(model, x, y).backward()
        loss_of(model, x[:2], y[:2]).backward()
    ops = sum(row["ops"] for row in hpcdl.stats()["allreduce"].values())
    opt.step()
    ref.step()
    opt.remove_hooks()
    assert ops == 2 * len(opt.bucket_layout())
    assert params_digest(got) == params_digest(want)


def test_grad_scaler_single_process_equals_plain_amp():
    """GradScaler's usual pattern, unchanged: the same parameters and scales as
    plain AMP training, through a skipped step (Inf loss) and with unscale_ + clipping."""
    for clip in (None, 0.05):
        got, got_scales, got_skipped = train_amp(MPI.COMM_SELF, 4, 8, 1, inf_step=1, inf_rank=0, clip=clip)
        want, want_scales, want_skipped = train_amp(
            MPI.COMM_SELF, 4, 8, 1, inf_step=1, inf_rank=0, clip=clip, distributed=False
        )
        assert got_skipped == want_skipped == [False, True, False, False]
        assert got_scales == want_scales
        assert params_digest(got) == params_digest(want), clip


def test_bad_arguments():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="missing from named_parameters"):
        hvt.DistributedOptimizer(sgd, list(model.named_parameters())[:2], comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="duplicate names"):
        hvt.DistributedOptimizer(sgd, [("w", p) for p in model.parameters()], comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvt.DistributedOptimizer(sgd, model.named_parameters(), backward_passes_per_step=0, comm=MPI.COMM_SELF)


RAISES_IN_BACKWARD = """
import torch, hpcdl, hpcdl.torch
from mpi4py import MPI
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 4))
opt = hpcdl.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       bucket_bytes=4096)
def fail(grad):
    raise RuntimeError("backward failed on rank 1")
for step in range(3):
    opt.zero_grad()
    hidden = model[1](model[0](torch.randn(4, 8)))
    if step == 2 and MPI.COMM_WORLD.Get_rank() == 1:
        hidden.register_hook(fail)  # backward stops halfway: the first layer's bucket is never full here
    model[4](model[3](model[2](hidden))).sum().backward()
    opt.step()
"""


def test_backward_failing_on_one_rank_ends_the_job():
    """The other ranks wait in a ring for the bucket rank 1 never fills; the uncaught
    exception aborts the job instead of leaving it hanging."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    started = time.monotonic()
    out = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, "-c", RAISES_IN_BACKWARD],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "backward failed on rank 1" in out.stderr, out.stderr
    assert "[hpcdl rank 1] uncaught RuntimeError: aborting the job" in out.stderr, out.stderr
    assert time.monotonic() - started < 240


def test_torch_example_learns_the_digits(tmp_path):
    """examples/train_torch.py end to end in one process: pack, read, train, report."""
    import json

    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_torch.py"), "--epochs", "3", "--metrics", str(metrics)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and epochs[-1]["test_acc"] > 0.7, run.stdout
    assert run.stdout.count("test acc ") == 3, run.stdout  # the human report too
