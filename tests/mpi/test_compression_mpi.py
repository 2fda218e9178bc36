"""Compressed allreduce under MPI: every rank's result against the documented error
bound, bitwise equality across ranks, and the error-feedback identity."""

import hashlib
import math

import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from hpcdl import _core
from hpcdl.compression import BF16, FP16, Int8, TopK

from conftest import agree, multi_rank, outcome
from helpers.compression import ODD_COUNTS, k_largest

WORLD = MPI.COMM_WORLD


def topk_sum_in_rank_order(inputs, codec):
    """What every rank must compute: each input's k largest, summed in rank order in float32."""
    expected = np.zeros(inputs[0].size, np.float32)
    for x in inputs:
        keep = k_largest(x, codec.k(x.size))
        expected[keep] += x[keep]
    return expected


def contribution(rank, count, scale=1.0):
    rng = np.random.default_rng(500 + rank)
    return (rng.standard_normal(count) * scale).astype(np.float32)


def digest(a):
    return hashlib.sha1(a.tobytes()).hexdigest()


def int8_ring_bound(inputs, block, size):
    """Documented bound: ((1 + 1/254)^p - 1) * sum over ranks of the absmax over
    each element's block (taken over a window of 2*block - 1, since chunk
    boundaries shift the blocks), plus float32 rounding of the sums."""
    n = inputs[0].size
    total = np.zeros(n)
    for x in inputs:
        padded = np.concatenate([np.zeros(block - 1), np.abs(x.astype(np.float64)), np.zeros(block - 1)])
        total += np.lib.stride_tricks.sliding_window_view(padded, 2 * block - 1).max(axis=1)
    return ((1 + 1 / 254) ** size - 1) * total + 4 * size * 2.0**-23 * total


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_int8_ring_within_bound_and_bitwise_identical(op):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    try:
        for chunk_bytes in (256, 1 << 20):
            hpcdl.configure(chunk_bytes=chunk_bytes)
            for count in ODD_COUNTS:
                inputs = [contribution(r, count) for r in range(size)]
                data = inputs[rank].copy()
                hpcdl.allreduce(data, op=op, compression=Int8(block=64))
                reference = np.sum([x.astype(np.float64) for x in inputs], axis=0)
                bound = int8_ring_bound(inputs, 64, size) if count else np.zeros(0)
                if op == "average":
                    reference, bound = reference / size, bound / size
                err = np.abs(data - reference)
                if not np.all(err <= bound):
                    problems.append(f"chunk {chunk_bytes} count {count}: err {err.max()} > {bound[err.argmax()]}")
                if len(set(WORLD.allgather(digest(data)))) != 1:
                    problems.append(f"chunk {chunk_bytes} count {count}: ranks differ")
    finally:
        hpcdl.configure(chunk_bytes=_core.DEFAULT_CHUNK_BYTES)
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "codec", [FP16(), BF16(), Int8(rounding="stochastic", seed=5), TopK(0.05), TopK(0.05, algorithm="split")], ids=str
)
def test_other_codecs_bitwise_identical_and_close(comm, codec):
    rank, size = comm.Get_rank(), comm.Get_size()
    rel = {"fp16": 2.0**-10, "bf16": 2.0**-7}.get(codec.name, 2 / 127)
    problems = []
    for count in ODD_COUNTS:
        inputs = [contribution(r, count) for r in range(size)]
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec, comm=comm)
        if len(set(comm.allgather(digest(data)))) != 1:
            problems.append(f"count {count}: ranks differ")
        if codec.name != "topk" and count:
            scale = np.sum([np.abs(x) for x in inputs], axis=0).max()
            err = np.abs(data - np.sum(inputs, axis=0, dtype=np.float64)).max()
            if err > size * rel * scale:
                problems.append(f"count {count}: err {err}")
    agree(comm, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_topk_allreduce_sums_every_ranks_k_largest_in_rank_order():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    for count, ratio in [(1, 0.01), (5, 0.01), (1000, 0.01), (100_003, 0.01), (4097, 1.0), (2_000_003, 0.01)]:
        inputs = [contribution(r, count) for r in range(size)]
        codec = TopK(ratio, algorithm="allgather")
        expected = topk_sum_in_rank_order(inputs, codec)
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec)
        if data.tobytes() != expected.tobytes():
            problems.append(f"count {count} ratio {ratio}: {np.count_nonzero(data != expected)} differ")
        if ratio == 1.0:
            dense = inputs[rank].copy()
            hpcdl.allreduce(dense)
            if not np.allclose(data, dense, rtol=1e-5, atol=1e-5):
                problems.append("ratio 1.0 differs from the dense result")
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [Int8(block=32), TopK(0.01), TopK(0.01, algorithm="split"), FP16()], ids=str)
@pytest.mark.parametrize("op", ["sum", "average"])
@multi_rank  # one rank sends nothing, so it compresses nothing and keeps no residual
def test_error_feedback_identity(comm, codec, op):
    """After T steps: sum of applied results (in sum units) + sum over ranks of
    residuals == sum of the true gradients, up to float rounding."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hpcdl.compression.reset_state()
    name = f"ef.{codec.name}.{op}"
    count, steps = 3001, 6
    applied = np.zeros(count, np.float64)
    true_total = np.zeros(count, np.float64)
    magnitude = 0.0
    for t in range(steps):
        grads = [contribution(r + 10 * t, count) for r in range(size)]
        true_total += np.sum(grads, axis=0, dtype=np.float64)
        magnitude += np.sum(np.abs(grads))
        g = grads[rank].copy()
        hpcdl.allreduce(g, op=op, name=name, compression=codec, comm=comm)
        applied += g.astype(np.float64) * (size if op == "average" else 1)
    residual = hpcdl.compression.residual(name, comm=comm)
    residual_sum = comm.allreduce(residual.astype(np.float64))
    gap = np.abs(applied + residual_sum - true_total).max()
    dropped = np.abs(true_total - applied).max()
    ok = gap <= 1e-5 * magnitude / count * size and dropped > 100 * gap
    hpcdl.compression.reset_state()
    gone = hpcdl.compression.residual(name, comm=comm) is None
    agree(comm, ok and gone, f"identity gap {gap}, dropped {dropped}, reset {gone}")


@pytest.mark.mpi(min_size=2)
def test_topk_large_tensor_identity_ties_and_misled_sample():
    """A tensor of 1 M values: averaged results plus residuals add up to the true
    gradients; heavy ties at the cut and a sample misled either way (its thresholds
    far too high, or far too low) still keep exactly the k largest, never more."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    codec, count = TopK(0.02, algorithm="allgather"), (1 << 20) + 77
    hpcdl.compression.reset_state()
    applied = np.zeros(count, np.float64)
    true_total = np.zeros(count, np.float64)
    for t in range(3):
        grads = [contribution(r + 10 * t, count) for r in range(size)]
        true_total += np.sum(grads, axis=0, dtype=np.float64)
        g = grads[rank].copy()
        hpcdl.allreduce(g, op="average", name="ef.large", compression=codec)
        applied += g.astype(np.float64) * size
    residual_sum = WORLD.allreduce(hpcdl.compression.residual("ef.large").astype(np.float64))
    gap = np.abs(applied + residual_sum - true_total).max()
    hpcdl.compression.reset_state()
    # Small integers: about 1/13 of all values tie at every magnitude, the cut
    # included; then large values exactly where the sample looks (every 64th
    # value is sampled here; these are every 16th of the first 65536 * 16), so
    # its threshold is far too high and the exact fallback has to find the rest.
    ties = [(((np.arange(count) * (7 + r)) % 13) - 6).astype(np.float32) for r in range(size)]
    misled = [contribution(r, count) for r in range(size)]
    for r, x in enumerate(misled):
        x[: 65536 * 16 : 16] = 1000.0 + r + np.arange(65536, dtype=np.float32) / 65536
    differ = []
    for inputs in (ties, misled):
        data = inputs[rank].copy()
        hpcdl.allreduce(data, compression=codec)
        differ.append(int(np.count_nonzero(data != topk_sum_in_rank_order(inputs, codec))))
    # The sample misled the other way (tiny values where it looks): far more
    # than 8k + 64 above its threshold, yet no rank sends more than k pairs.
    low = contribution(rank, count)
    low[: 65536 * 16 : 16] = 1e-6
    hpcdl.stats(reset=True)
    hpcdl.allreduce(low, compression=codec)
    sent = sum(row["bytes_sent"] for row in hpcdl.stats(reset=True)["allreduce"].values())
    same = len(set(WORLD.allgather(digest(low)))) == 1
    limit = (size - 1) * 8 * codec.k(count)
    agree(
        WORLD,
        gap <= 1e-4 and differ == [0, 0] and same and sent <= limit,
        f"identity gap {gap}, values differing from the k largest (ties, misled sample): {differ}, "
        f"ranks identical {same}, sent {sent} of at most {limit} bytes",
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ties", [False, True], ids=["spread", "ties"])
def test_named_topk_exact_from_the_last_cut_and_when_x_moves_away(ties):
    """A named tensor's scan starts from its last selection's cut: its results and
    residuals equal those of the exact k largest, step after step, also where x
    jumps far above that cut (1000 times the gradient: over 8k + 64 candidates)
    or falls below it (a zero gradient: fewer than k), and with ties at the cut."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    codec, count, name = TopK(0.01, algorithm="allgather"), 200_003, "ef.cut"
    k = codec.k(count)
    hpcdl.compression.reset_state()
    residuals = [np.zeros(count, np.float32) for _ in range(size)]
    problems = []
    for t, scale in enumerate([1, 1, 1.05, 1, 1000, 1000, 0, 1, 1]):
        grads = [contribution(r + 10 * t, count, scale) for r in range(size)]
        if ties:  # integers: every magnitude, the cut's included, is shared by thousands
            grads = [np.round(g * 4) for g in grads]
        xs = [g + e for g, e in zip(grads, residuals)]
        expected = topk_sum_in_rank_order(xs, codec)
        for r, x in enumerate(xs):
            residuals[r] = x.copy()
            residuals[r][k_largest(x, k)] = 0
        data = grads[rank].copy()
        hpcdl.allreduce(data, name=name, compression=codec)
        mine = hpcdl.compression.residual(name)
        if data.tobytes() != expected.tobytes() or mine.tobytes() != residuals[rank].tobytes():
            problems.append(
                f"step {t} (x{scale}): {np.count_nonzero(data != expected)} results and "
                f"{np.count_nonzero(mine != residuals[rank])} residuals differ"
            )
    hpcdl.compression.reset_state()
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_error_feedback_recovers_what_topk_dropped():
    """A constant gradient under top-k 10%: with error feedback every element is
    eventually sent; the running total tracks the truth far better than without."""
    size = WORLD.Get_size()
    hpcdl.compression.reset_state()
    count, steps = 1000, 100
    with_ef, without = np.zeros(count), np.zeros(count)
    grad = np.linspace(0.5, 1.5, count).astype(np.float32)
    for _ in range(steps):
        a, b = grad.copy(), grad.copy()
        hpcdl.allreduce(a, name="ef.constant", compression=TopK(0.1))
        hpcdl.allreduce(b, compression=TopK(0.1))
        with_ef += a
        without += b
    truth = steps * size * grad.astype(np.float64)
    err_ef, err_plain = np.abs(with_ef - truth).max(), np.abs(without - truth).max()
    hpcdl.compression.reset_state()
    agree(
        WORLD,
        err_ef < 0.2 * err_plain and hpcdl.compression.residual("ef.constant") is None,
        f"{err_ef} vs {err_plain}",
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [Int8(block=16), TopK(0.1), FP16()], ids=str)
def test_nan_and_inf_propagate_without_hanging(comm, codec):
    rank = comm.Get_rank()
    data = np.ones(1000, np.float32)
    if rank == 0:
        data[5], data[700] = np.nan, np.inf
        data[100] = 50  # make topk pick more than the specials
    hpcdl.allreduce(data, compression=codec, comm=comm)
    same = len(set(comm.allgather(digest(data)))) == 1
    agree(
        comm,
        same and not np.isfinite(data[5]) and not np.isfinite(data[700]) and np.isfinite(data[300]),
        f"{data[[5, 700, 300]]}, same {same}",
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "codec,bad",
    [
        (FP16(), 1e5),
        (FP16(), np.inf),
        (BF16(), np.nan),
        (Int8(block=16), np.inf),
        (Int8(block=512), np.nan),
        (TopK(0.1), np.inf),
        (TopK(0.002), np.nan),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_one_non_finite_step_does_not_poison_error_feedback(codec, bad, op):
    """One step where rank 0's g[3] and g[1500:1510] are non-finite (AMP's loss
    scaling makes such steps on purpose; top-k(0.002) keeps 4 of these 11): that
    step's result is non-finite at g[3], every later step with all-ones inputs
    is finite on every rank, and so is every residual. A finite value that only
    overflows the wire format (1e5 in fp16) may come out finite where its chunk's
    owner scales the average before encoding (50000.5 fits): its rounding error is
    then kept and applied at later steps, as error feedback should, so those
    places are held to finiteness only."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hpcdl.compression.reset_state()
    name = f"ef.poison.{codec}.{op}"
    count, problems = 2000, []
    carried = np.zeros(count, bool)  # places whose step-0 result came out finite from a bad input
    for step in range(4):
        g = np.ones(count, np.float32)
        if step == 0 and rank == 0:
            g[3] = g[1500:1510] = bad
        hpcdl.allreduce(g, op=op, name=name, compression=codec)
        residual = hpcdl.compression.residual(name)
        if not np.all(np.isfinite(residual)):
            problems.append(f"step {step}: {np.count_nonzero(~np.isfinite(residual))} non-finite residuals")
        if step == 0 and np.isfinite(g[3]) and not np.isfinite(bad):
            problems.append(f"step 0: g[3] = {g[3]}, the non-finite input was hidden")
        if step == 0:
            bad_places = [3, *range(1500, 1510)]
            carried[bad_places] = np.isfinite(g[bad_places])  # results are the same bits on every rank
        if step > 0 and not np.all(np.isfinite(g)):
            problems.append(f"step {step}: {np.count_nonzero(~np.isfinite(g))} non-finite results, g[3] = {g[3]}")
        rest = g[~carried]
        if step > 0 and codec.name != "topk" and not np.allclose(rest, size if op == "sum" else 1, rtol=1e-2):
            problems.append(f"step {step}: results {rest.min()}..{rest.max()}")
    hpcdl.compression.reset_state()
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@multi_rank
def test_codec_disagreement_is_a_mismatch_on_every_rank(comm):
    rank = comm.Get_rank()
    data = np.ones(100, np.float32)
    before = data.copy()
    codec = Int8(block=128) if rank == 1 else Int8()
    _, err = outcome(hpcdl.allreduce, data, name="mismatched.codec", compression=codec, comm=comm)
    message = str(err)
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "compression differs" in message
        and "int8(block=128) on rank 1" in message
        and np.array_equal(data, before)
    )
    _, err2 = outcome(
        hpcdl.allreduce, data.copy(), name="codec.vs.none", compression=None if rank == 0 else FP16(), comm=comm
    )
    ok2 = isinstance(err2, hpcdl.MismatchError) and "none on rank 0" in str(err2)
    agree(comm, ok and ok2, f"{err!r} / {err2!r}")


