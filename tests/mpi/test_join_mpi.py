"""join() (Horovod's uneven inputs) under MPI: while ranks have joined, the others'
allreduces (sum, average, grouped) and allgathers complete with the joined ranks'
engines taking part with zeros (no rows), against float64 references; join returns
the rank that joined last on every rank; the communicator works again after it (two
epochs); an operation join does not run raises on every rank within bounded time;
a Dup() and Split() sub-communicator; compressed allreduces (FP16, BF16, Int8, TopK) with
1..P-1 ranks joined against a numpy model of each codec; DistributedOptimizer with uneven
batch counts against a float64 reference, with a codec against the codec's model, with
PowerSGD against its float64 reference; Horovod's hvd.join()."""

import re
import time
import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.horovod.torch as hvd
from hpcdl import _core
from hpcdl.compression import BF16, FP16, Int8, PowerSGD, TopK
from hpcdl.torch import DistributedOptimizer, broadcast_parameters

from conftest import agree, collective, multi_rank, outcome, stall_limits
from helpers.compression import compressed_ring_reference, topk_reference
from helpers.device import device  # noqa: F401 - the fixture
from helpers.powersgd import Reference

pytestmark = pytest.mark.mpi(min_size=2)

SHAPE = (5, 7)
BOUND_S = 60  # every wait of a test that expects an error: it must come, not a hang


def data(rank, step, shape=SHAPE):
    return np.random.default_rng(1000 * step + rank).standard_normal(shape)


def epoch(comm, live, steps):
    """Ranks in `live` allreduce (sum named, average unnamed, grouped) and allgather for
    `steps` steps, then join; the others join at once. Returns (join's result, whether
    every result on this rank matched its float64 reference, a detail)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ok, detail = True, ""
    if rank in live:
        for step in range(steps):
            summed = hpcdl.allreduce(data(rank, step), comm=comm, name="join.sum")
            averaged = hpcdl.allreduce(data(rank, step + 50), op="average", comm=comm)
            grouped = hpcdl.grouped_allreduce(
                [data(rank, step + 100), data(rank, step + 150, (3,)).astype(np.float32)], comm=comm, name="join.group"
            )
            rows = hpcdl.allgather(data(rank, step + 200, (rank + 1, 2)), comm=comm, name="join.gather")
            expected_sum = sum(data(r, step) for r in live)
            expected_average = sum(data(r, step + 50) for r in live) / size  # the full size, as Horovod
            expected_group = [sum(data(r, step + 100) for r in live), sum(data(r, step + 150, (3,)) for r in live)]
            expected_rows = np.concatenate([data(r, step + 200, (r + 1, 2)) for r in sorted(live)])
            good = (
                np.allclose(summed, expected_sum, rtol=1e-12, atol=1e-12)
                and np.allclose(averaged, expected_average, rtol=1e-12, atol=1e-12)
                and np.allclose(grouped[0], expected_group[0], rtol=1e-12, atol=1e-12)
                and np.allclose(grouped[1], expected_group[1], rtol=1e-5, atol=1e-5)
                and rows.shape == expected_rows.shape
                and np.array_equal(rows, expected_rows)
            )
            if not good and ok:
                ok, detail = False, f"step {step} with live ranks {sorted(live)}"
    return hpcdl.join(comm), ok, detail


def check_epoch(comm, live, steps):
    last, ok, detail = epoch(comm, live, steps)
    lasts = comm.allgather(last)
    agree(comm, ok, detail)
    agree(comm, len(set(lasts)) == 1 and last in live, f"join returned {lasts} with live ranks {sorted(live)}")
    if len(live) == 1:
        # Its allreduces completed only once every other rank had joined: it joined last.
        agree(comm, last == next(iter(live)), f"join returned {last}, the last to join was {live}")


@multi_rank
def test_allreduce_and_allgather_with_one_to_all_but_one_rank_joined(comm):
    size = comm.Get_size()
    for joined in range(1, size):
        check_epoch(comm, set(range(joined, size)), steps=3)  # the coordinator (rank 0) among the joined
        check_epoch(comm, set(range(size - joined)), steps=2)  # the coordinator live


@multi_rank
def test_two_epochs_in_a_row_and_then_ordinary_operations(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    check_epoch(comm, {size - 1}, steps=4)
    check_epoch(comm, {0}, steps=1)
    out = collective(comm, lambda: hpcdl.allreduce(np.full(4, float(rank)), comm=comm, name="join.after"))
    agree(comm, np.array_equal(out, np.full(4, float(sum(range(size))))), str(out))


@multi_rank
def test_unnamed_operations_pair_again_after_a_join(comm):
    """The joined ranks ran the live ranks' unnamed operations: their numbering stays in step."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        for _ in range(3):
            hpcdl.allreduce(np.ones(3), comm=comm)
    hpcdl.join(comm)
    out = collective(comm, lambda: hpcdl.allreduce(np.full(3, float(rank + 1)), comm=comm))
    agree(comm, np.array_equal(out, np.full(3, size * (size + 1) / 2)), str(out))


