"""hpcdl.torch: DistributedOptimizer, broadcasts and the DDP hook, single-process and under MPI.

Reference results are computed on every rank locally (single-process training
on the concatenated batch), so no rank's answer depends on another's.
"""

import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from conftest import agree, collective, outcome

WORLD = MPI.COMM_WORLD
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)


def make_model(seed=0, dtype=torch.float32, hidden=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 5)).to(dtype)


def full_batch(step, per_rank, size, dtype=torch.float32):
    """The step's global batch; rank r trains on rows [r*per_rank, (r+1)*per_rank)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(per_rank * size, 12, generator=g).to(dtype)
    y = torch.randint(0, 5, (per_rank * size,), generator=g)
    return x, y


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def params_digest(model):
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_distributed(comm, steps, per_rank, dtype=torch.float32, bucket_bytes=512, passes=1, **kw):
    model = make_model(dtype=dtype)
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                   bucket_bytes=bucket_bytes, backward_passes_per_step=passes, comm=comm, **kw)
    rank, size = comm.Get_rank(), comm.Get_size()
    for step in range(steps):
        x, y = full_batch(step, per_rank * passes, size, dtype)
        mine = slice(rank * per_rank * passes, (rank + 1) * per_rank * passes)
        xs, ys = x[mine], y[mine]
        opt.zero_grad()
        for k in range(passes):
            part = slice(k * per_rank, (k + 1) * per_rank)
            (loss_of(model, xs[part], ys[part]) / passes).backward()
        opt.step()
    opt.remove_hooks()
    return model


def train_reference(steps, per_rank, size, dtype=torch.float32):
    """One process, the whole global batch per step, plain SGD."""
    model = make_model(dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x, y = full_batch(step, per_rank, size, dtype)
        opt.zero_grad()
        # mean over ranks of per-rank mean losses = the mean over the global batch
        losses = [loss_of(model, x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank])
                  for r in range(size)]
        (sum(losses) / size).backward()
        opt.step()
    return model


def train_amp(comm, steps, per_rank, size, inf_step, inf_rank, clip=None, distributed=True):
    """The usual AMP loop with torch.amp.GradScaler: scale(loss).backward(), then
    step() and update(), nothing else. Rank inf_rank's loss is Inf at inf_step
    (the step every rank must skip). With clip, the unscale_-then-clip pattern.
    distributed=False: one process over the whole global batch (the reference)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if distributed:
        opt = hvt.DistributedOptimizer(opt, model.named_parameters(), bucket_bytes=512, comm=comm, name="amp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    rank = comm.Get_rank() if distributed else 0
    shares = [rank] if distributed else list(range(size))
    scales, skipped = [], []
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        opt.zero_grad()
        losses = []
        for r in shares:
            loss = loss_of(model, x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank])
            losses.append(loss * float("inf") if (step, r) == (inf_step, inf_rank) else loss)
        before = params_digest(model)
        scaler.scale(sum(losses) / len(losses)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(params_digest(model) == before)
    if distributed:
        opt.remove_hooks()
    return model, scales, skipped


def max_difference(a, b):
    return max(float((p.detach().double() - q.detach().double()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------- single process

def test_wrapper_is_the_optimizer_class_and_schedulers_work():
    model = make_model()
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   comm=MPI.COMM_SELF)
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
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   bucket_bytes=32 * 32 * 4, comm=MPI.COMM_SELF, name="layout")
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
    opt = hvt.DistributedOptimizer(torch.optim.SGD(got.parameters(), lr=0.1), got.named_parameters(),
                                   comm=MPI.COMM_SELF, name="twice")
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
        want, want_scales, want_skipped = train_amp(MPI.COMM_SELF, 4, 8, 1, inf_step=1, inf_rank=0, clip=clip,
                                                    distributed=False)
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


# ---------------------------------------------------------------- under MPI

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
def test_data_parallel_equals_single_process_on_concatenated_batch(dtype, tol):
    size = WORLD.Get_size()
    got = collective(WORLD, train_distributed, WORLD, 5, 6, dtype=dtype)
    want = train_reference(5, 6, size, dtype=dtype)
    diff = max_difference(got, want)
    digests = WORLD.allgather(params_digest(got))
    agree(WORLD, diff < tol and len(set(digests)) == 1, f"max diff {diff}, distinct digests {len(set(digests))}")


@pytest.mark.mpi(min_size=2)
def test_accumulation_under_mpi_equals_reference():
    size = WORLD.Get_size()
    got = collective(WORLD, train_distributed, WORLD, 3, 3, passes=2)
    want = train_reference(3, 6, size)
    # each rank's half-batches are consecutive rows of its share: same global batch as the reference
    diff = max_difference(got, want)
    agree(WORLD, diff < 2e-5, f"max diff {diff}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_grad_scaler_equals_single_process_amp_and_skips_on_every_rank(clip):
    """scale(loss).backward(); [unscale_ + clip;] step(); update(): the same parameters as
    single-process AMP training on the concatenated batch; the Inf on the last rank at
    step 1 makes every rank skip that step and halve its scale."""
    size = WORLD.Get_size()
    got, scales, skipped = collective(WORLD, train_amp, WORLD, 5, 6, size, inf_step=1, inf_rank=size - 1, clip=clip)
    want, want_scales, want_skipped = train_amp(WORLD, 5, 6, size, inf_step=1, inf_rank=size - 1, clip=clip,
                                                distributed=False)
    diff = max_difference(got, want)
    views = WORLD.allgather((params_digest(got), scales, skipped))
    agree(WORLD, diff < 2e-5 and len({repr(v) for v in views}) == 1 and skipped == want_skipped
          and want_skipped[1] and not any(want_skipped[2:]) and scales == want_scales,
          f"max diff {diff}, skipped {skipped} vs {want_skipped}, scales {scales} vs {want_scales}, "
          f"{len({repr(v) for v in views})} distinct views")


@pytest.mark.mpi(min_size=2)
def test_parameters_without_gradient_on_some_ranks():
    """A branch used on even ranks only: no hang, and every rank ends bitwise identical."""
    rank = WORLD.Get_rank()

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.trunk = torch.nn.Linear(12, 8)
            self.even = torch.nn.Linear(8, 5)
            self.odd = torch.nn.Linear(8, 5)
            self.unused = torch.nn.Linear(3, 3)

        def forward(self, x):
            return (self.even if rank % 2 == 0 else self.odd)(torch.tanh(self.trunk(x)))

    model = Branchy()
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                   bucket_bytes=64, name="branchy")

    def train():
        for step in range(3):
            x, y = full_batch(step, 4, WORLD.Get_size())
            opt.zero_grad()
            loss = loss_of(model, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            loss.backward()
            # Buckets that backward left incomplete went at its end: waiting on
            # another hpcdl operation before step() neither hangs nor raises.
            hpcdl.allreduce(np.array([loss.item()], dtype=np.float32), name="branchy.loss")
            opt.step()

    collective(WORLD, train)
    opt.remove_hooks()
    digests = WORLD.allgather(params_digest(model))
    unused_zero = bool(torch.all(model.unused.weight.grad == 0))
    agree(WORLD, len(set(digests)) == 1 and unused_zero, f"{len(set(digests))} distinct, unused zero {unused_zero}")


@pytest.mark.mpi(min_size=2)
def test_first_bucket_allreduce_starts_before_backward_ends():
    """The last layers' bucket is reduced while autograd still works on the wide first layer."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 512), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   bucket_bytes=1 << 20, name="overlap")
    x = torch.randn(512, 256)
    y = torch.randint(0, 10, (512,))
    results = []

    def step():
        opt.zero_grad()
        loss_of(model, x, y).backward()
        backward_end_us = time.time() * 1e6
        opt.step()
        timings = opt.last_timings()
        first = timings[0]
        # Every bucket is announced (submitted, deferred) before the first one is full, and
        # each one's data moves only once its bucket is.
        announced_early = all(b["submitted_us"] <= first["ready_us"] for b in timings)
        in_order = all(b["submitted_us"] <= b["ready_us"] <= b["started_us"] <= b["finished_us"] for b in timings)
        results.append((first["started_us"] < backward_end_us, announced_early and in_order, first,
                        backward_end_us, len(timings)))

    for _ in range(3):
        collective(WORLD, step)
    opt.remove_hooks()
    overlapped = sum(r[0] for r in results)
    # several buckets, and at least one step where the first bucket's ring started during backward
    agree(WORLD, results[0][4] >= 4 and overlapped >= 1 and all(r[1] for r in results), results)


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
    out = subprocess.run([mpiexec, "-n", "3", sys.executable, "-c", RAISES_IN_BACKWARD],
                         env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "backward failed on rank 1" in out.stderr, out.stderr
    assert "[hpcdl rank 1] uncaught RuntimeError: aborting the job" in out.stderr, out.stderr
    assert time.monotonic() - started < 240


@pytest.mark.mpi(min_size=2)
def test_parameter_on_some_ranks_only_raises_everywhere():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = make_model()
    if rank == size - 1:
        model.add_module("extra", torch.nn.Linear(2, 2))
    _, err = outcome(hvt.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
                     model.named_parameters(), name="extra")
    message = str(err)
    ok = (isinstance(err, hpcdl.MismatchError) and "'extra.weight'" in message
          and f"on rank {size - 1} but not on rank 0" in message)
    agree(WORLD, ok, repr(err))


@pytest.mark.mpi(min_size=2)
def test_different_models_across_ranks_raise_everywhere():
    rank = WORLD.Get_rank()
    model = make_model(hidden=32 if rank != 1 else 33)
    _, err = outcome(hvt.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
                     model.named_parameters(), name="shapes")
    ok = (isinstance(err, hpcdl.MismatchError) and "'0.weight' is torch.float32[32, 12] on rank 0" in str(err)
          and "[33, 12] on rank 1" in str(err))
    _, err2 = outcome(hvt.broadcast_parameters, model.state_dict())
    ok2 = isinstance(err2, hpcdl.MismatchError) and "tensors to broadcast" in str(err2)
    agree(WORLD, ok and ok2, f"{err!r} / {err2!r}")


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_and_optimizer_state_from_root():
    rank = WORLD.Get_rank()
    model = make_model(seed=rank)
    model.register_buffer("steps", torch.tensor([rank], dtype=torch.int64))
    model.register_buffer("mask", torch.tensor([rank % 2 == 0, True]))
    root = WORLD.Get_size() - 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    if rank == root:  # only the root has momentum buffers (as after loading a checkpoint there)
        loss_of(model, *full_batch(0, 4, 1)).backward()
        opt.step()
    collective(WORLD, hvt.broadcast_parameters, model.state_dict(), root_rank=root)
    collective(WORLD, hvt.broadcast_optimizer_state, opt, root_rank=root)
    digests = WORLD.allgather((params_digest(model), model.steps.item(), model.mask.tolist()))
    momentum = opt.state[model[0].weight].get("momentum_buffer")
    mom_digests = WORLD.allgather(None if momentum is None else hashlib.sha1(momentum.numpy().tobytes()).hexdigest())
    ok = (len(set(map(repr, digests))) == 1 and digests[0][1] == root and opt.param_groups[0]["lr"] == 0.1 * (root + 1)
          and mom_digests[0] is not None and len(set(mom_digests)) == 1)
    agree(WORLD, ok, f"{digests}, {mom_digests}, lr {opt.param_groups[0]['lr']}")


@pytest.mark.mpi(min_size=2)
def test_ddp_comm_hook_equals_reference():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    port = WORLD.bcast(29500 + os.getpid() % 1000 if rank == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        model = DistributedDataParallel(make_model(), bucket_cap_mb=0.001)
        model.register_comm_hook(None, hvt.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def train():
            for step in range(4):
                x, y = full_batch(step, 6, size)
                opt.zero_grad()
                loss_of(model, x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6]).backward()
                opt.step()

        hpcdl.stats(reset=True)
        collective(WORLD, train)
        diff = max_difference(model.module, train_reference(4, 6, size))
        ops = hpcdl.stats()["allreduce"]["none"]["ops"]
    finally:
        dist.destroy_process_group()
    agree(WORLD, diff < 2e-5 and ops >= 4, f"max diff {diff}, hpcdl allreduce ops {ops}")


def test_torch_example_learns_the_digits(tmp_path):
    """examples/train_torch.py end to end in one process: pack, read, train, report."""
    import json

    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_torch.py"), "--epochs", "3",
                          "--metrics", str(metrics)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and epochs[-1]["test_acc"] > 0.7, run.stdout
    assert run.stdout.count("test acc ") == 3, run.stdout  # the human report too
