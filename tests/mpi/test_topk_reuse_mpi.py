"""Top-k's threshold reuse (TopK(ratio, reuse_steps=N), docs/compression.md
"Threshold reuse") through both allreduces: each rank's pairs, the result and
the residuals against a float32/float64 reference of the documented rules over
several steps in which ranks send different counts (and fall back to an exact
selection at different steps), bitwise identity across ranks, on the world and
on sub-communicators."""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from hpcdl.compression import TopK

from conftest import agree
from helpers.compression import topk_reuse_select

WORLD = MPI.COMM_WORLD
REUSE_STEPS, STEPS, COUNT = 3, 8, 20_011


def step_reference(xs, k, states, algorithm, scale):
    """One allreduce as documented: each rank sends its pairs (topk_reuse_select),
    scaled in float32; the allgather returns their float32 sums in rank order,
    the split the k largest magnitudes of those sums (lower index wins ties).
    A rank's residual is x without its own pairs that made it into the result.
    Returns (result, residuals, states, counts, float64 sums and magnitude sums)."""
    n = xs[0].size
    sums, sums64, abs64 = np.zeros(n, np.float32), np.zeros(n, np.float64), np.zeros(n, np.float64)
    sent, new_states = [], []
    for x, state in zip(xs, states):
        idx, state = topk_reuse_select(x, k, REUSE_STEPS, state)
        sums[idx] += x[idx] * np.float32(scale)
        sums64[idx] += x[idx].astype(np.float64) * scale
        abs64[idx] += np.abs(x[idx].astype(np.float64)) * scale
        sent.append(idx)
        new_states.append(state)
    candidates = np.unique(np.concatenate(sent))
    if algorithm == "split":
        order = np.lexsort((candidates, -np.abs(sums[candidates])))
        selected = np.sort(candidates[order[:k]])
    else:
        selected = candidates
    result = np.zeros(n, np.float32)
    result[selected] = sums[selected]
    residuals = []
    for x, idx in zip(xs, sent):
        r = x.copy()
        r[np.intersect1d(idx, selected)] = 0
        residuals.append(r)
    return result, residuals, new_states, [idx.size for idx in sent], (sums64, abs64, selected)


def scale_of(rank, step, size):
    """x's scale: rank 1 grows 10x at step 3 (its threshold would send over 2k),
    rank 2 (0 on two ranks) shrinks 10x at step 5 (under k/2): each selects
    exactly that step while the others reuse theirs."""
    if step == 3 and rank == 1:
        return 10.0
    if step == 5 and rank == 2 % size:
        return 0.1
    return 1.0


def run_steps(comm, algorithm, op, name):
    """STEPS allreduces of one named tensor; problems on this rank ('' each when right)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    codec = TopK(0.01, algorithm=algorithm, reuse_steps=REUSE_STEPS)
    k, scale = codec.k(COUNT), (1 / size if op == "average" else 1.0)
    residuals = [np.zeros(COUNT, np.float32) for _ in range(size)]
    states, counts_seen, problems = [None] * size, [], []
    hpcdl.compression.free_residual(name, comm)
    for step in range(STEPS):
        # data = z - residual, so x = data + residual is about scale x z on every rank and step:
        # counts near k except where scale_of changes it (as the gradients of steady training).
        datas = []
        for r in range(size):
            z = np.random.default_rng(1000 * step + r).standard_normal(COUNT).astype(np.float32)
            datas.append((np.float32(scale_of(r, step, size)) * z) - residuals[r])
        xs = [d + res for d, res in zip(datas, residuals)]
        expected, residuals, states, counts, (sums64, abs64, selected) = step_reference(xs, k, states, algorithm, scale)
        counts_seen.append(counts)
        data = datas[rank].copy()
        hpcdl.allreduce(data, op=op, name=name, compression=codec, comm=comm)
        if data.tobytes() != expected.tobytes():
            problems.append(f"step {step}: {np.count_nonzero(data != expected)} values differ from the reference")
        bound = 2 * size * 2.0**-23 * abs64[selected] + 1e-30
        if np.any(np.abs(data[selected].astype(np.float64) - sums64[selected]) > bound):
            problems.append(f"step {step}: values off their float64 sums")
        mine = hpcdl.compression.residual(name, comm)
        if mine is None or mine.tobytes() != residuals[rank].tobytes():
            problems.append(f"step {step}: residual differs from the reference")
        if len(set(comm.allgather(hashlib.sha1(data.tobytes()).hexdigest()))) != 1:
            problems.append(f"step {step}: ranks differ")
    hpcdl.compression.free_residual(name, comm)
    # The steps exercise what they are for: reused thresholds with counts that differ
    # between ranks and steps, and the exact selections the bounds force.
    reused = [c for step, cs in enumerate(counts_seen) for c in cs if step % (REUSE_STEPS + 1)]
    if not (any(c != k for c in reused) and len({tuple(cs) for cs in counts_seen[1:3]}) > 1):
        problems.append(f"counts never varied: {counts_seen}")
    if size > 1 and not (counts_seen[3][1] == k and counts_seen[5][2 % size] == k):
        problems.append(f"the bounds did not force exact selections: {counts_seen}")
    return problems


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["allgather", "split"])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_reuse_matches_the_reference_and_is_identical_on_every_rank(algorithm, op):
    problems = run_steps(WORLD, algorithm, op, f"reuse.{algorithm}.{op}")
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["allgather", "split"])
def test_reuse_on_sub_communicators(algorithm):
    """Halves of the world (the last may hold one rank: no exchange there) and a Dup."""
    rank = WORLD.Get_rank()
    half = WORLD.Split(rank % 2, rank)
    dup = WORLD.Dup()
    problems = []
    if half.Get_size() > 1:
        problems += run_steps(half, algorithm, "average", f"reuse.half.{algorithm}")
    problems += run_steps(dup, algorithm, "sum", f"reuse.dup.{algorithm}")
    half.Free()
    dup.Free()
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["allgather", "split"])
def test_reuse_without_a_name_selects_exactly(algorithm):
    """No name, no state: every call selects the exact k, as TopK without reuse does."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    xs = [np.random.default_rng(50 + r).standard_normal(COUNT).astype(np.float32) for r in range(size)]
    problems = []
    for _ in range(2):
        plain, reuse = xs[rank].copy(), xs[rank].copy()
        hpcdl.allreduce(plain, compression=TopK(0.01, algorithm=algorithm))
        hpcdl.allreduce(reuse, compression=TopK(0.01, algorithm=algorithm, reuse_steps=REUSE_STEPS))
        if plain.tobytes() != reuse.tobytes():
            problems.append(f"{np.count_nonzero(plain != reuse)} values differ")
    agree(WORLD, not problems, problems)
