"""hpcdl.horovod.torch on several ranks: values against float64 references computed on
every rank locally, in-place and out-of-place forms, handles, autograd, object broadcast,
and DistributedOptimizer against hpcdl.torch's own."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl.compression
import hpcdl.horovod.torch as hvd
import hpcdl.torch as hvt

from conftest import agree, collective, outcome
from helpers.device import device  # noqa: F401 - the fixture
from helpers.torch_adapter import full_batch, loss_of, make_model, params_digest

WORLD = MPI.COMM_WORLD
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def rank_data(rank, dtype, shape=(17, 5)):
    """Rank ``rank``'s input (any rank can make any rank's, for the references)."""
    values = np.random.default_rng(1000 + rank).integers(-50, 50, shape).astype(np.float64)
    if dtype.is_floating_point:
        values += np.random.default_rng(2000 + rank).random(shape)
    return values


def reference_sum(dtype, shape=(17, 5)):
    return sum(rank_data(r, dtype, shape) for r in range(WORLD.Get_size()))


def as_tensor(values, dtype):
    return torch.from_numpy(values).to(dtype)


@pytest.mark.mpi(min_size=2)
def test_basics_describe_the_job():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    layout = WORLD.allgather((hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()))
    agree(WORLD, hvd.size() == size and hvd.rank() == rank and hvd.is_homogeneous(), "rank/size")
    # one node here: every rank is local, one node across
    agree(
        WORLD,
        all(lr == r and ls == size and cr == 0 and cs == 1 for r, (lr, ls, cr, cs) in enumerate(layout)),
        str(layout),
    )


@pytest.mark.mpi(min_size=3)
def test_init_over_a_list_of_ranks():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    members = list(range(1, size))  # every rank but 0

    def on_the_subset():
        _, error = outcome(hvd.init, comm=members)
        if rank == 0:
            return isinstance(error, ValueError) and "not in the list" in str(error)
        summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
        return error is None and (hvd.rank(), hvd.size()) == (rank - 1, size - 1) and summed.item() == sum(members)

    ok = on_the_subset()
    hvd.init()  # back to COMM_WORLD on every rank
    agree(WORLD, ok and hvd.size() == size, "init over a list of ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_values_against_float64_reference(dtype):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    mine = as_tensor(rank_data(rank, dtype), dtype)
    kept = mine.clone()
    summed = collective(WORLD, hvd.allreduce, mine, op=hvd.Sum, name=f"sum.{dtype}")
    average = collective(WORLD, hvd.allreduce, mine, name=f"avg.{dtype}")
    deprecated = collective(WORLD, hvd.allreduce, mine, average=False)
    in_place = mine.clone()
    returned = collective(WORLD, hvd.allreduce_, in_place, op=hvd.Average)
    want_sum = reference_sum(dtype)
    want_avg = want_sum / size if dtype.is_floating_point else np.floor_divide(want_sum, size)
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    ok = (
        np.allclose(summed.double().numpy(), want_sum, rtol=tol, atol=tol)
        and np.allclose(average.double().numpy(), want_avg, rtol=tol, atol=tol)
        and torch.equal(deprecated, summed)
        and returned is in_place
        and torch.equal(in_place, average)
        and torch.equal(mine, kept)
        and summed.dtype == dtype
    )
    agree(WORLD, ok, f"{dtype}: sum diff {np.abs(summed.double().numpy() - want_sum).max()}")


@pytest.mark.mpi(min_size=2)
def test_scale_factors_and_fp16_compression():
    rank = WORLD.Get_rank()
    mine = as_tensor(rank_data(rank, torch.float64), torch.float64)
    scaled = collective(WORLD, hvd.allreduce, mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    compressed = collective(WORLD, hvd.allreduce, mine.float(), op=hvd.Sum, compression=hvd.Compression.fp16)
    want = reference_sum(torch.float64)
    ok = np.allclose(scaled.numpy(), want * 1.5, rtol=1e-12) and compressed.dtype == torch.float32
    ok = ok and np.allclose(compressed.double().numpy(), want, rtol=2e-3, atol=0.2)
    agree(WORLD, ok, "scaled or fp16-compressed sum differs from the reference")


@pytest.mark.mpi(min_size=2)
def test_async_handles_poll_and_synchronize():
    rank = WORLD.Get_rank()
    tensors = [as_tensor(rank_data(rank, torch.float64, (k + 3,)), torch.float64) for k in range(5)]
    originals = [t.clone() for t in tensors]

    def run():
        handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"async.{k}") for k, t in enumerate(tensors[:3])]
        handles += [hvd.allreduce_async_(t, op=hvd.Sum, name=f"async.{k + 3}") for k, t in enumerate(tensors[3:])]
        while not all(hvd.poll(h) for h in handles):
            pass
        return [hvd.synchronize(h) for h in handles]

    results = collective(WORLD, run)
    ok = all(np.allclose(r.numpy(), reference_sum(torch.float64, (k + 3,)), rtol=1e-12) for k, r in enumerate(results))
    ok = ok and all(torch.equal(t, o) for t, o in zip(tensors[:3], originals[:3]))  # out of place
    ok = ok and all(r is t for r, t in zip(results[3:], tensors[3:]))  # in place
    _, again = outcome(hvd.synchronize, 1 << 40)
    agree(WORLD, ok and isinstance(again, ValueError), "async results or handle bookkeeping wrong")


@pytest.mark.mpi(min_size=2)
def test_autograd_through_allreduce_and_broadcast():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def run():
        x = torch.full((4,), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = hvd.allreduce(x, op=hvd.Sum, name="grad.allreduce")
        (y * (rank + 1)).sum().backward()  # d/dx: the sum over ranks of (rank + 1)
        z = torch.full((3,), float(rank), dtype=torch.float64, requires_grad=True)
        w = hvd.broadcast(z, root_rank=1, name="grad.broadcast")
        (w * (rank + 2)).sum().backward()  # summed onto rank 1, zeros elsewhere
        return y.detach(), x.grad, w.detach(), z.grad

    y, x_grad, w, z_grad = collective(WORLD, run)
    ranks = np.arange(size)
    ok = np.allclose(y.numpy(), (ranks + 1).sum()) and np.allclose(x_grad.numpy(), (ranks + 1).sum())
    ok = ok and np.allclose(w.numpy(), 1.0)
    ok = ok and np.allclose(z_grad.numpy(), (ranks + 2).sum() if rank == 1 else 0.0)
    agree(WORLD, ok, f"y {y}, x.grad {x_grad}, w {w}, z.grad {z_grad}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bool, torch.int16, torch.bfloat16])
def test_broadcast_forms_and_dtypes(dtype):
    rank = WORLD.Get_rank()
    root = WORLD.Get_size() - 1

    def data(r):
        return torch.from_numpy(np.random.default_rng(r).integers(0, 2, (7, 3))).to(dtype)

    mine = data(rank)
    kept = mine.clone()
    out = collective(WORLD, hvd.broadcast, mine, root)
    in_place = data(rank)
    collective(WORLD, hvd.broadcast_, in_place, root, name=f"inplace.{dtype}")
    handle = collective(WORLD, hvd.broadcast_async_, data(rank), root)
    waited = collective(WORLD, hvd.synchronize, handle)
    ok = all(torch.equal(t, data(root)) for t in (out, in_place, waited)) and torch.equal(mine, kept)
    agree(WORLD, ok and out.dtype == dtype, f"{dtype} broadcast differs from rank {root}'s tensor")


@pytest.mark.mpi(min_size=2)
def test_broadcast_object_from_any_root():
    rank, root = WORLD.Get_rank(), 1
    obj = {"rank": rank, "array": np.arange(rank + 5), "text": "x" * (1000 * rank + 3)}
    got = collective(WORLD, hvd.broadcast_object, obj if rank == root else None, root_rank=root)
    ok = got["rank"] == root and got["array"].tolist() == list(range(root + 5)) and len(got["text"]) == 1003
    agree(WORLD, ok, f"got {got['rank']}")


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_a_horovod_error_on_every_rank():
    rank = WORLD.Get_rank()
    _, error = outcome(hvd.allreduce, torch.ones(4 + (rank == 0)), name="mismatch")
    agree(WORLD, isinstance(error, hvd.HorovodInternalError), repr(error))


def train(make_optimizer, steps=4, per_rank=5, clip=False):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    model = make_model()
    opt = make_optimizer(model)
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        loss_of(model, x[mine], y[mine]).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            # hpcdl's own optimizer has no skip_synchronize(): its step() after synchronize() only steps
            with opt.skip_synchronize() if hasattr(opt, "skip_synchronize") else contextlib.nullcontext():
                opt.step()
        else:
            opt.step()
    opt.remove_hooks()
    return model


def hpcdl_sgd(model, **kw):
    return hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), **kw)


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_equals_hpcdls_own():
    size = WORLD.Get_size()

    def horovod_sgd(model, **kw):
        return hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(), **kw
        )

    theirs = collective(WORLD, train, hpcdl_sgd)
    ours = collective(WORLD, train, horovod_sgd)
    predivided = collective(WORLD, train, lambda m: horovod_sgd(m, gradient_predivide_factor=float(size)))
    summed = collective(WORLD, train, lambda m: horovod_sgd(m, op=hvd.Sum))
    summed_own = collective(WORLD, train, lambda m: hpcdl_sgd(m, op="sum"))
    clipped = collective(WORLD, train, horovod_sgd, clip=True)
    clipped_own = collective(WORLD, train, hpcdl_sgd, clip=True)
    fp16 = collective(WORLD, train, lambda m: horovod_sgd(m, compression=hvd.Compression.fp16))
    fp16_own = collective(WORLD, train, lambda m: hpcdl_sgd(m, compression=hpcdl.compression.FP16()))
    pairs = [(ours, theirs), (predivided, theirs), (summed, summed_own), (clipped, clipped_own), (fp16, fp16_own)]
    same = [params_digest(a) == params_digest(b) for a, b in pairs]
    digests = WORLD.allgather(params_digest(ours))
    agree(
        WORLD,
        all(same) and len(set(digests)) == 1 and params_digest(ours) != params_digest(clipped),
        f"identical per pair: {same}",
    )


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_and_optimizer_state():
    rank = WORLD.Get_rank()
    model = make_model(seed=rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        loss_of(model, *full_batch(0, 4, 1)).backward()
        opt.step()
    collective(WORLD, hvd.broadcast_parameters, model.state_dict(), 0, prefix="model.")
    collective(WORLD, hvd.broadcast_optimizer_state, opt, 0)
    digests = WORLD.allgather(params_digest(model))
    lrs = WORLD.allgather(opt.param_groups[0]["lr"])
    steps = WORLD.allgather(len(opt.state_dict()["state"]))
    agree(
        WORLD, len(set(digests)) == 1 and set(lrs) == {0.01} and len(set(steps)) == 1 and steps[0] > 0, f"{lrs} {steps}"
    )


@pytest.mark.mpi(min_size=4)
def test_process_sets_reduce_and_broadcast_among_their_members():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))

    def run():
        sets = [hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))]
        mine, other = (sets[0], sets[1]) if rank % 2 == 0 else (sets[1], sets[0])
        summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=mine, name="ps.sum")
        average = hvd.allreduce(torch.tensor([rank], dtype=torch.int64), process_set=mine)
        root = mine.ranks[-1]  # a rank of init()'s communicator, as in Horovod
        got = hvd.broadcast(torch.tensor([float(rank)]), root_rank=root, process_set=mine)
        obj = hvd.broadcast_object({"from": rank}, root_rank=root, process_set=mine)
        hvd.barrier(process_set=mine)
        _, not_member = outcome(hvd.allreduce, torch.ones(1), process_set=other)
        removed = [hvd.remove_process_set(s) for s in sets]
        return mine, summed, average, got, obj, not_member, removed, root

    mine, summed, average, got, obj, not_member, removed, root = collective(WORLD, run)
    members = evens if rank % 2 == 0 else odds
    ok = (
        summed.item() == sum(members)
        and average.item() == sum(members) // len(members)
        and got.item() == root
        and obj == {"from": root}
        and mine.size() is None
        and removed == [True, True]
    )
    agree(
        WORLD,
        ok and isinstance(not_member, ValueError) and "is not in" in str(not_member),
        f"{summed} {average} {got} {obj} {not_member!r}",
    )


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_and_optimizer_state_within_a_process_set():
    """Each half of the ranks takes its last member's model and Adam state (root_rank a rank
    of init()'s communicator): equal within a set, different between the sets."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    halves = [list(range(0, size // 2)), list(range(size // 2, size))]

    def run():
        sets = [hvd.add_process_set(h) for h in halves]
        mine = sets[0] if rank < size // 2 else sets[1]
        root = mine.ranks[-1]
        model = make_model(seed=rank)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
        if rank == root:
            loss_of(model, *full_batch(rank, 4, 1)).backward()
            opt.step()
        hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=mine)
        hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=mine)
        other_root = halves[1 - sets.index(mine)][0]
        _, outside = outcome(hvd.broadcast_parameters, model.state_dict(), root_rank=other_root, process_set=mine)
        for s in sets:
            hvd.remove_process_set(s)
        return root, params_digest(model), opt.param_groups[0]["lr"], len(opt.state_dict()["state"]), outside

    root, digest, lr, steps, outside = collective(WORLD, run)
    seen = WORLD.allgather((root, digest))
    by_root = {}
    for r, d in seen:
        by_root.setdefault(r, set()).add(d)
    ok = (
        all(len(d) == 1 for d in by_root.values())
        and len({next(iter(d)) for d in by_root.values()}) == len(by_root) == 2
        and lr == 0.01 * (root + 1)
        and steps > 0
        and isinstance(outside, ValueError)
        and "is not in" in str(outside)
    )
    agree(WORLD, ok, f"{seen} lr {lr} steps {steps} {outside!r}")


