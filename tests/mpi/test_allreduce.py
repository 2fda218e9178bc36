"""Ring allreduce, broadcast and barrier under MPI (run with 3, 4 and 5 ranks).

A test that takes `comm` runs over COMM_SELF, COMM_WORLD and a Dup() of it
(`multi_rank`: the last two); the others exercise the world itself (its
report tree, stalls, sub-communicators split from it).

Every result is checked against a float64 reference and for bitwise equality
across ranks; ranks agree on the verdict before asserting (tests/conftest.py).
"""

import array
import gc
import hashlib
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import hpcdl

from conftest import agree, collective, multi_rank, outcome, stall_limits
from helpers import report_tree

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
COUNTS = [0, 1, 2, 3, 5, 7, 64, 1000, 4097, 65537]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
FLOATS = ("float32", "float64", "float16", "bfloat16")
NUMERIC = [d for d in hpcdl.DTYPES if d != "bool"]
OPS = ["min", "max", "product"]


def np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def contribution(rank, count, dtype, op="sum"):
    """Rank r's data: deterministic, so any rank can compute every rank's input.
    A product's floats lie in +-[0.5, 2] (no underflow), its integers in [-3, 5]
    (int8 and uint8 still wrap over 4 or 5 ranks)."""
    rng = np.random.default_rng(1000 + rank)
    if dtype == "bool":
        return rng.random(count) < 0.8
    if dtype not in FLOATS:
        info = np.iinfo(dtype)
        low, high = (-3, 6) if op == "product" else (-1000, 1000)
        return rng.integers(max(info.min, low), min(info.max, high), count).astype(dtype)
    if op == "product":
        return (rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)).astype(np_dtype(dtype))
    return rng.standard_normal(count).astype(np_dtype(dtype))


def digest(a):
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def tolerance(dtype, size, reference_abs):
    eps = {"float32": 2.0**-23, "float64": 2.0**-52, "float16": 2.0**-10, "bfloat16": 2.0**-7}
    # one rounding per hop, each bounded by eps times the running partial result
    return 2 * size * eps[dtype] * reference_abs + 1e-30


