"""hpcdl.horovod's allgather, alltoall and reducescatter (torch and TensorFlow): values
against references every rank computes locally, grouped and async forms, objects,
process sets, and the gradients Horovod defines for them."""

import numpy as np
import pytest
import tensorflow as tf
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.horovod.tensorflow as hvd_tf
import hpcdl.horovod.tensorflow.keras as hvd_keras
import hpcdl.horovod.torch as hvd

from conftest import agree, collective

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def rows(rank):
    return 0 if rank == 1 else rank + 2


def data(rank, n=None, dtype=torch.float64):
    n = rows(rank) if n is None else n
    g = torch.Generator().manual_seed(90 + rank)
    return torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype)


def test_torch_allgather_forms_and_types():
    rank, size = hvd.rank(), hvd.size()
    expected = torch.cat([data(r) for r in range(size)])
    out = collective(WORLD, hvd.allgather, data(rank))
    handle = hvd.allgather_async(data(rank), name="hvd.ag.async")
    async_out = collective(WORLD, hvd.synchronize, handle)
    grouped = collective(
        WORLD,
        hvd.grouped_allgather,
        [data(rank), torch.full((rank + 1,), rank, dtype=torch.uint8)],
        name="hvd.ag.group",
    )
    masks = torch.cat([torch.full((r + 1,), r, dtype=torch.uint8) for r in range(size)])
    ok = (
        torch.equal(out, expected)
        and torch.equal(async_out, expected)
        and torch.equal(grouped[0], expected)
        and grouped[1].dtype == torch.uint8
        and torch.equal(grouped[1], masks)
    )
    agree(WORLD, ok, f"{out.shape} {grouped[1].tolist()}")


def test_allgather_object_returns_every_ranks_object_in_rank_order():
    rank, size = hvd.rank(), hvd.size()
    got = collective(WORLD, hvd.allgather_object, {"rank": rank, "pad": "x" * (rank * 5 + 1)})
    agree(WORLD, got == [{"rank": r, "pad": "x" * (r * 5 + 1)} for r in range(size)], got)


