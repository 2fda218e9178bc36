"""PowerSGD in one process: its settings, the matrix kernels DistributedOptimizer runs
(hpcdl.torch.powersgd's take / project / project_back / finish) over simulated ranks against a
float64 reference of the documented semantics, and the one-rank rule (under MPI:
tests/mpi/test_powersgd_mpi.py)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from hpcdl.compression import PowerSGD, from_config, from_text
from hpcdl.torch import powersgd

from helpers.powersgd import Reference, seeded_q
from helpers.torch_adapter import full_batch, loss_of, make_model, params_digest


@pytest.mark.parametrize(
    "settings",
    [{"rank": 0}, {"rank": 1.5}, {"rank": True}, {"warmup_steps": -1}, {"seed": -2}, {"seed": 2**32}, {"rank": "1"}],
)
def test_bad_settings_raise_naming_the_setting(settings):
    with pytest.raises(ValueError, match=next(iter(settings))):
        PowerSGD(**settings)


def test_settings_round_trip_through_config_and_text():
    codec = PowerSGD(rank=4, warmup_steps=7, seed=3)
    assert str(codec) == "powersgd(rank=4,warmup_steps=7,seed=3)"
    assert from_config(codec.get_config()) == codec
    assert from_text(str(codec)) == codec
    assert from_text("powersgd") == PowerSGD()
    assert from_text(str(codec)) != PowerSGD(rank=4, warmup_steps=7, seed=4)


def test_an_allreduce_of_one_buffer_refuses_it_naming_the_optimizer():
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        hpcdl.allreduce(np.ones(8, np.float32), name="psgd.refused", compression=PowerSGD())


@pytest.mark.parametrize(
    "shape,rank,factored",
    [
        ((10,), 1, False),
        ((4, 4), 1, True),
        ((4, 4), 2, False),
        ((2, 2), 1, False),
        ((3, 2), 1, True),
        ((8, 3, 3, 3), 6, True),
        ((8, 3, 3, 3), 7, False),
        ((1, 100), 1, False),
    ],
)
def test_a_matrix_is_factored_only_where_the_factors_are_smaller(shape, rank, factored):
    assert PowerSGD(rank=rank).compresses(shape) == factored


def test_orthogonalize_gives_orthonormal_columns_the_same_bits_every_time():
    g = torch.Generator().manual_seed(5)
    p = torch.randn(40, 3, generator=g)
    a, b = powersgd.orthogonalize(p.clone()), powersgd.orthogonalize(p.clone())
    assert torch.equal(a, b)
    assert torch.allclose(a.T @ a, torch.eye(3), atol=1e-5)
    zero = powersgd.orthogonalize(torch.zeros(6, 2))
    assert torch.equal(zero, torch.zeros(6, 2))


def _matrix(name, n, m, rank, q0):
    q = torch.from_numpy(q0.astype(np.float32))
    return powersgd.Matrix(
        name,
        n,
        m,
        torch.zeros(n * m),
        torch.zeros(n * m),
        torch.zeros(n * rank),
        q.clone().view(-1),
        q.clone().view(-1),
    )


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _simulate(ranks, shapes, rank, steps, seed=0, poison=None):
    """The kernels over `ranks` simulated ranks (the averages taken here, in float32, as the ring's
    sum and division would), each step checked against the float64 reference."""
    ref = Reference(shapes, rank, seed, ranks)
    mats = {
        name: [_matrix(name, n, m, rank, seeded_q(seed, name, m, rank)) for _ in range(ranks)]
        for name, (n, m) in shapes.items()
    }
    rng = np.random.default_rng(11)
    worst, identity = 0.0, 0.0
    for step in range(steps):
        for name, (n, m) in shapes.items():
            grads = [rng.standard_normal((n, m)) for _ in range(ranks)]
            if poison == step:
                grads[0][0, 0] = np.inf
            group = mats[name]
            for mat, g in zip(group, grads):
                powersgd.take(mat, torch.from_numpy(g.astype(np.float32)))
                powersgd.project(mat)
            m_sent = [mat.m.clone() for mat in group]
            p = torch.stack([mat.p for mat in group]).sum(0) / ranks
            for mat in group:
                mat.p.copy_(p)
                powersgd.project_back(mat)
            q = torch.stack([mat.q for mat in group]).sum(0) / ranks
            approx = [torch.full((n, m), np.nan) for _ in group]  # every element must be written
            for mat, out in zip(group, approx):
                mat.q.copy_(q)
                powersgd.finish(mat, out)
            with np.errstate(invalid="ignore"):
                want, _ = ref.step(name, [g.astype(np.float32).astype(np.float64) for g in grads])
            assert all(_same_bits(a, approx[0]) and _same_bits(mat.q, group[0].q) for a, mat in zip(approx, group))
            if poison == step:
                assert all(torch.isfinite(mat.residual).all() for mat in group)
                assert all(torch.isfinite(mat.q).all() for mat in group)
                continue
            worst = max(worst, float(np.abs(approx[0].double().numpy() - want).max() / np.abs(want).max()))
            for mat, sent, out in zip(group, m_sent, approx):  # error feedback: M = approx + residual
                gap = (out.double() + mat.residual.double() - sent.double()).abs().max()
                identity = max(identity, float(gap / sent.abs().max()))
    return worst, identity


@pytest.mark.parametrize("rank", [1, 2])
def test_kernels_over_three_ranks_match_the_float64_reference(rank):
    worst, identity = _simulate(3, {"a.weight": (12, 7), "b.weight": (5, 9)}, rank, steps=6)
    assert worst < 1e-4, worst
    assert identity < 1e-6, identity


def test_an_overflow_stays_in_its_step():
    """An Inf gradient on one rank: that step's result is not finite on every rank alike, but the
    residual keeps no Inf/NaN and Q restarts from its seed, so the next step matches the reference."""
    worst, _ = _simulate(2, {"w": (6, 5)}, 1, steps=3, poison=1)
    assert worst < 1e-4, worst


def test_the_residual_changes_only_when_the_result_is_formed():
    """M goes into the work buffer, not over the residual: a step that stops after its P (an
    abandoned round) leaves the residual bit for bit as it was; the result's residual is
    M - P Q^T in float64 up to one float32 rounding and then lives in the other buffer."""
    n, m = 7, 5
    q0 = np.random.default_rng(3).standard_normal((m, 1)).astype(np.float32)
    mat = _matrix("w", n, m, 1, q0)
    mat.residual.copy_(torch.from_numpy(np.random.default_rng(4).standard_normal((n, m)).astype(np.float32)))
    before = mat.residual.clone()
    grad = torch.from_numpy(np.random.default_rng(5).standard_normal((n, m)).astype(np.float32))
    powersgd.take(mat, grad)
    powersgd.project(mat)
    assert _same_bits(mat.residual, before)
    sent = mat.m.clone()
    assert torch.equal(sent, grad + before)
    powersgd.project_back(mat)
    approx = torch.empty(n, m)
    work, residual = mat.m, mat.residual
    powersgd.finish(mat, approx)
    assert mat.residual.data_ptr() == work.data_ptr() and mat.m.data_ptr() == residual.data_ptr()
    want = sent.double() - mat.p.double() @ mat.q.double().T
    assert float((mat.residual.double() - want).abs().max()) <= 2**-23 * float(want.abs().max()) * 2


def test_dead_q_columns_restart_from_the_seeded_q():
    q0 = torch.arange(12, dtype=torch.float32).view(4, 3)
    q = torch.ones(4, 3)
    q[:, 0] = 0
    q[1, 2] = float("nan")
    powersgd.restart_columns(q, q0)
    assert torch.equal(q[:, 0], q0[:, 0]) and torch.equal(q[:, 2], q0[:, 2]) and torch.equal(q[:, 1], torch.ones(4))


def test_one_rank_leaves_the_gradients_exact_and_keeps_no_state():
    """COMM_SELF: nothing is sent, so nothing is compressed (as for every codec)."""
    model = make_model()
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model.named_parameters(),
        compression=PowerSGD(rank=1, warmup_steps=0),
        comm=MPI.COMM_SELF,
        name="psgd.one",
    )
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step in range(3):
        x, y = full_batch(step, 6, 1)
        for m, o in ((model, opt), (plain, plain_opt)):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    state = opt.state_dict()["hpcdl_powersgd"]
    opt.remove_hooks()
    assert params_digest(model) == params_digest(plain)
    assert state["steps"] == 3 and state["matrices"] == {}


def test_layout_puts_the_vectors_in_the_last_low_rank_bucket_and_op_sum_is_refused():
    """The biases (float32, not factored) ride in the P of the low-rank bucket launched last."""
    model = make_model(hidden=32)
    opt = hvt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression=PowerSGD(rank=2),
        bucket_bytes=4 * 2 * (5 + 32 + 32 + 32),
        comm=MPI.COMM_SELF,
        name="psgd.layout",
    )
    layout = [shapes for _, _, shapes in opt.bucket_layout()]
    opt.remove_hooks()
    assert layout == [[(5, 32), (32, 32)], [(32, 12), (5,), (32,), (32,)]]
    with pytest.raises(ValueError, match="average"):
        hvt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression=PowerSGD(),
            op="sum",
            comm=MPI.COMM_SELF,
            name="psgd.sum",
        )