def exact_reference(inputs, dtype, op, size):
    """Integers and bool: numpy's result in the dtype itself (it wraps like the core)."""
    stack = np.stack(inputs)
    if op in ("sum", "average"):
        total = np.add.reduce(stack, axis=0, dtype=dtype)
        return np.floor_divide(total, np.array(size, dtype=dtype)) if op == "average" else total
    ufunc = {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    return ufunc.reduce(stack, axis=0, dtype=dtype)


def check_allreduce(comm, count, dtype, op):
    size = comm.Get_size()
    data = contribution(comm.Get_rank(), count, dtype, op)
    inputs = [contribution(r, count, dtype, op) for r in range(size)]
    out = hpcdl.allreduce(data, op=op, comm=comm)
    if dtype not in FLOATS:
        expected = exact_reference(inputs, dtype, op, size)
        ok = out is data and data.tobytes() == expected.tobytes()
        detail = f"{np.count_nonzero(data != expected)} of {count} differ"
    else:
        wide = np.stack([a.astype(np.float64) for a in inputs])
        if op in ("min", "max"):  # exact: the result is one of the inputs
            reference = getattr(np, op)(wide, axis=0)
            tol = np.zeros(count)
        else:
            reference = np.prod(wide, axis=0) if op == "product" else np.sum(wide, axis=0)
            reference_abs = np.abs(reference) if op == "product" else np.sum(np.abs(wide), axis=0)
            if op == "average":
                reference, reference_abs = reference / size, reference_abs / size
            tol = tolerance(dtype, size, reference_abs)
        err = np.abs(data.astype(np.float64) - reference)
        ok = bool(np.all(err <= tol)) and out is data
        detail = f"in place: {out is data}, max err {err.max() if count else 0}"
    digests = comm.allgather(digest(data))
    same = len(set(digests)) == 1
    return ok and same, "" if ok and same else f"{detail}, bitwise same: {same}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_sum_all_counts_and_dtypes(comm, dtype):
    problems = []
    for count in COUNTS:
        ok, detail = check_allreduce(comm, count, dtype, "sum")
        if not ok:
            problems.append(f"count {count}: {detail}")
    agree(comm, not problems, problems)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_allreduce_average(comm, dtype):
    problems = []
    for count in (1, 7, 4097):
        ok, detail = check_allreduce(comm, count, dtype, "average")
        if not ok:
            problems.append(f"count {count}: {detail}")
    agree(comm, not problems, problems)


@pytest.mark.parametrize(
    "dtype, op",
    [(d, op) for d in NUMERIC for op in OPS]
    + [(d, op) for d in NUMERIC if d not in FLOATS for op in ("sum", "average")],
)
def test_every_op_on_every_numeric_dtype(comm, dtype, op):
    """Min, max, product on every type; the integers' sum and floor-divided average:
    float64 references for floats, numpy's own wrapping arithmetic for integers."""
    problems = []
    for count in (0, 1, 7, 4097):
        ok, detail = check_allreduce(comm, count, dtype, op)
        if not ok:
            problems.append(f"count {count}: {detail}")
    agree(comm, not problems, problems)


@pytest.mark.parametrize("op", OPS)
def test_bool_min_max_product_are_and_or_and(comm, op):
    ok, detail = check_allreduce(comm, 1001, "bool", op)
    agree(comm, ok, detail)


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_wins_min_and_max(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    results = []
    for op in ("min", "max"):
        a = np.arange(6).astype(np_dtype(dtype))
        if rank == size - 1:
            a[2] = np.nan
        hpcdl.allreduce(a, op=op, comm=comm)
        results.append(a.astype(np.float64))
    ok = all(np.isnan(r[2]) and np.array_equal(np.delete(r, 2), [0, 1, 3, 4, 5]) for r in results)
    agree(comm, ok, results)


@pytest.mark.parametrize("sub_size", [2, 3])
def test_reduction_ops_on_sub_communicators(sub_size):
    rank = WORLD.Get_rank()
    sub = WORLD.Split(rank // sub_size, rank)
    problems = []
    for dtype in ("float32", "bfloat16", "int8", "uint64"):
        for op in OPS + ["average"]:
            ok, detail = check_allreduce(sub, 1001, dtype, op)
            if not ok:
                problems.append(f"{dtype} {op}: {detail}")
    sub.Free()
    agree(WORLD, not problems, problems)


@multi_rank
def test_mismatched_op_names_both_ops(comm):
    rank = comm.Get_rank()
    _, err = outcome(
        hpcdl.allreduce,
        np.ones(8, dtype=np.int16),
        op="max" if rank == 0 else "product",
        name="mismatched.minmax",
        comm=comm,
    )
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "op differs: max on rank 0" in str(err)
        and "product on rank" in str(err)
    )
    agree(comm, ok, repr(err))


GROUP = [
    ("float32", (1001,)),
    ("float16", (3, 7)),
    ("int64", (5,)),
    ("bfloat16", (65, 63)),
    ("uint8", (0,)),
    ("float64", (2, 2, 2)),
]


def group_of(rank, op):
    return [contribution(rank, int(np.prod(shape)), dtype, op).reshape(shape) for dtype, shape in GROUP]


@pytest.mark.parametrize("op", ["sum", "average", "max", "product"])
def test_grouped_allreduce_is_bitwise_each_arrays_own_allreduce(comm, op):
    """One operation for the group (one agreement, counted once), each array's result
    bitwise what its own allreduce gives; the integers against numpy's exact result."""
    rank, size = comm.Get_rank(), comm.Get_size()
    grouped, alone = group_of(rank, op), group_of(rank, op)
    hpcdl.stats(reset=True)
    results = collective(comm, lambda: hpcdl.grouped_allreduce(grouped, op=op, comm=comm, name="group"))
    counted = hpcdl.stats(reset=True)
    for i, a in enumerate(alone):
        collective(comm, lambda: hpcdl.allreduce(a, op=op, comm=comm, name=f"alone.{i}"))
    exact = exact_reference([group_of(r, op)[2] for r in range(size)], "int64", op, size)
    ok = (
        all(r is g for r, g in zip(results, grouped))
        and [g.shape for g in grouped] == [s for _, s in GROUP]
        and all(g.tobytes() == a.tobytes() for g, a in zip(grouped, alone))
        and np.array_equal(grouped[2], exact)
        and len(set(comm.allgather(digest(grouped[0])))) == 1
        and counted["grouped_allreduce"]["none"]["ops"] == 1
        and "allreduce" not in counted
    )
    agree(comm, ok, f"{[g.ravel()[:2] for g in grouped]} {[a.ravel()[:2] for a in alone]} {counted}")


@multi_rank
def test_grouped_allreduce_of_mismatched_arrays_raises_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays = [np.ones((4, 6), dtype=np.float32), np.ones(3, dtype=np.int32)]
    if rank == size - 1:
        arrays[0] = arrays[0].reshape(24)
    before = [a.copy() for a in arrays]
    _, err = outcome(hpcdl.grouped_allreduce, arrays, comm=comm, name="group.mismatch")
    message = str(err)
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "arrays differ" in message
        and f"(float32[24], int32[3]) on rank {size - 1}" in message
        and "(float32[4, 6], int32[3]) on rank" in message
        and all(np.array_equal(a, b) for a, b in zip(arrays, before))
    )
    _, fewer = outcome(hpcdl.grouped_allreduce, arrays[: 1 + (rank == 0)], comm=comm, name="group.fewer")
    ok2 = isinstance(fewer, hpcdl.MismatchError) and "arrays differ" in str(fewer)
    agree(comm, ok and ok2, f"{err!r} / {fewer!r}")


def test_grouped_allreduce_bad_input_is_refused_before_any_communication():
    _, bool_sum = outcome(hpcdl.grouped_allreduce, [np.ones(3, np.float32), np.ones(2, bool)])
    _, read_only = outcome(hpcdl.grouped_allreduce, [np.ones(3, np.float32), b"\x00" * 8])
    ok = (
        isinstance(bool_sum, ValueError)
        and "op='sum' does not reduce bool" in str(bool_sum)
        and isinstance(read_only, ValueError)
        and "read-only" in str(read_only)
        and hpcdl.grouped_allreduce([]) == []
    )
    agree(WORLD, ok, f"{bool_sum!r} / {read_only!r}")


@pytest.mark.parametrize("sub_size", [2, 3])
def test_grouped_allreduce_on_sub_communicators(sub_size):
    rank = WORLD.Get_rank()
    sub = WORLD.Split(rank // sub_size, rank)
    grouped, alone = group_of(sub.Get_rank(), "min"), group_of(sub.Get_rank(), "min")
    hpcdl.grouped_allreduce(grouped, op="min", comm=sub)
    for a in alone:
        hpcdl.allreduce(a, op="min", comm=sub)
    ok = all(g.tobytes() == a.tobytes() for g, a in zip(grouped, alone))
    sub.Free()
    agree(WORLD, ok, "grouped min differs from the arrays' own")


@pytest.mark.parametrize("sub_size", [2, 3])
def test_allreduce_on_sub_communicators(sub_size):
    """Rings of 2 and 3 ranks inside the world, each group on its own communicator."""
    rank = WORLD.Get_rank()
    color = rank // sub_size
    sub = WORLD.Split(color, rank)
    problems = []
    for dtype in ("float32", "float16", "int64"):
        for count in (0, 1, sub.Get_size() - 1, 1001):
            ok, detail = check_allreduce(sub, count, dtype, "sum")
            if not ok:
                problems.append(f"{dtype} count {count}: {detail}")
    sub.Free()
    agree(WORLD, not problems, problems)


def test_many_chunks_and_tiny_chunks():
    """Many pipeline chunks per segment, including empty chunks, stay exact."""
    problems = []
    try:
        for chunk_bytes in (64, 4096, 1 << 16):
            hpcdl.configure(chunk_bytes=chunk_bytes)
            for count in (3, 33, 300_001):
                ok, detail = check_allreduce(WORLD, count, "float32", "sum")
                if not ok:
                    problems.append(f"chunk {chunk_bytes} count {count}: {detail}")
    finally:
        hpcdl.configure(chunk_bytes=hpcdl._core.DEFAULT_CHUNK_BYTES)
    agree(WORLD, not problems, problems)


def test_two_rank_half_precision_matches_numpy_bitwise():
    """With 2 ranks each element is one fp32 add rounded once: exactly numpy's result."""
    rank = WORLD.Get_rank()
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    ok, detail = True, ""
    if pair != MPI.COMM_NULL:
        for dtype in ("float16", "bfloat16"):
            a = contribution(pair.Get_rank(), 5001, dtype)
            both = [contribution(r, 5001, dtype) for r in range(2)]
            expected = (both[0].astype(np.float32) + both[1].astype(np.float32)).astype(np_dtype(dtype))
            hpcdl.allreduce(a, comm=pair)
            if a.tobytes() != expected.tobytes():
                ok, detail = False, f"{dtype}: {np.count_nonzero(a != expected)} elements differ from numpy"
        pair.Free()
    agree(WORLD, ok, detail)


def test_bfloat16_uint16_view_equals_ml_dtypes(comm):
    a = contribution(comm.Get_rank(), 999, "bfloat16")
    b = a.copy().view(np.uint16)
    hpcdl.allreduce(a, comm=comm)
    hpcdl.allreduce(b, dtype="bfloat16", comm=comm)
    agree(comm, a.view(np.uint16).tobytes() == b.tobytes(), "uint16 view result differs")


def test_named_ops_submitted_in_different_orders(comm):
    """Autograd hooks fire in any order: named ops still pair up correctly."""
    rank, size = comm.Get_rank(), comm.Get_size()
    names = [f"grad.{i}" for i in range(12)]
    order = np.random.default_rng(rank).permutation(len(names))
    arrays = {n: np.full(100 + i, float(rank + i), dtype=np.float32) for i, n in enumerate(names)}
    handles = [hpcdl.allreduce_async(arrays[names[i]], name=names[i], comm=comm) for i in order]
    collective(comm, lambda: [h.wait() for h in handles])
    bad = [n for i, n in enumerate(names) if not np.all(arrays[n] == sum(r + i for r in range(size)))]
    agree(comm, not bad, f"wrong results for {bad}")


def test_ops_agreed_while_a_ring_runs():
    """Operations submitted while a large ring moves its data are agreed during its
    waits and run after it: right results in any submission order, and a mismatch
    among them still fails on every rank."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    big = np.full(4 << 20, float(rank), dtype=np.float32)
    first = hpcdl.allreduce_async(big, name="during.big")
    names = [f"during.{i}" for i in range(8)]
    order = np.random.default_rng(rank).permutation(len(names))
    arrays = {n: np.full(1000 + i, float(rank * i), dtype=np.float64) for i, n in enumerate(names)}
    handles = [hpcdl.allreduce_async(arrays[names[i]], name=names[i]) for i in order]
    odd = np.ones(10 + (rank == size - 1), dtype=np.float32)
    _, mismatch = outcome(hpcdl.allreduce_async(odd, name="during.odd").wait)
    collective(WORLD, lambda: [h.wait() for h in [first, *handles]])
    bad = [n for i, n in enumerate(names) if not np.all(arrays[n] == sum(r * i for r in range(size)))]
    big_ok = bool(np.all(big == sum(range(size))))
    agree(
        WORLD,
        not bad and big_ok and isinstance(mismatch, hpcdl.MismatchError),
        f"wrong results for {bad}, big ring right: {big_ok}, mismatch raised: {mismatch!r}",
    )


def test_async_handle_done_and_wait_return_buffer(comm):
    a = np.ones(10_000, dtype=np.float64)
    h = hpcdl.allreduce_async(a, name="handle-test", comm=comm)
    out = collective(comm, h.wait)
    agree(comm, out is a and h.done() and np.all(a == comm.Get_size()))


def test_deferred_allreduce_moves_data_only_after_mark_ready():
    """Agreed at submission; each rank writes its buffer afterwards, at its own time,
    and the reduction sees what was written before mark_ready()."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    a = np.zeros(4097, dtype=np.float32)
    handle = hpcdl.allreduce_async(a, name="deferred.data", deferred=True)
    time.sleep(0.05 * rank)
    a[:] = contribution(rank, a.size, "float32")
    handle.mark_ready()
    collective(WORLD, handle.wait)
    expected = sum(contribution(r, a.size, "float32").astype(np.float64) for r in range(size))
    t = handle.timings()
    ordered = (
        t["submitted_us"] <= t["ready_us"] <= t["agreed_us"] or t["submitted_us"] <= t["agreed_us"] <= t["ready_us"]
    )
    ok = (
        np.allclose(a, expected, rtol=1e-5, atol=1e-4)
        and len(set(WORLD.allgather(digest(a)))) == 1
        and ordered
        and t["ready_us"] <= t["started_us"]
        and t["ready_us"] - t["submitted_us"] >= 0.045e6 * rank
    )
    agree(WORLD, ok, t)


@multi_rank
def test_deferred_mismatch_raises_on_every_rank_without_mark_ready(comm):
    """The check runs at submission: a disagreement surfaces before any data is ready."""
    rank = comm.Get_rank()
    handle = hpcdl.allreduce_async(
        np.zeros(10 + (rank == 0), dtype=np.float32), name="deferred.mismatch", deferred=True, comm=comm
    )
    deadline = time.monotonic() + 60
    finished, err = False, None
    while not finished and err is None and time.monotonic() < deadline:
        finished, err = outcome(handle.done)  # done() raises the error it sees
        time.sleep(0.01)
    agree(comm, isinstance(err, hpcdl.MismatchError) and "count differs" in str(err), repr(err))


@multi_rank
def test_name_already_in_flight_is_refused(comm):
    """Rank 0 submits "dup" twice before the others submit it once: the second is refused."""
    rank = comm.Get_rank()
    a = np.ones(4, dtype=np.float32)
    err = None
    if rank == 0:
        handle = hpcdl.allreduce_async(a, name="dup", comm=comm)
        _, err = outcome(hpcdl.allreduce_async, np.ones(4, dtype=np.float32), name="dup", comm=comm)
        comm.barrier()
    else:
        comm.barrier()
        handle = hpcdl.allreduce_async(a, name="dup", comm=comm)
    collective(comm, handle.wait)
    ok = rank != 0 or (isinstance(err, ValueError) and "already in flight" in str(err))
    agree(comm, ok and np.all(a == comm.Get_size()), repr(err))


def test_same_name_reused_step_after_step(comm):
    """A training loop reuses each name as soon as the last op under it finished."""
    a = np.ones(257, dtype=np.float32)
    for step in range(100):
        a[:] = step
        collective(comm, lambda: hpcdl.allreduce(a, name="reused.every.step", comm=comm))
        if not np.all(a == step * comm.Get_size()):
            break
    agree(comm, np.all(a == step * comm.Get_size()) and step == 99, f"step {step}: {a[:3]}")


def test_stats_count_ring_bytes_exactly(comm):
    """Each element crosses 2(p-1) links in a ring: the sum of bytes over ranks says so."""
    size = comm.Get_size()
    hpcdl.stats(reset=True)
    n = 100_003
    hpcdl.allreduce(np.ones(n, dtype=np.float32), comm=comm)
    row = hpcdl.stats()["allreduce"]["none"]
    total_sent = comm.allreduce(row["bytes_sent"])
    total_received = comm.allreduce(row["bytes_received"])
    expected = 2 * (size - 1) * n * 4
    agree(
        comm,
        row["ops"] == 1
        and total_sent == expected
        and total_received == expected
        and row["dense_bytes"] == row["bytes_sent"],
        f"{row}, total {total_sent} vs {expected}",
    )


def test_small_allreduce_is_recursive_doubling_bytes_exactly(comm):
    """Up to RECURSIVE_DOUBLING_MAX_BYTES each of the largest power of two q <= p ranks
    sends its buffer log2 q times, and each of the p - q folded pairs sends it twice more
    (the pair's values in, the result back); one float32 more is the ring's or, over
    a power-of-two size, halving-doubling's 2(p-1) (the same bytes).
    Either way within the float64 reference's bound and bitwise the same on every rank."""
    size = comm.Get_size()
    q = 1 << (size.bit_length() - 1)
    small = hpcdl._core.RECURSIVE_DOUBLING_MAX_BYTES // 4
    problems = []
    for n, expected in (
        (small, (q * (q.bit_length() - 1) + 2 * (size - q)) * small * 4),
        (small + 1, 2 * (size - 1) * (small + 1) * 4),
    ):
        hpcdl.stats(reset=True)
        ok, detail = check_allreduce(comm, n, "float32", "sum")
        row = hpcdl.stats().get("allreduce", {}).get("none", {"bytes_sent": 0, "bytes_received": 0})
        sent, received = comm.allreduce(row["bytes_sent"]), comm.allreduce(row["bytes_received"])
        if (sent, received) != (expected, expected) or not ok:
            problems.append(f"n {n}: sent {sent}, received {received}, expected {expected}; {detail}")
    agree(comm, not problems, problems)


def check_halving_doubling(comm):
    """Problems of allreduces around halving-doubling's range (more than
    RECURSIVE_DOUBLING_MAX_BYTES, at most HALVING_DOUBLING_MAX_SEGMENT_BYTES per rank, a
    power-of-two size of at least HALVING_DOUBLING_MIN_RANKS: scripts/test.sh runs this file
    under 8 ranks too; below, the ring at these sizes): both ends, a count that splits unevenly and one element more
    (the ring again), each dtype's width, every op, against the float64 reference
    (exact for integers) and bitwise the same on every rank."""
    size = comm.Get_size()
    takes_it = size >= hpcdl._core.HALVING_DOUBLING_MIN_RANKS and size & (size - 1) == 0
    problems = []
    for dtype, ops in (
        ("float32", ("sum", "average", "min", "product")),
        ("float64", ("sum", "max")),
        ("float16", ("average",)),
        ("int32", ("sum", "average")),
    ):
        width = np.dtype(np_dtype(dtype)).itemsize
        low = hpcdl._core.RECURSIVE_DOUBLING_MAX_BYTES // width + 1
        high = size * hpcdl._core.HALVING_DOUBLING_MAX_SEGMENT_BYTES // width
        for count in (low, low + size + 1, high, high + 1):
            algorithm = hpcdl._core.dense_allreduce_algorithm(size, count * width)
            expected = "none" if size == 1 else "halving-doubling" if takes_it and count <= high else "ring"
            if algorithm != expected:
                problems.append(f"{dtype} x {count} on {size}: {algorithm}, expected {expected}")
            for op in ops:
                ok, detail = check_allreduce(comm, count, dtype, op)
                if not ok:
                    problems.append(f"{dtype} x {count} {op} ({algorithm}): {detail}")
    return problems


def test_mid_allreduce_by_halving_doubling(comm):
    problems = check_halving_doubling(comm)
    agree(comm, not problems, problems)


@multi_rank
def test_mismatched_count_raises_on_every_rank(comm):
    rank = comm.Get_rank()
    n = 1000 + (2 if rank == comm.Get_size() - 1 else 0)
    a = np.ones(n, dtype=np.float32)
    before = a.copy()
    _, err = outcome(hpcdl.allreduce, a, name="mismatched.count", comm=comm)
    message = str(err)
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "mismatched.count" in message
        and "count differs" in message
        and f"rank {comm.Get_size() - 1}" in message
        and np.array_equal(a, before)
    )
    agree(comm, ok, repr(err))
    # The engine keeps working afterwards.
    ok2, detail = check_allreduce(comm, 100, "float32", "sum")
    agree(comm, ok2, detail)


@multi_rank
def test_mismatched_dtype_and_op_raise_on_every_rank(comm):
    rank = comm.Get_rank()
    a = np.ones(64, dtype=np.float64 if rank == 0 else np.float32)
    _, err = outcome(hpcdl.allreduce, a, name="mismatched.dtype", comm=comm)
    ok = isinstance(err, hpcdl.MismatchError) and "dtype differs" in str(err) and "float64 on rank 0" in str(err)
    b = np.ones(64, dtype=np.float32)
    _, err2 = outcome(hpcdl.allreduce, b, op="average" if rank == 1 else "sum", name="mismatched.op", comm=comm)
    ok2 = isinstance(err2, hpcdl.MismatchError) and "op differs" in str(err2)
    agree(comm, ok and ok2, f"{err!r} / {err2!r}")


@multi_rank
@pytest.mark.parametrize("call", ["allreduce", "broadcast"])
def test_mismatched_shape_with_equal_count_raises_on_every_rank(comm, call):
    """[17, 1311] against [17, 23, 57]: the same 22287 elements, yet no sum of both."""
    rank = comm.Get_rank()
    shape = (17, 1311) if rank == 0 else (17, 23, 57)
    a = np.full(shape, rank + 1, dtype=np.float32)
    before = a.copy()
    _, err = outcome(getattr(hpcdl, call), a, comm=comm, name=f"mismatched.shape.{call}")
    message = str(err)
    others = "rank 1" if comm.Get_size() == 2 else "ranks 1, "
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and "shape differs" in message
        and "[17, 1311] on rank 0" in message
        and f"[17, 23, 57] on {others}" in message
        and "count differs" not in message
        and np.array_equal(a, before)
    )
    agree(comm, ok, repr(err))