def test_join_on_split_sub_communicators():
    world = MPI.COMM_WORLD
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    try:
        size = sub.Get_size()
        last, ok, detail = epoch(sub, {size - 1}, steps=2)
        agree(world, ok and last == size - 1, f"{detail}; join returned {last}")
        out = hpcdl.allreduce(np.ones(2), comm=sub, name="join.sub.after")
        agree(world, np.array_equal(out, np.full(2, float(size))), str(out))
    finally:
        sub.Free()


def _named_in_stall_warnings(caught, name):
    """The ranks each StallWarning about operation `name` says it waits for."""
    named = []
    for w in caught:
        if issubclass(w.category, hpcdl.StallWarning) and f"'{name}'" in str(w.message):
            found = re.search(r"for ranks? ([\d, ]+), which", str(w.message))
            named.append(sorted(int(r) for r in found.group(1).split(", ")) if found else str(w.message))
    return named


def test_stall_warnings_name_the_late_rank_not_the_joined_one():
    """Rank 0 joins; the last rank is late to an allreduce the others wait in: their
    warnings name the late rank only, and the join's name the ranks not joined yet, which
    only shrink."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    hpcdl.barrier(world)  # hpcdl's channels on world are set up: what follows waits in the agreement
    with stall_limits(stall_warning_seconds=0.3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 0:
                hpcdl.join(world)
            else:
                if rank == size - 1:
                    time.sleep(1.5)
                hpcdl.allreduce(np.ones(2), comm=world, name="join.late")
                hpcdl.join(world)
        if rank == 0:
            named = _named_in_stall_warnings(caught, "hpcdl.join")
            # ranks that join once the late one arrives drop out of later warnings, in any order
            pending = set(range(1, size))
            ok = bool(named) and all(isinstance(n, list) and n and set(n) <= pending for n in named)
            ok = ok and size - 1 in named[0] and all(set(b) <= set(a) for a, b in zip(named, named[1:]))
        elif rank < size - 1:
            named = _named_in_stall_warnings(caught, "join.late")
            ok = bool(named) and all(n == [size - 1] for n in named)
        else:
            named, ok = [], True  # the late rank waited for no one
        agree(world, ok, named)


def _unsupported(comm, kind):
    size = comm.Get_size()
    if kind == "reducescatter":
        return hpcdl.reducescatter(np.ones((size, 2)), comm=comm, name="join.bad")
    if kind == "alltoall":
        return hpcdl.alltoall(np.ones((size, 2)), comm=comm, name="join.bad")
    if kind == "max":
        return hpcdl.allreduce(np.ones(3), op="max", comm=comm, name="join.bad")
    if kind == "broadcast":  # from rank 0, which has joined
        return hpcdl.broadcast(np.ones(3), root=0, comm=comm, name="join.bad")
    return hpcdl.allreduce(np.ones(3), comm=comm, name="join.bad", op="product")


@multi_rank
@pytest.mark.parametrize("kind", ["reducescatter", "alltoall", "max", "broadcast", "product"])
def test_an_operation_join_does_not_run_raises_on_every_rank(comm, kind):
    """All but the last rank join; the last submits what join does not run: MismatchError
    there, and the joined ranks' join raises it too; then the communicator works."""
    rank, size = comm.Get_rank(), comm.Get_size()
    t0 = time.monotonic()
    if rank == size - 1:
        _, error = outcome(_unsupported, comm, kind)
    else:
        _, error = outcome(lambda: hpcdl.join_async(comm).wait(timeout=BOUND_S))
    waited = time.monotonic() - t0
    agree(
        comm,
        isinstance(error, hpcdl.MismatchError) and "joined" in str(error) and waited < BOUND_S,
        f"{type(error).__name__}: {error} after {waited:.1f} s",
    )
    out = collective(comm, lambda: hpcdl.allreduce(np.full(2, 1.0), comm=comm, name="join.recovered"))
    agree(comm, np.array_equal(out, np.full(2, float(size))), str(out))
    check_epoch(comm, {0}, steps=1)  # and join works again


