"""Top-k over data in segments (include/hpcdl/util/segments.hpp): an allreduce marked
ready with its data in pieces gives, in those pieces, the same bits as the same
allreduce of the contiguous array, step after step (so the error feedback is the
same too), for both algorithms and threshold reuse; DistributedOptimizer's TopK
buckets reduce each .grad where backward left it, with the same bits as the
contiguous path; wrong segments raise on every rank."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from hpcdl import _core
from hpcdl.compression import Int8, TopK

from conftest import agree, collective
from helpers.torch_adapter import full_batch, loss_of, make_model

WORLD = MPI.COMM_WORLD
N = 5003
CUTS = [0, 7, 7, 1000, 1016, 3001, N]  # an empty piece, pieces not multiples of the scan's 16-value groups
STEPS = 4


def _pieces(flat):
    return [flat[a:b] for a, b in zip(CUTS, CUTS[1:])]


def _inputs(step):
    rng = np.random.default_rng(1000 * step + WORLD.Get_rank())
    x = rng.standard_normal(N).astype(np.float32)
    x[rng.integers(0, N, 50)] = 2.5  # ties at the cut
    return x


def run_both(codec, tag):
    """Per step (contiguous result, the pieces' concatenation, whether the segmented op's own
    buffer was left alone)."""
    out = []
    for step in range(STEPS):
        whole = _inputs(step)
        pieces = _pieces(_inputs(step).copy())
        untouched = np.full(N, 7.0, np.float32)
        seg = hpcdl.allreduce_async(untouched, op="average", name=f"{tag}.segments", compression=codec, deferred=True)
        seg.mark_ready([_core.Buffer(p) for p in pieces])
        hpcdl.allreduce(whole, op="average", name=f"{tag}.whole", compression=codec)
        seg.wait()
        out.append((whole, np.concatenate(pieces), bool((untouched == 7.0).all())))
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "codec",
    [
        TopK(0.01, algorithm="split"),
        TopK(0.01, algorithm="allgather"),
        TopK(0.01, algorithm="split", reuse_steps=2),
        TopK(0.01, algorithm="allgather", reuse_steps=2),
        TopK(1.0, algorithm="split"),
    ],
    ids=str,
)
def test_segments_give_the_bits_of_the_contiguous_array(codec):
    steps = collective(WORLD, run_both, codec, f"segments.{codec}")
    same = [w.view(np.int32).tolist() == s.view(np.int32).tolist() for w, s, _ in steps]
    nonzero = [int(np.count_nonzero(w)) for w, _, _ in steps]
    agree(
        WORLD,
        all(same) and all(u for _, _, u in steps) and all(c > 0 for c in nonzero),
        f"same bits per step {same}, own buffer untouched {[u for _, _, u in steps]}, nonzeros {nonzero}",
    )


def _mark_wrong(segments, codec=TopK(0.01)):
    handle = hpcdl.allreduce_async(np.zeros(N, np.float32), name="segments.wrong", compression=codec, deferred=True)
    try:
        handle.mark_ready(segments)
        return None
    except (TypeError, ValueError) as exc:
        return str(exc)
    finally:
        handle.mark_ready()  # the buffer's zeros, so no rank waits on the operation
        handle.wait()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "segments, words",
    [
        (lambda: [_core.Buffer(np.zeros(N - 1, np.float32))], "segments hold 5002 values, the operation 5003"),
        (lambda: [_core.Buffer(np.zeros(N, np.float64))], "segments must be float32"),
    ],
    ids=["short", "float64"],
)
def test_wrong_segments_raise_on_every_rank(segments, words):
    error = _mark_wrong(segments())
    agree(WORLD, error is not None and words in error, f"error: {error!r}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [None, Int8()], ids=str)
def test_segments_are_refused_without_topk(codec):
    error = _mark_wrong([_core.Buffer(np.zeros(N, np.float32))], codec)
    agree(WORLD, error is not None and "only a float32 allreduce with TopK" in error, f"error: {error!r}")


def _flat_slot_is_zero(opt, param):
    """Whether param's slot of its bucket's flat buffer holds only zeros (never written)."""
    for bucket in opt._buckets:
        for p, offset, numel in bucket.slots:
            if p is param:
                return bool((bucket.flat[offset : offset + numel] == 0).all())
    raise AssertionError("parameter in no bucket")


def train(codec, set_to_none, as_view, strided_grad):
    """Per step: whether the .grad bits after the step are those of the reference, whether
    the bucket's flat buffer was left alone for each gradient reduced in place (every one,
    except a strided gradient, which is staged there), and the nonzeros. The reference:
    hpcdl.allreduce of the concatenated local gradients (the contiguous path) under its own
    name, so with its own residual. strided_grad: no backward; .grad is set by hand (one of
    them a transposed view) and step() reduces it."""
    torch.manual_seed(0)
    model = make_model()
    tag = f"{set_to_none}.{as_view}.{strided_grad}"
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression=codec,
        bucket_bytes=1 << 20,
        name=f"segments.opt.{tag}",
        gradient_as_bucket_view=as_view,
    )
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [p for p, _, _ in opt._buckets[0].slots]  # the bucket's order: backward's
    strided = next(p for p in params if p.dim() == 2)
    rows = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        if strided_grad:
            gen = torch.Generator().manual_seed(100 * step + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            strided.grad = torch.randn(tuple(reversed(strided.shape)), generator=gen).t()
            local = torch.cat([p.grad.reshape(-1) for p in params])
        else:  # backward's end reduces the gradients: the local ones come from a twin without hooks
            twin = make_model()
            twin.load_state_dict(model.state_dict())
            x, y = full_batch(step, 6, size)
            batch = slice(rank * 6, (rank + 1) * 6)
            loss_of(twin, x[batch], y[batch]).backward()
            named = dict(model.named_parameters())
            twin_of = {named[n]: q for n, q in twin.named_parameters()}
            local = torch.cat([twin_of[p].grad.reshape(-1) for p in params])
            loss_of(model, x[batch], y[batch]).backward()
        local = local.numpy().copy()
        opt.step()
        got = torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy()
        untouched = [_flat_slot_is_zero(opt, p) for p in params if not (strided_grad and p is strided)]
        rows.append((local, got, untouched))
    opt.remove_hooks()
    return rows


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "set_to_none, as_view, strided_grad",
    [(True, False, False), (False, False, False), (True, True, False), (True, False, True)],
)
def test_optimizer_reduces_each_grad_where_it_lies(set_to_none, as_view, strided_grad):
    rows = collective(WORLD, train, TopK(0.05, algorithm="split"), set_to_none, as_view, strided_grad)
    refs = []
    for step, (local, _, _) in enumerate(rows):
        hpcdl.allreduce(
            local,
            op="average",
            name=f"segments.ref.{set_to_none}.{as_view}.{strided_grad}",
            compression=TopK(0.05, algorithm="split"),
        )
        refs.append(local)
    same = [ref.view(np.int32).tolist() == got.view(np.int32).tolist() for ref, (_, got, _) in zip(refs, rows)]
    untouched = [all(u) for _, _, u in rows]
    nonzero = [int(np.count_nonzero(got)) for _, got, _ in rows]
    agree(
        WORLD,
        all(same) and all(untouched) and all(c > 0 for c in nonzero),
        f"same bits per step {same}, flat buffer left alone {untouched}, nonzeros {nonzero}",
    )
