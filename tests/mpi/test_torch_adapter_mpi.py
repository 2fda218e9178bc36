"""hpcdl.torch under MPI: DistributedOptimizer, broadcasts and the DDP hook.

Reference results are computed on every rank locally (single-process training
on the concatenated batch), so no rank's answer depends on another's.
"""

import hashlib
import os
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from conftest import agree, collective, outcome
from helpers.torch_adapter import (full_batch, loss_of, make_model, max_difference, params_digest, train_amp,
                                   train_distributed, train_reference)

WORLD = MPI.COMM_WORLD


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
