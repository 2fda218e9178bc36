"""hpcdl.allreduce / broadcast over torch tensors under MPI: CPU tensors in place, staged
tensors ([cuda] on the GPU, [staged-cpu] the same path on CPU) in place, the results of
numpy arrays bit for bit; the gathering collectives read them through the same intake."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl

from conftest import agree, collective, outcome
from helpers.device import device  # noqa: F401 - the fixture

WORLD = MPI.COMM_WORLD


def rank_values(rank, n=1000, dtype=torch.float32):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(n, generator=g).to(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_allreduce_of_tensors_equals_that_of_arrays(device, dtype, op):
    rank = WORLD.Get_rank()
    t = rank_values(rank, dtype=dtype).to(device)
    ptr = t.data_ptr()
    # the same bytes as numpy (bfloat16: its bits, read as bfloat16)
    mine = rank_values(rank, dtype=dtype)
    array = mine.view(torch.int16).numpy().copy() if dtype == torch.bfloat16 else mine.numpy().copy()
    out = collective(WORLD, hpcdl.allreduce, t, op=op, name=f"tensor.{dtype}.{op}")
    collective(
        WORLD,
        hpcdl.allreduce,
        array,
        op=op,
        name=f"array.{dtype}.{op}",
        dtype="bfloat16" if dtype == torch.bfloat16 else None,
    )
    got = t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    digests = WORLD.allgather(got)
    agree(
        WORLD,
        out is t and t.data_ptr() == ptr and got == array.tobytes() and len(set(digests)) == 1,
        f"in place {out is t and t.data_ptr() == ptr}, equals numpy {got == array.tobytes()}",
    )


@pytest.mark.mpi(min_size=2)
def test_async_collectives_of_tensors_overlap_and_land_in_place(device):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    tensors = [torch.full((300 + i,), float(rank + i), device=device) for i in range(4)]
    handles = [hpcdl.allreduce_async(t, name=f"async.{i}") for i, t in enumerate(tensors)]
    b = torch.full((5,), float(rank), device=device, dtype=torch.float64)
    hb = hpcdl.broadcast_async(b, root=size - 1, name="async.bcast")
    results = collective(WORLD, lambda: [h.wait() for h in handles] + [hb.wait()])
    total = sum(range(size))
    ok = (
        all(r is t for r, t in zip(results, tensors + [b]))
        and all(torch.all(t.cpu() == total + i * size) for i, t in enumerate(tensors))
        and torch.all(b.cpu() == size - 1)
    )
    agree(WORLD, ok, [t[:2].tolist() for t in tensors] + [b.tolist()])


@pytest.mark.mpi(min_size=2)
def test_compressed_allreduce_of_a_tensor_is_identical_on_every_rank(device):
    t = rank_values(WORLD.Get_rank(), n=4096).to(device)
    collective(WORLD, hpcdl.allreduce, t, op="average", name="tensor.int8", compression=hpcdl.compression.Int8())
    exact = sum(rank_values(r, n=4096) for r in range(WORLD.Get_size())) / WORLD.Get_size()
    err = float((t.cpu() - exact).abs().max())
    digests = WORLD.allgather(t.cpu().numpy().tobytes())
    agree(WORLD, len(set(digests)) == 1 and err < 0.1, f"max error {err}, {len(set(digests))} distinct")


@pytest.mark.mpi(min_size=2)
def test_a_non_contiguous_tensor_raises_on_every_rank(device):
    _, err = outcome(hpcdl.allreduce, torch.ones(4, 6, device=device).t())
    agree(WORLD, isinstance(err, ValueError) and "contiguous" in str(err), repr(err))


@pytest.mark.mpi(min_size=2)
def test_a_cpu_tensor_is_zero_copy():
    """The core reads and writes the tensor's own memory (no staging for CPU tensors)."""
    t = torch.full((8,), float(WORLD.Get_rank()))
    view = t.numpy()  # shares memory with t
    collective(WORLD, hpcdl.allreduce, t, name="zero.copy")
    agree(WORLD, np.all(view == sum(range(WORLD.Get_size()))), view.tolist())


def _mismatched_shape_error(tensor_of):
    """hpcdl.allreduce of [17, 1311] on rank 0 against [17, 23, 57] elsewhere (the same count)."""
    rank = WORLD.Get_rank()
    t = tensor_of(torch.ones((17, 1311) if rank == 0 else (17, 23, 57)))
    _, err = outcome(hpcdl.allreduce, t, name="tensor.shape")
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "shape differs" in str(err)
        and "[17, 1311] on rank 0" in str(err)
        and torch.all(t.cpu() == 1)
    )
    return ok, repr(err)