@pytest.mark.mpi(min_size=2)
def test_unnamed_allreduces_from_pool_threads_named_differently_per_rank():
    """hvd.allreduce without a name from ThreadPoolExecutor threads whose names differ on
    every rank (torch's autograd and data-loading threads): paired by submission order,
    each result the float64 reference."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def reduce(i):
        values = rank_data(rank, torch.int64, (7, 3)) + i  # integers: float64 sums are exact in any order
        return outcome(hvd.allreduce, as_tensor(values, torch.float64), op=hvd.Sum)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"rank{rank}-loader") as pool:
        results = [pool.submit(reduce, i).result(120) for i in range(4)]
    errors = [err for _, err in results if err is not None]
    right = not errors and all(
        np.array_equal(out.numpy(), reference_sum(torch.int64, (7, 3)) + size * i) for i, (out, _) in enumerate(results)
    )
    agree(WORLD, right, f"{errors!r}")


@pytest.mark.mpi(min_size=2)
def test_collectives_on_device_tensors(device):
    """[cuda] on the GPU, [staged-cpu] the same staging path on CPU tensors."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    root = size - 1

    def run():
        floats = as_tensor(rank_data(rank, torch.float64), torch.float64).to(device)
        ints = as_tensor(rank_data(rank, torch.int64), torch.int64).to(device)
        summed = hvd.allreduce(floats, op=hvd.Sum, postscale_factor=0.5)
        in_place = floats.clone()
        hvd.allreduce_(in_place)
        averaged_ints = hvd.synchronize(hvd.allreduce_async(ints))
        flags = torch.tensor([rank % 2 == 0, True, rank == root], device=device)
        hvd.broadcast_(flags, root_rank=root)
        x = torch.full((3,), float(rank + 1), dtype=torch.float64, device=device, requires_grad=True)
        hvd.allreduce(x, op=hvd.Sum).sum().backward()
        return [t.detach().cpu() for t in (summed, in_place, averaged_ints, flags, x.grad)], floats.device

    (summed, in_place, averaged_ints, flags, x_grad), where = collective(WORLD, run)
    want = reference_sum(torch.float64)
    ok = (
        where.type == device.type
        and np.allclose(summed.numpy(), want * 0.5, rtol=1e-12)
        and np.allclose(in_place.numpy(), want / size, rtol=1e-12)
        and np.array_equal(averaged_ints.numpy(), np.floor_divide(reference_sum(torch.int64), size))
        and flags.tolist() == [root % 2 == 0, True, True]
        and np.allclose(x_grad.numpy(), size)
    )
    agree(WORLD, ok, f"on {device}: flags {flags.tolist()}, grad {x_grad}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16, torch.int8, torch.uint8])
def test_min_max_product_in_every_form(dtype):
    """hvd.Min, hvd.Max, hvd.Product out of place, in place (allreduce_) and async
    (allreduce_async_ + synchronize), against numpy's reductions of every rank's input."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def data(r):  # small integers: products stay exact in every dtype (uint8: no negatives)
        values = np.random.default_rng(70 + r).integers(0 if dtype == torch.uint8 else -2, 3, (4, 6))
        return torch.tensor(values).to(dtype)

    def run():
        mine = data(rank)
        low = hvd.allreduce(mine, op=hvd.Min, name="hvd.min")
        high = mine.clone()
        hvd.allreduce_(high, op=hvd.Max)
        product = mine.clone()
        hvd.synchronize(hvd.allreduce_async_(product, op=hvd.Product, name="hvd.product"))
        return mine, low, high, product

    mine, low, high, product = collective(WORLD, run)
    stack = np.stack([data(r).to(torch.float64).numpy() for r in range(size)])
    ok = (
        torch.equal(mine, data(rank))
        and low.dtype == high.dtype == product.dtype == dtype
        and np.array_equal(low.to(torch.float64).numpy(), stack.min(0))
        and np.array_equal(high.to(torch.float64).numpy(), stack.max(0))
        and np.array_equal(product.to(torch.float64).numpy(), stack.prod(0))
    )
    agree(WORLD, ok, f"{low} {high} {product}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16])
def test_broadcast_of_every_dtype_goes_through_the_core(dtype):
    rank, root = WORLD.Get_rank(), WORLD.Get_size() - 1
    hpcdl.stats(reset=True)
    mine = torch.tensor(np.random.default_rng(rank).integers(0, 2, (3, 5))).to(dtype)
    got = collective(WORLD, hvd.broadcast, mine, root_rank=root, name=f"bcast.{dtype}")
    want = torch.tensor(np.random.default_rng(root).integers(0, 2, (3, 5))).to(dtype)
    ops = hpcdl.stats()["broadcast"]["broadcast"]["ops"]
    agree(WORLD, torch.equal(got, want) and got.dtype == dtype and ops == 1, f"{got} {ops}")


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_forms_and_gradient():
    """grouped_allreduce (out of place, differentiable), grouped_allreduce_ (in place) and
    grouped_allreduce_async + synchronize: each tensor as its own hvd.allreduce gives it."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def run():
        tensors = [torch.tensor(rank_data(rank, dtype)).to(dtype) for dtype in DTYPES]
        out = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="hvd.group")
        in_place = [t.clone() for t in tensors]
        hvd.grouped_allreduce_(in_place)
        handle = hvd.grouped_allreduce_async(tensors, op=hvd.Max)
        highest = hvd.synchronize(handle)
        alone = [hvd.allreduce(t) for t in tensors]
        x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = torch.ones(2, requires_grad=True)
        reduced = hvd.grouped_allreduce([x, y], op=hvd.Sum)
        (reduced[0].sum() + 2 * reduced[1].sum()).backward()
        return tensors, out, in_place, highest, alone, x.grad, y.grad

    tensors, out, in_place, highest, alone, x_grad, y_grad = collective(WORLD, run)
    inputs = [[rank_data(r, dtype) for r in range(size)] for dtype in DTYPES]
    ok = (
        all(torch.equal(t, torch.tensor(rank_data(rank, d)).to(d)) for t, d in zip(tensors, DTYPES))
        and all(np.allclose(o.to(torch.float64).numpy(), sum(i), rtol=1e-5) for o, i in zip(out, inputs))
        and all(torch.equal(p, a) for p, a in zip(in_place, alone))
        and all(
            np.array_equal(h.to(torch.float64).numpy(), np.max([np.asarray(v, h.numpy().dtype) for v in i], 0))
            for h, i in zip(highest, inputs)
        )
        and torch.all(x_grad == size)
        and torch.all(y_grad == 2 * size)
    )
    agree(WORLD, ok, f"{[o.flatten()[:2] for o in out]} {x_grad} {y_grad}")
