"""hpcdl.torch under MPI: DistributedOptimizer, broadcasts and the DDP hook.

Reference results are computed on every rank locally (single-process training
on the concatenated batch), so no rank's answer depends on another's.
"""

import collections
import hashlib
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt

from conftest import agree, collective, outcome
from helpers.torch_adapter import (
    compressed_optimizer,
    full_batch,
    gloo_group,
    loss_of,
    make_model,
    max_difference,
    params_digest,
    through_torch_save,
    train_amp,
    train_distributed,
    train_reference,
    train_steps,
)

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
    want, want_scales, want_skipped = train_amp(
        WORLD, 5, 6, size, inf_step=1, inf_rank=size - 1, clip=clip, distributed=False
    )
    diff = max_difference(got, want)
    views = WORLD.allgather((params_digest(got), scales, skipped))
    agree(
        WORLD,
        diff < 2e-5
        and len({repr(v) for v in views}) == 1
        and skipped == want_skipped
        and want_skipped[1]
        and not any(want_skipped[2:])
        and scales == want_scales,
        f"max diff {diff}, skipped {skipped} vs {want_skipped}, scales {scales} vs {want_scales}, "
        f"{len({repr(v) for v in views})} distinct views",
    )


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
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), bucket_bytes=64, name="branchy"
    )

    def train():
        for step in range(3):
            x, y = full_batch(step, 4, WORLD.Get_size())
            opt.zero_grad()
            loss = loss_of(model, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
            loss.backward()
            # Buckets that backward left incomplete went at its end: waiting on
            # another hpcdl operation before step() neither hangs nor raises.
            hpcdl.allreduce(np.array([loss.item()], dtype=np.float32), name="branchy.loss")
            opt.step()

    collective(WORLD, train)
    opt.remove_hooks()
    digests = WORLD.allgather(params_digest(model))
    # no rank has a gradient for the unused layer: it keeps none (as in DDP); each branch is
    # used on some rank, so every rank has the average for both
    unused_none = model.unused.weight.grad is None and model.odd.weight.grad is not None
    agree(WORLD, len(set(digests)) == 1 and unused_none, f"{len(set(digests))} distinct, unused none {unused_none}")


@pytest.mark.mpi(min_size=2)
def test_first_bucket_allreduce_starts_before_backward_ends():
    """The last layers' bucket is reduced while autograd still works on the wide first layer."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 512), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), bucket_bytes=1 << 20, name="overlap"
    )
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
        results.append(
            (first["started_us"] < backward_end_us, announced_early and in_order, first, backward_end_us, len(timings))
        )

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
    _, err = outcome(
        hvt.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), name="extra"
    )
    message = str(err)
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "'extra.weight'" in message
        and f"on rank {size - 1} but not on rank 0" in message
    )
    agree(WORLD, ok, repr(err))


@pytest.mark.mpi(min_size=2)
def test_different_models_across_ranks_raise_everywhere():
    rank = WORLD.Get_rank()
    model = make_model(hidden=32 if rank != 1 else 33)
    _, err = outcome(
        hvt.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), name="shapes"
    )
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "'0.weight' is torch.float32[32, 12] on rank 0" in str(err)
        and "[33, 12] on rank 1" in str(err)
    )
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
    ok = (
        len(set(map(repr, digests))) == 1
        and digests[0][1] == root
        and opt.param_groups[0]["lr"] == 0.1 * (root + 1)
        and mom_digests[0] is not None
        and len(set(mom_digests)) == 1
    )
    agree(WORLD, ok, f"{digests}, {mom_digests}, lr {opt.param_groups[0]['lr']}")


Pair = collections.namedtuple("Pair", "first second")  # at module level: pickle finds it by name


def digest(t):
    layout = str(t.layout)
    t = t.to_dense() if t.layout != torch.strided else t
    return (
        layout,
        str(t.dtype),
        tuple(t.shape),
        str(t.device),
        hashlib.sha1(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest(),
    )


def flat_tensors(value, path=()):
    """{path: digest} of every tensor in a nested dict/list/tuple, and the rest as it is."""
    if isinstance(value, torch.Tensor):
        return {path: digest(value)}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {path: repr(value)}
    out = {path: type(value).__name__}
    for key, item in items:
        out.update(flat_tensors(item, (*path, key)))
    return out


@pytest.mark.mpi(min_size=2)
def test_broadcast_optimizer_state_gives_every_tensor_bitwise_and_sends_the_large_ones_by_the_engine():
    """Adam's state and a strided tensor a custom optimizer may keep: every rank ends with the
    root's bits, and what exceeds a page went through hpcdl's broadcast, not the pickle."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    root = size - 1
    model = make_model(seed=rank, hidden=48)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (rank + 1))
    loss_of(model, *full_batch(rank, 4, 1)).backward()
    opt.step()
    opt.state[model[0].weight]["strided"] = (torch.arange(4096, dtype=torch.float32) + rank).reshape(64, 64).t()
    hpcdl.stats(reset=True)
    collective(WORLD, hvt.broadcast_optimizer_state, opt, root_rank=root)
    received = hpcdl.stats().get("broadcast", {}).get("broadcast", {}).get("bytes_received", 0)
    state = opt.state_dict()
    sizes = [t.numel() * t.element_size() for entry in state["state"].values() for t in entry.values()]
    large = sum(n for n in sizes if n > 4096)
    tensors = WORLD.allgather(flat_tensors(state))
    ok = (
        all(t == tensors[root] for t in tensors)
        and len(sizes) == 3 * 6 + 1
        and opt.param_groups[0]["lr"] == 1e-3 * (root + 1)
        and (rank == root or received >= large > 4 * 4096)
    )
    agree(WORLD, ok, f"rank {rank}: {len(sizes)} tensors, received {received} of {large} bytes")


