"""Faults across ranks: each test starts its own small mpiexec job and checks
that it ends within a bound, with output that names the rank at fault.

Single-process tests (not marked mpi): the job runs in its own session and is
killed as a group if it outlives its bound, so a hang fails the test instead
of hanging the run. Bounds are generous (a loaded CI machine must pass).
"""

import os
import re
import signal
import sys
import time

import pytest

from conftest import MPIEXEC, finish_job, start_job
from helpers.fault_jobs import BOUND_S, TCP_LOOPBACK, finish, run_job, start, survivor_lines


def test_rank_that_exits_ends_the_job_and_survivors_name_it(tmp_path):
    """Rank 1 calls sys.exit(1) while ranks 0 and 2 wait in an allreduce it never
    submits: by default they fail naming it (rank 2 hears it through rank 0,
    the coordinator), and their uncaught error ends the job."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        if RANK == 1:
            time.sleep(0.5)
            sys.exit(1)
        hpcdl.allreduce(np.ones(1000, np.float32), name="never.on.rank1")
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    found = survivor_lines(out, (0, 2), 1)
    assert all(found.values()), out
    assert "CancelledError" in out, out


def test_rank_that_exits_inside_a_ring_ends_the_job(tmp_path):
    """Rank 1 exits with a deferred allreduce never marked ready: ranks 0 and 2
    already move that operation's data in the ring. They abandon the ring
    (cancelling what it posted) and fail naming rank 1."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        a = np.ones(3 << 20, np.float32)  # several ring chunks of 4 MiB on 3 ranks
        h = hpcdl.allreduce_async(a, name="big", deferred=True)
        if RANK == 1:
            time.sleep(1.0)  # the others are in the ring by now
            sys.exit(1)
        h.mark_ready()
        h.wait()
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    found = survivor_lines(out, (0, 2), 1)
    assert all(found.values()), out


