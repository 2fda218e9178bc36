"""Top-k's split allreduce (include/hpcdl/algorithms/sparse_allreduce.hpp): its result and
residuals against a reference of the documented semantics, bitwise identity
across ranks, on the world and on sub-communicators, and its bytes per rank
flat in p. Run under 4 ranks and, by scripts/test.sh, under 3 and 5."""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from hpcdl.compression import TopK

from conftest import agree, collective
from helpers.compression import k_largest

WORLD = MPI.COMM_WORLD


def split_reference(inputs, k, scale):
    """The documented result, computed the way the core rounds: each rank's k
    largest scaled in float32, summed in rank order in float32, then the k
    largest magnitudes of those sums (among the indices some rank sent; lower
    indices win ties). Returns (result, selected indices, the float64 sums and
    sums of magnitudes)."""
    n = inputs[0].size
    sums, sums64, abs64 = np.zeros(n, np.float32), np.zeros(n, np.float64), np.zeros(n, np.float64)
    sent = np.zeros(n, bool)
    for x in inputs:
        keep = k_largest(x, k)
        sums[keep] += x[keep] * np.float32(scale)
        sums64[keep] += x[keep].astype(np.float64) * scale
        abs64[keep] += np.abs(x[keep].astype(np.float64)) * scale
        sent[keep] = True
    candidates = np.flatnonzero(sent)
    order = np.lexsort((candidates, -np.abs(sums[candidates])))
    selected = np.sort(candidates[order[:k]])
    result = np.zeros(n, np.float32)
    result[selected] = sums[selected]
    return result, selected, (sums64, abs64)


def digest(a):
    return hashlib.sha1(a.tobytes()).hexdigest()


def integers(rank, count, seed=0):
    """Small integers: float32 sums are exact, and magnitudes tie everywhere."""
    rng = np.random.default_rng(700 + 31 * seed + rank)
    return rng.integers(-300, 300, count).astype(np.float32)


def normal(rank, count, seed=0):
    rng = np.random.default_rng(900 + 31 * seed + rank)
    return rng.standard_normal(count).astype(np.float32)


def check_split(comm, count, ratio, op, make):
    """One split allreduce on comm; '' when it matches the reference on this rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    codec = TopK(ratio, algorithm="split")
    inputs = [make(r, count) for r in range(size)]
    scale = 1 / size if op == "average" else 1.0
    expected, selected, (sums64, abs64) = split_reference(inputs, codec.k(count), scale)
    data = inputs[rank].copy()
    hpcdl.allreduce(data, op=op, comm=comm, compression=codec)
    problems = []
    if data.tobytes() != expected.tobytes():
        problems.append(f"{np.count_nonzero(data != expected)} values differ from the reference")
    # Against float64: every value is its float64 sum up to float32 rounding (p products, p sums).
    bound = 2 * size * 2.0**-23 * abs64[selected] + 1e-30
    if np.any(np.abs(data[selected] - sums64[selected]) > bound):
        problems.append("selected values off their float64 sums")
    if len(set(comm.allgather(digest(data)))) != 1:
        problems.append("ranks differ")
    return f"count {count} ratio {ratio} {op} p={size}: {problems}" if problems else ""


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_split_matches_reference_and_is_identical_on_every_rank(op):
    problems = []
    for count, ratio in [
        (1, 0.5),
        (2, 0.5),
        (3, 1.0),
        (7, 0.3),
        (1000, 0.01),
        (4097, 0.05),
        (100_003, 0.01),
        (300_001, 0.001),
    ]:
        for make in (integers, normal):
            problems.append(check_split(WORLD, count, ratio, op, make))
    problems = [p for p in problems if p]
    agree(WORLD, not problems, problems)


def own_window(rank, count, size=WORLD.Get_size()):
    """Normal values in this rank's p-th of the index space, zeros elsewhere: its
    pairs fall in (about) its own range, so most pairwise blocks are empty."""
    x = np.zeros(count, np.float32)
    lo, hi = rank * count // size, (rank + 1) * count // size
    x[lo:hi] = normal(rank, hi - lo, seed=3)
    return x


@pytest.mark.mpi(min_size=2)
def test_split_with_empty_blocks_between_ranks():
    """The pairwise exchange sends no message for an empty block; the sums stay in rank order."""
    problems = [
        check_split(WORLD, count, 0.01, op, own_window) for count in (10_000, 65_537) for op in ("sum", "average")
    ]
    problems = [p for p in problems if p]
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sub_size", [2, 3])
def test_split_on_sub_communicators(sub_size):
    """Groups of 2 and 3 ranks (the last group may be smaller), each on its own communicator."""
    rank = WORLD.Get_rank()
    sub = WORLD.Split(rank // sub_size, rank)
    problems = []
    if sub.Get_size() > 1:
        for count, ratio in [(5, 0.4), (10_007, 0.02)]:
            problems.append(check_split(sub, count, ratio, "average", normal))
            problems.append(check_split(sub, count, ratio, "sum", integers))
    sub.Free()
    problems = [p for p in problems if p]
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_split_residual_keeps_exactly_what_the_global_selection_dropped():
    """Per rank and step: x = gradient + residual; the new residual is x with
    zeros exactly where this rank's own pair made it into the result, so
    residual + what was applied of this rank's contribution = x."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    codec, count, name = TopK(0.02, algorithm="split"), 20_011, "split.ef"
    k = codec.k(count)
    hpcdl.compression.reset_state()
    residuals = [np.zeros(count, np.float32) for _ in range(size)]
    problems = []
    for step in range(4):
        xs = [normal(r, count, seed=step) + residuals[r] for r in range(size)]
        expected, selected, _ = split_reference(xs, k, 1 / size)
        for r, x in enumerate(xs):
            residuals[r] = x.copy()
            residuals[r][np.intersect1d(k_largest(x, k), selected)] = 0
        g = normal(rank, count, seed=step)
        hpcdl.allreduce(g, op="average", name=name, compression=codec)
        mine = hpcdl.compression.residual(name)
        if g.tobytes() != expected.tobytes():
            problems.append(f"step {step}: result differs in {np.count_nonzero(g != expected)}")
        if mine.tobytes() != residuals[rank].tobytes():
            problems.append(f"step {step}: residual differs in {np.count_nonzero(mine != residuals[rank])}")
        # The rank's part of the applied result plus its residual is its x.
        own = np.intersect1d(k_largest(xs[rank], k), selected)
        applied_own = np.zeros(count, np.float32)
        applied_own[own] = xs[rank][own]
        if not np.array_equal(applied_own + mine, xs[rank]):
            problems.append(f"step {step}: residual + applied != x")
    hpcdl.compression.reset_state()
    agree(WORLD, not problems, problems)