@multi_rank
def test_equal_shapes_reduce_and_a_flat_buffer_is_its_count(comm):
    size = comm.Get_size()
    a = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) * (comm.Get_rank() + 1)
    collective(comm, lambda: hpcdl.allreduce(a, comm=comm, name="equal.shape"))
    b = array.array("f", range(6))  # a flat buffer: its shape is its count
    collective(comm, lambda: hpcdl.allreduce(b, comm=comm, name="flat.buffer"))
    expected = np.arange(24, dtype=np.float64).reshape(2, 3, 4) * (size * (size + 1) / 2)
    flat = np.frombuffer(b, dtype=np.float32)
    agree(comm, np.array_equal(a, expected) and np.array_equal(flat, np.arange(6) * size), f"{a.ravel()[:4]} {flat}")


def test_a_cached_operation_whose_shape_changes_is_a_mismatch():
    """An operation reported by its id (its description unchanged) is still compared by
    shape: the rank whose array changes shape reports it in full again."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    a = np.ones((6, 10), dtype=np.float32)
    warm = [outcome(collective, WORLD, hpcdl.allreduce, a, name="cached.shape")[1] for _ in range(5)]
    changed = a.reshape(60) if rank == size - 1 else a
    _, err = outcome(hpcdl.allreduce, changed, name="cached.shape")
    ok = (
        all(e is None for e in warm)
        and isinstance(err, hpcdl.MismatchError)
        and "shape differs" in str(err)
        and f"[60] on rank {size - 1}" in str(err)
        and f"[6, 10] on rank{'s' if size > 2 else ''} 0" in str(err)
    )
    agree(WORLD, ok, f"{warm} {err!r}")


@multi_rank
def test_unnamed_allreduce_against_broadcast_is_a_mismatch(comm):
    rank = comm.Get_rank()
    a = np.ones(8, dtype=np.float32)
    call = hpcdl.broadcast if rank == 0 else hpcdl.allreduce
    _, err = outcome(call, a, comm=comm)
    agree(comm, isinstance(err, hpcdl.MismatchError) and "operation differs" in str(err), repr(err))


def test_stall_warning_names_the_missing_rank():
    """A stall on a communicator whose channels are set up names the late rank (a
    stall in the set-up itself, the first operation on a communicator, cannot)."""
    rank = WORLD.Get_rank()
    collective(WORLD, hpcdl.barrier)  # the channels exist whichever test ran before
    with stall_limits(stall_warning_seconds=0.3):
        a = np.ones(16, dtype=np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 0:
                time.sleep(1.5)
            collective(WORLD, hpcdl.allreduce, a, name="late.tensor")
        stall = [str(w.message) for w in caught if issubclass(w.category, hpcdl.StallWarning)]
        if rank == 0:
            ok = not stall
        else:
            ok = bool(stall) and "late.tensor" in stall[0] and "rank 0" in stall[0]
        agree(WORLD, ok and np.all(a == WORLD.Get_size()), stall)


def run_named_step(names, arrays, step, seed):
    """Every rank submits the named ops in its own order; True when all sums are right."""
    order = np.random.default_rng(seed).permutation(len(names))
    for i in order:
        arrays[names[i]][:] = step + i
    handles = [hpcdl.allreduce_async(arrays[names[i]], name=names[i]) for i in order]
    for h in handles:
        h.wait()
    return all(np.all(arrays[n] == (step + i) * WORLD.Get_size()) for i, n in enumerate(names))


def test_ops_seen_before_reach_each_rank_once_per_tree_child():
    """Steady state: each rank gets one merged report per op from each of its
    children in the report tree (rank 0: up to (k - 1) ceil(log_k P) of them),
    never a rank's own description."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    names = [f"steady.{i}" for i in range(6)]
    arrays = {n: np.zeros(33 + i, dtype=np.float32) for i, n in enumerate(names)}
    first, _ = outcome(run_named_step, names, arrays, 0, rank)  # new names: full descriptions
    hpcdl.stats(reset=True)
    WORLD.Barrier()  # every rank's counts are reset before any rank reports the next step
    steps = 5
    results = [outcome(run_named_step, names, arrays, step, 100 * step + rank) for step in range(1, steps + 1)]
    right = first is True and all(ok is True and err is None for ok, err in results)
    counts = hpcdl.stats()["agreement"]
    children = report_tree.children_counts(size, report_tree.radix_in_effect(size))[rank]
    ok = counts["descriptions_received"] == 0 and counts["entries_received"] == steps * len(names) * children
    if rank != 0:
        ok = ok and counts["messages_sent"] > 0
    agree(WORLD, right and ok, f"results right: {right}, {children} children, {counts}")


