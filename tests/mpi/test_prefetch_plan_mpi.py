"""The prefetcher under 4 MPI ranks runs exactly plan()'s result, and a state taken
on 4 ranks resumes on 2 and on 3 with exactly the rest of the global order.
Collective-safe (conftest)."""

import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from hpcdl.prefetch import Prefetcher, plan

from conftest import agree, collective, multi_rank, world_only
from helpers.prefetch import store_made_by_rank0


@pytest.fixture(scope="module")
def shared_store():
    yield from store_made_by_rank0(MPI.COMM_WORLD, "hpcdl-prefetch-plan-", files=150, seed=12)


@pytest.mark.mpi(min_size=4)
@multi_rank
def test_prefetcher_runs_exactly_plan(comm, shared_store):
    # Capacities differ per rank and cut inside frequency classes; ranks 1 and 3 have a disk tier.
    st, me, ranks = shared_store, comm.Get_rank(), comm.Get_size()
    rams = [20000 + 7000 * q for q in range(ranks)]
    disks = [15000 if q % 2 else 0 for q in range(ranks)]
    disk_dir = tempfile.mkdtemp(prefix=f"hpcdl-plan-disk{me}-") if disks[me] else None

    def run():
        try:
            with Prefetcher(
                st, 8, 4, 31, comm=comm, ram_bytes=rams[me], disk_dir=disk_dir, disk_bytes=disks[me], start=(1, 2)
            ) as pf:
                return pf.placement(), pf.peer_sources()
        finally:
            if disk_dir:
                shutil.rmtree(disk_dir, ignore_errors=True)

    placed, (rank, key) = collective(comm, run)
    want = plan(len(st), 8, ranks, me, 4, 31, st.sizes, rams, disks, start=(1, 2))
    same = all((placed[k] == want[k]).all() for k in ("freq", "first", "tier", "offset", "ram", "disk"))
    same &= (rank == want["source_rank"]).all() and (key == want["source_key"]).all()
    agree(comm, same, "the prefetcher's placement or peer sources differ from plan()")
    exercised = comm.allreduce(int((rank >= 0).sum())) > 0 and comm.allreduce(len(placed["disk"])) > 0
    agree(comm, exercised, "no peer source or no disk tier in use: the test would not exercise them")


def global_batches(comm, pf):
    """Every remaining global batch: the ranks' local batches in rank order."""
    mine = [b.indices.copy() for b in pf]
    every = comm.allgather(mine)
    return [np.concatenate([every[r][s] for r in range(len(every))]) for s in range(len(mine))]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("resume_ranks", [2, 3])
@world_only
def test_a_4_rank_checkpoint_resumes_on_fewer_ranks(comm, shared_store, resume_ranks):
    st, batch, epochs, seed = shared_store, 12, 2, 19
    me = comm.Get_rank()
    steps = len(st) // batch
    sub = comm.Split(0 if me < resume_ranks else MPI.UNDEFINED, me)

    def uninterrupted():
        with Prefetcher(st, batch, epochs, seed, comm=comm, ram_bytes=4000) as pf:
            return global_batches(comm, pf)

    def first_half():
        with Prefetcher(st, batch, epochs, seed, comm=comm, ram_bytes=4000) as pf:
            mine = [next(iter(pf)).indices.copy() for _ in range(steps // 2)]
            state = pf.state()
        every = comm.allgather(mine)
        return [np.concatenate([every[r][s] for r in range(len(every))]) for s in range(len(mine))], state

    def resumed(state):
        if sub == MPI.COMM_NULL:
            return None
        with Prefetcher(st, batch, epochs, seed, comm=sub, ram_bytes=4000, start=state) as pf:
            assert pf.ranks == resume_ranks and pf.local_batch == batch // resume_ranks
            return global_batches(sub, pf)

    try:
        whole = collective(comm, uninterrupted)
        head, state = collective(comm, first_half)
        tail = collective(comm, resumed, state)
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
    agree(
        comm,
        state
        == {
            "epoch": 0,
            "sample_in_epoch": steps // 2 * batch,
            "seed": seed,
            "global_batch": batch,
            "samples": len(st),
            "drop_last": True,
        },
        f"state {state}",
    )
    if tail is not None:
        ok = len(head) + len(tail) == len(whole) == epochs * steps
        ok = ok and all((a == b).all() for a, b in zip(head + tail, whole))
        union = np.concatenate(head + tail)
        ok = ok and (np.sort(union) == np.sort(np.concatenate(whole))).all()
        agree_detail = f"{len(head)} + {len(tail)} global batches against {len(whole)}"
    else:
        ok, agree_detail = True, ""
    agree(comm, ok, "the resumed run is not the rest of the uninterrupted one: " + agree_detail)