COUNT = 1003  # odd: segments and int8 blocks of unequal lengths
CHUNK_BYTES = 256  # several chunks per segment (the int8 blocks restart at each)
RING_CODECS = [FP16(), BF16(), Int8(block=16)]
TOPK_CODECS = [
    TopK(0.05, algorithm="allgather"),
    TopK(0.05, algorithm="split"),
    TopK(0.05, algorithm="allgather", reuse_steps=2),
    TopK(0.05, algorithm="split", reuse_steps=2),
]


def _values(rank, epoch, step):
    return np.random.default_rng(10_000 * epoch + 100 * step + rank).standard_normal(COUNT).astype(np.float32)


def _epochs(size):
    """Per epoch, each rank's step count: for 1..size-1 ranks joined at once (the first ones,
    then the last ones), the others run 2 or 3 steps, so more ranks join on the way."""
    plans = []
    for joined in range(1, size):
        plans.append([0 if r < joined else 2 + r % 2 for r in range(size)])
        plans.append([0 if r >= size - joined else 2 + r % 2 for r in range(size)])
    return plans


class _CodecReference:
    """Every rank's inputs, residual (None until its first allreduce of the name) and top-k
    threshold state, stepped through the documented codec semantics. A joined rank's input is
    zeros and its own state is left as it was; on the ring it re-encodes the partial sums that
    pass it, and what those encodings drop (with a zero residual, which changes nothing else)
    is kept by no rank: step() returns it, for the identity."""

    def __init__(self, size, codec, op):
        self.size, self.codec, self.op = size, codec, op
        self.residuals, self.states = [None] * size, [None] * size

    def step(self, epoch, step, live):
        """(the result, what the joined ranks' encodings dropped, in sum units)."""
        zeros = np.zeros(COUNT, np.float32)
        inputs = [_values(r, epoch, step) if r in live else zeros for r in range(self.size)]
        if self.codec.name == "topk":  # a joined rank sends pairs of zeros: it drops nothing
            mine = [
                (zeros if self.residuals[r] is None else self.residuals[r]) if r in live else None
                for r in range(self.size)
            ]
            states = [self.states[r] if r in live else None for r in range(self.size)]
            result, after, states = topk_reference(inputs, mine, states, self.codec, self.op)
            for r in live:
                self.states[r] = states[r]
        else:
            mine = [
                zeros if r not in live or self.residuals[r] is None else self.residuals[r] for r in range(self.size)
            ]
            result, after = compressed_ring_reference(inputs, mine, self.codec, self.op, CHUNK_BYTES)
        for r in live:
            self.residuals[r] = after[r]
        dropped = sum(
            (after[r].astype(np.float64) for r in range(self.size) if r not in live and after[r] is not None),
            np.zeros(COUNT),
        )
        return result, dropped