@pytest.mark.parametrize("halves", [False, True], ids=["world", "halves"])
def test_a_small_communicator_runs_operations_on_the_descriptions_sent_to_every_rank(halves):
    """Blocking named steps (each rank's only pending operation) run one-hop on
    a communicator of at most HPCDL_AGREEMENT_ONE_HOP_RANKS ranks, never on a
    larger one; steps submitted in a different order on each rank, uneven
    alltoalls and a mismatch after one-hop rounds still agree, and are right."""
    comm = WORLD.Split(WORLD.Get_rank() % 2 if halves else 0, WORLD.Get_rank())
    rank, size = comm.Get_rank(), comm.Get_size()
    hpcdl.stats(reset=True)
    WORLD.Barrier()
    names = [f"onehop.{i}" for i in range(3)]
    arrays = {n: np.zeros(40 + i, dtype=np.float32) for i, n in enumerate(names)}
    right = True
    for step in range(30):
        a = np.full(257, rank + step, dtype=np.float32)
        hpcdl.allreduce(a, comm=comm, name="onehop.sum")
        right = right and bool(np.all(a == sum(range(size)) + size * step))
        splits = [(rank + peer + step) % 3 for peer in range(size)]  # rows this rank sends each peer
        rows = np.concatenate([np.full((splits[p], 2), 100 * rank + p, dtype=np.float64) for p in range(size)])
        got, got_splits = hpcdl.alltoall(rows, splits=splits, comm=comm, name="onehop.a2a")
        expect = [(src + rank + step) % 3 for src in range(size)]
        want = np.concatenate([np.full((expect[s], 2), 100 * s + rank, dtype=np.float64) for s in range(size)])
        right = right and list(got_splits) == expect and np.array_equal(got.reshape(-1, 2), want)
        if step % 5 == 4:  # several pending at once, in each rank's own order: the plan's way
            order = np.random.default_rng(100 * step + rank).permutation(len(names))
            for i in order:
                arrays[names[i]][:] = step + i
            for h in [hpcdl.allreduce_async(arrays[names[i]], comm=comm, name=names[i]) for i in order]:
                h.wait()
            right = right and all(np.all(arrays[n] == (step + i) * size) for i, n in enumerate(names))
    ran = comm.allreduce(hpcdl.stats()["agreement"]["one_hop_runs"])
    counted = ran > 0 if report_tree.one_hop_in_effect(size) else ran == 0
    # A different description after one-hop rounds fails on every rank, by the plan.
    b = np.zeros(258 if rank == size - 1 else 257, dtype=np.float32)
    _, err = outcome(hpcdl.allreduce, b, comm=comm, name="onehop.sum")
    named = size == 1 or (isinstance(err, hpcdl.MismatchError) and "'onehop.sum'" in str(err))
    comm.Free()
    agree(WORLD, right and counted and named, f"right {right}, one-hop runs {ran} of P = {size}, error {err!r}")


