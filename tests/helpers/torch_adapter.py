"""Models and training loops shared by the single-process and MPI PyTorch tests."""

import contextlib
import hashlib
import io
import os
import socket

import torch
from mpi4py import MPI

import hpcdl.torch as hvt

torch.set_num_threads(1)


def make_model(seed=0, dtype=torch.float32, hidden=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 5),
    ).to(dtype)


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
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def through_torch_save(obj):
    """obj after torch.save and torch.load, as a checkpoint holds it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def train_steps(model, opt, comm, first, count, per_rank=4):
    """Steps [first, first + count) of full_batch, on this rank's rows, on the model's device."""
    rank, size = comm.Get_rank(), comm.Get_size()
    device = next(model.parameters()).device
    for i in range(first, first + count):
        x, y = full_batch(i, per_rank, size)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        loss_of(model, x[rows].to(device), y[rows].to(device)).backward()
        opt.step()


def compressed_optimizer(model, codec, name, bucket_bytes=2048):
    """DistributedOptimizer over SGD with momentum, compressed with codec."""
    base = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return hvt.DistributedOptimizer(
        base, model.named_parameters(), compression=codec, name=name, bucket_bytes=bucket_bytes
    )


def train_distributed(comm, steps, per_rank, dtype=torch.float32, bucket_bytes=512, passes=1, **kw):
    model = make_model(dtype=dtype)
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model.named_parameters(),
        bucket_bytes=bucket_bytes,
        backward_passes_per_step=passes,
        comm=comm,
        **kw,
    )
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
        losses = [
            loss_of(model, x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank])
            for r in range(size)
        ]
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
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    rank = comm.Get_rank() if distributed else 0
    shares = [rank] if distributed else list(range(size))
    scales, skipped = [], []
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        opt.zero_grad()
        losses = []
        for r in shares:
            loss = loss_of(model, x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank])
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
    return max(
        float((p.detach().double() - q.detach().double()).abs().max()) for p, q in zip(a.parameters(), b.parameters())
    )


@contextlib.contextmanager
def gloo_group():
    """torch.distributed's gloo group over COMM_WORLD for DDP's set-up, on a port free on rank 0."""
    import torch.distributed as dist

    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port if MPI.COMM_WORLD.Get_rank() == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=MPI.COMM_WORLD.Get_rank(), world_size=MPI.COMM_WORLD.Get_size())
    try:
        yield
    finally:
        dist.destroy_process_group()
