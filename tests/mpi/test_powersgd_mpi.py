"""PowerSGD through DistributedOptimizer on several ranks: training against a float64
reference of the documented semantics (the world, a Dup() and sub-communicators), bitwise
identity across ranks, the dense warm-up, a state_dict() round trip, the staged (device)
path, and the digits model trained within 1 point of dense."""

import io

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl.torch as hvt
from hpcdl import _tensors
from hpcdl.compression import PowerSGD

from conftest import agree, collective, multi_rank, outcome, world_only
from helpers.device import device  # noqa: F401 - the fixture
from helpers.powersgd import Reference
from helpers.torch_adapter import full_batch, loss_of, make_model, max_difference, params_digest

WORLD = MPI.COMM_WORLD
LR, PER_RANK = 0.5, 6


@pytest.fixture(params=["world", "dup", "halves"])
def group(request):
    """The communicator: COMM_WORLD, its Dup(), or a Split() into even and odd ranks (each half
    trains at once, on its own)."""
    if request.param == "world":
        yield WORLD
        return
    comm = WORLD.Dup() if request.param == "dup" else WORLD.Split(WORLD.Get_rank() % 2)
    yield comm
    comm.Free()


def make_optimizer(model, comm, codec, name, bucket_bytes=256):
    return hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model.named_parameters(),
        compression=codec,
        bucket_bytes=bucket_bytes,
        comm=comm,
        name=name,
    )


def run(model, opt, comm, steps, first=0):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    device = next(model.parameters()).device
    timings = []
    for step in range(first, first + steps):
        x, y = full_batch(step, PER_RANK, size)
        opt.zero_grad()
        loss_of(model, x[mine].to(device), y[mine].to(device)).backward()
        opt.step()
        timings.append(opt.last_timings())
    return timings


def train(comm, codec, steps, name, device=None):
    model = make_model()
    if device is not None:
        model = model.to(device)
    opt = make_optimizer(model, comm, codec, name)
    timings = run(model, opt, comm, steps)
    opt.remove_hooks()
    return model.cpu(), timings


def reference(size, codec, steps):
    """The same training in float64, every rank's gradient computed here."""
    model = make_model().double()
    shapes = {n: (p.shape[0], p[0].numel()) for n, p in model.named_parameters() if codec.compresses(p.shape)}
    ref = Reference(shapes, codec.rank, codec.seed, size)
    for step in range(steps):
        x, y = full_batch(step, PER_RANK, size)
        grads = []
        for r in range(size):
            model.zero_grad()
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            loss_of(model, x[rows].double(), y[rows]).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                if size > 1 and step >= codec.warmup_steps and n in shapes:
                    approx, _ = ref.step(n, [g[n].view(shapes[n]).numpy() for g in grads])
                    update = torch.from_numpy(approx).view(p.shape)
                else:
                    update = sum(g[n] for g in grads) / size
                p -= LR * update
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [PowerSGD(rank=1, warmup_steps=1), PowerSGD(rank=2, warmup_steps=0, seed=5)], ids=str)
def test_training_matches_the_float64_reference_with_the_same_bits_on_every_rank(group, codec):
    got, timings = collective(WORLD, train, group, codec, 5, "psgd.ref")
    want = reference(group.Get_size(), codec, 5)
    diff = max_difference(got, want)
    digests = group.allgather(params_digest(got))
    names = [t["name"] for t in timings[-1]]
    factored = group.Get_size() == 1 or any(n.endswith(".P") for n in names)
    agree(
        WORLD,
        diff < 1e-4 and len(set(digests)) == 1 and factored,
        f"max diff {diff} to the float64 reference, {len(set(digests))} distinct results, ops {names}",
    )


@pytest.mark.mpi(min_size=2)
@multi_rank
def test_warmup_steps_are_dense_allreduces(comm):
    """The warm-up sends whole gradients (the low-rank buckets as they are, not P and Q) and matches
    dense training up to the order of the ring's sums (its buckets differ); then P and Q follow,
    each bucket's Q after its P, and nothing else (the biases ride in the last bucket's P)."""
    warm, timings = collective(WORLD, train, comm, PowerSGD(rank=1, warmup_steps=3), 3, "psgd.warm")
    dense, _ = collective(WORLD, train, comm, None, 3, "psgd.dense")
    _, later = collective(WORLD, train, comm, PowerSGD(rank=1, warmup_steps=3), 4, "psgd.later")
    names = [[t["name"] for t in step] for step in timings]
    factored = [t["name"] for t in later[-1] if t["name"].endswith((".P", ".Q"))]
    ordered = all(
        p["ready_us"] <= q["submitted_us"] <= q["finished_us"]
        for p, q in zip(later[-1], later[-1][1:])
        if p["name"].endswith(".P")
    )
    diff = max_difference(warm, dense)
    agree(
        WORLD,
        diff < 1e-6
        and not any(n.endswith(".P") for s in names for n in s)
        and len(factored) == len(later[-1]) == 4
        and ordered,
        f"max diff to dense {diff}, warm-up ops {names}, after it {factored} of {len(later[-1])}, P before Q {ordered}",
    )


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.mpi(min_size=2)
@multi_rank
def test_state_dict_round_trip_resumes_bit_for_bit(comm):
    codec = PowerSGD(rank=2, warmup_steps=1)

    def resumed():
        model = make_model()
        opt = make_optimizer(model, comm, codec, "psgd.first")
        run(model, opt, comm, 3)
        model_state, opt_state = _saved(model.state_dict()), _saved(opt.state_dict())
        opt.remove_hooks()
        again = make_model(seed=9)
        again.load_state_dict(model_state)
        opt = make_optimizer(again, comm, codec, "psgd.second")
        opt.load_state_dict(opt_state)
        steps = opt.state_dict()["hpcdl_powersgd"]["steps"]
        run(again, opt, comm, 3, first=3)
        opt.remove_hooks()
        return again, opt_state, steps

    got, state, steps = collective(WORLD, resumed)
    whole, _ = collective(WORLD, train, comm, codec, 6, "psgd.whole")
    kept = state["hpcdl_powersgd"]["matrices"]
    residuals = comm.allgather(b"".join(m["residual"].numpy().tobytes() for m in kept.values()))
    qs = comm.allgather(b"".join(m["q"].numpy().tobytes() for m in kept.values()))
    agree(
        WORLD,
        params_digest(got) == params_digest(whole)
        and steps == 3
        and len(kept) == 3
        and len(set(qs)) == 1
        and len(set(residuals)) == comm.Get_size(),
        f"resumed == uninterrupted {params_digest(got) == params_digest(whole)}, steps {steps}, "
        f"matrices {sorted(kept)}, distinct Q {len(set(qs))}, distinct residuals {len(set(residuals))}",
    )