def test_a_freed_communicators_last_messages_never_reach_the_next_one():
    """One-hop's reports and plan entries still travel when a step has ended on
    every rank; MPI gives the next communicator the freed one's context id. Each
    Dup runs named steps under the same names as the last, with the other op,
    and is freed at once: every result is exact and no rank meets a plan of
    the freed communicator (before the close on free, a MismatchError or a hang
    came within ~20 rounds at P = 4)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hpcdl.stats(reset=True)
    right, errors = True, []
    for i in range(60):
        comm = WORLD.Dup()
        op = "sum" if i % 2 else "average"
        for k in range(3):
            a = np.full(64, rank + 1.0)
            _, err = outcome(hpcdl.allreduce, a, op=op, comm=comm, name=f"freed.{k}")
            if err is not None:
                errors.append(f"round {i} step {k}: {err!r}")
            want = size * (size + 1) / 2 / (1 if op == "sum" else size)
            right = right and bool(np.all(a == want))
        comm.Free()
    ran = WORLD.allreduce(hpcdl.stats()["agreement"]["one_hop_runs"])
    counted = ran > 0 if report_tree.one_hop_in_effect(size) else ran == 0
    agree(WORLD, right and not errors and counted, f"right {right}, errors {errors[:2]}, one-hop runs {ran}")


def test_mismatch_after_many_cached_steps_is_named_on_every_rank():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    names = ["cached.a", "cached.changes", "cached.b"]
    arrays = {n: np.zeros(100, dtype=np.float32) for n in names}
    cached_ok = all(outcome(run_named_step, names, arrays, step, rank)[0] is True for step in range(20))
    if rank == size - 1:
        arrays["cached.changes"] = np.zeros(101, dtype=np.float32)
    # Reports held for stalls are released only after 900 s now: the changed
    # description must complete its subtree's merged report (rank size - 1 is
    # a leaf under an inner rank at P = 4 and 5), not wait for that release.
    with stall_limits(stall_warning_seconds=3600, stall_error_seconds=3600):
        order = names[::-1] if rank % 2 else names
        handles = [hpcdl.allreduce_async(arrays[n], name=n) for n in order]
        errors = {h.name: outcome(h.wait, timeout=60)[1] for h in handles}
    err = errors["cached.changes"]
    named = (
        isinstance(err, hpcdl.MismatchError)
        and "'cached.changes'" in str(err)
        and "count differs" in str(err)
        and f"101 on rank {size - 1}" in str(err)
    )
    others_ran = errors["cached.a"] is None and errors["cached.b"] is None
    # The next step, back in agreement, runs.
    arrays["cached.changes"] = np.zeros(100, dtype=np.float32)
    after, after_err = outcome(run_named_step, names, arrays, 21, rank)
    agree(
        WORLD,
        cached_ok and named and others_ran and after is True,
        f"cached steps right: {cached_ok}, {errors}, after: {after} {after_err!r}",
    )


def test_stall_of_an_op_seen_before_names_the_missing_rank_inside_the_tree():
    """The missing rank is an inner node of the report tree (rank 2 of 4 or 5,
    whose subtree holds rank 3) or a leaf (rank 1 of 3): held reports go up."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    missing = size // 2
    a = np.ones(16, dtype=np.float32)
    warm = [outcome(collective, WORLD, hpcdl.allreduce, a, name="late.cached")[1] for _ in range(3)]
    with stall_limits(stall_warning_seconds=0.3):
        a[:] = 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == missing:
                time.sleep(1.5)
            _, err = outcome(hpcdl.allreduce, a, name="late.cached")
        stall = [str(w.message) for w in caught if issubclass(w.category, hpcdl.StallWarning)]
        if rank == missing:
            ok = not stall
        else:
            ok = bool(stall) and "late.cached" in stall[0] and f"for rank {missing}," in stall[0]
        agree(WORLD, ok and err is None and all(e is None for e in warm) and np.all(a == size), (stall, err, warm))