def test_torch_reducescatter_and_alltoall():
    rank, size = hvd.rank(), hvd.size()
    n = 2 * size + 1
    avg = collective(WORLD, hvd.reducescatter, data(rank, n), name="hvd.rs")
    summed = collective(WORLD, hvd.grouped_reducescatter, [data(rank, n)], op=hvd.Sum, name="hvd.rs.group")[0]
    total = sum(data(r, n) for r in range(size))
    begin = rank * (n // size) + min(rank, n % size)
    mine = slice(begin, begin + n // size + (rank < n % size))
    splits = [(rank + j) % 2 for j in range(size)]
    sent = torch.cat([torch.full((k, 2), 10 * rank + j) for j, k in enumerate(splits)])
    got, got_splits = collective(WORLD, hvd.alltoall, sent, splits=splits, name="hvd.a2a")
    expected_splits = [(r + rank) % 2 for r in range(size)]
    expected = torch.cat([torch.full((k, 2), 10 * r + rank) for r, k in enumerate(expected_splits)])
    equal = collective(WORLD, hvd.alltoall, torch.arange(size) + 10 * rank, name="hvd.a2a.equal")
    ok = (
        torch.allclose(avg, total[mine] / size)
        and torch.allclose(summed, total[mine])
        and got_splits.dtype == torch.int32
        and got_splits.tolist() == expected_splits
        and torch.equal(got, expected)
        and torch.equal(equal, torch.tensor([10 * r + rank for r in range(size)]))
    )
    agree(WORLD, ok, f"{avg.shape} {got_splits.tolist()} {equal.tolist()}")


def test_torch_gradients_through_allgather_reducescatter_and_alltoall():
    """Gradients as Horovod defines them, checked against each rank's analytic value."""
    rank, size = hvd.rank(), hvd.size()
    x = (data(rank) + 1).requires_grad_()
    weights = torch.arange(1.0, 1 + sum(rows(r) for r in range(size)), dtype=torch.float64)[:, None]
    (hvd.allgather(x) * weights * (rank + 1)).sum().backward()
    offset = sum(rows(r) for r in range(rank))
    # this rank's rows of the average over ranks of (r + 1) * weights
    expected = (weights[offset : offset + rows(rank)] * sum(range(1, size + 1)) / size).expand(rows(rank), 3)
    ag_ok = torch.allclose(x.grad, expected)

    y = data(rank, size).requires_grad_()
    (hvd.reducescatter(y, op=hvd.Sum) * (rank + 1)).sum().backward()
    rs_expected = torch.cat([torch.full((1, 3), float(r + 1)) for r in range(size)]).double()
    rs_ok = torch.allclose(y.grad, rs_expected)

    z = torch.arange(float(size), dtype=torch.float64).requires_grad_()
    out = hvd.alltoall(z)
    (out * (torch.arange(float(size)) + 1)).sum().backward()  # received from rank r weighs r + 1
    a2a_ok = torch.allclose(z.grad, torch.full((size,), float(rank + 1), dtype=torch.float64))
    agree(WORLD, ag_ok and rs_ok and a2a_ok, f"{ag_ok} {rs_ok} {a2a_ok}: {z.grad.tolist()}")


def test_torch_allgather_on_a_process_set():
    rank = hvd.rank()
    evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    try:
        if evens.included():
            out = hvd.allgather(torch.full((1,), rank), process_set=evens)
            ok = out.tolist() == evens.ranks
        else:
            ok, out = True, None
        agree(WORLD, ok, out)
    finally:
        hvd.remove_process_set(evens)


@pytest.mark.parametrize("graph", [False, True])
def test_tensorflow_allgather_reducescatter_alltoall(graph):
    rank, size = hvd_tf.rank(), hvd_tf.size()
    x = tf.constant(data(rank).numpy())
    n = 2 * size
    y = tf.constant(data(rank, n).numpy())
    sent = tf.constant([[rank]] * size, tf.int32)

    def run(x, y, sent):
        return (
            hvd_tf.allgather(x, name="tf.ag"),
            hvd_tf.reducescatter(y, op=hvd_tf.Sum, name="tf.rs"),
            hvd_tf.alltoall(sent, name="tf.a2a"),
        )

    gathered, scattered, (received, received_splits) = collective(WORLD, tf.function(run) if graph else run, x, y, sent)
    total = sum(data(r, n) for r in range(size)).numpy()
    ok = (
        np.array_equal(gathered.numpy(), torch.cat([data(r) for r in range(size)]).numpy())
        and np.allclose(scattered.numpy(), total[2 * rank : 2 * rank + 2])
        and received.numpy().ravel().tolist() == list(range(size))
        and received_splits.numpy().tolist() == [1] * size
    )
    agree(WORLD, ok, f"{gathered.shape} {scattered.shape} {received.numpy().ravel().tolist()}")


def test_tensorflow_allgather_gradient_is_this_ranks_rows_of_the_average():
    rank, size = hvd_tf.rank(), hvd_tf.size()
    x = tf.Variable(data(rank).numpy())
    weights = np.arange(1.0, 1 + sum(rows(r) for r in range(size)))[:, None]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd_tf.allgather(x) * weights * (rank + 1))
    grad = tape.gradient(loss, x)
    offset = sum(rows(r) for r in range(rank))
    expected = np.broadcast_to(weights[offset : offset + rows(rank)] * sum(range(1, size + 1)) / size, (rows(rank), 3))
    agree(WORLD, np.allclose(np.asarray(grad), expected), np.asarray(grad).tolist())


def test_keras_allgather_and_reducescatter_return_numpy_values():
    rank, size = hvd_keras.rank(), hvd_keras.size()
    gathered = collective(WORLD, hvd_keras.allgather, np.full((rank + 1, 2), rank, np.float32), name="keras.ag")
    scattered = collective(WORLD, hvd_keras.reducescatter, np.full((size, 2), rank + 1.0), name="keras.rs")
    ok = (
        isinstance(gathered, np.ndarray)
        and gathered[:, 0].tolist() == [r for r in range(size) for _ in range(r + 1)]
        and isinstance(scattered, np.ndarray)
        and np.allclose(scattered, (size + 1) / 2)
    )
    agree(WORLD, ok, f"{gathered.tolist()} {scattered.tolist()}")


def test_sync_batch_norm_equals_batch_norm_over_the_global_batch():
    """Each rank normalizes its 4 samples with the global batch's statistics: outputs, input
    gradients, running statistics and the ranks' summed weight gradients equal BatchNorm1d
    on the whole batch (float64)."""
    rank, size = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4 * size, 3, 5, generator=g, dtype=torch.float64) * 2 + 1
    dy = torch.randn(4 * size, 3, 5, generator=g, dtype=torch.float64)
    ref, sync = torch.nn.BatchNorm1d(3).double(), hvd.SyncBatchNorm(3).double()
    with torch.no_grad():
        for bn in (ref, sync):
            bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
            bn.bias.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    x_ref = full.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * dy).sum().backward()
    mine = slice(4 * rank, 4 * rank + 4)
    x = full[mine].clone().requires_grad_()
    out = sync(x)
    (out * dy[mine]).sum().backward()
    weight_grad = WORLD.allreduce(sync.weight.grad.numpy())
    sync.eval()
    evaluated = sync(full[mine])
    ok = (
        torch.allclose(out, out_ref[mine].detach())
        and torch.allclose(x.grad, x_ref.grad[mine])
        and torch.allclose(sync.running_mean, ref.running_mean)
        and torch.allclose(sync.running_var, ref.running_var)
        and np.allclose(weight_grad, ref.weight.grad.numpy())
        and torch.allclose(evaluated, ref.eval()(full)[mine].detach())
    )
    agree(WORLD, ok, f"{(out - out_ref[mine]).abs().max()}")


