"""Packing the HDF5 store under 4 MPI ranks: the same store as one rank packs,
errors on every rank, resume after a lost manifest."""

import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

from hpcdl import store

from conftest import agree, collective, multi_rank, outcome
from helpers.store import check_round_trip, make_tree


@pytest.fixture
def shared_tree(comm):
    """A source tree made by rank 0 in a directory every rank sees."""
    base = collective(comm, lambda: tempfile.mkdtemp(prefix="hpcdl-store-") if comm.Get_rank() == 0 else None)
    base = comm.bcast(base, root=0)
    content = collective(
        comm, lambda: make_tree(os.path.join(base, "src"), files=150) if comm.Get_rank() == 0 else None
    )
    content = comm.bcast(content, root=0)
    yield base, content
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(base)


@pytest.mark.mpi
@multi_rank
def test_mpi_pack_matches_single_rank(comm, shared_tree):
    base, content = shared_tree
    src = os.path.join(base, "src")
    result = collective(comm, lambda: store.pack(src, os.path.join(base, "multi"), shards=6, comm=comm, progress=False))
    agree(comm, result.samples == len(content) and result.shards == 6, result)
    collective(
        comm,
        lambda: (
            store.pack(src, os.path.join(base, "single"), shards=2, comm=MPI.COMM_SELF, progress=False)
            if comm.Get_rank() == 0
            else None
        ),
    )
    comm.Barrier()

    def compare():
        multi, single = store.Store(os.path.join(base, "multi")), store.Store(os.path.join(base, "single"))
        assert list(multi.names) == list(single.names)
        assert (multi.labels == single.labels).all()
        mine = range(comm.Get_rank(), len(multi), comm.Get_size())
        data, offsets = multi.read_many(list(mine))
        for k, i in enumerate(mine):
            assert data[offsets[k] : offsets[k + 1]].tobytes() == content[multi.names[i]]
        check_round_trip(multi, content) if comm.Get_rank() == 0 else None
        assert multi.verify().problems == []

    collective(comm, compare)


@pytest.mark.mpi
@multi_rank
def test_mpi_pack_errors_reach_every_rank(comm, shared_tree):
    base, _ = shared_tree
    src, dst = os.path.join(base, "src"), os.path.join(base, "dst")
    collective(comm, lambda: store.pack(src, dst, comm=comm, progress=False))
    _, err = outcome(store.pack, src, dst, comm=comm, progress=False)
    agree(comm, isinstance(err, FileExistsError) and "already holds" in str(err), repr(err))
    _, err = outcome(store.pack, os.path.join(base, "missing"), os.path.join(base, "x"), comm=comm, progress=False)
    agree(comm, isinstance(err, FileNotFoundError), repr(err))


@pytest.mark.mpi
@multi_rank
def test_mpi_pack_resumes_after_a_lost_manifest(comm, shared_tree):
    base, content = shared_tree
    src, dst = os.path.join(base, "src"), os.path.join(base, "dst")
    collective(comm, lambda: store.pack(src, dst, shards=5, comm=comm, progress=False))
    comm.Barrier()
    collective(comm, lambda: os.remove(os.path.join(dst, store.MANIFEST)) if comm.Get_rank() == 0 else None)
    result = collective(comm, lambda: store.pack(src, dst, shards=5, comm=comm, progress=False))
    agree(comm, result.reused_shards == 5, result)
    collective(comm, lambda: check_round_trip(store.Store(dst), content))
