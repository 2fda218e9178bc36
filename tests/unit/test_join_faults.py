"""Faults while ranks have joined (hpcdl.join): each test starts its own small
mpiexec job, bounded, and checks that the ranks left behind fail naming the
rank that left instead of waiting in their join forever."""

from helpers.fault_jobs import run_job, survivor_lines


def test_rank_that_exits_while_the_others_wait_in_join_ends_the_job(tmp_path):
    """Ranks 0 and 2 have joined; rank 1, still training, exits: their joins fail naming it."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        if RANK == 1:
            hpcdl.allreduce(np.ones(8, np.float32), name="live.step")  # the joined ranks add zeros
            time.sleep(0.5)
            sys.exit(1)
        last = hpcdl.join()
        print(f"rank {RANK} finished the join: {last}", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the join" not in out, out
    found = survivor_lines(out, (0, 2), 1)
    assert all(found.values()), out


def test_joined_rank_that_exits_fails_the_live_ranks_operation(tmp_path):
    """Rank 2 joins and then exits: ranks 0 and 1 would wait for its zeros; they fail naming it,
    and the first of them to fail ends the job."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        if RANK == 2:
            h = hpcdl.join_async()
            time.sleep(0.5)
            sys.exit(1)
        time.sleep(1.5)
        hpcdl.allreduce(np.ones(8, np.float32), name="after.rank2.left")
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    assert "rank 2 of the communicator (rank 2 of COMM_WORLD) left" in out, out
    # the first survivor to fail aborts the job, which may end the other before it prints
    assert any(f"[hpcdl rank {r}] uncaught CancelledError" in out for r in (0, 1)), out