@pytest.mark.mpi(min_size=2)
@multi_rank
def test_stats_measure_compressed_bytes_exactly(comm):
    size = comm.Get_size()
    n, block = 100_003, 256
    hpcdl.stats(reset=True)
    hpcdl.allreduce(np.ones(n, np.float32), compression=Int8(block=block), comm=comm)
    hpcdl.allreduce(np.ones(n, np.float32), compression=TopK(0.01, algorithm="allgather"), comm=comm)
    hpcdl.allreduce(np.ones(n, np.float32), comm=comm)
    rows = hpcdl.stats()["allreduce"]
    int8, topk, dense = rows["int8(block=256)"], rows["topk(ratio=0.01,algorithm=allgather)"], rows["none"]
    seg_lens = [n // size + (1 if s < n % size else 0) for s in range(size)]  # one chunk per segment here
    expected_int8 = 2 * (size - 1) * sum(math.ceil(s / block) * 4 + s for s in seg_lens)
    expected_topk = size * (size - 1) * 8 * TopK(0.01).k(n)
    totals = {k: comm.allreduce(r["bytes_sent"]) for k, r in (("int8", int8), ("topk", topk))}
    ok = (
        totals["int8"] == expected_int8
        and totals["topk"] == expected_topk
        and int8["dense_bytes"] == dense["bytes_sent"] == topk["dense_bytes"]
        and int8["dense_bytes"] / int8["bytes_sent"] > 3.9
        and int8["ops"] == 1
        and int8["seconds"] > 0
    )
    agree(comm, ok, f"{rows}, totals {totals} vs {expected_int8}, {expected_topk}")


@pytest.mark.mpi(min_size=2)
def test_set_residual_is_added_by_the_next_allreduce_also_before_the_communicators_first_operation():
    """Each rank sets its residual (rank + 1 everywhere), on a communicator used before and on a
    fresh Dup (held until its first operation makes its context); a TopK that keeps every value
    then returns sum(rank + 1) for zero data, and leaves the residual zero. A Dup freed with a
    held residual it never used frees it."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hpcdl.barrier(WORLD)
    fresh, unused = WORLD.Dup(), WORLD.Dup()
    try:
        results = []
        for comm in (WORLD, fresh):
            hpcdl.compression.set_residual("set.res", np.full(37, rank + 1.0, np.float32), comm)
            out = hpcdl.allreduce(np.zeros(37, np.float32), comm=comm, name="set.res", compression=TopK(1.0))
            left = hpcdl.compression.residual("set.res", comm)
            results.append(np.array_equal(out, np.full(37, size * (size + 1) / 2, np.float32)) and not left.any())
        hpcdl.compression.set_residual("never.run", np.ones(5, np.float32), unused)
        _, wrong = outcome(hpcdl.compression.set_residual, "bad", np.ones((2, 2), np.float32))
    finally:
        fresh.Free()
        unused.Free()
    agree(WORLD, results == [True, True] and isinstance(wrong, ValueError), f"{results}, 2-D: {wrong!r}")


@pytest.mark.mpi(min_size=2)
def test_free_residual_and_residual_memory():
    """300 uniquely named 1 MiB tensors, each freed after its step: the residuals'
    memory stays at one tensor's instead of growing by 1 MiB per name."""
    hpcdl.compression.reset_state()
    count = 1 << 18  # 1 MiB of float32
    g = contribution(WORLD.Get_rank(), count)
    peak, freed_all = 0, True
    for i in range(300):
        name = f"unique.{i}"
        hpcdl.allreduce(g.copy(), name=name, compression=Int8())
        peak = max(peak, hpcdl.compression.residual_memory())
        freed_all = freed_all and hpcdl.compression.free_residual(name) and hpcdl.compression.residual(name) is None
    left = hpcdl.compression.residual_memory()
    again = hpcdl.compression.free_residual("unique.0")
    agree(
        WORLD,
        peak == 4 * count and freed_all and left == 0 and again is False,
        f"peak {peak} bytes, every one freed {freed_all}, left {left}, freed twice {again}",
    )