def skewed(rank, count):
    """Large values only in the first twentieth of the indices: ranges of equal
    length would send every pair to rank 0."""
    x = normal(rank, count)
    x[: count // 20] *= 1000
    return x


def received_per_rank(comm, codec, count, make=normal):
    """Bytes this rank received in one allreduce of count values (hpcdl.stats)."""
    data = make(comm.Get_rank(), count)
    hpcdl.stats(reset=True)
    hpcdl.allreduce(data, comm=comm, compression=codec)
    rows = hpcdl.stats(reset=True)["allreduce"]
    return rows[str(codec)]["bytes_received"]


@pytest.mark.mpi(min_size=3)
def test_split_bytes_per_rank_flat_in_p_and_auto_runs_the_models_choice():
    """The split: every rank receives at most 2x the p = 2 figure of the
    allgather (8k), with every large value in a twentieth of the indices too
    (the ranges follow the pairs), while the allgather receives (p - 1) 8k.
    auto receives the bytes of the algorithm TopK.algorithm_for names."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    count, ratio = 1_000_003, 0.01
    k = TopK(ratio).k(count)
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)

    def measure():
        two = received_per_rank(pair, TopK(ratio, algorithm="allgather"), count) if pair != MPI.COMM_NULL else None
        return (
            two,
            received_per_rank(WORLD, TopK(ratio), count),
            received_per_rank(WORLD, TopK(ratio, algorithm="allgather"), count),
            received_per_rank(WORLD, TopK(ratio, algorithm="split"), count),
            received_per_rank(WORLD, TopK(ratio, algorithm="split"), count, skewed),
        )

    two, auto, allgather, split, skew = collective(WORLD, measure)
    if pair != MPI.COMM_NULL:
        pair.Free()
    p2 = WORLD.bcast(two, root=0)
    chosen = TopK(ratio).algorithm_for(size, count)
    ok = (
        p2 == 8 * k
        and allgather == (size - 1) * 8 * k
        and split <= 2 * p2
        and skew <= 2 * p2
        and auto == {"split": split, "allgather": allgather}[chosen]
    )
    agree(
        WORLD,
        ok,
        f"p=2 {p2} (8k = {8 * k}), p={size}: auto ({chosen}) {auto}, allgather {allgather}, split {split}, "
        f"skewed split {skew}",
    )


@pytest.mark.mpi(min_size=2)
def test_split_nan_propagates_and_identical():
    rank = WORLD.Get_rank()
    data = np.ones(1000, np.float32)
    if rank == 0:
        data[5], data[700] = np.nan, np.inf
        data[100] = 50
    hpcdl.allreduce(data, compression=TopK(0.1, algorithm="split"))
    same = len(set(WORLD.allgather(digest(data)))) == 1
    agree(
        WORLD,
        same and np.isnan(data[5]) and np.isinf(data[700]) and np.count_nonzero(data) == 100,
        f"{data[[5, 700, 100]]}, non-zeros {np.count_nonzero(data)}, same {same}",
    )
