"""hpcdl.torch.Pipeline: schedules, partitioning, training equal to single-process
training, the hybrid pipeline x data grid, measured activation memory, checkpoints
and bad input, single-process and under mpiexec -n 4.

Every rank computes the single-process reference itself (the whole model on the
whole batch) and compares its own stage's parameters with it, so no rank's
verdict depends on another's; ranks agree on the verdict before asserting.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcdl
import hpcdl.torch as hvt
from conftest import agree, collective, outcome
from hpcdl.pipeline import (BACKWARD, FORWARD, PipelineError, balanced_split, bubble_fraction,
                            pipeline_grid, stage_actions)

WORLD = MPI.COMM_WORLD
torch.set_num_threads(1)
LR = 0.3


def make_model(seed=0, width=16, blocks=4):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, width), torch.nn.Tanh()]
    for _ in range(blocks - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 5))


def batch(step, rows=16, replica=0):
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)


def train_single(steps, rows=16, replicas=1):
    """The reference: one process, the whole model, the replicas' batches concatenated."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        parts = [batch(step, rows, r) for r in range(replicas)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def train_pipeline(pipe, steps, rows=16, replica=0, optimizer=None):
    opt = optimizer or torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step, rows, replica)
        opt.zero_grad()
        losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        opt.step()
    return losses


def max_difference(pipe, reference):
    ref = dict(reference.named_parameters())
    return max((p - ref[n]).abs().max().item() for n, p in pipe.named_parameters())