@pytest.mark.mpi(min_size=2)
def test_an_optimizer_that_cannot_take_the_roots_state_fails_on_every_rank():
    """Rank 1's optimizer has one parameter group fewer than the root's: torch refuses the
    state there, and every rank raises that error (the root too), instead of the root
    going on alone."""
    rank = WORLD.Get_rank()
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    if rank != 1:
        groups.append({"params": model[4].parameters()})
    opt = torch.optim.SGD(groups, lr=0.1)
    _, error = outcome(hvt.broadcast_optimizer_state, opt, root_rank=0)
    named = (
        isinstance(error, ValueError) and ("parameter group" in str(error)) and (rank == 1 or "rank 1" in str(error))
    )
    agree(WORLD, named, repr(error))


@pytest.mark.mpi(min_size=2)
def test_the_state_broadcast_keeps_every_dtype_shape_and_container():
    """The state broadcast itself (before torch's load_state_dict casts to the parameters'
    dtype): dtypes hpcdl broadcasts and one it does not (inline), 0-d, empty, strided, sparse,
    nested lists, tuples and namedtuples, each bitwise the root's, on the CPU."""
    from hpcdl.torch import _state_broadcast
    from hpcdl.torch.optimizer import _BROADCASTABLE

    rank = WORLD.Get_rank()
    root = 0
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = None
    if rank == root:
        mine = {
            "state": {
                0: {
                    "counts": torch.arange(5000, dtype=torch.int32),
                    "flags": torch.arange(9000) % 3 == 0,
                    "phase": torch.full((2000,), complex(1, 2), dtype=torch.complex64),
                    "strided": torch.arange(4096, dtype=torch.float64).reshape(64, 64).t(),
                    "step": torch.tensor(7.0),
                    "none": torch.empty(0, 3),
                },
                2: {"nested": [torch.ones(3000, dtype=torch.bfloat16), (torch.zeros(2, dtype=torch.uint8), "text")]},
                4: {"sparse": torch.sparse_coo_tensor([[0, 4000]], [1.0, 2.0], (5000,))},
            },
            "param_groups": [{"lr": 0.5, "params": [0, 1, 2, 3, 4, 5], "pair": Pair(torch.arange(2000), 3)}],
        }
    got = collective(
        WORLD, _state_broadcast.broadcast_state, opt, mine, root, WORLD, _BROADCASTABLE, "the state broadcast test"
    )
    tensors = WORLD.allgather(flat_tensors(got))
    pair = got["param_groups"][0]["pair"]
    ok = all(t == tensors[root] for t in tensors) and len(tensors[root]) == 30 and type(pair) is Pair
    agree(WORLD, ok, f"rank {rank}: {len(tensors[rank])} entries, pair {type(pair).__name__}")