@pytest.mark.mpi(min_size=2)
def test_mismatched_tensor_shapes_raise_on_every_rank(device):
    """A staged tensor ([cuda], [staged-cpu]) goes through a flat host copy: its shape still travels."""
    agree(WORLD, *_mismatched_shape_error(lambda t: t.to(device)))


@pytest.mark.mpi(min_size=2)
def test_mismatched_cpu_tensor_shapes_raise_on_every_rank():
    agree(WORLD, *_mismatched_shape_error(lambda t: t))


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_of_tensors_lands_in_place(device):
    """A group of staged ([cuda], [staged-cpu]) tensors, reduced in place, equal to their own allreduces."""
    rank = WORLD.Get_rank()
    tensors = [rank_values(rank, n=300).to(device), rank_values(rank, n=6, dtype=torch.bfloat16).to(device).view(2, 3)]
    alone = [t.clone() for t in tensors]
    results = collective(WORLD, hpcdl.grouped_allreduce, tensors, op="average", name="tensor.group")
    for i, t in enumerate(alone):
        collective(WORLD, hpcdl.allreduce, t, op="average", name=f"tensor.alone.{i}")
    ok = all(r is t and torch.equal(t.cpu(), a.cpu()) for r, t, a in zip(results, tensors, alone))
    agree(WORLD, ok and tensors[1].shape == (2, 3), f"{[t.cpu().ravel()[:3] for t in tensors]}")


def _gathers(size):
    """Each gathering collective (single and grouped) as a function of one tensor with size * 2 rows."""
    return {
        "allgather": lambda t, name: hpcdl.allgather(t, name=name),
        "reducescatter": lambda t, name: hpcdl.reducescatter(t, name=name),
        "alltoall": lambda t, name: hpcdl.alltoall(t, name=name)[0],
        "grouped_allgather": lambda t, name: hpcdl.grouped_allgather([t], name=name)[0],
        "grouped_reducescatter": lambda t, name: hpcdl.grouped_reducescatter([t], name=name)[0],
    }


def _gathering_float64_problems(to_device):
    """allgather, reducescatter and alltoall (and the grouped forms) of a float64 tensor, against
    numpy's float64 references of every rank's values: the problems seen (none: all equal)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    values = [rank_values(r, n=size * 2 * 3, dtype=torch.float64).reshape(size * 2, 3).numpy() for r in range(size)]
    mine = to_device(torch.from_numpy(values[rank].copy()))
    expected = {
        "allgather": np.concatenate(values),
        "reducescatter": np.sum(values, axis=0)[2 * rank : 2 * rank + 2],
        "alltoall": np.concatenate([v[2 * rank : 2 * rank + 2] for v in values]),
    }
    problems = []
    for kind, fn in _gathers(size).items():
        out = collective(WORLD, fn, mine, f"gather.f64.{kind}")
        want = expected[kind.removeprefix("grouped_")]
        close = out.shape == want.shape and np.allclose(out.cpu().numpy(), want, rtol=1e-12, atol=0)
        if not (isinstance(out, torch.Tensor) and out.device == mine.device and out.dtype == torch.float64 and close):
            problems.append(f"{kind}: {out!r}")
    if not torch.equal(mine.cpu(), torch.from_numpy(values[rank])):
        problems.append(f"the input changed: {mine!r}")
    return problems


@pytest.mark.mpi(min_size=2)
def test_gathering_collectives_of_cpu_tensors_equal_their_float64_references():
    """A CPU tensor is read by address (hpcdl._tensors.host_memory, as allreduce reads it)."""
    problems = _gathering_float64_problems(lambda t: t)
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_gathering_collectives_of_staged_tensors_equal_their_float64_references(device):
    """[cuda], [staged-cpu]: the tensor's staged host copy is read; results land on its device."""
    problems = _gathering_float64_problems(lambda t: t.to(device))
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_gathering_collectives_refuse_what_allreduce_refuses_on_every_rank():
    """One intake's checks: a tensor with the negative bit set, a non-contiguous one and one
    on another device are refused by every gathering collective with allreduce's errors,
    before any rank submits (so no rank waits for the others)."""
    size = WORLD.Get_size()
    refused = {
        "negative bit": (ValueError, torch._neg_view(torch.ones(size * 2, 3))),
        "contiguous": (ValueError, torch.ones(3, size * 2).t()),
        "CPU and CUDA tensors, got one on meta": (TypeError, torch.ones(size * 2, 3, device="meta")),
    }
    problems = []
    for words, (kind, tensor) in refused.items():
        for name, fn in _gathers(size).items():
            _, err = outcome(fn, tensor, f"refused.{name}")
            if not (isinstance(err, kind) and words in str(err)):
                problems.append(f"{name} of a tensor that should raise '{words}': {err!r}")
    agree(WORLD, not problems, problems)
