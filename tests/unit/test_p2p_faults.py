"""Faults around the engine's point-to-point transfers: each test starts its
own mpiexec job (helpers.fault_jobs.run_job: own session, killed on its bound)."""

from helpers.fault_jobs import run_job


def test_receive_from_a_rank_that_exits_fails_instead_of_hanging(tmp_path):
    """Rank 0 exchanges one message with rank 1, then exits; rank 1 waits for a
    second message that never comes: its receive fails (CancelledError naming
    rank 0) instead of waiting forever."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        from hpcdl import _core
        comm = WORLD.Dup()
        peer = 1 - RANK
        got = np.zeros(8, np.uint8)
        r = _core.transfer(False, _core.Buffer(got, None, True, True), comm, peer, 1)
        _core.transfer(True, _core.Buffer(np.ones(8, np.uint8), None, False, True), comm, peer, 1).wait(60)
        r.wait(60)
        if RANK == 0:
            time.sleep(0.5)
            sys.exit(0)
        start = time.monotonic()
        try:
            _core.transfer(False, _core.Buffer(got, None, True, True), comm, 0, 2).wait(90)
            print("rank 1 received a message nobody sent", flush=True)
        except Exception as exc:
            print(f"rank 1 got {type(exc).__name__} after {time.monotonic() - start:.0f} s: {exc}", flush=True)
    """,
    )
    assert "received a message nobody sent" not in out, out
    assert "rank 1 got CancelledError" in out, out
    assert "rank 0 of the communicator" in out, out