def test_torch_grouped_forms_are_bitwise_their_single_calls_with_their_gradients():
    rank, size = hvd.rank(), hvd.size()
    members = [data(rank), torch.arange(rank * 2, dtype=torch.float32).reshape(rank, 2)]
    grouped = collective(WORLD, hvd.grouped_allgather, members, name="hvd.gag")
    singles = [collective(WORLD, hvd.allgather, m, name=f"hvd.gag.{i}") for i, m in enumerate(members)]
    n = 2 * size + 1
    rs_members = [data(rank, n), data(rank, size - 1, torch.float32)]
    rs_grouped = collective(WORLD, hvd.grouped_reducescatter, rs_members, op=hvd.Average, name="hvd.grs")
    rs_singles = [collective(WORLD, hvd.reducescatter, m, name=f"hvd.grs.{i}") for i, m in enumerate(rs_members)]
    ok = all(torch.equal(g, s) for g, s in zip(grouped + rs_grouped, singles + rs_singles))

    # Gradients: each member's is its single call's.
    x, y = (data(rank) + 1).requires_grad_(), data(rank, size).requires_grad_()
    gx, _ = hvd.grouped_allgather([x, torch.ones(rank, 2, requires_grad=True)])
    weights = torch.arange(1.0, 1 + sum(rows(r) for r in range(size)), dtype=torch.float64)[:, None]
    (gx * weights * (rank + 1)).sum().backward()
    offset = sum(rows(r) for r in range(rank))
    expected = (weights[offset : offset + rows(rank)] * sum(range(1, size + 1)) / size).expand(rows(rank), 3)
    (scattered,) = hvd.grouped_reducescatter([y], op=hvd.Sum)
    (scattered * (rank + 1)).sum().backward()
    rs_expected = torch.cat([torch.full((1, 3), float(r + 1)) for r in range(size)]).double()
    grads_ok = torch.allclose(x.grad, expected) and torch.allclose(y.grad, rs_expected)
    agree(WORLD, ok and grads_ok, f"{ok} {grads_ok}")


def test_torch_grouped_forms_with_mismatched_members_raise_on_every_rank():
    rank = hvd.rank()
    other = torch.float32 if rank == 0 else torch.float64
    for fn, members in (
        (hvd.grouped_allgather, [data(rank), torch.ones(1, 3, dtype=other)]),
        (hvd.grouped_reducescatter, [torch.ones(4, 3), torch.ones(4, 2 if rank == 0 else 3)]),
    ):
        try:
            fn(members, name="hvd.group.mismatch")
            err = None
        except Exception as exc:  # noqa: BLE001 - checked on every rank below
            err = exc
        agree(WORLD, isinstance(err, hpcdl.MismatchError) and "arrays" in str(err), repr(err))


@pytest.mark.parametrize("graph", [False, True])
def test_tensorflow_grouped_forms_are_their_single_calls(graph):
    rank, size = hvd_tf.rank(), hvd_tf.size()
    xs = [tf.constant(data(rank).numpy()), tf.constant([[rank]] * (rank + 1), tf.int32)]
    ys = [tf.constant(data(rank, 2 * size).numpy()), tf.constant(data(rank, size + 1).numpy(), tf.float64)]

    def run(x0, x1, y0, y1):
        return (
            hvd_tf.grouped_allgather([x0, x1], name="tf.gag"),
            hvd_tf.grouped_reducescatter([y0, y1], op=hvd_tf.Sum),
        )

    gathered, scattered = collective(WORLD, tf.function(run) if graph else run, *xs, *ys)
    singles = [collective(WORLD, hvd_tf.allgather, x, name=f"tf.gag.{i}") for i, x in enumerate(xs)]
    rs_singles = [
        collective(WORLD, hvd_tf.reducescatter, y, op=hvd_tf.Sum, name=f"tf.grs.{i}") for i, y in enumerate(ys)
    ]
    ok = all(
        g.dtype == s.dtype and np.array_equal(g.numpy(), s.numpy())
        for g, s in zip(list(gathered) + list(scattered), singles + rs_singles)
    )
    x = tf.Variable(data(rank).numpy())
    weights = np.arange(1.0, 1 + sum(rows(r) for r in range(size)))[:, None]
    with tf.GradientTape() as tape:
        (out,) = hvd_tf.grouped_allgather([x])
        loss = tf.reduce_sum(out * weights * (rank + 1))
    grad = tape.gradient(loss, x)
    offset = sum(rows(r) for r in range(rank))
    expected = np.broadcast_to(weights[offset : offset + rows(rank)] * sum(range(1, size + 1)) / size, (rows(rank), 3))
    agree(WORLD, ok and np.allclose(np.asarray(grad), expected), f"{ok}")