def _run_compressed_epochs(comm, codec, op, name):
    """Every epoch of _epochs: the ranks with steps allreduce `name` with the codec, then join
    (nothing else between, since the others' steps need the joined ranks' engines). Returns
    this rank's problems against the reference (for stochastic int8, which has none: the live
    ranks' results against each other) and against the float64 error-feedback identity."""
    rank, size = comm.Get_rank(), comm.Get_size()
    exact = codec.name != "int8" or codec.get_config()["rounding"] == "nearest"
    reference = _CodecReference(size, codec, op) if exact else None
    problems, units = [], size if op == "average" else 1
    for epoch, steps in enumerate(_epochs(size)):
        before = _core.residual(comm, name)
        mine = []
        for step in range(steps[rank]):
            got = _values(rank, epoch, step)
            _, error = outcome(hpcdl.allreduce, got, op=op, comm=comm, name=name, compression=codec)
            mine.append(got)
            if error is not None:
                problems.append(f"epoch {epoch} step {step}: {type(error).__name__}: {error}")
        last, error = outcome(hpcdl.join, comm)
        if error is not None:
            problems.append(f"epoch {epoch}: join raised {type(error).__name__}: {error}")
        after = _core.residual(comm, name)
        everyone = comm.allgather((mine, before, after))
        applied, given, lost = np.zeros(COUNT), np.zeros(COUNT), np.zeros(COUNT)
        for step in range(max(steps)):
            live = {r for r in range(size) if steps[r] > step}
            results = [everyone[r][0][step] for r in sorted(live)]
            if any(not np.array_equal(x, results[0]) for x in results):
                problems.append(f"epoch {epoch} step {step}: the live ranks' results differ")
            if reference is not None:
                want, dropped = reference.step(epoch, step, live)
                lost += dropped
                if rank in live and not np.array_equal(mine[step], want):
                    wrong = np.count_nonzero(mine[step] != want)
                    problems.append(f"epoch {epoch} step {step} live {sorted(live)}: {wrong} values differ")
            applied += results[0].astype(np.float64) * units
            given += sum(_values(r, epoch, step).astype(np.float64) for r in live)
        if steps[rank] == 0 and not (before is None and after is None or np.array_equal(before, after)):
            problems.append(f"epoch {epoch}: this joined rank's residual changed")
        if reference is not None and steps[rank] and not np.array_equal(after, reference.residuals[rank]):
            problems.append(f"epoch {epoch}: the residual differs from the reference")
        # What the live ranks gave is what was applied plus what their residuals kept plus
        # what the joined ranks' encodings dropped (stochastic int8, without a reference: at
        # most a quantum of the block's absmax, bounded by the live values' largest, per step).
        kept = sum(a.astype(np.float64) - (0 if b is None else b) for _, b, a in everyone if a is not None)
        scale = sum(np.abs(_values(r, epoch, s)).astype(np.float64) for r in range(size) for s in range(steps[r]))
        slack = 1e-5 * (1 + scale)
        if reference is None:
            slack += max(steps) * size * max(np.abs(_values(r, epoch, 0)).max() for r in range(size)) / 127
        gap = np.abs(applied + kept + lost - given)
        if not np.all(gap <= slack):
            problems.append(f"epoch {epoch}: applied + kept - given = {gap.max()}")
        if last is None or steps[last] != max(steps):  # the last to join ran the most steps
            problems.append(f"epoch {epoch}: join returned {last}")
    return problems


@multi_rank
@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("codec", RING_CODECS + TOPK_CODECS + [Int8(block=16, rounding="stochastic", seed=3)], ids=str)
def test_compressed_allreduce_with_joined_ranks_matches_the_codec_reference(comm, codec, op):
    """1..size-1 ranks joined, two epochs each way round, one named tensor throughout: each live
    rank's result and residual equal, bit for bit, the documented codec semantics with the
    joined ranks' values zero (stochastic int8: the live ranks agree bit for bit); a joined
    rank's residual stays as it was; applied plus kept equals the live ranks' float64 sum."""
    name = f"join.codec.{codec}.{op}"
    hpcdl.configure(chunk_bytes=CHUNK_BYTES)
    try:
        problems = collective(comm, _run_compressed_epochs, comm, codec, op, name)
    finally:
        hpcdl.configure(chunk_bytes=_core.DEFAULT_CHUNK_BYTES)
    agree(comm, not problems, problems[:5])


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _batch(rank, step):
    g = torch.Generator().manual_seed(97 * rank + step)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)


@multi_rank
@pytest.mark.parametrize("op", ["average", "sum"])
def test_distributed_optimizer_with_uneven_batches_matches_a_float64_reference(comm, op):
    """Rank r trains on 2 + r batches, then joins: each step's update is the sum of the
    live ranks' gradients (divided by the full size for average). The last rank to join
    holds the trained parameters, which it broadcasts."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lr, steps = 0.1, [2 + r for r in range(size)]
    model = _model()
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), model.named_parameters(), comm=comm, op=op, name=f"join.{op}"
    )
    for step in range(steps[rank]):
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hpcdl.join(comm)
    # The ranks that joined early stopped stepping: the last one's parameters are the model (Horovod's recipe).
    broadcast_parameters(model.state_dict(), root_rank=last, comm=comm)

    reference = _model()
    for step in range(max(steps)):
        grads = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(size):
            if step < steps[r]:
                reference.zero_grad()
                x, y = _batch(r, step)
                torch.nn.functional.mse_loss(reference(x), y).backward()
                grads = [g + p.grad for g, p in zip(grads, reference.parameters())]
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= lr * (g / size if op == "average" else g)
    close = all(
        torch.allclose(p, q, rtol=1e-10, atol=1e-12) for p, q in zip(model.parameters(), reference.parameters())
    )
    agree(comm, close and last == size - 1, f"parameters match: {close}; join returned {last}")


def _uneven_steps(size, epoch):
    """Rank r's steps in an epoch: 2 + r, then 2 + (size - 1 - r): each rank joins first once."""
    return [2 + (r if epoch % 2 == 0 else size - 1 - r) for r in range(size)]