def test_rank_that_raises_ends_the_job(tmp_path):
    rc, out = run_job(
        tmp_path,
        3,
        """
        if RANK == 1:
            time.sleep(0.5)
            raise RuntimeError("boom on rank 1")
        hpcdl.allreduce(np.ones(1000, np.float32), name="never.on.rank1")
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    assert "[hpcdl rank 1] uncaught RuntimeError: aborting the job" in out, out


def test_abort_on_uncaught_exception_can_be_switched_off(tmp_path):
    """Off (the function on every rank): the raising rank prints its traceback and exits without
    MPI_Abort; its engine leaves at exit (or the launcher ends the job), so the job still ends."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        hpcdl.abort_on_uncaught_exception(False)
        if RANK == 1:
            time.sleep(0.5)
            raise RuntimeError("boom on rank 1")
        hpcdl.allreduce(np.ones(1000, np.float32), name="never.on.rank1")
    """,
    )
    assert rc != 0, out
    assert "RuntimeError: boom on rank 1" in out, out
    assert "aborting the job" not in out, out
    # Each rank writes its answer to its own file: the launcher merges the ranks' stdout in chunks
    # that can split a line, so counting lines in it is not a check of two ranks.
    code = (
        "import os, sys, hpcdl; open(os.path.join(sys.argv[1], 'hook.' + os.environ['PMI_RANK']), 'w')"
        ".write(str(sys.excepthook is sys.__excepthook__))"
    )
    env = dict(os.environ, HPCDL_ABORT_ON_EXCEPTION="0")
    rc, out, _ = finish_job(
        start_job([MPIEXEC, "-n", "2", sys.executable, "-c", code, str(tmp_path)], env=env), BOUND_S
    )
    answers = {r: (tmp_path / f"hook.{r}").read_text() if (tmp_path / f"hook.{r}").exists() else None for r in (0, 1)}
    assert rc == 0 and answers == {0: "True", 1: "True"}, (answers, out)


def test_the_last_rank_to_exit_sends_nothing_to_ranks_already_gone(tmp_path):
    """Over TCP an MPI_Isend to a rank that has left (in MPI_Finalize or ended) can block in
    connect() for good, so the last rank to leave must not send its leave notice there.
    Ranks 1-3 leave first (their engines shut down as at interpreter exit, then they
    finalize); rank 0, the coordinator, which tells every rank, leaves after them. It knows
    from their own leave notices, so its exit is prompt and clean."""
    rc, out = run_job(
        tmp_path,
        4,
        """
        if RANK != 0:
            hpcdl._core.shutdown()  # what the atexit hook runs; then MPI_Finalize at exit
            open(os.path.join(os.environ["JOB_DIR"], f"left.{RANK}"), "w").close()
        else:
            marks = [os.path.join(os.environ["JOB_DIR"], f"left.{r}") for r in (1, 2, 3)]
            deadline = time.monotonic() + 90
            while not all(map(os.path.exists, marks)) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # they are in MPI_Finalize by now
            print(f"rank 0: the others left: {all(map(os.path.exists, marks))}", flush=True)
    """,
        extra_env=TCP_LOOPBACK,
    )
    assert rc == 0, out
    assert "rank 0: the others left: True" in out, out
    assert "could not tell the other ranks" not in out, out


def test_rank_killed_with_sigkill_ends_the_job(tmp_path):
    """No code runs on a SIGKILLed rank, nor, once the launcher (MPICH's hydra)
    ends the job, on the others: hydra's report is what names it. Its PID line
    names one of the job's processes, not always the killed one (a race in
    hydra), so the check is the report of the signal."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        if RANK == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        hpcdl.allreduce(np.ones(1000, np.float32), name="never.on.rank1")
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    assert "BAD TERMINATION" in out and "Killed (signal 9)" in out, out


RING_NEIGHBOURS = r"rank \d or rank \d of the communicator, its neighbours"


@pytest.mark.parametrize(
    "ranks, values, scheme, who, every_one_names_it, wait_sleep_us",
    [
        # several ring chunks of 4 MiB on 3 ranks: ranks 0 and 2 wait on their neighbours
        (3, "3 << 20", "ring", RING_NEIGHBOURS, True, None),
        # the same with the polite wait's sleeps capped below 16 us, and with none
        (3, "3 << 20", "ring", RING_NEIGHBOURS, True, "8"),
        (3, "3 << 20", "ring", RING_NEIGHBOURS, True, "0"),
        # recursive doubling: rank 0 folds into rank 1, which exchanges with rank 2
        (3, "16", "recursive doubling", r"rank \d of the communicator, its partner", True, None),
        # halving-doubling, 32 KiB per rank on 8: ranks 0, 3 and 5 exchange with rank 1, the
        # others then wait on them
        (8, "64 << 10", "halving-doubling", r"one of ranks \d, \d, \d of the communicator, its partners", False, None),
    ],
)
def test_a_stopped_rank_inside_an_allreduce_ends_the_job_after_stall_error_seconds(
    tmp_path, ranks, values, scheme, who, every_one_names_it, wait_sleep_us
):
    """A rank that stops (SIGSTOP; likewise one killed under a launcher that leaves
    the others running) sends nothing and never leaves: the ranks waiting on it make
    no progress, and with stall_error_seconds set they fail naming the ranks they wait
    on instead of waiting for ever, and their uncaught error ends the job, whatever
    HPCDL_WAIT_SLEEP_US allows between polls."""
    extra_env = None if wait_sleep_us is None else {"HPCDL_WAIT_SLEEP_US": wait_sleep_us}
    rc, out = run_job(
        tmp_path,
        ranks,
        f"""
        hpcdl.configure(stall_error_seconds=3)
        a = np.ones({values}, np.float32)
        assert hpcdl._core.dense_allreduce_algorithm(WORLD.Get_size(), a.nbytes) == "{scheme}"
        h = hpcdl.allreduce_async(a, name="stopped", deferred=True)
        if RANK == 1:
            time.sleep(1.0)  # the others wait on it by now
            os.kill(os.getpid(), signal.SIGSTOP)
        h.mark_ready()
        h.wait()
        print(f"rank {{RANK}} finished the allreduce", flush=True)
    """,
        extra_env=extra_env,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    failed = [r for r in range(ranks) if r != 1 and f"[hpcdl rank {r}] uncaught StallTimeoutError" in out]
    named = re.findall(
        rf"operation 'stopped' made no progress in its {scheme} for [\d.]+ s \(stall_error_seconds\): ({who})",
        out,
    )
    names_rank_1 = [bool(re.search(r"\b1\b", text)) for text in named]
    # A send MPI cannot cancel (a message of 64 KiB to a stopped rank, half in shared
    # memory) aborts the job after 10 s, the stall named in the abort's line.
    ended = failed or "aborting the job (MPI_Abort)" in out
    assert ended and named and (all if every_one_names_it else any)(names_rank_1), out


def test_a_stopped_pipeline_stage_is_named_after_the_stall_limits(tmp_path):
    """Stage 1 of a two-stage pipeline stops (SIGSTOP) before its second step: stage 0
    waits for its gradient, warns past stall_warning_seconds and fails past
    stall_error_seconds naming stage 1, instead of waiting for ever; its uncaught
    error ends the job."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        import torch
        import hpcdl.torch as hvt
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        pipe = hvt.Pipeline(model, torch.nn.functional.cross_entropy, micro_batches=2)
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)  # the first, slow, step
        hpcdl.configure(stall_warning_seconds=1, stall_error_seconds=3)
        WORLD.Barrier()
        if pipe.stage == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
        print(f"rank {RANK} finished the step", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the step" not in out, out
    stall = (
        r"stage 0 has waited [\d.]+ s for stage 1 \(micro-batch \d's (activation|gradient)[^)]*\): it may be stopped"
    )
    assert re.search(rf"\[hpcdl rank 0\] {stall}", out), out  # the StallWarning
    assert "[hpcdl rank 0] uncaught PipelineError" in out, out
    assert re.search(rf"PipelineError: stage 0 of 2 failed: StallTimeoutError: hpcdl: {stall}", out), out


# A rank stops (SIGSTOP) just before a collective call of hpcdl's Python side: the
# other rank must warn past stall_warning_seconds and fail past stall_error_seconds
# naming the call, where an mpi4py collective (or making a communicator) would block
# for ever. case: (the rank that stops, set-up code, the call, the call's name in the stall).
STOPPED_BEFORE = {
    "DistributedOptimizer's check": (
        1,
        "import torch\nimport hpcdl.torch as hvt\nmodel = torch.nn.Linear(4, 2)",
        "hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())",
        "the check that the parameters of DistributedOptimizer agree",
    ),
    "broadcast_optimizer_state's root": (
        0,
        "import torch\nimport hpcdl.torch as hvt\noptimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)",
        "hvt.broadcast_optimizer_state(optimizer, root_rank=0)",
        "broadcast_optimizer_state from rank 0",
    ),
    "hpcdl.horovod's init": (1, "import hpcdl.horovod.torch as hvd", "hvd.init()", "init"),
}


def assert_stall_reported(out, rank, stall):
    """``rank`` warned of the stall (regex), then failed with StallTimeoutError naming it."""
    assert re.search(rf"\[hpcdl rank {rank}\] {stall}", out), out  # the StallWarning
    assert f"[hpcdl rank {rank}] uncaught StallTimeoutError" in out, out
    assert re.search(rf"StallTimeoutError: hpcdl: {stall}", out), out


@pytest.mark.parametrize("case", STOPPED_BEFORE)
def test_a_rank_stopped_before_a_collective_call_is_reported_after_the_stall_limits(tmp_path, case):
    stopped, setup, call, what = STOPPED_BEFORE[case]
    body = f"""
{setup}
hpcdl.configure(stall_warning_seconds=1, stall_error_seconds=3)
WORLD.Barrier()
if RANK == {stopped}:
    os.kill(os.getpid(), signal.SIGSTOP)
{call}
print(f"rank {{RANK}} made the call", flush=True)
"""
    rc, out = run_job(tmp_path, 2, body)
    assert rc != 0, out
    assert "made the call" not in out, out
    stall = rf"{re.escape(what)} has waited [\d.]+ s for the 2 ranks of the communicator: some rank has not reached it"
    assert_stall_reported(out, 1 - stopped, stall)


def test_a_rank_that_stops_while_packing_is_named_after_the_stall_limits(tmp_path):
    """Rank 1 stops (SIGSTOP) as it starts writing its shard: rank 0, which waits for
    every rank's last progress report, warns past stall_warning_seconds and fails past
    stall_error_seconds naming rank 1, where a blocking receive waited for ever."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        import hpcdl.store.packing as packing
        from hpcdl import store
        src = os.path.join(os.environ["JOB_DIR"], "src")
        if RANK == 0:
            for i in range(40):
                os.makedirs(os.path.join(src, f"c{i % 2}"), exist_ok=True)
                with open(os.path.join(src, f"c{i % 2}", f"{i:03d}.bin"), "wb") as fh:
                    fh.write(os.urandom(100))
        WORLD.Barrier()
        write_shard = packing._write_shard
        def write_or_stop(*args):
            if RANK == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            return write_shard(*args)
        packing._write_shard = write_or_stop
        hpcdl.configure(stall_warning_seconds=1, stall_error_seconds=3)
        store.pack(src, os.path.join(os.environ["JOB_DIR"], "store"), shards=2, comm=WORLD, progress=False)
        print(f"rank {RANK} packed", flush=True)
    """,
    )
    assert rc != 0, out
    assert "packed" not in out, out
    assert_stall_reported(out, 0, r"pack has had no progress report for [\d.]+ s: rank 1 still writing")


def test_freeing_a_communicator_with_operations_in_flight_ends_the_job(tmp_path):
    """Rank 1 frees a communicator while its operation "a" is in flight there and
    rank 0 waits in "b" on it: rank 0 fails naming rank 1."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        sub = WORLD.Dup()
        hpcdl.allreduce(np.ones(4, np.float32), comm=sub)  # hpcdl's channels on sub exist
        if RANK == 1:
            h = hpcdl.allreduce_async(np.ones(4, np.float32), comm=sub, name="a")
            sub.Free()
            time.sleep(600)  # the job must end without this rank's help
        hpcdl.allreduce(np.ones(4, np.float32), comm=sub, name="b")
        print(f"rank {RANK} finished the allreduce", flush=True)
    """,
    )
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    assert survivor_lines(out, (0,), 1)[0], out
    assert "freed the communicator" in out, out


def test_first_operation_on_a_new_communicator_does_not_block_the_engine(tmp_path):
    """Rank 0 submits its first operation on a new communicator while rank 1 still
    waits for an operation both submitted before: the engine must run that one
    (the communicator's set-up must not hold it). Then rank 1 submits its first
    operation on another new communicator 2 s late: rank 0 gets a StallWarning
    meanwhile, and both results are right."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        sub = WORLD.Split(0, RANK)
        x, y = np.ones(1000, np.float32), np.full(10, 2.0, np.float32)
        h = hpcdl.allreduce_async(x)
        if RANK == 0:
            hpcdl.allreduce(y, comm=sub)
            h.wait()
        else:
            time.sleep(1.0)
            h.wait()
            hpcdl.allreduce(y, comm=sub)
        print(f"rank {RANK} first: {bool(np.all(x == 2) and np.all(y == 4))}", flush=True)

        late = WORLD.Dup()
        hpcdl.configure(stall_warning_seconds=0.5)
        z = np.ones(10, np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if RANK == 1:
                time.sleep(2.0)
            hpcdl.allreduce(z, comm=late)
        stalls = [str(w.message) for w in caught if issubclass(w.category, hpcdl.StallWarning)]
        warned = any("first operation on this communicator" in s for s in stalls) if RANK == 0 else not stalls
        print(f"rank {RANK} late: {bool(np.all(z == 2)) and warned} {stalls}", flush=True)
    """,
    )
    assert rc == 0, out
    for r in (0, 1):
        assert f"rank {r} first: True" in out, out
        assert f"rank {r} late: True" in out, out


def test_ctrl_c_interrupts_a_rank_blocked_on_a_new_communicator(tmp_path):
    """Rank 0 waits in its first operation on a communicator rank 1 never uses:
    SIGINT (Ctrl-C) to rank 0 raises KeyboardInterrupt there, whose uncaught
    exception ends the job."""
    proc = start(
        tmp_path,
        2,
        """
        sub = WORLD.Dup()
        if RANK == 1:
            time.sleep(600)
        with open(os.path.join(os.environ["JOB_DIR"], "rank0.pid"), "w") as f:
            f.write(str(os.getpid()))
        hpcdl.allreduce(np.ones(4, np.float32), comm=sub)
        print("rank 0 finished the allreduce", flush=True)
    """,
    )
    pid_file = tmp_path / "rank0.pid"
    deadline = time.monotonic() + BOUND_S
    while not pid_file.exists() or not pid_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert pid_file.exists(), finish(proc)[1]
    time.sleep(1.0)  # rank 0 is inside allreduce now
    os.kill(int(pid_file.read_text()), signal.SIGINT)
    rc, out = finish(proc)
    assert rc != 0, out
    assert "finished the allreduce" not in out, out
    assert "[hpcdl rank 0] uncaught KeyboardInterrupt" in out, out


def test_abandoned_ring_returns_only_once_its_transfers_are_cancelled(tmp_path):
    """Ranks 0 and 2 catch the error of a ring abandoned because rank 1 left, and
    reuse the buffer. The ring returned only after cancelling (or completing)
    what it had posted; a send MPI cannot cancel (rank 0's to the departed
    rank 1, under MPICH) ends the job instead of leaving MPI the buffer.

    Rank 1 leaves as at interpreter exit (its engine shuts down and tells the
    others) but its process lives on: were it to end at once, the launcher
    could kill ranks 0 and 2 before they decide, and what is checked here would
    not be seen."""
    rc, out = run_job(
        tmp_path,
        3,
        """
        a = np.ones(3 << 20, np.float32)
        h = hpcdl.allreduce_async(a, name="big", deferred=True)
        if RANK == 1:
            time.sleep(1.0)
            hpcdl._core.shutdown()  # what hpcdl's atexit hook runs
            time.sleep(45.0)
            sys.exit(1)
        h.mark_ready()
        try:
            h.wait()
        except hpcdl.CancelledError as exc:
            a[:] = -1.0  # the caller's memory again
            print(f"rank {RANK} caught: {exc}", flush=True)
        time.sleep(1.0)
        del a  # freed: MPI must not write here any more
        time.sleep(1.0)
    """,
    )
    assert rc != 0, out
    caught = {r: f"rank {r} caught: hpcdl: rank 1 of the communicator" in out for r in (0, 2)}
    cannot_cancel = "[hpcdl rank 0] ring allreduce: a transfer could not be cancelled" in out
    assert caught[2] and (caught[0] or cannot_cancel), out


# The engine thread's own messages (a rank left, a deferred operation not marked
# ready) reach Python as warnings at the next call into hpcdl: filterable, the
# rank in front, never written to stderr behind the filters' back.

LEFT_WHILE_WAITING = """
        submitted = os.path.join(os.environ["JOB_DIR"], "submitted")
        if RANK == 1:  # leaves once rank 0's operation is pending, so that rank 0 is told
            deadline = time.monotonic() + 90
            while not os.path.exists(submitted) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(0)
        h = hpcdl.allreduce_async(np.ones(1000, np.float32), name="never.on.rank1")
        open(submitted, "w").close()
        try:
            h.wait()
        except hpcdl.CancelledError as exc:
            print(f"rank 0 raised: {'rank 1 of the communicator' in str(exc)}", flush=True)
"""


def test_a_rank_that_left_is_named_in_an_engine_warning(tmp_path):
    """Rank 0 waits in an allreduce rank 1 never submits; rank 1 exits. Rank 0's wait
    issues an EngineWarning naming rank 1 (catchable like any warning, rank in front)
    before it raises CancelledError."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        recording = warnings.catch_warnings(record=True)
        caught = recording.__enter__()
        warnings.simplefilter("always")
    """
        + LEFT_WHILE_WAITING
        + """
        left = [str(w.message) for w in caught if w.category is hpcdl.EngineWarning]
        ok = any(m.startswith("[hpcdl rank 0] rank 1 of the communicator (rank 1 of COMM_WORLD) left") for m in left)
        print(f"rank {RANK} warned: {ok} {left}", flush=True)
    """,
    )
    assert rc == 0, out
    assert "rank 0 raised: True" in out and "rank 0 warned: True" in out, out


def test_the_news_of_a_rank_that_left_obeys_warning_filters(tmp_path):
    """The same with warnings.simplefilter("ignore"): the operation still raises, and
    nothing of the engine's reaches the output."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        warnings.simplefilter("ignore")
    """
        + LEFT_WHILE_WAITING,
    )
    assert rc == 0, out
    assert "rank 0 raised: True" in out, out
    assert "[hpcdl rank 0]" not in out and "EngineWarning" not in out, out


def test_a_deferred_operation_not_marked_ready_warns_through_warning_filters(tmp_path):
    """The engine waits for a deferred operation's mark_ready(): its StallWarning
    arrives at the next call into hpcdl (here mark_ready() itself) with the rank in
    front; "ignore" silences it; a flood keeps the first kMaxNotices (64) and says
    how many more were dropped."""
    rc, out = run_job(
        tmp_path,
        1,
        """
        def wait_unready(name, seconds):
            a = np.ones(4, np.float32)
            h = hpcdl.allreduce_async(a, comm=MPI.COMM_SELF, name=name, deferred=True)
            time.sleep(seconds)
            h.mark_ready()
            h.wait()

        hpcdl.allreduce(np.ones(1, np.float32), comm=MPI.COMM_SELF)  # its channels are set up
        hpcdl.configure(stall_warning_seconds=0.2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wait_unready("late", 1.5)
        stalls = [str(w.message) for w in caught if w.category is hpcdl.StallWarning]
        expected = "[hpcdl rank 0] deferred operation 'late' is agreed on every rank but has waited "
        print(f"warned: {bool(stalls) and all(s.startswith(expected) for s in stalls)} {stalls}", flush=True)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            wait_unready("silenced", 1.5)
        print(f"silenced: {len(caught)}", flush=True)

        # A notice at each of the engine's 20 ms wakes: up to 400 in 8 s, 65 overflow the 64 kept.
        hpcdl.configure(stall_warning_seconds=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wait_unready("flood", 8.0)
        # mark_ready() issues what was kept; a notice the engine adds meanwhile comes at wait().
        first = [(w.category.__name__, str(w.message)) for w in caught[:65]]
        flood = sum(kind == "StallWarning" and "'flood'" in m for kind, m in first[:64])
        dropped = [m for kind, m in first[64:] if kind == "EngineWarning" and "more engine messages were dropped" in m]
        print(f"flood: {flood} {dropped}", flush=True)
    """,
    )
    assert rc == 0, out
    assert "warned: True" in out, out
    assert "silenced: 0" in out and "'silenced'" not in out, out
    assert "flood: 64 ['[hpcdl rank 0] " in out, out


def test_a_first_operation_given_up_during_set_up_leaves_the_engine_working(tmp_path):
    """Rank 0 gives up (stall limit) on the first operation of a new communicator
    while its channels are still being set up; rank 1 submits that operation later,
    which completes the set-up. Rank 0's engine must not report the operation it
    gave up on (it once aborted with std::out_of_range there): rank 1's fails with a
    stall error, and the next operation on the communicator sums right."""
    rc, out = run_job(
        tmp_path,
        2,
        """
        hpcdl.configure(stall_error_seconds=1.0)
        comm = WORLD.Dup()
        a = np.ones(4, np.float32)
        if RANK == 0:
            try:
                hpcdl.allreduce(a, comm=comm, name="first")
            except hpcdl.StallTimeoutError as exc:
                print(f"rank 0 gave up: {exc}", flush=True)
        WORLD.Barrier()
        if RANK == 1:
            try:
                hpcdl.allreduce(a, comm=comm, name="first")
            except hpcdl.StallTimeoutError as exc:
                print(f"rank 1 gave up: {exc}", flush=True)
        WORLD.Barrier()
        b = np.full(4, RANK + 1.0, np.float32)
        hpcdl.allreduce(b, comm=comm, name="second")
        print(f"rank {RANK} second {b.tolist()}", flush=True)
    """,
        bound=60,
    )
    assert rc == 0, out
    assert "rank 0 gave up:" in out and "rank 1 gave up:" in out, out
    assert "rank 0, which submitted it earlier and gave up on it" in out, out
    assert "rank 0 second [3.0, 3.0, 3.0, 3.0]" in out and "rank 1 second [3.0, 3.0, 3.0, 3.0]" in out, out
    assert "out_of_range" not in out, out
