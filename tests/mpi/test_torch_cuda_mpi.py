"""hpcdl.torch with device tensors: [cuda] on the GPU (ranks share it round-robin), [staged-cpu]
the same staging path (device gathering, side-stream copies, device codecs, the hpcdl-cuda
thread) on CPU tensors. Every rank computes its reference itself; ranks agree before asserting."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from hpcdl import _tensors
from hpcdl.compression import FP16, Int8, TopK

from conftest import agree, collective
from helpers.device import device  # noqa: F401 - the fixture
from helpers.torch_adapter import (
    compressed_optimizer,
    full_batch,
    gloo_group,
    loss_of,
    make_model,
    max_difference,
    params_digest,
    through_torch_save,
    train_reference,
    train_steps,
)

WORLD = MPI.COMM_WORLD


@contextlib.contextmanager
def host_path():
    """The reference: the same training through the plain host path (no staging)."""
    old = _tensors.staging_cpu_tensors(False)
    try:
        yield
    finally:
        _tensors.staging_cpu_tensors(old)


def train(device, steps=5, per_rank=6, comm=WORLD, **kw):
    rank, size = comm.Get_rank(), comm.Get_size()
    model = make_model().to(device)
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), bucket_bytes=512, comm=comm, **kw
    )
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        loss_of(model, x[mine].to(device), y[mine].to(device)).backward()
        opt.step()
    opt.remove_hooks()
    return model.cpu()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec,tol", [(None, 2e-5), (FP16(), 1e-2), (Int8(), 5e-2), (TopK(0.2), 5e-2)], ids=str)
def test_distributed_optimizer_on_device_equals_the_host_run(device, codec, tol):
    got = collective(WORLD, train, device, compression=codec)
    with host_path():
        want = collective(WORLD, train, torch.device("cpu"), compression=codec)
    diff = max_difference(got, want)
    digests = WORLD.allgather(params_digest(got))
    agree(
        WORLD,
        diff < tol and len(set(digests)) == 1,
        f"max diff {diff} to the host run, {len(set(digests))} distinct results",
    )


@pytest.mark.mpi(min_size=2)
def test_one_rank_keeps_gradients_on_the_device_untouched(device):
    """COMM_SELF: no exchange, no copy; the same bits as the plain optimizer."""
    hpcdl.stats(reset=True)
    got = train(device, comm=MPI.COMM_SELF)
    ops = hpcdl.stats().get("allreduce", {}).get("none", {}).get("ops", 0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(5):
        x, y = full_batch(step, 6, 1)
        opt.zero_grad()
        loss_of(model, x.to(device), y.to(device)).backward()
        opt.step()
    same = params_digest(got) == params_digest(model.cpu())
    agree(WORLD, same and ops == 0, f"same bits {same}, allreduce ops {ops}")


def train_amp(device, size, distributed, steps=4, per_rank=6):
    """autocast + GradScaler on the device; distributed=False: one process, the whole batch."""
    rank = WORLD.Get_rank() if distributed else 0
    kind, low = ("cuda", torch.float16) if device.type == "cuda" else ("cpu", torch.bfloat16)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if distributed:
        opt = hvt.DistributedOptimizer(opt, model.named_parameters(), bucket_bytes=512, name="amp.device")
    scaler = torch.amp.GradScaler(kind, init_scale=2.0**10, growth_interval=2)
    shares = [rank] if distributed else list(range(size))
    scales = []
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        opt.zero_grad()
        with torch.autocast(kind, dtype=low):
            losses = [
                loss_of(
                    model,
                    x[r * per_rank : (r + 1) * per_rank].to(device),
                    y[r * per_rank : (r + 1) * per_rank].to(device),
                )
                for r in shares
            ]
        scaler.scale(sum(losses) / len(losses)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    if distributed:
        opt.remove_hooks()
    return model.cpu(), scales


@pytest.mark.mpi(min_size=2)
def test_amp_on_device_equals_single_process_amp(device):
    size = WORLD.Get_size()
    got, scales = collective(WORLD, train_amp, device, size, True)
    want, want_scales = train_amp(device, size, False)
    diff = max_difference(got, want)
    views = WORLD.allgather((params_digest(got), scales))
    agree(
        WORLD,
        diff < 2e-3 and scales == want_scales and len({repr(v) for v in views}) == 1,
        f"max diff {diff}, scales {scales} vs {want_scales}",
    )


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_of_device_state_with_buffers(device):
    rank, root = WORLD.Get_rank(), WORLD.Get_size() - 1
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).to(device)
    model(torch.randn(8, 6, device=device))  # running statistics and num_batches_tracked differ per rank
    model.register_buffer("mask", torch.tensor([rank % 2 == 0, True], device=device))
    collective(WORLD, hvt.broadcast_parameters, model.state_dict(), root_rank=root)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    digest = repr([(k, v.contiguous().view(-1).view(torch.uint8).tolist()) for k, v in state.items()])
    digests = WORLD.allgather(digest)
    on_device = all(t.device.type == device.type for t in model.state_dict().values())
    agree(
        WORLD,
        len(set(digests)) == 1 and on_device and state["mask"].tolist() == [root % 2 == 0, True],
        f"{len(set(digests))} distinct states, on device {on_device}",
    )


@pytest.mark.mpi(min_size=2)
def test_error_feedback_on_the_device_survives_a_state_dict_round_trip(device):
    """Int8 encoded on the device keeps two residuals per bucket (the device encoder's and the
    engine's): 3 steps, state_dict() through torch.save, a new model and optimizer load it, 3
    more steps: bit for bit the 6 uninterrupted steps, and the device one is on the device."""
    codec = Int8(block=64)
    tag = device.type

    def resumed():
        model = make_model(seed=3).to(device)
        opt = compressed_optimizer(model, codec, f"efd.first.{tag}")
        train_steps(model, opt, WORLD, 0, 3)
        model_state, opt_state = through_torch_save(model.state_dict()), through_torch_save(opt.state_dict())
        opt.remove_hooks()
        again = make_model(seed=9).to(device)
        again.load_state_dict(model_state)
        opt = compressed_optimizer(again, codec, f"efd.second.{tag}")
        opt.load_state_dict(opt_state)
        train_steps(again, opt, WORLD, 3, 3)
        opt.remove_hooks()
        return params_digest(again), opt_state["hpcdl_residuals"]

    got, saved = collective(WORLD, resumed)
    whole_model = make_model(seed=3).to(device)
    whole = compressed_optimizer(whole_model, codec, f"efd.whole.{tag}")
    collective(WORLD, train_steps, whole_model, whole, WORLD, 0, 6)
    whole.remove_hooks()
    kinds = {kind for entry in saved.values() for kind in entry}
    on_device = all(entry["device"].device == next(whole_model.parameters()).device for entry in saved.values())
    agree(
        WORLD,
        got == params_digest(whole_model) and kinds == {"params", "engine", "device"} and on_device,
        f"resumed == uninterrupted {got == params_digest(whole_model)}, saved {kinds}, device residuals on "
        f"the model's device {on_device}",
    )


@pytest.mark.mpi(min_size=2)
def test_broadcast_optimizer_state_lands_on_each_ranks_own_device(device):
    """Adam's state on the root's device reaches every rank bitwise, each tensor beyond a
    page allocated on that rank's own device (its parameters'), never on the root's GPU."""
    rank, root = WORLD.Get_rank(), 0
    model = make_model(seed=rank, hidden=48).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    x, y = full_batch(rank, 4, 1)
    loss_of(model, x.to(device), y.to(device)).backward()
    opt.step()
    collective(WORLD, hvt.broadcast_optimizer_state, opt, root_rank=root)
    state = opt.state_dict()["state"]
    moments = [t for entry in state.values() for key, t in entry.items() if key != "step"]
    digest = repr([t.cpu().contiguous().view(-1).view(torch.uint8).tolist() for t in moments])
    digests = WORLD.allgather(digest)
    devices = {str(t.device) for t in moments}
    agree(
        WORLD,
        len(set(digests)) == 1 and devices == {str(device)} and opt.param_groups[0]["lr"] == 0.01 * (root + 1),
        f"{len(set(digests))} distinct states, devices {devices} (this rank's {device})",
    )


