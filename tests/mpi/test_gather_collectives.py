"""allgather (a first dimension that differs per rank), reducescatter and alltoall (with
splits) under MPI: results against numpy / float64 references, bitwise identical where
every rank holds the same result, on COMM_SELF, COMM_WORLD, its Dup() and Split()
sub-communicators; disagreements raise on every rank; a late rank gets the stall warning."""

import time
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl

from conftest import agree, collective, multi_rank, outcome, stall_limits
from helpers.device import device  # noqa: F401 - the fixture

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
MOVED_DTYPES = DTYPES + ["uint8", "int8", "uint64", "bool"]  # allgather and alltoall reduce nothing
ROW = (3, 2)  # the dimensions after the first


def np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def rows_of(rank):
    """Uneven rows per rank, none on rank 1."""
    return 0 if rank == 1 else 2 * rank + 1


def block(rank, rows, dtype, row=ROW, seed=0):
    """Rank `rank`'s data: deterministic, so every rank can compute every rank's input."""
    rng = np.random.default_rng(7000 + 31 * seed + rank)
    if dtype.startswith(("int", "uint", "bool")):
        low = -50 if dtype.startswith("int") else 0
        return rng.integers(low, 2 if dtype == "bool" else 50, (rows,) + row).astype(np_dtype(dtype))
    return rng.standard_normal((rows,) + row).astype(np_dtype(dtype))


def on(comm, fn, *args, **kwargs):
    """fn(*args, comm=comm, **kwargs) on every rank of comm, raising on every rank if any rank raised."""
    return collective(comm, lambda: fn(*args, comm=comm, **kwargs))


def same_everywhere(comm, array):
    return len(set(comm.allgather(array.tobytes()))) == 1