def sub_pipelines(comm, stages):
    """Independent pipelines of ``stages`` ranks inside the 4-rank job."""
    return comm.Split(color=comm.Get_rank() // stages, key=comm.Get_rank())


# --------------------------------------------------------------------------- single process

@pytest.mark.parametrize("stages,m", [(1, 1), (2, 3), (4, 4), (4, 9), (3, 2)])
def test_schedules_run_each_micro_batch_once_in_dependency_order(stages, m):
    for name in ("gpipe", "1f1b"):
        for stage in range(stages):
            actions = stage_actions(name, stages, stage, m)
            assert sorted(actions) == sorted([(k, i) for k in (FORWARD, BACKWARD) for i in range(m)])
            assert all(actions.index((FORWARD, i)) < actions.index((BACKWARD, i)) for i in range(m))


def in_flight(actions):
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def test_1f1b_schedule_bounds_the_micro_batches_in_flight():
    for stages in (2, 4, 8):
        m = 4 * stages
        for stage in range(stages):
            assert in_flight(stage_actions("1f1b", stages, stage, m)) == stages - stage
            assert in_flight(stage_actions("gpipe", stages, stage, m)) == m


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        stage_actions("zb", 2, 0, 4)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_split([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7]  # 15, 13, 17
    assert balanced_split([5, 5, 5], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        balanced_split([1, 1], 3)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)


def test_one_stage_pipeline_equals_plain_training():
    pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=4, comm=MPI.COMM_SELF)
    losses = train_pipeline(pipe, steps=3)
    assert max_difference(pipe, train_single(3)) < 1e-6
    assert losses[-1] < losses[0]


def test_balance_by_params_marks_and_explicit_starts():
    model = make_model(width=32)  # Linear(12,32), Tanh, 3x(Linear(32,32), Tanh), Linear(32,5)
    assert hvt.Pipeline(model, F.cross_entropy, 2, comm=MPI.COMM_SELF).starts == [0]
    marked = torch.nn.Sequential(torch.nn.Linear(12, 8), hvt.PipeSplit(), torch.nn.Linear(8, 5))
    with pytest.raises(ValueError, match="1 PipeSplit marks make 2 stages"):
        hvt.Pipeline(marked, F.cross_entropy, 2, stages=1, balance="marks", comm=MPI.COMM_SELF)
    from hpcdl.torch.pipeline import _stage_starts
    assert _stage_starts(marked, "marks", 2, None, MPI.COMM_SELF) == [0, 2]
    # parameters per layer 416, 0, 1056, 0, 1056, 0, 1056, 0, 165: cut at 3 (1472 | 2277)
    assert _stage_starts(model, "params", 2, None, MPI.COMM_SELF) == [0, 3]
    assert _stage_starts(model, [0, 3], 2, None, MPI.COMM_SELF) == [0, 3]
    times = _stage_starts(model, "time", 2, torch.randn(4, 12), MPI.COMM_SELF)
    assert len(times) == 2 and 0 < times[1] < len(model)
    for bad in ([0], [1, 3], [0, 3, 3], [0, 9]):
        with pytest.raises(ValueError, match="increasing layer indices"):
            _stage_starts(model, bad, 2 if len(bad) < 3 else 3, None, MPI.COMM_SELF)


# --------------------------------------------------------------------------- under MPI

def verdict(comm, run, verify):
    """run() on every rank, the ranks agree it ran, then verify(result) -> (ok, detail) on
    every rank and the ranks agree on that: a failure on one rank never hangs the others."""
    result, exc = outcome(run)
    agree(comm, exc is None, f"{type(exc).__name__}: {exc}")
    checked, exc = outcome(verify, result)
    agree(comm, exc is None and checked[0], f"{type(exc).__name__}: {exc}" if exc else checked[1])


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_training_equals_single_process(comm, schedule, stages):
    pipe_comm = sub_pipelines(comm, stages)
    steps = 4

    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=4, schedule=schedule, comm=pipe_comm)
        losses = train_pipeline(pipe, steps)
        return pipe, losses

    def verify(result):
        pipe, losses = result
        diff = max_difference(pipe, train_single(steps))
        learns = not pipe.is_last or losses[-1] < losses[0]
        return diff < 1e-5 and learns, f"stage {pipe.stage}: max |difference| {diff:.2e}, losses {losses}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_2x2_equals_single_process_and_replicas_are_identical(comm, schedule):
    steps = 4

    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2, schedule=schedule, stages=2,
                            comm=comm)
        replica = pipe.data_comm.Get_rank()
        opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=LR), bucket_bytes=256)
        train_pipeline(pipe, steps, rows=8, replica=replica, optimizer=opt)
        return pipe

    def verify(pipe):
        diff = max_difference(pipe, train_single(steps, rows=8, replicas=2))
        identical = replicas_identical(pipe)
        return diff < 1e-5 and identical, f"stage {pipe.stage}: max |difference| {diff:.2e}, identical {identical}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_hybrid_with_int8_compression_keeps_replicas_identical_and_learns(comm):
    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2, stages=2, comm=comm)
        opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=LR),
                                         compression=hpcdl.compression.Int8())
        losses = train_pipeline(pipe, 6, rows=8, replica=0, optimizer=opt)
        return pipe, losses

    def verify(result):
        pipe, losses = result
        identical = replicas_identical(pipe)
        learns = not pipe.is_last or losses[-1] < losses[0]
        return identical and learns, f"stage {pipe.stage}: identical {identical}, losses {losses}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_1f1b_holds_at_most_stages_micro_batches_of_activations(comm):
    m = 8  # = 2P: GPipe holds all of them, 1F1B at most P - stage

    def run():
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=m, schedule=schedule)
            train_pipeline(pipe, 2, rows=16)
            peaks[schedule] = pipe.activation_stats()
        return pipe.stage, peaks

    def verify(result):
        stage, peaks = result
        ok = (peaks["1f1b"]["peak_micro_batches"] == comm.Get_size() - stage
              and peaks["gpipe"]["peak_micro_batches"] == m
              and peaks["1f1b"]["peak_bytes"] < peaks["gpipe"]["peak_bytes"]
              and peaks["1f1b"]["live_micro_batches"] == peaks["gpipe"]["live_micro_batches"] == 0)
        return ok, f"stage {stage}: {peaks}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_checkpoint_saves_and_loads_the_whole_model_and_close_ends_the_pipeline(comm):
    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2)
        train_pipeline(pipe, 2)
        state = pipe.full_state_dict()
        fresh = hvt.Pipeline(make_model(seed=7), F.cross_entropy, micro_batches=2)
        fresh.load_full_state_dict(state)
        pipe.close()
        return pipe, state, fresh

    def verify(result):
        pipe, state, fresh = result
        loaded = dict(fresh.named_parameters())
        same_stage = all(torch.equal(p, loaded[n]) for n, p in pipe.named_parameters())
        whole = True
        if pipe.stage == 0:  # the whole model, under the original model's keys
            reference = train_single(2).state_dict()
            whole = list(state) == list(reference) and all((state[k] - reference[k]).abs().max() < 1e-5
                                                           for k in reference)
        _, after_close = outcome(train_pipeline, pipe, 1)
        closed = isinstance(after_close, PipelineError) and "closed" in str(after_close)
        return same_stage and whole and closed, (f"stage {pipe.stage}: loaded equal {same_stage}, whole model "
                                                 f"{whole}, after close(): {after_close!r}")

    verdict(comm, run, verify)