@pytest.mark.mpi(min_size=2)
def test_ddp_comm_hook_equals_reference():
    from torch.nn.parallel import DistributedDataParallel

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with gloo_group():
        model = DistributedDataParallel(make_model(), bucket_cap_mb=0.001)
        model.register_comm_hook(None, hvt.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def train():
            for step in range(4):
                x, y = full_batch(step, 6, size)
                opt.zero_grad()
                loss_of(model, x[rank * 6 : (rank + 1) * 6], y[rank * 6 : (rank + 1) * 6]).backward()
                opt.step()

        hpcdl.stats(reset=True)
        collective(WORLD, train)
        diff = max_difference(model.module, train_reference(4, 6, size))
        ops = hpcdl.stats()["allreduce"]["none"]["ops"]
    agree(WORLD, diff < 2e-5 and ops >= 4, f"max diff {diff}, hpcdl allreduce ops {ops}")


@pytest.mark.mpi(min_size=2)
def test_ddp_comm_hook_keeps_each_named_models_error_feedback_apart():
    """Two compressed DDP models in one process, named "gen" and "disc": each bucket's residual is
    its own model's (its size, under its name), none under the default name."""
    from torch.nn.parallel import DistributedDataParallel

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with gloo_group():
        models = {"gen": make_model(hidden=8), "disc": make_model(hidden=24)}
        for name, module in list(models.items()):
            models[name] = DistributedDataParallel(module, bucket_cap_mb=25)  # one bucket each
            codec = hpcdl.compression.TopK(0.1)
            models[name].register_comm_hook({"compression": codec, "name": f"ddp.{name}"}, hvt.ddp_comm_hook)

        def train():
            for step in range(2):
                x, y = full_batch(step, 6, size)
                for model in models.values():
                    model.zero_grad()
                    loss_of(model, x[rank * 6 : (rank + 1) * 6], y[rank * 6 : (rank + 1) * 6]).backward()

        collective(WORLD, train)
        sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
        kept = {n: hpcdl.compression.residual(f"ddp.{n}.bucket.0") for n in models}
        default = hpcdl.compression.residual("ddp.bucket.0")
    ok = all(kept[n] is not None and kept[n].size == sizes[n] for n in models) and default is None
    agree(WORLD, ok, f"sizes {sizes}, residuals { ({n: None if r is None else r.size for n, r in kept.items()}) }")


def _compressed_ddp(name, hidden=8):
    """A DDP model (one bucket) whose hook compresses with TopK under ``name``, its own state dict."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(hidden=hidden), bucket_cap_mb=25)
    model.register_comm_hook({"compression": hpcdl.compression.TopK(0.1), "name": name}, hvt.ddp_comm_hook)
    return model


def _ddp_step(model, step):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = full_batch(step, 6, size)
    model.zero_grad()
    loss_of(model, x[rank * 6 : (rank + 1) * 6], y[rank * 6 : (rank + 1) * 6]).backward()


@pytest.mark.mpi(min_size=2)
def test_two_live_ddp_models_under_one_name_raise_on_every_rank():
    """Two compressed DDP models left under one name would mix their error feedback: once the
    second has stepped, the first stepping again raises on every rank, naming the cure."""
    with gloo_group():
        first, second = _compressed_ddp("ddp.clash"), _compressed_ddp("ddp.clash", hidden=24)
        collective(WORLD, _ddp_step, first, 0)
        collective(WORLD, _ddp_step, second, 0)
        _, error = outcome(_ddp_step, first, 1)
    agree(WORLD, error is not None and "its own state dict with its own" in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
def test_a_new_ddp_model_under_a_used_name_starts_from_zero_residuals():
    """A model that takes over a name from one before it does not inherit its residuals: after
    one step its residual is that of the same model trained under a fresh name."""
    with gloo_group():
        earlier = _compressed_ddp("ddp.again")
        for step in range(2):
            collective(WORLD, _ddp_step, earlier, step)
        inherited = hpcdl.compression.residual("ddp.again.bucket.0").copy()
        later, fresh = _compressed_ddp("ddp.again"), _compressed_ddp("ddp.fresh")
        collective(WORLD, _ddp_step, later, 5)
        collective(WORLD, _ddp_step, fresh, 5)
        got, want = hpcdl.compression.residual("ddp.again.bucket.0"), hpcdl.compression.residual("ddp.fresh.bucket.0")
    agree(
        WORLD,
        np.any(inherited != 0) and np.array_equal(got, want) and not np.array_equal(got, inherited),
        f"earlier residual nonzero {np.any(inherited != 0)}, later == fresh {np.array_equal(got, want)}",
    )


@pytest.mark.mpi(min_size=2)
def test_parameters_added_after_wrapping_are_averaged():
    """add_param_group() on the wrapped optimizer: the new layer's gradients are averaged
    like the others (issue 30.3), so every rank ends with the same weights."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model, head = make_model(), _seeded_head()
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), name="added")
    opt.add_param_group({"params": head.parameters(), "lr": 0.25})

    def train():
        for step in range(3):
            x, _ = full_batch(step, 4, size)
            opt.zero_grad()
            head(model(x[rank * 4 : (rank + 1) * 4])).pow(2).mean().backward()
            opt.step()

    collective(WORLD, train)
    opt.remove_hooks()
    # the reference: one process, the mean over ranks of the per-rank losses
    ref_model, ref_head = make_model(), _seeded_head()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    ref.add_param_group({"params": ref_head.parameters(), "lr": 0.25})
    for step in range(3):
        x, _ = full_batch(step, 4, size)
        ref.zero_grad()
        (sum(ref_head(ref_model(x[r * 4 : (r + 1) * 4])).pow(2).mean() for r in range(size)) / size).backward()
        ref.step()
    diff = float((head.weight - ref_head.weight).detach().abs().max())
    digests = WORLD.allgather(hashlib.sha1(head.weight.detach().numpy().tobytes()).hexdigest())
    agree(
        WORLD,
        diff < 2e-5 and len(set(digests)) == 1,
        f"head differs from reference by {diff}, {len(set(digests))} distinct heads",
    )


