"""A thread the OS refuses: each child process lowers its address-space limit
(RLIMIT_AS) to a few MiB above what it maps, less than a thread's 8 MiB stack,
so that hpcdl's next thread really cannot be created. The call must raise a
Python exception naming that thread, never end the process in std::terminate
(SIGABRT), and work once the limit is lifted. Each child runs in its own session
and is killed as a group if it outlives its bound.
"""

import os
import re
import signal
import sys
import textwrap

import pytest
from mpi4py import MPI

from conftest import finish_job, start_job
from helpers.fault_jobs import BOUND_S, run_job
from helpers.prefetch import make_store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")

# A child's own: glibc reuses the stacks of threads that ended, so a process
# that ran threads before (packing a store) could start more without mapping anything.
PRELUDE = """
import os, resource, sys, time
import numpy as np
from mpi4py import MPI
import hpcdl


def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def limit_address_space(extra_mib):
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (extra_mib << 20), resource.RLIM_INFINITY))


def lift_limit():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def threads_now():
    return len(os.listdir("/proc/self/task"))


def threads_left(before, seconds=5.0):
    # A joined thread's task stays in /proc until the kernel reaps it, a moment
    # after pthread_join returns (longer on a loaded machine); one still running stays.
    deadline = time.monotonic() + seconds
    while threads_now() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads_now() - before
"""


def run_child(tmp_path, body, *args):
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = start_job([sys.executable, str(script), *map(str, args)], env=dict(os.environ, PYTHONUNBUFFERED="1"))
    code, out, _ = finish_job(proc, BOUND_S)
    assert code != -signal.SIGABRT, f"the child aborted (std::terminate):\n{out}"
    return code, out


def test_engine_thread_refused_raises_and_a_later_submission_starts_it(tmp_path):
    code, out = run_child(
        tmp_path,
        """
        limit_address_space(2)
        for attempt in (1, 2):
            try:
                hpcdl.allreduce(np.ones(8, np.float32), comm=MPI.COMM_SELF)
                print(f"attempt {attempt}: no error", flush=True)
            except hpcdl.errors.HpcdlError as exc:
                print(f"attempt {attempt}: {exc}", flush=True)
        lift_limit()
        print("after the limit:", hpcdl.allreduce(np.ones(8, np.float32), comm=MPI.COMM_SELF).tolist(), flush=True)
    """,
    )
    assert code == 0, out
    for attempt in (1, 2):
        assert f"attempt {attempt}: hpcdl could not start its engine thread: " in out, out
    assert "after the limit: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in out, out


def test_prefetcher_threads_refused_raise_and_none_is_left_running(tmp_path):
    """The limit grows by 4 MiB per attempt until the prefetcher starts: the
    attempts before fail at their first or a later thread, and after each the
    threads it had started are joined."""
    store = make_store(str(tmp_path), files=40, comm=MPI.COMM_SELF)
    store.close()
    code, out = run_child(
        tmp_path,
        """
        from hpcdl import store
        from hpcdl.prefetch import Prefetcher

        st = store.Store(sys.argv[1])
        kwargs = dict(ram_bytes=0, staging_bytes=1 << 16, staging_threads=4)
        before = threads_now()
        for extra_mib in range(2, 200, 4):
            limit_address_space(extra_mib)
            try:
                pf = Prefetcher(st, 8, 1, 0, **kwargs)
            except hpcdl.errors.HpcdlError as exc:
                lift_limit()
                print(f"refused at +{extra_mib} MiB: {exc}; threads left: {threads_left(before)}", flush=True)
                continue
            lift_limit()
            print(f"started at +{extra_mib} MiB", flush=True)
            with pf:
                print(f"batches: {sum(1 for _ in pf)}", flush=True)
            break
    """,
        tmp_path / "store",
    )
    assert code == 0, out
    refused = [line for line in out.splitlines() if line.startswith("refused at")]
    assert refused, out
    for line in refused:
        assert "hpcdl could not start the prefetcher's " in line and line.endswith("threads left: 0"), out
    assert "batches: 5" in out, out


def test_prefetcher_thread_refused_on_one_rank_fails_it_on_every_rank(tmp_path):
    """Rank 1's limit grows by 2 MiB per attempt until the prefetcher starts.
    First its peer-tier server thread is refused: the ranks' agreement on the
    peer tier's set-up fails on both. Then a later thread (staging, fill) is
    refused on rank 1 alone: both ranks close together and raise, rank 0 naming
    rank 1. Never does a rank wait for a peer that has no prefetcher."""
    make_store(str(tmp_path), files=40, comm=MPI.COMM_SELF).close()
    rc, out = run_job(
        tmp_path,
        2,
        PRELUDE
        + textwrap.dedent("""
        from hpcdl import store
        from hpcdl.prefetch import Prefetcher

        st = store.Store(os.environ["STORE"])
        kwargs = dict(comm=WORLD, ram_bytes=1 << 20, staging_bytes=1 << 16, staging_threads=1)
        with open(os.path.join(os.environ["JOB_DIR"], f"rank{RANK}.txt"), "w") as log:
            for extra_mib in range(2, 100, 2):
                if RANK == 1:
                    limit_address_space(extra_mib)
                try:
                    pf = Prefetcher(st, 8, 1, 0, **kwargs)
                except hpcdl.errors.HpcdlError as exc:
                    lift_limit()
                    print(f"raised: {exc}", file=log, flush=True)
                    continue
                lift_limit()
                with pf:
                    print(f"batches: {sum(1 for _ in pf)}", file=log, flush=True)
                break
    """),
        extra_env={"STORE": str(tmp_path / "store")},
    )
    assert rc == 0, out
    logs = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert len(logs[0]) == len(logs[1]) and logs[0][-1] == logs[1][-1] == "batches: 5", (logs, out)
    server = "hpcdl could not start the prefetcher's peer-tier server thread: "
    later = re.compile(r"hpcdl could not start the prefetcher's (staging|fill) thread: ")
    attempts = list(zip(logs[0][:-1], logs[1][:-1]))
    assert any(server in mine for _, mine in attempts), (logs, out)
    assert any(later.search(mine) for _, mine in attempts), (logs, out)
    for theirs, mine in attempts:
        if server in mine:
            assert theirs.startswith("raised: peer tier: rank 1 of the communicator could not set up"), (logs, out)
        else:
            assert later.match(mine[len("raised: ") :]) and theirs == "raised: [hpcdl rank 1] " + mine[8:], (logs, out)


def test_store_reader_threads_refused_read_the_same_bytes_on_the_calling_thread(tmp_path):
    """read_many()'s pool starts the workers the OS grants; with none it reads
    on the calling thread alone, the same bytes."""
    make_store(str(tmp_path), files=40, comm=MPI.COMM_SELF).close()
    code, out = run_child(
        tmp_path,
        """
        from hpcdl import store

        indices = list(range(40))
        expected = store.Store(sys.argv[1], threads=1)
        wanted = [expected.read(i) for i in indices]
        st = store.Store(sys.argv[1], threads=8)
        before = threads_now()
        limit_address_space(2)
        buffer, offsets = st.read_many(indices)
        pool_threads = threads_now() - before
        lift_limit()
        same = all(bytes(buffer[offsets[k]:offsets[k + 1]]) == bytes(wanted[k]) for k in range(len(indices)))
        print(f"pool threads: {pool_threads}; same bytes: {same}", flush=True)
    """,
        tmp_path / "store",
    )
    assert code == 0, out
    assert "pool threads: 0; same bytes: True" in out, out
