"""hpcdl.torch.Pipeline: schedules, partitioning, training equal to single-process
training, the hybrid pipeline x data grid, measured activation memory, checkpoints
and bad input: the single-process tests (tests/mpi/test_pipeline_mpi.py runs
the pipelines under mpiexec -n 4).
"""

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcdl.torch as hvt
from hpcdl.pipeline import BACKWARD, FORWARD, balanced_split, bubble_fraction, stage_actions

from helpers.pipeline import make_model, max_difference, train_pipeline, train_single


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


def test_time_balance_times_the_layers_as_the_pipeline_runs_them():
    """The model's input needs no gradient in the pipeline, so timing must not compute one for the
    first layer (a heavy first layer would be over-counted and the cut move off balance)."""
    from hpcdl.torch.pipeline import _layer_times

    class Seen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inputs_need_grad = []

        def forward(self, x):
            self.inputs_need_grad.append(x.requires_grad)
            return x

    first, later = Seen(), Seen()
    times = _layer_times([first, torch.nn.Linear(12, 8), later], torch.randn(4, 12))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert first.inputs_need_grad and not any(first.inputs_need_grad)
    assert later.inputs_need_grad and all(later.inputs_need_grad)
