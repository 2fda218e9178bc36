"""hpcdl.torch.Pipeline under mpiexec -n 4: training equal to single-process
training, the hybrid pipeline x data grid, measured activation memory,
checkpoints, and bad input that fails every rank.

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
from hpcdl.pipeline import PipelineError, pipeline_grid

from conftest import agree, collective, multi_rank, outcome, world_only
from helpers.pipeline import LR, make_model, max_difference, train_pipeline, train_single


def sub_pipelines(comm, stages):
    """Independent pipelines of ``stages`` ranks inside the 4-rank job."""
    return comm.Split(color=comm.Get_rank() // stages, key=comm.Get_rank())


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
@world_only
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
@world_only
def test_hybrid_2x2_equals_single_process_and_replicas_are_identical(comm, schedule):
    steps = 4

    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2, schedule=schedule, stages=2, comm=comm)
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
@world_only
def test_hybrid_with_int8_compression_keeps_replicas_identical_and_learns(comm):
    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2, stages=2, comm=comm)
        opt = pipe.distributed_optimizer(
            torch.optim.SGD(pipe.parameters(), lr=LR), compression=hpcdl.compression.Int8()
        )
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
@world_only
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
        ok = (
            peaks["1f1b"]["peak_micro_batches"] == comm.Get_size() - stage
            and peaks["gpipe"]["peak_micro_batches"] == m
            and peaks["1f1b"]["peak_bytes"] < peaks["gpipe"]["peak_bytes"]
            and peaks["1f1b"]["live_micro_batches"] == peaks["gpipe"]["live_micro_batches"] == 0
        )
        return ok, f"stage {stage}: {peaks}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@world_only
def test_last_step_times_report_each_actions_cpu_within_the_step(comm, schedule):
    m = 4

    def run():
        pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=m, schedule=schedule)
        train_pipeline(pipe, 2)
        return pipe.last_step_times()

    def verify(times):
        work = times["forward_cpu_s"] + times["backward_cpu_s"] + [times["other_cpu_s"]]
        # one thread's CPU cannot exceed the wall time it ran in
        ok = (
            len(times["forward_cpu_s"]) == len(times["backward_cpu_s"]) == m
            and min(work) >= 0
            and sum(work) <= times["step_s"] + 1e-3
            and 0 <= times["waited_s"] <= times["step_s"]
        )
        return ok, f"rank {comm.Get_rank()}: {times}"

    verdict(comm, run, verify)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@world_only
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
            whole = list(state) == list(reference) and all(
                (state[k] - reference[k]).abs().max() < 1e-5 for k in reference
            )
        _, after_close = outcome(train_pipeline, pipe, 1)
        closed = isinstance(after_close, PipelineError) and "closed" in str(after_close)
        return same_stage and whole and closed, (
            f"stage {pipe.stage}: loaded equal {same_stage}, whole model {whole}, after close(): {after_close!r}"
        )

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
@world_only
def test_stage_count_that_does_not_divide_the_ranks(comm):
    expect_error_everywhere(
        comm,
        lambda: hvt.Pipeline(make_model(), F.cross_entropy, 2, stages=3),
        ValueError,
        "3 pipeline stages do not divide the 4 ranks",
    )


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@world_only
def test_micro_batches_that_do_not_divide_the_batch(comm):
    pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=3)
    expect_error_everywhere(
        comm,
        lambda: train_pipeline(pipe, 1, rows=16),
        PipelineError,
        r"stage [03] of 4 failed: ValueError: 3 micro-batches do not divide the "
        r"(inputs|targets)' batch of 16",
    )


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@world_only
def test_stage_output_that_does_not_fit_the_next_stage(comm):
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Linear(16, 8), torch.nn.Linear(12, 8), torch.nn.Linear(8, 5)
    )
    pipe = hvt.Pipeline(model, F.cross_entropy, micro_batches=2)
    expect_error_everywhere(
        comm,
        lambda: train_pipeline(pipe, 1),
        PipelineError,
        r"stage 2 of 4 failed: ValueError: stage 2 \(layers 2\.\.2\) cannot take stage 1's "
        r"output float32\[8, 8\]",
    )
    # the pipeline is unusable afterwards, on every rank, without waiting on anyone
    expect_error_everywhere(comm, lambda: train_pipeline(pipe, 1), PipelineError, "failed in an earlier step")


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@world_only
def test_batch_shape_changed_after_the_first_step(comm):
    pipe = hvt.Pipeline(make_model(), F.cross_entropy, micro_batches=2)
    collective(comm, train_pipeline, pipe, 1, rows=16)
    expect_error_everywhere(
        comm,
        lambda: train_pipeline(pipe, 1, rows=8),
        PipelineError,
        r"stage 0 of 4 failed: .*float32\[4, 12\] but was float32\[8, 12\] at the first step",
    )


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["schedule", "micro_batches"])
@world_only
def test_ranks_that_disagree_on_the_schedule(comm, setting):
    odd_rank = 2 if setting == "schedule" else 1
    odd = comm.Get_rank() == odd_rank
    kwargs = {
        "schedule": "gpipe" if odd and setting == "schedule" else "1f1b",
        "micro_batches": 4 if odd and setting == "micro_batches" else 2,
    }
    expect_error_everywhere(
        comm,
        lambda: hvt.Pipeline(make_model(), F.cross_entropy, **kwargs),
        hpcdl.MismatchError,
        f"{setting} is .* on rank 0 but .* on rank {odd_rank}",
    )


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@multi_rank
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
@world_only
def test_stage_output_that_changes_after_the_first_step(comm):
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 8), torch.nn.Linear(8, 8), Widen(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 5)
    )
    pipe = hvt.Pipeline(model, F.cross_entropy, micro_batches=2, balance=[0, 1, 3, 4])
    collective(comm, train_pipeline, pipe, 1)
    model[2].extra = 1  # stage 1 (layers 1-2) now sends float32[8, 9] where float32[8, 8] was agreed
    expect_error_everywhere(
        comm,
        lambda: train_pipeline(pipe, 1),
        PipelineError,
        r"stage 1 of 4 failed: ValueError: stage 1's output for micro-batch 0 is "
        r"float32\[8, 9\], not the float32\[8, 8\] agreed at the first step",
    )


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@multi_rank
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


@pytest.mark.mpi(min_size=2)
@multi_rank
def test_time_balance_cuts_alike_on_every_rank(comm):
    """balance="time": every rank times the layers itself (different times), and the
    summed times decide the cut, so every rank must get the same cut."""
    from hpcdl.torch.pipeline import _stage_starts

    torch.manual_seed(comm.Get_rank())
    model = make_model(width=32)
    starts = collective(comm, _stage_starts, model, "time", 2, torch.randn(4, 12), comm)
    everyone = comm.allgather(starts)
    agree(comm, all(s == everyone[0] for s in everyone) and 0 < starts[1] < len(model), everyone)