def test_stall_error_fails_waiting_ranks_instead_of_hanging():
    rank = WORLD.Get_rank()
    with stall_limits(stall_error_seconds=0.5):
        if rank != 0:
            _, err = outcome(hpcdl.allreduce, np.ones(4, dtype=np.float32), name="never.on.rank0")
            ok = isinstance(err, hpcdl.StallTimeoutError) and "rank 0" in str(err)
        else:
            err, ok = None, True
        agree(WORLD, ok, repr(err))
    hpcdl.barrier()


@pytest.mark.parametrize("dtype", hpcdl.DTYPES)
def test_broadcast_from_every_root(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    problems = []
    for root in range(size):
        expected = contribution(root, 3001, dtype)
        a = expected.copy() if rank == root else np.zeros(3001, dtype=np_dtype(dtype))
        hpcdl.broadcast(a, root=root, comm=comm)
        if a.tobytes() != expected.tobytes():
            problems.append(f"root {root}")
    agree(comm, not problems, problems)


@multi_rank
def test_broadcast_root_disagreement_and_bad_root(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    a = np.zeros(10, dtype=np.float32)
    _, err = outcome(hpcdl.broadcast, a, root=0 if rank else 1, name="bcast.roots", comm=comm)
    _, err2 = outcome(hpcdl.broadcast, a, root=size, comm=comm)
    agree(
        comm,
        isinstance(err, hpcdl.MismatchError)
        and "root differs" in str(err)
        and isinstance(err2, ValueError)
        and "root" in str(err2),
        f"{err!r} / {err2!r}",
    )


@multi_rank
def test_barrier_waits_for_everyone(comm):
    rank = comm.Get_rank()
    if rank == 0:
        time.sleep(0.5)
    t_enter = MPI.Wtime()
    hpcdl.barrier(comm=comm)
    waited = MPI.Wtime() - t_enter
    # rank 0 was late by 0.5 s: everyone else must have waited for it
    agree(comm, rank == 0 or waited > 0.3, f"barrier returned after {waited:.3f} s")


def test_large_message_default_chunks(comm):
    ok, detail = check_allreduce(comm, 3 * (1 << 20) + 17, "float32", "sum")
    agree(comm, ok, detail)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_sums_wrap_like_numpy(comm, dtype):
    """Integer sums that overflow wrap modulo 2^bits (as MPI_SUM does), not undefined behaviour."""
    rank, size = comm.Get_rank(), comm.Get_size()
    info = np.iinfo(dtype)
    base = np.array([info.max, info.max - 7, info.min, info.min + 3, 1, -1], dtype)
    data = base - np.array(rank % 2, dtype) * np.array([0, 0, 0, 0, 0, 1], dtype)
    with np.errstate(over="ignore"):
        expected = np.zeros_like(base)
        for r in range(size):
            expected += base - np.array(r % 2, dtype) * np.array([0, 0, 0, 0, 0, 1], dtype)  # numpy wraps
    hpcdl.allreduce(data, name=f"wrap.{dtype}", comm=comm)
    agree(comm, np.array_equal(data, expected), f"{data} vs {expected}")


def test_unnamed_ops_racing_from_two_threads_that_differ_are_a_mismatch():
    """Thread "reduce-64" and thread "reduce-96" submit unnamed allreduces in opposite
    orders on rank 0 and the other ranks: submission order pairs each thread's
    operation with the other thread's, whose array differs (count, shape), which is
    a MismatchError on every rank, never a sum of both. Thread names play no part:
    the threads are named differently on every rank."""
    rank = WORLD.Get_rank()
    small, large = np.ones(64, np.float32), np.full(96, 100.0, np.float32)
    first_done = threading.Event()
    results = {}

    def reduce(array, goes_first, key):
        if not goes_first:
            first_done.wait(30)
        handle = hpcdl.allreduce_async(array)
        if goes_first:
            first_done.set()
        results[key] = outcome(handle.wait)

    threads = [
        threading.Thread(target=reduce, args=(small, rank == 0, "small"), name=f"rank{rank}-small"),
        threading.Thread(target=reduce, args=(large, rank != 0, "large"), name=f"rank{rank}-large"),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = {k: err for k, (_, err) in results.items()}
    ok = len(errors) == 2 and all(
        isinstance(e, hpcdl.MismatchError) and "count differs" in str(e) and "shape differs" in str(e)
        for e in errors.values()
    )
    agree(WORLD, ok and np.all(small == 1) and np.all(large == 100), f"{errors!r}, {small[0]}, {large[0]}")


def test_unnamed_ops_from_pool_threads_named_differently_per_rank_are_right(comm):
    """Unnamed allreduces submitted one after another from ThreadPoolExecutor threads
    whose names differ on every rank (as TF's numpy_function and tf.data pools, or
    torch's autograd threads): they pair by submission order and each gets its sum."""
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays = [np.arange(i, i + 50, dtype=np.float64) * (rank + 1) for i in range(6)]
    seen = set()

    def reduce(array):
        seen.add(threading.current_thread().name)
        return outcome(hpcdl.allreduce, array, comm=comm)

    with ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"rank{rank}-pool") as pool:
        results = [pool.submit(reduce, a).result(120) for a in arrays]
    errors = [err for _, err in results if err is not None]
    scale = size * (size + 1) / 2  # sum over ranks of (rank + 1)
    expected = [np.arange(i, i + 50, dtype=np.float64) * scale for i in range(6)]
    right = all(np.array_equal(a, e) for a, e in zip(arrays, expected))
    names = comm.allgather(sorted(seen))
    distinct = size == 1 or not set(names[0]) & set(names[-1])
    agree(comm, not errors and right and distinct, f"{errors!r}, right {right}, names {names}")


def test_unnamed_ops_from_two_threads_in_the_same_order_are_right(comm):
    """Two threads taking turns the same way on every rank: each gets its own sum."""
    size = comm.Get_size()
    ones, hundreds = np.ones(64, np.float32), np.full(64, 100.0, np.float32)
    results = {}

    def reduce(array, key):
        results[key] = outcome(hpcdl.allreduce, array, comm=comm)

    for values, key in ((ones, "ones"), (hundreds, "hundreds"), (ones, "ones-again")):
        t = threading.Thread(target=reduce, args=(values, key), name=f"reduce-{key}")
        t.start()
        t.join(120)
    errors = [err for _, err in results.values() if err is not None]
    agree(
        comm,
        not errors and np.all(ones == size * size) and np.all(hundreds == 100 * size),
        f"{errors!r}, {ones[0]}, {hundreds[0]}",
    )


def test_handles_polled_with_done_release_their_buffers(comm):
    """Handles polled with done() and never waited for: once finished, dropping
    them and the arrays frees the arrays (hpcdl keeps nothing of them)."""
    arrays = [np.ones(1 << 16, np.float32) for _ in range(64)]
    refs = [weakref.ref(a) for a in arrays]
    handles = [hpcdl.allreduce_async(a, name=f"polled.{i}", comm=comm) for i, a in enumerate(arrays)]
    deadline = time.monotonic() + 60
    while not all(h.done() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    finished = all(h.done() for h in handles)
    right = all(np.all(a == comm.Get_size()) for a in arrays)
    del arrays, handles
    gc.collect()
    alive = sum(r() is not None for r in refs)
    agree(comm, finished and right and alive == 0, f"finished {finished}, right {right}, {alive} arrays alive")


@multi_rank
def test_done_raises_the_error_of_a_failed_operation(comm):
    """A mismatch seen through done() is raised there, on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    handle = hpcdl.allreduce_async(np.ones(10 + (rank == size - 1), np.float32), name="polled.mismatch", comm=comm)
    deadline = time.monotonic() + 60
    finished, err = False, None
    while not finished and err is None and time.monotonic() < deadline:
        finished, err = outcome(handle.done)
        time.sleep(0.01)
    agree(comm, isinstance(err, hpcdl.MismatchError) and "count differs" in str(err), f"{finished} {err!r}")


def test_an_intercommunicator_is_refused_on_every_rank():
    """Across an intercommunicator's two groups the ring would pair the wrong ranks
    (a 4-rank sum gave 5 on every rank): refused at submission, before any data moves."""
    rank = WORLD.Get_rank()
    half = WORLD.Split(rank % 2, rank)
    inter = half.Create_intercomm(0, WORLD, 1 - rank % 2, tag=77)  # the other group's first rank leads it
    _, error = outcome(lambda: hpcdl.allreduce(np.ones(4, dtype=np.float32), comm=inter))
    inter.Free()
    half.Free()
    agree(WORLD, isinstance(error, ValueError) and "intercommunicator" in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
def test_stall_error_names_a_rank_that_gave_up_not_one_that_never_submitted():
    """Every rank but the last submits 'given.up' and gives up on it (stall limit);
    the last submits it afterwards. Its error names the others as having given up,
    not as never having submitted it; the engine goes on working."""
    rank, last = WORLD.Get_rank(), WORLD.Get_size() - 1
    collective(WORLD, hpcdl.barrier)  # the channels exist whichever test ran before
    with stall_limits(stall_error_seconds=1.0):
        a = np.ones(8, dtype=np.float32)
        first = second = None
        if rank != last:
            _, first = outcome(hpcdl.allreduce, a, name="given.up")
        WORLD.Barrier()
        if rank == last:
            _, second = outcome(hpcdl.allreduce, a, name="given.up")
        WORLD.Barrier()
        others = f"rank {last - 1}" if last == 1 else "ranks " + ", ".join(map(str, range(last)))
        if rank != last:
            ok = isinstance(first, hpcdl.StallTimeoutError) and f"never submitted by rank {last}" in str(first)
            err = first
        else:
            ok = (
                isinstance(second, hpcdl.StallTimeoutError)
                and "never submitted" not in str(second)
                and f"{others}, which submitted it earlier and gave up on it" in str(second)
            )
            err = second
        b = np.ones(8, dtype=np.float32)
        collective(WORLD, hpcdl.allreduce, b, name="after.given.up")
        agree(WORLD, ok and np.all(b == WORLD.Get_size()), repr(err))