@pytest.mark.mpi(min_size=2)
@world_only
def test_broadcast_optimizer_state_shares_steps_and_q_and_keeps_each_ranks_residuals(comm):
    """Error feedback is per rank: after the broadcast every rank has the root's step count and
    Q (each rank's made different first) and still its own residuals."""
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    model = make_model()
    opt = make_optimizer(model, comm, PowerSGD(rank=1, warmup_steps=0), "psgd.bcast")
    run(model, opt, comm, 1)
    state = opt.state_dict()
    state["hpcdl_powersgd"]["steps"] = 10 + rank
    for i, m in enumerate(state["hpcdl_powersgd"]["matrices"].values()):
        m["q"] = torch.full_like(m["q"], float(rank + i))
        m["residual"] = torch.full_like(m["residual"], float(100 * rank + i))
    opt.load_state_dict(state)
    collective(WORLD, hvt.broadcast_optimizer_state, opt, root, comm)
    after = opt.state_dict()["hpcdl_powersgd"]
    opt.remove_hooks()
    matrices = list(after["matrices"].values())
    own = all(
        torch.equal(m["residual"], torch.full_like(m["residual"], float(100 * rank + i)))
        for i, m in enumerate(matrices)
    )
    roots = all(torch.equal(m["q"], torch.full_like(m["q"], float(root + i))) for i, m in enumerate(matrices))
    agree(
        WORLD,
        own and roots and after["steps"] == 10 + root and len(matrices) == 3,
        f"own residuals kept {own}, root's Q {roots}, steps {after['steps']}, matrices {len(matrices)}",
    )


@pytest.mark.mpi(min_size=2)
@world_only
def test_a_state_of_other_settings_raises_on_every_rank(comm):
    model = make_model()
    opt = make_optimizer(model, comm, PowerSGD(rank=1, warmup_steps=0), "psgd.bad")
    run(model, opt, comm, 1)
    state = opt.state_dict()
    opt.remove_hooks()
    other = make_optimizer(model, comm, PowerSGD(rank=2, warmup_steps=0), "psgd.other")
    _, error = outcome(other.load_state_dict, state)
    other.remove_hooks()
    agree(WORLD, isinstance(error, ValueError) and "rank" in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
def test_the_staged_path_equals_the_host_path(device):
    codec = PowerSGD(rank=2, warmup_steps=1)
    got, timings = collective(WORLD, train, WORLD, codec, 5, "psgd.device", device)
    old = _tensors.staging_cpu_tensors(False)
    try:
        want, _ = collective(WORLD, train, WORLD, codec, 5, "psgd.host")
    finally:
        _tensors.staging_cpu_tensors(old)
    diff = max_difference(got, want)
    digests = WORLD.allgather(params_digest(got))
    factored = any(t["name"].endswith(".Q") for t in timings[-1])
    agree(
        WORLD,
        diff < 1e-5 and len(set(digests)) == 1 and factored,
        f"max diff {diff} to the host path, {len(set(digests))} distinct results, factored {factored}",
    )


def digits_accuracy(codec, name, steps=300, batch=32, hidden=64):
    """A torch MLP on scikit-learn's digits, each rank on its shard; held-out accuracy."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y, test_size=0.3, random_state=0, stratify=y
    )
    x_mine, y_mine = torch.from_numpy(x_train[rank::size]), torch.from_numpy(y_train[rank::size])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=codec,
        name=name,
    )
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        pick = torch.randint(0, len(y_mine), (batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x_mine[pick]), y_mine[pick]).backward()
        opt.step()
    opt.remove_hooks()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    return accuracy, len(set(WORLD.allgather(params_digest(model)))) == 1


@pytest.mark.mpi(min_size=2)
def test_digits_train_within_one_point_of_dense():
    dense, dense_same = collective(WORLD, digits_accuracy, None, "digits.dense")
    results = {
        str(c): collective(WORLD, digits_accuracy, c, f"digits.{c.rank}")
        for c in (PowerSGD(rank=1, warmup_steps=10), PowerSGD(rank=4, warmup_steps=10))
    }
    detail = f"dense {dense:.4f}, " + ", ".join(f"{k} {a:.4f} (ranks identical: {s})" for k, (a, s) in results.items())
    if WORLD.Get_rank() == 0:
        print(f"[hpcdl rank 0] digits accuracy: {detail}")
    agree(WORLD, dense_same and dense > 0.9 and all(s and a >= dense - 0.01 for a, s in results.values()), detail)