def _seeded_head():
    torch.manual_seed(7)
    return torch.nn.Linear(5, 3)


@pytest.mark.mpi(min_size=2)
def test_a_frozen_layer_keeps_no_gradient_and_does_not_move():
    """Fine-tuning: requires_grad_(False) and zero_grad(set_to_none=True) after wrapping; with
    momentum and weight decay the frozen layer must not move and keep .grad None (issue 30.4)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = make_model()
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        model.named_parameters(),
        bucket_bytes=256,
        name="frozen",
    )

    def step(i):
        x, y = full_batch(i, 4, size)
        opt.zero_grad(set_to_none=True)
        loss_of(model, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]).backward()
        opt.step()

    collective(WORLD, step, 0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    for i in range(1, 4):
        collective(WORLD, step, i)
    opt.remove_hooks()
    moved = max(float((p - f).abs().max()) for p, f in zip(model[0].parameters(), frozen))
    grads = [p.grad is None for p in model[0].parameters()]
    trained = model[2].weight.grad is not None
    agree(
        WORLD,
        moved == 0 and all(grads) and trained,
        f"frozen layer moved {moved}, grad None {grads}, trained layer has a gradient: {trained}",
    )


@pytest.mark.mpi(min_size=2)
def test_optimizers_with_the_default_name_keep_their_own_error_feedback():
    """Two wrapped optimizers, both with the default name, compressed: each one's error feedback is its
    own, so each model trains as it does alone (issue 30.5); a live explicit name clash raises."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    codec = hpcdl.compression.TopK(0.1)

    def wrap(model, **kw):
        return hvt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), compression=codec, **kw
        )

    def train(pairs, steps=4):
        for i in range(steps):
            x, y = full_batch(i, 4, size)
            for model, opt in pairs:
                opt.zero_grad()
                loss_of(model, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]).backward()
                opt.step()

    a, b = make_model(seed=1), make_model(seed=2, hidden=32)
    opt_a, opt_b = wrap(a), wrap(b)
    names = (opt_a.bucket_layout()[0][0], opt_b.bucket_layout()[0][0])
    collective(WORLD, train, [(a, opt_a), (b, opt_b)])
    alone = make_model(seed=1)
    opt_alone = wrap(alone)  # the next default name: residuals of its own
    collective(WORLD, train, [(alone, opt_alone)])
    opt_c = wrap(make_model(), name="clash")
    _, clash = outcome(wrap, make_model(), name="clash")
    for opt in (opt_a, opt_b, opt_alone, opt_c):
        opt.remove_hooks()
    same = params_digest(a) == params_digest(alone)
    agree(
        WORLD,
        same and names[0] != names[1] and isinstance(clash, ValueError) and "named" in str(clash),
        f"A trained with B equals A alone: {same}; bucket names {names}; clash: {clash!r}",
    )


