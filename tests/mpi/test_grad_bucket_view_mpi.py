"""DistributedOptimizer(gradient_as_bucket_view=True): .grad becomes the parameter's slot of
its bucket; the gradients and the trained parameters are the same bits as without it, with
zero_grad(set_to_none=True) and False, dense, a CPU codec and PowerSGD's vectors (which ride
in its last low-rank bucket)."""

import pytest
import torch
from mpi4py import MPI

import hpcdl.torch as hvt
from hpcdl.compression import Int8, PowerSGD

from conftest import agree, collective
from helpers.torch_adapter import full_batch, loss_of, make_model, params_digest

WORLD = MPI.COMM_WORLD
PER_RANK, STEPS = 6, 4


def _in_buckets(opt, grad):
    """Whether grad's memory lies in one of the optimizer's host buckets."""
    at = grad.data_ptr()
    return any(
        b.flat.data_ptr() <= at < b.flat.data_ptr() + b.flat.numel() * b.flat.element_size()
        for b in opt._buckets
        if not b.local
    )


def train(codec, as_view, set_to_none, name):
    """[per step: the .grad bits after backward], the final parameters' digest, and per step
    whether every .grad of a dense bucket (PowerSGD: every vector) was a view into its bucket after
    the step."""
    model = make_model()
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        model.named_parameters(),
        compression=codec,
        bucket_bytes=1024,
        name=name,
        gradient_as_bucket_view=as_view,
    )
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    grads, views, pointers = [], [], []
    for step in range(STEPS):
        x, y = full_batch(step, PER_RANK, size)
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(
            model, x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        ).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        views.append(
            all(_in_buckets(opt, p.grad) for p in model.parameters() if not isinstance(codec, PowerSGD) or p.dim() == 1)
        )
        pointers.append([p.grad.data_ptr() for p in model.parameters()])
    opt.remove_hooks()
    return grads, params_digest(model), views, pointers


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("codec", [None, Int8(), PowerSGD(rank=1, warmup_steps=1)], ids=str)
def test_views_give_the_same_bits_as_the_copies(codec, set_to_none):
    plain, plain_digest, plain_views, _ = collective(WORLD, train, codec, False, set_to_none, "view.plain")
    viewed, view_digest, views, pointers = collective(WORLD, train, codec, True, set_to_none, "view.on")
    same = all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for step_a, step_b in zip(plain, viewed)
        for a, b in zip(step_a, step_b)
    )
    # kept across steps when backward accumulates into it; a fresh .grad each step otherwise
    stable = pointers[1:] == pointers[:-1] if not set_to_none else True
    agree(
        WORLD,
        same and plain_digest == view_digest and all(views) and not any(plain_views) and stable,
        f"same grads {same}, same params {plain_digest == view_digest}, views {views} "
        f"(without the option {plain_views}), stable .grad {stable}",
    )
