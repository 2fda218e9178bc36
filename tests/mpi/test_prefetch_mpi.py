"""The prefetcher under 4 MPI ranks: every sample exactly once per epoch across
ranks, peer fetches that deliver the right bytes, each sample read from the
store once per job when every rank caches what it reads, a silent peer -> the
store, mismatched settings or stores -> an error on every rank, a peer's wrong
bytes never delivered. Collective-safe (conftest)."""

import shutil
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from hpcdl.errors import MismatchError
from hpcdl.prefetch import Prefetcher, PrefetchWarning
from hpcdl.store import Store

from conftest import agree, collective, multi_rank, outcome, world_only
from helpers.prefetch import STALE_EDITS, copies_made_by_rank0, store_made_by_rank0

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def shared_store():
    yield from store_made_by_rank0(MPI.COMM_WORLD, "hpcdl-prefetch-mpi-", files=160, seed=8)


@pytest.fixture(scope="module")
def store_copies():
    yield from copies_made_by_rank0(MPI.COMM_WORLD, "hpcdl-prefetch-copies-", files=160, seed=8)


def delivered(pf, st):
    """(indices, all bytes right) over the rest of the run."""
    ids, right = [], True
    for batch in pf:
        ids.append(batch.indices.copy())
        right &= all(bytes(batch[j]) == st.read(int(i)) for j, i in enumerate(batch.indices))
    return (np.concatenate(ids) if ids else np.zeros(0, np.uint64)), right


@multi_rank
def test_every_sample_once_per_epoch_across_ranks(comm, shared_store):
    st, epochs, batch = shared_store, 3, 16

    def run():
        with Prefetcher(st, batch, epochs, 5, comm=comm, ram_bytes=0) as pf:
            return delivered(pf, st)

    (ids, right) = collective(comm, run)
    agree(comm, right, "wrong bytes")
    every = comm.allgather(ids)
    steps = len(st) // batch
    per_rank = steps * batch // comm.Get_size()
    ok = True
    for e in range(epochs):
        seen = np.concatenate([x[e * per_rank : (e + 1) * per_rank] for x in every]).astype(np.int64)
        counts = np.bincount(seen, minlength=len(st))
        ok &= counts.max() == 1 and counts.sum() == steps * batch
    agree(comm, ok, "a sample read twice (or missed) in an epoch")


@multi_rank
def test_peer_fetches_deliver_the_right_bytes(comm, shared_store):
    st = shared_store
    # Each rank's RAM holds about a third of the data: much of what a rank
    # misses locally sits in a peer's RAM.
    ram = int(st.sizes.sum()) // 3

    def run():
        with Prefetcher(st, 8, 4, 11, comm=comm, ram_bytes=ram, peer_timeout=10.0) as pf:
            ids, right = delivered(pf, st)
        return ids, right, pf.stats()  # final: counts every request answered

    ids, right, stats = collective(comm, run)
    agree(comm, right, "wrong bytes")
    peer_hits = comm.allreduce(stats["hits"]["peer"])
    peer_fills = comm.allreduce(stats["peer_fills"])
    served = comm.allreduce(stats["served_to_peers"])
    agree(
        comm,
        peer_hits > 0 and peer_fills > 0 and peer_hits + peer_fills == served,
        f"peer hits {peer_hits}, peer fills {peer_fills}, served {served}",
    )
    agree(comm, sum(stats["hits"].values()) == len(ids), f"hits {stats['hits']} for {len(ids)} reads")


