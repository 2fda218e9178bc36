"""Engine-driven point-to-point (hpcdl._core.transfer) under mpiexec -n 4: ranks
pair up (0-1, 2-3; an odd last rank only takes part in the agreements).
Bitwise round trips, tag matching, a size mismatch that fails the receiver
clearly, and a transfer that completes while the receiver's Python thread
makes no MPI call (the engine's thread progressed it)."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from hpcdl import _core
from hpcdl.errors import MismatchError

from conftest import agree, outcome


def partner(comm):
    """This rank's peer (rank ^ 1), or None for an odd last rank."""
    peer = comm.Get_rank() ^ 1
    return peer if peer < comm.Get_size() else None


def send(array, comm, peer, tag):
    return _core.transfer(True, _core.Buffer(array, None, False, True), comm, peer, tag)


def recv(array, comm, peer, tag):
    return _core.transfer(False, _core.Buffer(array, None, True, True), comm, peer, tag)


def pattern(nbytes, seed):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def settle(comm, run):
    """run() -> (ok, detail) on every rank; the ranks agree on the verdict (and on any exception)."""
    result, exc = outcome(run)
    ok, detail = result if exc is None else (False, repr(exc))
    agree(comm, ok, detail)


@pytest.fixture
def pair_comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_round_trip_is_bitwise_equal(pair_comm):
    """Each pair exchanges 0 B, 1 B, 4 KiB + 3 and 6 MiB both ways; what arrives equals what was sent."""
    comm, peer = pair_comm, partner(pair_comm)

    def run():
        if peer is None:
            return True, ""
        for i, nbytes in enumerate([0, 1, 4096 + 3, 6 << 20]):
            mine, theirs = pattern(nbytes, 10 * comm.Get_rank() + i), pattern(nbytes, 10 * peer + i)
            got = np.full(nbytes, 7, dtype=np.uint8)
            r = recv(got, comm, peer, 100 + i)
            s = send(mine, comm, peer, 100 + i)
            r.wait(60)
            s.wait(60)
            if not np.array_equal(got, theirs):
                return False, f"{nbytes} bytes differ from what rank {peer} sent"
        return True, ""

    settle(comm, run)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_many_tags_match_their_own_messages(pair_comm):
    """64 messages of distinct sizes and tags, received in the reverse order they
    were sent: each lands in the receive with its tag."""
    comm, peer = pair_comm, partner(pair_comm)
    tags = range(64)

    def run():
        if peer is None:
            return True, ""
        got = {t: np.zeros(1000 + 17 * t, dtype=np.uint8) for t in tags}
        receives = [recv(got[t], comm, peer, t) for t in reversed(tags)]
        sends = [send(pattern(1000 + 17 * t, 1000 * comm.Get_rank() + t), comm, peer, t) for t in tags]
        for h in receives + sends:
            h.wait(60)
        bad = [t for t in tags if not np.array_equal(got[t], pattern(1000 + 17 * t, 1000 * peer + t))]
        return not bad, f"tags {bad} got another message's bytes"

    settle(comm, run)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sent", [12, 20])