def _train_and_join(comm, model, opt, epochs, batch, join=hpcdl.join):
    """Each rank trains its uneven steps (batch(rank, epoch, step)), joins (join(comm)), and
    takes the parameters of the rank that joined last. Returns each epoch's join result."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lasts = []
    for epoch in range(epochs):
        for step in range(_uneven_steps(size, epoch)[rank]):
            x, y = batch(rank, epoch, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        lasts.append(join(comm))
        broadcast_parameters(model.state_dict(), root_rank=lasts[-1], comm=comm)
    return lasts


def _classifier(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _labelled(rank, epoch, step):
    g = torch.Generator().manual_seed(1000 * epoch + 31 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _live_gradients(model, epoch, step, live):
    """Each live rank's gradients at the shared parameters, as its DistributedOptimizer gathers them."""
    grads = {}
    for r in sorted(live):
        model.zero_grad()
        x, y = _labelled(r, epoch, step)
        torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
        grads[r] = [p.grad.clone() for p in model.parameters()]
    return grads


def _check_codec_training(comm, model, opt, codec, join=hpcdl.join):
    """Two epochs of uneven batch counts with join through `opt` (a float32 model in one
    bucket, the codec's compressed average with error feedback): the parameters equal, bit for
    bit, plain SGD on the documented codec semantics over the live ranks' gradients (joined
    ranks' zeros), and each rank's bucket residual its reference (a joined rank's as it was)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    params = list(model.parameters())
    layout = opt.bucket_layout()
    one_bucket = len(layout) == 1 and layout[0][2] == [tuple(p.shape) for p in reversed(params)]
    lasts = collective(comm, _train_and_join, comm, model, opt, 2, _labelled, join)
    residual = _core.residual(comm, layout[0][0])
    opt.remove_hooks()

    reference = _classifier()
    plain = torch.optim.SGD(reference.parameters(), lr=0.3)
    count = sum(p.numel() for p in params)
    residuals, states = [np.zeros(count, np.float32) for _ in range(size)], [None] * size
    for epoch in range(2):
        steps = _uneven_steps(size, epoch)
        for step in range(max(steps)):
            live = {r for r in range(size) if steps[r] > step}
            grads = _live_gradients(reference, epoch, step, live)
            # The bucket: the gradients in reverse registration order (backward's), flattened.
            flat = [
                torch.cat([g.reshape(-1) for g in reversed(grads[r])]).numpy()
                if r in live
                else np.zeros(count, np.float32)
                for r in range(size)
            ]
            mine = [residuals[r] if r in live else None for r in range(size)]
            if codec.name == "topk":
                summed, after, states = topk_reference(
                    flat, mine, [states[r] if r in live else None for r in range(size)], codec, "average"
                )
            else:
                summed, after = compressed_ring_reference(flat, mine, codec, "average", _core.DEFAULT_CHUNK_BYTES)
            for r in live:
                residuals[r] = after[r]
            at = 0
            for p in reversed(list(reference.parameters())):
                p.grad = torch.from_numpy(summed[at : at + p.numel()].copy()).view(p.shape)
                at += p.numel()
            plain.step()
    same = all(torch.equal(p, q) for p, q in zip(params, reference.parameters()))
    agree(
        comm,
        one_bucket and same and np.array_equal(residual, residuals[rank]) and lasts == [size - 1, 0],
        f"one bucket: {one_bucket}; parameters equal: {same}; residual equal: "
        f"{residual is not None and np.array_equal(residual, residuals[rank])}; joins returned {lasts}",
    )


@multi_rank
@pytest.mark.parametrize(
    "codec", [FP16(), Int8(block=8), TopK(0.2, algorithm="allgather"), TopK(0.2, algorithm="split")], ids=str
)
def test_distributed_optimizer_with_uneven_batches_and_a_codec_matches_the_codec_reference(comm, codec):
    model = _classifier()
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model.named_parameters(),
        comm=comm,
        compression=codec,
        bucket_bytes=1 << 20,
        name=f"join.codec.opt.{codec}",
    )
    _check_codec_training(comm, model, opt, codec)


def test_horovod_distributed_optimizer_with_fp16_compression_keeps_training_under_join():
    """Horovod's recipe: hvd.DistributedOptimizer(compression=hvd.Compression.fp16), uneven
    batches, hvd.join(), parameters broadcast from the last rank (hpcdl's FP16 codec)."""
    hvd.init()
    model = _classifier()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    _check_codec_training(MPI.COMM_WORLD, model, opt, FP16(), lambda comm: hvd.join())


def _check_powersgd_training(comm, device=torch.device("cpu"), name="join.powersgd"):
    """PowerSGD with a warm-up that some ranks finish before they join and others after: a
    joined rank contributes zero P and Q, its residuals stay, and after each join every rank
    takes the last rank's step count and Q (else the next epoch's ranks would disagree on the
    warm-up and on Q). Two epochs against the float64 reference."""
    rank, size = comm.Get_rank(), comm.Get_size()
    codec = PowerSGD(rank=1, warmup_steps=3, seed=2)
    model = _classifier().to(device)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model.named_parameters(),
        comm=comm,
        compression=codec,
        name=name,
    )
    lasts = collective(comm, _train_and_join, comm, model, opt, 2, lambda *at: [t.to(device) for t in _labelled(*at)])
    model = model.cpu()
    state = opt.state_dict()["hpcdl_powersgd"]
    opt.remove_hooks()

    reference = _classifier().double()
    shapes = {n: (p.shape[0], p[0].numel()) for n, p in reference.named_parameters() if codec.compresses(p.shape)}
    ref = Reference(shapes, codec.rank, codec.seed, size)
    reduced = 0
    for epoch in range(2):
        steps = _uneven_steps(size, epoch)
        for step in range(max(steps)):
            live = {r for r in range(size) if steps[r] > step}
            grads = _live_gradients(reference, epoch, step, live)
            with torch.no_grad():
                for i, (n, p) in enumerate(reference.named_parameters()):
                    if reduced >= codec.warmup_steps and n in shapes:
                        g = [
                            grads[r][i].view(shapes[n]).numpy() if r in live else np.zeros(shapes[n])
                            for r in range(size)
                        ]
                        update = torch.from_numpy(ref.step(n, g, live)[0]).view(p.shape)
                    else:
                        update = sum(grads[r][i] for r in live) / size
                    p -= 0.3 * update
            reduced += 1
    diff = max(
        float((p.detach().double() - q.detach()).abs().max())
        for p, q in zip(model.parameters(), reference.parameters())
    )
    counted = state["steps"] == reduced or rank != lasts[-1]  # the others take it at their next step
    agree(
        comm,
        diff < 1e-4 and lasts == [size - 1, 0] and counted,
        f"max difference {diff} to the float64 reference; joins returned {lasts}; steps {state['steps']} of {reduced}",
    )


@multi_rank
def test_distributed_optimizer_with_powersgd_and_uneven_batches_matches_the_float64_reference(comm):
    _check_powersgd_training(comm)


def test_powersgd_on_the_staged_path_under_join_matches_the_float64_reference(device):
    """The same on the staged path (Q on the device, shared through its host buffer)."""
    _check_powersgd_training(MPI.COMM_WORLD, device, "join.powersgd.staged")


def test_horovod_join_returns_the_last_rank_and_allreduce_sees_zeros():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == size - 1:
        out = hvd.allreduce(torch.full((3,), 2.0, dtype=torch.float64), op=hvd.Sum, name="hvd.join.sum")
        average = hvd.allreduce(torch.full((3,), 2.0, dtype=torch.float64), name="hvd.join.average")
        ok = torch.equal(out, torch.full((3,), 2.0, dtype=torch.float64)) and torch.allclose(
            average, torch.full((3,), 2.0 / size, dtype=torch.float64)
        )
    else:
        ok = True
    last = hvd.join()
    agree(MPI.COMM_WORLD, ok and isinstance(last, int) and last == size - 1, f"join returned {last!r}; ok={ok}")