@pytest.mark.parametrize("tiers,read_gap", [("ram", 0), ("ram", 1 << 20), ("ram+disk", 0)])
@world_only
def test_each_sample_is_read_from_the_store_once_per_job(comm, shared_store, tiers, read_gap):
    # Every rank caches all it reads (RAM, or a small RAM and a disk tier): a
    # sample's first reader loads it from the store, every later reader from
    # a peer that read it earlier, so the store serves each sample once.
    st, total = shared_store, int(shared_store.sizes.sum())
    disk_dir = tempfile.mkdtemp(prefix=f"hpcdl-prefetch-disk{comm.Get_rank()}-") if tiers == "ram+disk" else None
    ram, disk = (total, 0) if tiers == "ram" else (total // 4, total)

    def run():
        with Prefetcher(
            st,
            8,
            3,
            21,
            comm=comm,
            ram_bytes=ram,
            disk_dir=disk_dir,
            disk_bytes=disk,
            peer_timeout=30.0,
            read_gap=read_gap,
        ) as pf:
            ids, right = delivered(pf, st)
        return ids, right, pf.stats()

    try:
        ids, right, stats = collective(comm, run)
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    agree(comm, right, "wrong bytes")
    read = np.unique(np.concatenate(comm.allgather(ids)).astype(np.int64))
    distinct = int((st.sizes[read] > 0).sum())  # an empty sample needs no read
    store_reads = comm.allreduce(stats["store_reads"])
    agree(comm, store_reads == distinct, f"{store_reads} store reads for {distinct} distinct non-empty samples")
    # Coalesced fills: fewer read calls than samples; without gaps read through, each byte once per job.
    requests, nbytes = comm.allreduce(stats["store_requests"]), comm.allreduce(stats["store_bytes"])
    agree(comm, requests < store_reads, f"{requests} store requests for {store_reads} samples")
    if read_gap == 0:
        agree(comm, nbytes == int(st.sizes[read].sum()), f"{nbytes} bytes read for {int(st.sizes[read].sum())}")
    peer_fills, served = comm.allreduce(stats["peer_fills"]), comm.allreduce(stats["served_to_peers"])
    agree(comm, peer_fills > 0 and peer_fills == served, f"peer fills {peer_fills}, served {served}")
    agree(comm, stats["hits"]["store"] == 0 and sum(stats["hits"].values()) == len(ids), repr(stats["hits"]))
    if tiers == "ram+disk":
        agree(comm, stats["hits"]["disk"] > 0, "no disk hits")
        disk_fills = comm.allreduce(stats["disk_written"])
        agree(comm, disk_fills > 0, "nothing written to the disk tiers")


@world_only
def test_a_silent_peer_means_reading_the_store(comm, shared_store):
    st = shared_store
    ram = int(st.sizes.sum()) // 3
    slow = 1.0 if comm.Get_rank() == 1 else 0.0  # rank 1 stalls for a second before its first answer

    def run():
        with Prefetcher(st, 8, 2, 13, comm=comm, ram_bytes=ram, peer_timeout=0.05, _serve_delay=slow) as pf:
            ids, right = delivered(pf, st)
            return right, pf.stats()

    right, stats = collective(comm, run)
    agree(comm, right, "wrong bytes")
    timeouts = comm.allreduce(stats["peer_timeouts"])
    agree(comm, timeouts > 0, "no request timed out")


@world_only
def test_a_peer_that_stops_answering_costs_a_few_timeouts(comm, shared_store):
    # Rank 1's server stops answering for longer than the whole run (it catches
    # up before close(), which waits for every answer). Every other rank gives
    # it up after its first timeouts and reads the store instead: at most one
    # timeout per requesting thread (4 staging threads and the peer filler),
    # however many samples rank 1 holds.
    st = shared_store
    ram = int(st.sizes.sum()) // 3
    gone = 12.0 if comm.Get_rank() == 1 else 0.0

    def run():
        with Prefetcher(
            st, 8, 4, 17, comm=comm, ram_bytes=ram, staging_threads=4, peer_timeout=0.5, _serve_delay=gone
        ) as pf:
            ids, right = delivered(pf, st)
            return right, pf.stats()

    right, stats = collective(comm, run)
    agree(comm, right, "wrong bytes")
    timeouts = comm.allgather((stats["peer_timeouts"], stats["peers_gone"]))
    agree(comm, sum(t for t, _ in timeouts) > 0, "no request to rank 1 timed out")
    # (a loaded machine may time out on a healthy peer too: the bound is per peer given up on)
    agree(
        comm,
        all(t <= 5 * g and (g > 0) == (t > 0) for t, g in timeouts),
        f"(timeouts, peers given up on) per rank {timeouts}: a gone peer cost more than one timeout per thread",
    )


@multi_rank
def test_peer_replies_in_pieces_deliver_the_right_bytes(comm, shared_store):
    # Replies cut into MPI messages of 7 bytes: the path a sample of 2 GiB or
    # more takes with the default limit of 1 GiB per message.
    st = shared_store
    ram = int(st.sizes.sum()) // 3

    def run():
        with Prefetcher(st, 8, 2, 11, comm=comm, ram_bytes=ram, peer_timeout=30.0, _peer_message_bytes=7) as pf:
            ids, right = delivered(pf, st)
        return ids, right, pf.stats()

    ids, right, stats = collective(comm, run)
    agree(comm, right, "wrong bytes")
    peer_hits, served = comm.allreduce(stats["hits"]["peer"]), comm.allreduce(stats["served_to_peers"])
    peer_fills = comm.allreduce(stats["peer_fills"])
    agree(
        comm,
        peer_hits + peer_fills > 0 and peer_hits + peer_fills == served,
        f"peer hits {peer_hits}, peer fills {peer_fills}, served {served}",
    )
    agree(comm, stats["peer_timeouts"] == 0 and stats["peer_errors"] == 0, repr(stats))


@multi_rank
def test_mismatched_settings_raise_on_every_rank(comm, shared_store):
    seed = 1 if comm.Get_rank() == 2 else 0
    _, err = outcome(Prefetcher, shared_store, 8, 2, seed, comm=comm)
    agree(comm, isinstance(err, MismatchError), repr(err))
    batch = 6 if comm.Get_rank() == 0 else 8
    _, err = outcome(Prefetcher, shared_store, batch, 2, 0, comm=comm)
    agree(comm, err is not None, "no error for different batch sizes")
    _, err = outcome(Prefetcher, shared_store, 10, 2, 0, comm=comm)  # 10 is not a multiple of 4 ranks
    agree(comm, isinstance(err, ValueError) and "multiple" in str(err), repr(err))


@pytest.mark.parametrize("stale", sorted(STALE_EDITS))
@multi_rank
def test_ranks_reading_different_stores_raise_on_every_rank(comm, store_copies, stale):
    """Issue 30's case: rank 0 reads a stale copy of the data set (the same
    sizes with byte 0 of every sample different, or every sample one byte
    shorter) and holds a RAM tier the others fetch from. Construction raises
    MismatchError on every rank, naming the ranks and their store paths,
    instead of serving rank 0's bytes to the others. A faithful copy at
    another path (a per-node copy) is accepted and delivers the right bytes."""
    rank = comm.Get_rank()
    mine = store_copies[stale] if rank == 0 else store_copies["fresh"]
    pf, err = outcome(Prefetcher, mine, 8, 2, 5, comm=comm, ram_bytes=(1 << 30) if rank == 0 else 0)
    if pf is not None:
        pf.close()
    others = "rank 1 has" if comm.Get_size() == 2 else f"ranks 1-{comm.Get_size() - 1} have"
    text = str(err)
    agree(
        comm,
        isinstance(err, MismatchError)
        and "the stores" in text
        and "rank 0 has fingerprint" in text
        and f"{others} fingerprint" in text
        and f"'{store_copies[stale]}'" in text
        and f"'{store_copies['fresh']}'" in text,
        repr(err),
    )
    st = Store(store_copies["same"] if rank == 0 else store_copies["fresh"])
    with Prefetcher(st, 8, 2, 5, comm=comm, ram_bytes=(1 << 30) if rank == 0 else 0) as pf:
        ids, right = delivered(pf, st)
    agree(comm, right and len(ids) > 0, f"{len(ids)} samples, right bytes: {right}")


@pytest.mark.parametrize("stale", sorted(STALE_EDITS))
@world_only
def test_a_peer_that_sends_other_bytes_is_not_served(comm, store_copies, stale, monkeypatch):
    """The check on arrival alone: with the stores' agreement bypassed (every
    rank's fingerprint made equal), rank 0 reads a stale copy and really sends
    its other bytes (byte 0 different: a CRC32C mismatch; one byte shorter: a
    length mismatch), as a peer whose tier or transfer damaged them would.
    Every rank caches, so both the peer filler's and the staging threads'
    fetches meet them. No rank delivers a byte that is not its own store's:
    a bad reply is read from the store instead, counted (peer_damaged), and
    warned about once, naming the peer and this rank's store path."""
    # raising=False: should the method be renamed, the stores' agreement fails this test instead
    monkeypatch.setattr(Store, "fingerprint", lambda self: "bypassed", raising=False)
    rank = comm.Get_rank()
    st = Store(store_copies[stale] if rank == 0 else store_copies["fresh"])
    ram = (1 << 30) if rank == 0 else int(st.sizes.sum()) // 3

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrefetchWarning)
            with Prefetcher(st, 8, 3, 11, comm=comm, ram_bytes=ram, peer_timeout=30.0) as pf:
                ids, right = delivered(pf, st)
        return right, pf.stats(), [str(w.message) for w in caught if issubclass(w.category, PrefetchWarning)]

    right, stats, messages = collective(comm, run)
    agree(comm, right, "a sample that is not this rank's store's was delivered")
    damaged = [m for m in messages if " sent sample " in m]
    named = all(st.shard_paths[0] in m and ("rank 0 sent" in m) == (rank != 0) for m in damaged)
    agree(
        comm,
        stats.get("peer_damaged", 0) >= 1 and stats["peers_gone"] >= 1 and damaged and named,
        f"peer_damaged {stats.get('peer_damaged')}, peers_gone {stats['peers_gone']}, warnings {messages}",
    )