def test_size_mismatch_fails_the_receiver_clearly(pair_comm, sent):
    """The even rank sends ``sent`` bytes where the odd rank expects 16: the receive
    fails with MismatchError naming both ranks; the sender finishes; nobody hangs."""
    comm, peer = pair_comm, partner(pair_comm)

    def run():
        if peer is None:
            return None
        if comm.Get_rank() % 2 == 0:
            send(np.ones(sent, dtype=np.uint8), comm, peer, 5).wait(60)
            return None
        got = np.zeros(16, dtype=np.uint8)
        return outcome(recv(got, comm, peer, 5).wait, 60)[1]

    error, exc = outcome(run)
    if comm.Get_rank() % 2 == 1 and peer is not None:
        text = str(error)
        ok = (
            exc is None
            and isinstance(error, MismatchError)
            and f"rank {peer}" in text
            and f"rank {comm.Get_rank()}" in text
            and "16 bytes" in text
        )
        agree(comm, ok, f"expected a MismatchError naming ranks {peer} and {comm.Get_rank()}, got {exc or error!r}")
    else:
        agree(comm, exc is None, repr(exc))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_transfer_progresses_while_python_makes_no_mpi_call(pair_comm):
    """The even rank sends 64 MiB (far above any eager limit: a rendezvous that
    moves only while someone calls MPI). The odd rank posts the receive, then
    sleeps in pure Python; the transfer must be done before it waits: the
    engine's thread moved it. Both ranks enter the sleep after a barrier and
    the sleep is long (8 s against ~0.1 s of copying), so a loaded machine passes."""
    comm, peer = pair_comm, partner(pair_comm)
    nbytes = 64 << 20

    def run():
        if peer is None:
            comm.Barrier()
            return True, ""
        if comm.Get_rank() % 2 == 0:
            data = pattern(nbytes, 3)
            comm.Barrier()
            h = send(data, comm, peer, 9)
            h.wait(120)
            return True, ""
        got = np.zeros(nbytes, dtype=np.uint8)
        h = recv(got, comm, peer, 9)
        comm.Barrier()
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:  # pure Python: no MPI call on this thread
            sum(range(10000))
        done_before_wait = h.done()
        h.wait(120)
        return done_before_wait and np.array_equal(got, pattern(nbytes, 3)), (
            "the 64 MiB receive had not completed after 8 s without MPI calls on this thread"
            if not done_before_wait
            else "the bytes differ"
        )

    settle(comm, run)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_receive_posted_long_before_its_send_completes(pair_comm):
    """The odd rank posts a 64 MiB receive (a rendezvous) 3 s before the even rank
    sends: its engine polls it less and less often meanwhile (engine_wait_sleep),
    and the message still arrives whole, both ranks' counters showing its bytes."""
    comm, peer = pair_comm, partner(pair_comm)
    nbytes = 64 << 20

    def run():
        hpcdl.stats(reset=True)
        if peer is None:
            comm.Barrier()
            return True, ""
        if comm.Get_rank() % 2 == 0:
            data = pattern(nbytes, 4)
            comm.Barrier()
            time.sleep(3.0)
            send(data, comm, peer, 11).wait(120)
            sent = hpcdl.stats()["transfer"]["send"]
            return (sent["ops"], sent["bytes_sent"]) == (1, nbytes), f"send counters {sent}"
        got = np.zeros(nbytes, dtype=np.uint8)
        h = recv(got, comm, peer, 11)
        comm.Barrier()
        h.wait(120)
        received = hpcdl.stats()["transfer"]["receive"]
        if not np.array_equal(got, pattern(nbytes, 4)):
            return False, "the bytes differ"
        return (received["ops"], received["bytes_received"]) == (1, nbytes), f"receive counters {received}"

    settle(comm, run)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_freeing_a_pair_right_after_its_transfer_then_making_more():
    """A communicator freed as soon as its first transfer completes, while hpcdl's duplication of it
    (MPI_Comm_idup, started by that transfer) may still be in flight, five times over; then an
    allreduce on the world still runs. Open MPI crashed here (signal 11 in MPI_Comm_free)."""
    world = MPI.COMM_WORLD

    def run():
        for round_ in range(5):
            pair = world.Split(world.Get_rank() // 2, world.Get_rank())
            peer = partner(pair)
            if peer is not None:
                data = pattern(4096, round_)
                got = np.zeros_like(data)
                handle = send(data, pair, peer, 7) if pair.Get_rank() == 0 else recv(got, pair, peer, 7)
                handle.wait(60)
                if pair.Get_rank() == 1 and not np.array_equal(got, data):
                    return False, f"round {round_}: the transfer's bytes differ"
            pair.Free()
        total = np.ones(8, dtype=np.float64)
        hpcdl.allreduce(total, op="sum")
        return bool(np.all(total == world.Get_size())), f"allreduce after the frees gave {total[:2]}"

    settle(world, run)