@pytest.mark.parametrize("dtype", MOVED_DTYPES)
def test_allgather_of_uneven_rows_is_the_concatenation_in_rank_order(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = block(rank, rows_of(rank), dtype)
    before = mine.copy()
    out = on(comm, hpcdl.allgather, mine, name=f"gather.{dtype}")
    expected = np.concatenate([block(r, rows_of(r), dtype) for r in range(size)])
    ok = (
        out.dtype == mine.dtype
        and out.shape == expected.shape
        and out.tobytes() == expected.tobytes()
        and mine.tobytes() == before.tobytes()
        and same_everywhere(comm, out)
    )
    agree(comm, ok, f"{out.dtype} {out.shape} vs {expected.shape}")


@multi_rank
def test_allgather_in_many_chunks_and_with_no_rows_anywhere(comm):
    """Blocks far larger than the chunk (pipelined over many chunks), one rank with 0 rows;
    then every rank with 0 rows."""
    rank, size = comm.Get_rank(), comm.Get_size()
    old = hpcdl.configure()["chunk_bytes"]
    hpcdl.configure(chunk_bytes=4096)
    try:
        rows = [0 if r == size - 1 else 5000 + 977 * r for r in range(size)]
        mine = block(rank, rows[rank], "float64", row=(1,))
        out = on(comm, hpcdl.allgather, mine, name="gather.chunked")
        expected = np.concatenate([block(r, rows[r], "float64", row=(1,)) for r in range(size)])
        empty = on(comm, hpcdl.allgather, np.zeros((0, 4), np.float32))
    finally:
        hpcdl.configure(chunk_bytes=old)
    agree(comm, np.array_equal(out, expected) and empty.shape == (0, 4), f"{out.shape} {empty.shape}")


def test_allgather_on_split_sub_communicators():
    rank = WORLD.Get_rank()
    half = WORLD.Split(rank % 2, rank)
    try:
        mine = np.full((rank + 1, 2), rank, np.int64)
        out = on(half, hpcdl.allgather, mine, name="gather.half")
        members = [r for r in range(WORLD.Get_size()) if r % 2 == rank % 2]
        expected = np.concatenate([np.full((r + 1, 2), r, np.int64) for r in members])
        agree(WORLD, np.array_equal(out, expected), out.ravel().tolist())
    finally:
        half.Free()


def test_allgather_of_torch_and_tensorflow_tensors(device):
    tf = pytest.importorskip("tensorflow")
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = torch.arange(rows_of(rank) * 2, dtype=torch.bfloat16).reshape(-1, 2).to(device) + rank
    out = collective(WORLD, hpcdl.allgather, mine, name="gather.torch")
    expected = torch.cat([torch.arange(rows_of(r) * 2, dtype=torch.bfloat16).reshape(-1, 2) + r for r in range(size)])
    tf_out = collective(WORLD, hpcdl.allgather, tf.constant([[rank, rank]] * (rank + 1), tf.int32), name="gather.tf")
    tf_expected = np.concatenate([[[r, r]] * (r + 1) for r in range(size)]).astype(np.int32)
    ok = (
        isinstance(out, torch.Tensor)
        and out.device == mine.device
        and out.dtype == torch.bfloat16
        and torch.equal(out.cpu(), expected)
        and isinstance(tf_out, tf.Tensor)
        and np.array_equal(tf_out.numpy(), tf_expected)
    )
    agree(WORLD, ok, f"{out.device} {out.dtype} {tuple(out.shape)}; {tf_out.shape}")


@multi_rank
def test_allgather_with_different_dtypes_or_row_shapes_raises_on_every_rank(comm):
    rank = comm.Get_rank()
    a = np.ones((2, 3), np.float32 if rank == 0 else np.float64)
    _, err = outcome(hpcdl.allgather, a, comm=comm, name="gather.dtype")
    agree(comm, isinstance(err, hpcdl.MismatchError) and "dtype" in str(err), repr(err))
    b = np.ones((2, 3 if rank == 0 else 4), np.float32)
    _, err = outcome(hpcdl.allgather, b, comm=comm, name="gather.row")
    agree(comm, isinstance(err, hpcdl.MismatchError), repr(err))
    c = np.ones((rank + 1, 6) if rank == 0 else (rank + 1, 3, 2), np.float32)  # rows of equal size, other shapes
    _, err = outcome(hpcdl.allgather, c, comm=comm, name="gather.shape")
    agree(comm, isinstance(err, hpcdl.MismatchError) and "[6]" in str(err) and "[3, 2]" in str(err), repr(err))
    _, err = outcome(hpcdl.allgather, np.float32(1.0), comm=comm)
    agree(comm, isinstance(err, ValueError) and "dimension" in str(err), repr(err))


def test_a_late_rank_gets_the_stall_warning_on_allgather():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    collective(WORLD, hpcdl.barrier)  # the channels exist whichever test ran before
    with stall_limits(stall_warning_seconds=0.3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 0:
                time.sleep(1.5)
            out = collective(WORLD, hpcdl.allgather, np.full((1, 2), rank, np.int32), name="late.gather")
        stall = [str(w.message) for w in caught if issubclass(w.category, hpcdl.StallWarning)]
        named = bool(stall) and "late.gather" in stall[0] and "rank 0" in stall[0]
        ok = (not stall if rank == 0 else named) and out[:, 0].tolist() == list(range(size))
        agree(WORLD, ok, stall)


def segment(rank, size, rows):
    """Horovod's split of the first dimension: the first rows % size ranks one row more."""
    begin = rank * (rows // size) + min(rank, rows % size)
    return begin, begin + rows // size + (rank < rows % size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_reducescatter_gives_each_rank_its_rows_of_the_reduction(comm, dtype, op):
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 2 * size + 1  # the first rank gets one row more
    mine = block(rank, rows, dtype, seed=1)
    before = mine.copy()
    out = on(comm, hpcdl.reducescatter, mine, op=op, name=f"rs.{dtype}.{op}")
    inputs = [block(r, rows, dtype, seed=1).astype(np.float64) for r in range(size)]
    exact = np.max(inputs, axis=0) if op == "max" else sum(inputs)
    if op == "average":  # integers floor-divide
        exact = exact // size if dtype.startswith("int") else exact / size
    begin, end = segment(rank, size, rows)
    tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-5}.get(dtype, 1e-12)
    ok = (
        out.shape == (end - begin,) + ROW
        and out.dtype == mine.dtype
        and mine.tobytes() == before.tobytes()
        and np.allclose(out.astype(np.float64), exact[begin:end], rtol=tol, atol=tol * size)
    )
    agree(comm, ok, f"{out.shape} rows {begin}:{end}")


@multi_rank
def test_reducescatter_sum_of_bools_and_alltoall_bad_splits_raise_on_every_rank(comm):
    size = comm.Get_size()
    _, err = outcome(hpcdl.reducescatter, np.ones((size, 2), bool), op="sum", comm=comm)
    agree(comm, isinstance(err, ValueError) and "does not reduce bool" in str(err), repr(err))
    _, err = outcome(hpcdl.alltoall, np.ones((size + 1, 2)), comm=comm)
    agree(comm, isinstance(err, ValueError) and "divide" in str(err), repr(err))
    _, err = outcome(hpcdl.alltoall, np.ones((3, 2)), splits=[3] + [1] * (size - 1), comm=comm)
    agree(comm, isinstance(err, ValueError) and "splits" in str(err), repr(err))


def test_reducescatter_of_a_torch_tensor(device):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    t = torch.arange(size * 4, dtype=torch.float32).reshape(size, 4).to(device) * (rank + 1)
    out = collective(WORLD, hpcdl.reducescatter, t, name="rs.torch")
    expected = torch.arange(size * 4, dtype=torch.float32).reshape(size, 4)[rank] * sum(range(1, size + 1))
    agree(WORLD, out.device == t.device and torch.equal(out.cpu(), expected.reshape(1, 4)), out.tolist())


def sent_by(rank, size, dtype):
    """Rank `rank`'s splits (zeros included) and the rows it sends: row values name sender and receiver."""
    splits = [(rank + 2 * j) % 3 for j in range(size)]
    rows = [np.full((n,) + ROW, 10 * rank + j).astype(np_dtype(dtype)) for j, n in enumerate(splits)]
    return splits, np.concatenate(rows)


@pytest.mark.parametrize("dtype", MOVED_DTYPES)
def test_alltoall_with_splits_delivers_each_ranks_rows_in_rank_order(comm, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    splits, mine = sent_by(rank, size, dtype)
    received, got_splits = on(comm, hpcdl.alltoall, mine, splits=splits, name=f"a2a.{dtype}")
    expected_splits = [sent_by(r, size, dtype)[0][rank] for r in range(size)]
    expected = np.concatenate(
        [np.full((n,) + ROW, 10 * r + rank).astype(np_dtype(dtype)) for r, n in enumerate(expected_splits)]
    )
    ok = got_splits == expected_splits and received.tobytes() == expected.tobytes() and received.shape == expected.shape
    agree(comm, ok, f"{got_splits} vs {expected_splits}")


@multi_rank
def test_alltoall_without_splits_splits_equally(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = torch.arange(2 * size, dtype=torch.int64) + 100 * rank
    received, splits = on(comm, hpcdl.alltoall, mine, name="a2a.equal")
    expected = torch.tensor([100 * r + 2 * rank + k for r in range(size) for k in range(2)])
    agree(comm, splits == [2] * size and torch.equal(received, expected), received.tolist())


def pieces_splits(rank, size, call):
    """Rank `rank`'s splits in call `call`: thousands of rows, an empty block at every size > 1."""
    return [0 if (rank + j + call) % 3 == 0 else 700 * (1 + (rank * size + j + call) % 4) for j in range(size)]


def pieces_block(sender, receiver, call, n):
    """The n rows `sender` sends `receiver` in call `call`: each names them and its index."""
    return np.stack([np.arange(n, dtype=np.int64), np.full(n, 1000 * sender + 10 * receiver + call, np.int64)], axis=1)


def test_alltoall_in_many_pieces_with_several_calls_in_flight(comm):
    """Blocks far larger than the chunk (many pieces each, sent ahead of the count the
    receiver learns them by) and three calls submitted at once, so a fast rank's next
    call can arrive while a peer still receives the one before: every row lands whole,
    in rank order, with each call's own counts."""
    rank, size = comm.Get_rank(), comm.Get_size()
    old = hpcdl.configure()["chunk_bytes"]
    hpcdl.configure(chunk_bytes=256)
    try:
        handles = []
        for c in range(3):
            splits = pieces_splits(rank, size, c)
            mine = np.concatenate([pieces_block(rank, j, c, n) for j, n in enumerate(splits)])
            handles.append(hpcdl.alltoall_async(mine, splits=splits, comm=comm, name=f"a2a.pieces.{c}"))
        results = [outcome(h.wait) for h in handles]
    finally:
        hpcdl.configure(chunk_bytes=old)
    ok = all(err is None for _, err in results)
    for c, (got, _) in enumerate(results if ok else []):
        received, got_splits = got
        expected_splits = [pieces_splits(r, size, c)[rank] for r in range(size)]
        expected = np.concatenate([pieces_block(r, rank, c, n) for r, n in enumerate(expected_splits)])
        ok = ok and got_splits == expected_splits and np.array_equal(received, expected)
    agree(comm, ok, repr([err for _, err in results]))


@multi_rank
def test_alltoall_and_reducescatter_with_different_shapes_raise_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    a = np.ones((size, 2 if rank == 0 else 5), np.float32)
    _, err = outcome(hpcdl.alltoall, a, comm=comm, name="a2a.row")
    agree(comm, isinstance(err, hpcdl.MismatchError), repr(err))
    b = np.ones((size, 4) if rank == 0 else (size, 2, 2), np.float32)
    _, err = outcome(hpcdl.reducescatter, b, comm=comm, name="rs.shape")
    agree(comm, isinstance(err, hpcdl.MismatchError) and "shape" in str(err), repr(err))


def group_inputs(rank, seed):
    """One rank's members of a grouped allgather: dtypes, row shapes and row counts
    differing per member (0 rows on rank 1, and a member with 0 rows everywhere)."""
    return [
        block(rank, rows_of(rank), "float64", seed=seed),
        block(rank, rank + 1, "bfloat16", row=(5,), seed=seed),
        np.zeros((0, 2), np.int32),
        block(rank, 2 * rank, "uint8", row=(1, 3), seed=seed),
    ]


@pytest.mark.parametrize("chunk_bytes", [4096, None])
def test_grouped_allgather_members_are_bitwise_their_own_calls(comm, chunk_bytes):
    rank, size = comm.Get_rank(), comm.Get_size()
    old = hpcdl.configure()["chunk_bytes"]
    hpcdl.configure(chunk_bytes=chunk_bytes or old)
    try:
        mine = group_inputs(rank, 2)
        before = [m.tobytes() for m in mine]
        grouped = on(comm, hpcdl.grouped_allgather, mine, name="ggather")
        singles = [on(comm, hpcdl.allgather, m, name=f"ggather.single.{i}") for i, m in enumerate(mine)]
    finally:
        hpcdl.configure(chunk_bytes=old)
    expected = [np.concatenate([group_inputs(r, 2)[i] for r in range(size)]) for i in range(len(mine))]
    ok = (
        len(grouped) == len(mine)
        and all(
            g.dtype == e.dtype and g.shape == e.shape and g.tobytes() == e.tobytes() for g, e in zip(grouped, expected)
        )
        and all(g.tobytes() == s.tobytes() for g, s in zip(grouped, singles))
        and [m.tobytes() for m in mine] == before
        and all(same_everywhere(comm, g) for g in grouped)
    )
    agree(comm, ok, [(g.dtype, g.shape) for g in grouped])


def rs_group_inputs(rank, size, seed):
    """One rank's members of a grouped reducescatter: fewer rows than ranks (0-row segments),
    rows that do not divide by the size, and a float32 member."""
    return [
        block(rank, max(size - 1, 1), "float64", seed=seed),
        block(rank, 3 * size + 2, "float32", row=(7,), seed=seed),
        block(rank, size, "int64", row=(2,), seed=seed),
    ]


@pytest.mark.parametrize("op", ["sum", "average", "min"])
def test_grouped_reducescatter_members_are_bitwise_their_own_calls(comm, op):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = rs_group_inputs(rank, size, 3)
    before = [m.tobytes() for m in mine]
    grouped = on(comm, hpcdl.grouped_reducescatter, mine, op=op, name=f"grs.{op}")
    singles = [on(comm, hpcdl.reducescatter, m, op=op, name=f"grs.{op}.single.{i}") for i, m in enumerate(mine)]
    ok, detail = len(grouped) == len(mine), []
    for i, (got, single) in enumerate(zip(grouped, singles)):
        inputs = [rs_group_inputs(r, size, 3)[i].astype(np.float64) for r in range(size)]
        exact = np.min(inputs, axis=0) if op == "min" else sum(inputs)
        if op == "average":
            exact = exact // size if mine[i].dtype.kind == "i" else exact / size
        begin, end = segment(rank, size, mine[i].shape[0])
        tol = 1e-5 if mine[i].dtype == np.float32 else 1e-12
        ok = ok and (
            got.dtype == mine[i].dtype
            and got.shape == (end - begin,) + mine[i].shape[1:]
            and got.tobytes() == single.tobytes()
            and np.allclose(got.astype(np.float64), exact[begin:end], rtol=tol, atol=tol * size)
        )
        detail.append((got.dtype, got.shape, begin, end))
    agree(comm, ok and [m.tobytes() for m in mine] == before, detail)


@multi_rank
def test_reducescatter_in_many_pieces_matches_the_float64_reference(comm):
    """Blocks far larger than the chunk (many pieces per block, capped), rows that do not
    divide by the size: the pairwise reduce-scatter against a float64 reference."""
    rank, size = comm.Get_rank(), comm.Get_size()
    old = hpcdl.configure()["chunk_bytes"]
    hpcdl.configure(chunk_bytes=64)
    try:
        rows = 4000 * size + size - 1
        mine = block(rank, rows, "float64", row=(3,), seed=4)
        out = on(comm, hpcdl.reducescatter, mine, op="average", name="rs.pieces")
    finally:
        hpcdl.configure(chunk_bytes=old)
    exact = sum(block(r, rows, "float64", row=(3,), seed=4) for r in range(size)) / size
    begin, end = segment(rank, size, rows)
    agree(comm, out.shape == (end - begin, 3) and np.allclose(out, exact[begin:end], rtol=1e-12), out.shape)


def test_grouped_gathers_on_split_sub_communicators():
    rank = WORLD.Get_rank()
    half = WORLD.Split(rank % 2, rank)
    try:
        members = [r for r in range(WORLD.Get_size()) if r % 2 == rank % 2]
        mine = [np.full((rank + 1, 2), rank, np.int64), np.full((len(members), 3), rank + 0.5)]
        gathered = on(half, hpcdl.grouped_allgather, mine, name="ggather.half")
        scattered = on(half, hpcdl.grouped_reducescatter, mine[1:], name="grs.half")
        expected = np.concatenate([np.full((r + 1, 2), r, np.int64) for r in members])
        ok = (
            np.array_equal(gathered[0], expected)
            and gathered[1].shape == (len(members) ** 2, 3)
            and np.array_equal(scattered[0], np.full((1, 3), sum(r + 0.5 for r in members)))
        )
        agree(WORLD, ok, [g.shape for g in gathered])
    finally:
        half.Free()


@multi_rank
def test_grouped_gathers_with_mismatched_members_raise_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    other = np.float32 if rank == 0 else np.float64
    cases = [
        (hpcdl.grouped_allgather, [np.ones((rank, 2)), np.ones((1, 2), other)], "float32"),
        (hpcdl.grouped_allgather, [np.ones((1, 2)), np.ones((1, 3 if rank == 0 else 4))], "[3]"),
        (hpcdl.grouped_allgather, [np.ones((1, 2))] * (1 if rank == 0 else 2), "arrays"),
        (hpcdl.grouped_reducescatter, [np.ones((size, 2)), np.ones((size, 2), other)], "float32"),
        (hpcdl.grouped_reducescatter, [np.ones((size + (rank == 0), 2))], "[" + str(size + 1)),
    ]
    for i, (fn, bufs, named) in enumerate(cases):
        _, err = outcome(fn, bufs, comm=comm, name=f"gmismatch.{i}")
        agree(comm, isinstance(err, hpcdl.MismatchError) and named in str(err), f"case {i}: {err!r}")
    _, err = outcome(hpcdl.grouped_reducescatter, [np.ones((size, 2))], op="sum" if rank else "max", comm=comm)
    agree(comm, isinstance(err, hpcdl.MismatchError) and "op" in str(err), repr(err))
    _, err = outcome(hpcdl.grouped_allgather, [np.ones((2, 2)), np.float32(1.0)], comm=comm)
    agree(comm, isinstance(err, ValueError) and "dimension" in str(err), repr(err))
    agree(comm, hpcdl.grouped_allgather([], comm=comm) == [] and hpcdl.grouped_reducescatter([], comm=comm) == [])


@multi_rank
def test_results_in_recycled_memory_stay_intact_while_held_and_are_whole_when_reused(comm):
    """A large result's memory (32 MiB or more) goes back to the engine's pool only when its
    last view goes (include/hpcdl/util/result_block.hpp): results still held (the array, or a
    view that outlived it) keep their bytes through later calls of the same and smaller sizes,
    and a result that takes a freed block, also one up to twice its size, is written whole
    (alltoall with uneven splits, zeros included, in pieces)."""
    rank, size = comm.Get_rank(), comm.Get_size()

    def call(seed, scale):
        splits = [scale * ((rank + j + seed) % 3) for j in range(size)]
        mine = np.concatenate([np.full((n, 5), 1000 * seed + 10 * rank + j, np.float64) for j, n in enumerate(splits)])
        expected_splits = [scale * ((r + rank + seed) % 3) for r in range(size)]
        expected = np.concatenate(
            [np.full((n, 5), 1000 * seed + 10 * r + rank, np.float64) for r, n in enumerate(expected_splits)]
        )
        received, got_splits = on(comm, hpcdl.alltoall, mine, splits=splits, name=f"a2a.pool.{seed}.{scale}")
        return received, got_splits == expected_splits and received.shape == expected.shape, expected

    old = hpcdl.configure()["chunk_bytes"]
    hpcdl.configure(chunk_bytes=1 << 20)
    try:
        big = 280000  # rows of 40 bytes: 3 x big rows are just over 32 MiB
        held, ok, held_expected = call(0, big)
        view = held[1::2]
        view_expected = held_expected[1::2].copy()
        del held
        freed, ok1, _ = call(1, big)
        del freed
        checks = [ok, ok1]
        for seed, scale in ((4, big), (2, big), (3, big * 3 // 4), (5, 7)):  # seed 4 sends as seed 1
            got, fine, expected = call(seed, scale)
            checks.append(fine and np.array_equal(got, expected))
            del got
    finally:
        hpcdl.configure(chunk_bytes=old)
    agree(comm, all(checks) and np.array_equal(view, view_expected), checks)