@pytest.mark.mpi(min_size=2)
def test_sparse_gradients_are_gathered_or_go_dense():
    """An Embedding(sparse=True) trains as the dense embedding does: its indices and values
    allgathered (Horovod's sparse path), or with sparse_as_dense=True densified; the
    gathered path leaves every rank bitwise identical."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()

    def model(sparse):
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Embedding(20, 6, sparse=sparse), torch.nn.Flatten(), torch.nn.Linear(12, 5))

    def train(m, **kw):
        opt = hvt.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.5), m.named_parameters(), name=f"sparse.{kw}", **kw
        )
        try:
            for i in range(3):
                g = torch.Generator().manual_seed(i)
                ids = torch.randint(0, 20, (4 * size, 2), generator=g)
                y = torch.randint(0, 5, (4 * size,), generator=g)
                opt.zero_grad()
                loss_of(m, ids[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]).backward()
                opt.step()
        finally:
            opt.remove_hooks()
        return m

    gathered = collective(WORLD, train, model(True))
    dense = collective(WORLD, train, model(False))
    densified = collective(WORLD, train, model(True), sparse_as_dense=True)
    diff, gathered_diff = max_difference(dense, densified), max_difference(dense, gathered)
    same = len(set(WORLD.allgather(params_digest(gathered)))) == 1
    agree(
        WORLD,
        diff < 1e-6 and gathered_diff < 1e-6 and same,
        f"dense vs densified {diff}, vs gathered {gathered_diff}, ranks identical {same}",
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [hpcdl.compression.TopK(0.05), hpcdl.compression.Int8(block=64)], ids=str)
def test_error_feedback_residuals_survive_a_state_dict_round_trip(codec):
    """3 steps, state_dict() through torch.save, a new model and optimizer (another name) load it,
    3 more steps: bit for bit the 6 uninterrupted steps. The same resume without the residuals
    differs (what the state carries matters), and each rank saved its own."""

    def resumed(keep_residuals):
        model = make_model(seed=3)
        opt = compressed_optimizer(model, codec, f"ef.first.{codec}.{keep_residuals}")
        train_steps(model, opt, WORLD, 0, 3)
        model_state, opt_state = through_torch_save(model.state_dict()), through_torch_save(opt.state_dict())
        opt.remove_hooks()
        again = make_model(seed=9)
        again.load_state_dict(model_state)
        opt = compressed_optimizer(again, codec, f"ef.second.{codec}.{keep_residuals}")
        opt.load_state_dict(
            opt_state if keep_residuals else {k: v for k, v in opt_state.items() if k != "hpcdl_residuals"}
        )
        train_steps(again, opt, WORLD, 3, 3)
        opt.remove_hooks()
        return params_digest(again), opt_state["hpcdl_residuals"]

    got, saved = collective(WORLD, resumed, True)
    without, _ = collective(WORLD, resumed, False)
    whole_model = make_model(seed=3)
    whole = compressed_optimizer(whole_model, codec, f"ef.whole.{codec}")
    collective(WORLD, train_steps, whole_model, whole, WORLD, 0, 6)
    whole.remove_hooks()
    mine = b"".join(saved[k]["engine"].numpy().tobytes() for k in sorted(saved))
    distinct = len(set(WORLD.allgather(mine)))
    nonzero = all(bool(saved[k]["engine"].abs().sum() > 0) for k in saved)
    agree(
        WORLD,
        got == params_digest(whole_model) and without != got and saved and nonzero and distinct == WORLD.Get_size(),
        f"resumed == uninterrupted {got == params_digest(whole_model)}, without residuals differs {without != got}, "
        f"buckets saved {sorted(saved)}, non-zero {nonzero}, distinct across ranks {distinct}",
    )


@pytest.mark.mpi(min_size=2)
def test_a_new_optimizer_named_like_a_removed_one_starts_without_its_residuals():
    """An optimizer removed after 2 steps leaves residuals under its bucket names; a new one of
    the same name on a fresh model trains as one of a name never used (it adds nothing of them)."""
    codec = hpcdl.compression.TopK(0.05)

    def two_steps(name, remove=True):
        model = make_model(seed=3)
        opt = compressed_optimizer(model, codec, name)
        train_steps(model, opt, WORLD, 0, 2)
        held = opt.state_dict()["hpcdl_residuals"]
        if remove:
            opt.remove_hooks()
        return params_digest(model), held

    _, left = collective(WORLD, two_steps, "ef.reused")
    reused, _ = collective(WORLD, two_steps, "ef.reused")
    fresh, _ = collective(WORLD, two_steps, "ef.never.used")
    nonzero = bool(left) and all(bool(b["engine"].abs().sum() > 0) for b in left.values())
    agree(
        WORLD, nonzero and reused == fresh, f"the first one left residuals {nonzero}; reused == fresh {reused == fresh}"
    )


@pytest.mark.mpi(min_size=2)
def test_residuals_that_do_not_fit_the_optimizer_raise_on_load_and_change_nothing():
    codec = hpcdl.compression.TopK(0.05)
    model = make_model(seed=3)
    opt = compressed_optimizer(model, codec, "ef.fit")
    collective(WORLD, train_steps, model, opt, WORLD, 0, 2)
    state = through_torch_save(opt.state_dict())
    before = {k: hpcdl.compression.residual(f"ef.fit.{k}") for k in state["hpcdl_residuals"]}
    opt.remove_hooks()
    errors = []
    other_layout = compressed_optimizer(make_model(seed=3), codec, "ef.fit.layout", bucket_bytes=1 << 20)
    errors.append(outcome(other_layout.load_state_dict, state)[1])
    other_layout.remove_hooks()
    plain = make_model(seed=3)
    dense = hvt.DistributedOptimizer(
        torch.optim.SGD(plain.parameters(), lr=0.5), plain.named_parameters(), name="ef.fit.dense"
    )
    errors.append(outcome(dense.load_state_dict, state)[1])
    dense.remove_hooks()
    same = compressed_optimizer(make_model(seed=3), codec, "ef.fit")
    same.load_state_dict(state)  # the saver's residuals, which the failed loads below must leave alone
    shrunk = {k: dict(v, engine=v["engine"][:-1]) for k, v in state["hpcdl_residuals"].items()}
    errors.append(outcome(same.load_state_dict, dict(state, hpcdl_residuals=shrunk))[1])
    reordered = {k: dict(v, params=v["params"][::-1]) for k, v in state["hpcdl_residuals"].items()}
    errors.append(outcome(same.load_state_dict, dict(state, hpcdl_residuals=reordered))[1])
    same.remove_hooks()
    kept = all(np.array_equal(hpcdl.compression.residual(f"ef.fit.{k}"), v) for k, v in before.items())
    expected = ("does not have", "no codec", "values, not", "bucket holds")
    ok = kept and all(isinstance(e, ValueError) and words in str(e) for e, words in zip(errors, expected))
    agree(WORLD, ok, f"residuals kept {kept}; errors {errors!r}")


@pytest.mark.mpi(min_size=2)
def test_broadcast_optimizer_state_keeps_each_ranks_error_feedback():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = make_model(seed=3)
    opt = compressed_optimizer(model, hpcdl.compression.TopK(0.05), "ef.bcast")
    collective(WORLD, train_steps, model, opt, WORLD, 0, 2)
    mine = opt.state_dict()["hpcdl_residuals"]
    collective(WORLD, hvt.broadcast_optimizer_state, opt, size - 1)
    after = opt.state_dict()["hpcdl_residuals"]
    opt.remove_hooks()
    own = sorted(after) == sorted(mine) and all(torch.equal(after[k]["engine"], mine[k]["engine"]) for k in mine)
    distinct = len(set(WORLD.allgather(b"".join(after[k]["engine"].numpy().tobytes() for k in sorted(after)))))
    agree(WORLD, own and distinct == size, f"own residuals kept {own}, distinct across ranks {distinct} (rank {rank})")