@pytest.mark.mpi(min_size=2)
def test_pipeline_with_device_stages_equals_single_process(device):
    from helpers.pipeline import make_model as pipeline_model
    from helpers.pipeline import max_difference as pipeline_difference
    from helpers.pipeline import train_pipeline, train_single

    pair = WORLD.Split(color=WORLD.Get_rank() // 2, key=WORLD.Get_rank())
    try:

        def run():
            pipe = hvt.Pipeline(pipeline_model(), F.cross_entropy, micro_batches=4, comm=pair)
            pipe.module.to(device)
            losses = train_pipeline(pipe, 3)
            pipe.module.cpu()
            return pipe, losses

        pipe, losses = collective(WORLD, run)
        diff = pipeline_difference(pipe, train_single(3))
    finally:
        pair.Free()
    agree(WORLD, diff < 1e-4, f"stage {pipe.stage}: max diff {diff}, losses {losses}")


@pytest.mark.mpi(min_size=2)
def test_full_state_dict_of_device_stages_is_on_the_cpu_and_loads_onto_each_stages_device(device):
    """full_state_dict gives stage 0 every stage's tensors on the CPU (pickled from a GPU
    they would land on that GPU's number on stage 0's node), and load_full_state_dict of a
    state held on stage 0's device puts each stage's part on that stage's own device."""
    from helpers.pipeline import make_model as pipeline_model

    pair = WORLD.Split(color=WORLD.Get_rank() // 2, key=WORLD.Get_rank())
    try:

        def run():
            pipe = hvt.Pipeline(pipeline_model(), F.cross_entropy, micro_batches=4, comm=pair)
            pipe.module.to(device)
            full = pipe.full_state_dict()
            changed = None if pipe.stage else {key: (t + 1).to(device) for key, t in full.items()}
            pipe.load_full_state_dict(changed)
            return pipe, full, pipe.module.state_dict()

        pipe, full, mine = collective(WORLD, run)
    finally:
        pair.Free()
    original = pipeline_model().state_dict()
    gathered = full is None or (
        set(full) == set(original)
        and all(t.device.type == "cpu" and torch.equal(t, original[k]) for k, t in full.items())
    )
    loaded = all(t.device == device and torch.equal(t.cpu(), original[k] + 1) for k, t in mine.items())
    agree(WORLD, gathered and loaded and len(mine) > 0, f"stage {pipe.stage}: gathered {gathered}, loaded {loaded}")


@pytest.mark.mpi(min_size=2)
def test_ddp_comm_hook_on_device_equals_reference(device):
    from torch.nn.parallel import DistributedDataParallel

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with gloo_group():
        ids = [device] if device.type == "cuda" else None
        model = DistributedDataParallel(make_model().to(device), device_ids=ids, bucket_cap_mb=0.001)
        model.register_comm_hook(None, hvt.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def run():
            for step in range(4):
                x, y = full_batch(step, 6, size)
                opt.zero_grad()
                loss_of(
                    model, x[rank * 6 : (rank + 1) * 6].to(device), y[rank * 6 : (rank + 1) * 6].to(device)
                ).backward()
                opt.step()

        collective(WORLD, run)
        diff = max_difference(model.module.cpu(), train_reference(4, 6, size))
    agree(WORLD, diff < 2e-5, f"max diff {diff}")


@pytest.mark.mpi(min_size=2)
def test_frozen_and_added_parameters_on_the_device(device):
    """A layer frozen after wrapping keeps .grad None and does not move; a head added with
    add_param_group is averaged (the ranks end bitwise identical), on the device path too."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = make_model().to(device)
    torch.manual_seed(7)
    head = torch.nn.Linear(5, 3).to(device)
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        model.named_parameters(),
        bucket_bytes=256,
        name="device.frozen",
    )
    opt.add_param_group({"params": head.parameters()})
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = [p.detach().cpu().clone() for p in model[0].parameters()]

    def run():
        for step in range(3):
            x, _ = full_batch(step, 4, size)
            opt.zero_grad(set_to_none=True)
            head(model(x[rank * 4 : (rank + 1) * 4].to(device))).pow(2).mean().backward()
            opt.step()

    collective(WORLD, run)
    opt.remove_hooks()
    moved = max(float((p.detach().cpu() - f).abs().max()) for p, f in zip(model[0].parameters(), frozen))
    none = all(p.grad is None for p in model[0].parameters())
    digests = WORLD.allgather(head.weight.detach().cpu().numpy().tobytes() + params_digest(model.cpu()).encode())
    agree(
        WORLD,
        moved == 0 and none and len(set(digests)) == 1,
        f"frozen moved {moved}, grads None {none}, {len(set(digests))} distinct results",
    )