@multi_rank
def test_a_bad_argument_on_one_rank_raises_on_every_rank(comm, shared_store):
    """One rank alone fails its local set-up (a store path that does not exist,
    a negative size, a staging buffer that cannot be allocated): every rank
    raises, the others naming it, instead of waiting in the peer tier's
    collective MPI_Comm_dup for it."""
    bad = comm.Get_size() - 1
    mine = comm.Get_rank() == bad

    def named(err):
        return err is not None and (mine or f"[hpcdl rank {bad}]" in str(err))

    _, err = outcome(Prefetcher, "/nonexistent/hpcdl-store" if mine else shared_store, 8, 1, 0, comm=comm)
    agree(comm, named(err), repr(err))
    _, err = outcome(Prefetcher, shared_store, 8, 1, 0, comm=comm, staging_bytes=-1 if mine else 0)
    agree(comm, named(err) and "staging_bytes" in str(err), repr(err))
    _, err = outcome(Prefetcher, shared_store, 8, 1, 0, comm=comm, staging_bytes=1 << 62 if mine else 0)
    agree(comm, named(err) and "staging buffer" in str(err), repr(err))
    with Prefetcher(shared_store, 8, 1, 0, comm=comm) as pf:  # the ranks still work together afterwards
        ids, right = delivered(pf, shared_store)
    agree(comm, right and len(ids) == len(shared_store) // 8 * 8 // comm.Get_size(), f"{len(ids)} samples")


@multi_rank
def test_a_prefetcher_dropped_without_close_is_closed(comm, shared_store):
    """Dropped on every rank without close(): its __del__ closes it (collective,
    bounded by its timeout), which joins the threads and frees the peer tier's
    communicator; the ranks go on with a new one."""
    import gc

    pf = Prefetcher(shared_store, 8, 1, 0, comm=comm)
    core = pf._core
    next(iter(pf))
    del pf
    gc.collect()
    agree(comm, core.stats() is None, "the core is still open")
    with Prefetcher(shared_store, 8, 1, 0, comm=comm) as pf:
        ids, right = delivered(pf, shared_store)
    agree(comm, right and len(ids) > 0, f"{len(ids)} samples")


@multi_rank
def test_auto_read_settings_are_rank_0s_on_every_rank(comm, shared_store):
    # Rank 0 measures the store and broadcasts its speed: every rank derives the
    # same settings. A rank that asks for a size keeps it, without a hang.
    st = shared_store
    gap = 0 if comm.Get_rank() == 1 else "auto"

    def run():
        with Prefetcher(st, 8, 1, 3, comm=comm, ram_bytes=int(st.sizes.sum()), read_gap=gap) as pf:
            ids, right = delivered(pf, st)
        return right, pf.read_settings

    right, chosen = collective(comm, run)
    agree(comm, right, "wrong bytes")
    everyone = comm.allgather({k: v for k, v in chosen.items() if k not in ("read_gap", "auto")})
    agree(comm, all(c == everyone[0] for c in everyone), f"read settings differ: {everyone}")
    agree(comm, (chosen["read_gap"] == 0) == (comm.Get_rank() == 1), f"read_gap {chosen['read_gap']}")