def replicas_identical(pipe):
    mine = torch.cat([p.detach().view(-1) for _, p in pipe.named_parameters()])
    return all(torch.equal(mine, r) for r in pipe.data_comm.allgather(mine))


def expect_error_everywhere(comm, fn, kind, pattern):
    _, exc = outcome(fn)
    ok = isinstance(exc, kind) and re.search(pattern, str(exc)) is not None
    agree(comm, ok, f"got {type(exc).__name__}: {exc}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_stage_count_that_does_not_divide_the_ranks(comm):
    expect_error_everywhere(comm, lambda: hvt.Pipeline(make_model(), F.cross_entropy, 2, stages=3),
                            ValueError, "3 pipeline stages do not divide the 4 ranks")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_micro_batches_that_do_not_divide_the_batch(comm):
    pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=3)
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1, rows=16), PipelineError,
                            r"stage [03] of 4 failed: ValueError: 3 micro-batches do not divide the "
                            r"(inputs|targets)' batch of 16")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_stage_output_that_does_not_fit_the_next_stage(comm):
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 8), torch.nn.Linear(12, 8),
                                torch.nn.Linear(8, 5))
    pipe = hvt.Pipeline(model, F.cross_entropy, micro_batches=2)
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1), PipelineError,
                            r"stage 2 of 4 failed: ValueError: stage 2 \(layers 2\.\.2\) cannot take stage 1's "
                            r"output float32\[8, 8\]")
    # the pipeline is unusable afterwards, on every rank, without waiting on anyone
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1), PipelineError, "failed in an earlier step")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_batch_shape_changed_after_the_first_step(comm):
    pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2)
    collective(comm, train_pipeline, pipe, 1, rows=16)
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1, rows=8), PipelineError,
                            r"stage 0 of 4 failed: .*float32\[4, 12\] but was float32\[8, 12\] at the first step")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["schedule", "micro_batches"])
def test_ranks_that_disagree_on_the_schedule(comm, setting):
    odd_rank = 2 if setting == "schedule" else 1
    odd = comm.Get_rank() == odd_rank
    kwargs = {"schedule": "gpipe" if odd and setting == "schedule" else "1f1b",
              "micro_batches": 4 if odd and setting == "micro_batches" else 2}
    expect_error_everywhere(comm, lambda: hvt.Pipeline(make_model(), F.cross_entropy, **kwargs),
                            hpcdl.MismatchError, f"{setting} is .* on rank 0 but .* on rank {odd_rank}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_grid_layout(comm):
    pipe, data = pipeline_grid(comm, 2)
    rank = comm.Get_rank()
    got = (pipe.Get_rank(), pipe.Get_size(), data.Get_rank(), data.Get_size())
    agree(comm, got == (rank % 2, 2, rank // 2, 2), f"{got}")


class Widen(torch.nn.Module):
    """Appends ``extra`` copies of the first feature: a stage whose output shape the test changes."""

    def __init__(self):
        super().__init__()
        self.extra = 0

    def forward(self, x):
        return torch.cat([x] + [x[:, :1]] * self.extra, dim=1)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_stage_output_that_changes_after_the_first_step(comm):
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 8), Widen(), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 5))
    pipe = hvt.Pipeline(model, F.cross_entropy, micro_batches=2, balance=[0, 1, 3, 4])
    collective(comm, train_pipeline, pipe, 1)
    model[2].extra = 1  # stage 1 (layers 1-2) now sends float32[8, 9] where float32[8, 8] was agreed
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1), PipelineError,
                            r"stage 1 of 4 failed: ValueError: stage 1's output for micro-batch 0 is "
                            r"float32\[8, 9\], not the float32\[8, 8\] agreed at the first step")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_pipeline_messages_never_match_the_users_receives(comm):
    """The pipeline talks on a duplicate of comm: a receive of any source and tag that
    the user posted on comm stays for the user's own message."""
    rank, size = comm.Get_rank(), comm.Get_size()
    pending = comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)

    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=4, comm=comm)
        train_pipeline(pipe, 2)
        return max_difference(pipe, train_single(2))

    diff, exc = outcome(run)
    comm.send(("user", rank), dest=(rank + 1) % size, tag=7)
    got = pending.wait()
    agree(comm, exc is None and diff < 1e-5 and got == ("user", (rank - 1) % size), f"{exc!r} {diff} {got}")
