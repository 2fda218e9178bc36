"""HPCDL_TIMELINE writes one valid Chrome trace with a track per rank: the
engine's collectives and the prefetcher's fetches and stalls."""

import json
import os
import subprocess
import sys

PROGRAM = """
import numpy as np, hpcdl
for i in range(3):
    hpcdl.allreduce(np.ones(100_000, dtype=np.float32), name=f"grad.{i}")
hpcdl.broadcast(np.ones(10, dtype=np.float32))
"""


def run_with_timeline(tmp_path, ranks, program, **extra_env):
    """``program`` on ``ranks`` ranks with HPCDL_TIMELINE set: (its stdout, its stderr, the trace's path)."""
    trace_path = tmp_path / "run.json"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, HPCDL_TIMELINE=str(trace_path), **extra_env)
    proc = subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr, trace_path


def test_timeline_has_every_rank_and_ring_phase(tmp_path):
    _, _, trace_path = run_with_timeline(tmp_path, 4, PROGRAM)
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert trace["otherData"] == {"ranks": 4, "missing_ranks": [], "dropped_events": {}}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(4):
        mine = {(e["name"], e["cat"]) for e in spans if e["pid"] == rank}
        for i in range(3):
            assert {(f"grad.{i}", "negotiate"), (f"grad.{i}", "reduce_scatter"), (f"grad.{i}", "allgather")} <= mine, (
                rank,
                mine,
            )
        assert ("op#0", "broadcast") in mine
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(4)}
    assert not list(tmp_path.glob("run.json.rank*"))  # parts merged and removed


# A RAM tier whose span reads each take 1 s more (the test hook of a slow
# store): the first batch's samples are still being read when the consumer
# asks for it, so every rank waits for the prefetcher (stalls).
PREFETCH_PROGRAM = """
import json, sys, numpy as np, hpcdl
from mpi4py import MPI
from hpcdl.prefetch import Prefetcher
with Prefetcher(sys.argv[1], batch_size=8, epochs=2, seed=3, comm=MPI.COMM_WORLD, ram_bytes=1 << 20, staging_threads=1,
                _span_delay=1.0) as pf:
    for epoch in pf.epochs():
        for batch in epoch:
            pass
        hpcdl.allreduce(np.ones(1000, dtype=np.float32), name="grad")
    stats = pf.stats()
every = MPI.COMM_WORLD.gather([MPI.COMM_WORLD.rank, sum(stats["hits"].values()), stats["stall_seconds"]])
if every:
    print("STATS " + json.dumps(every))
"""


def test_timeline_has_prefetcher_fetches_and_stalls_per_rank(tmp_path):
    from hpcdl import store

    src = tmp_path / "src"
    for i in range(96):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"{i:03d}.bin").write_bytes(os.urandom(2000 + i))
    store.pack(str(src), str(tmp_path / "store"), progress=False)
    trace_path = tmp_path / "run.json"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    # HPCDL_TRACE (the prefetcher's own trace) must not take the events from the timeline.
    env = dict(os.environ, HPCDL_TIMELINE=str(trace_path), HPCDL_TRACE=str(tmp_path / "prefetch-trace.json"))
    proc = subprocess.run(
        [mpiexec, "-n", "4", sys.executable, "-c", PREFETCH_PROGRAM, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("STATS "))
    stats = {rank: (hits, stall) for rank, hits, stall in json.loads(line[6:])}
    assert sorted(stats) == [0, 1, 2, 3]
    spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank, (hits, stall_seconds) in stats.items():
        mine = [e for e in spans if e["pid"] == rank]
        fetches = [e for e in mine if e["name"].startswith("fetch ")]
        stalls = [e for e in mine if e["name"] == "stall"]
        assert hits == 2 * 96 // 4 and len(fetches) == hits, (rank, hits, len(fetches))
        assert all(e["tid"] == 1 and e["cat"] == "prefetch" for e in fetches + stalls)
        # Every stall the prefetcher counted is on the track, and nothing else is.
        assert abs(sum(e["dur"] for e in stalls) - stall_seconds * 1e6) <= 1 + 1e-3 * stall_seconds * 1e6, rank
        # 1000 floats: recursive doubling, one span per allreduce (no ring phases)
        assert len([e for e in mine if e["name"] == "grad" and e["cat"] == "allreduce"]) == 2
    assert all(stall_seconds > 0 for _, stall_seconds in stats.values()), stats
    assert "HPCDL_TRACE is ignored while HPCDL_TIMELINE is set" in proc.stderr
    assert not list(tmp_path.glob("prefetch-trace.json*"))


# Rank 0 sends rank 1 two messages (tags 5 and 6); rank 0 prints both ranks' transfer counters.
TRANSFER_PROGRAM = """
import json, numpy as np, hpcdl
from mpi4py import MPI
from hpcdl import _core
comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
for tag, nbytes in ((5, 100), (6, 70000)):
    buf = _core.Buffer(np.zeros(nbytes, np.uint8), None, rank == 1, True)
    _core.transfer(rank == 0, buf, comm, 1 - rank, tag).wait(60)
every = comm.gather([rank, hpcdl.stats()["transfer"]])
if every:
    print("STATS " + json.dumps(every), flush=True)
comm.Free()
"""


def test_timeline_has_a_span_per_transfer_with_peer_tag_and_bytes(tmp_path):
    stdout, _, trace_path = run_with_timeline(tmp_path, 2, TRANSFER_PROGRAM)
    line = next(line for line in stdout.splitlines() if line.startswith("STATS "))
    stats = dict(json.loads(line[6:]))
    assert list(stats[0]) == ["send"] and list(stats[1]) == ["receive"], stats
    assert (stats[0]["send"]["ops"], stats[0]["send"]["bytes_sent"], stats[0]["send"]["bytes_received"]) == (
        2,
        70100,
        0,
    ), stats
    assert (stats[1]["receive"]["ops"], stats[1]["receive"]["bytes_received"], stats[1]["receive"]["bytes_sent"]) == (
        2,
        70100,
        0,
    ), stats
    spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    transfers = sorted((e["pid"], e["cat"], e["name"]) for e in spans if e["cat"] in ("send", "receive"))
    assert transfers == [
        (0, "send", "rank 0's send of 100 bytes to rank 1 (tag 5)"),
        (0, "send", "rank 0's send of 70000 bytes to rank 1 (tag 6)"),
        (1, "receive", "rank 1's receive of 100 bytes from rank 0 (tag 5)"),
        (1, "receive", "rank 1's receive of 70000 bytes from rank 0 (tag 6)"),
    ], transfers
    assert all(e["dur"] >= 0 and e["ts"] > 0 and e["tid"] == 0 for e in spans)


def test_a_rank_keeps_at_most_the_event_limit_and_the_trace_counts_the_rest(tmp_path):
    """HPCDL_TIMELINE_MAX_EVENTS bounds each rank's events in memory: the first
    ones are kept, the rest counted in otherData.dropped_events and named at exit."""
    _, stderr, trace_path = run_with_timeline(tmp_path, 2, PROGRAM, HPCDL_TIMELINE_MAX_EVENTS="4")
    trace = json.loads(trace_path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    dropped = trace["otherData"]["dropped_events"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert len(mine) == 4, (rank, mine)
        # The first op's three phases are among the four kept (recorded first).
        assert {"grad.0"} <= {e["name"] for e in mine}, mine
        assert not any(e["name"] == "grad.2" for e in mine), mine
        assert dropped[str(rank)] >= 5, dropped  # grad.1 and grad.2's phases at least
    assert f"{sum(dropped.values())} events past HPCDL_TIMELINE_MAX_EVENTS not kept (ranks [0, 1])" in stderr, stderr


def test_a_bad_event_limit_is_refused_at_import():
    env = dict(os.environ, HPCDL_TIMELINE_MAX_EVENTS="0")
    proc = subprocess.run([sys.executable, "-c", "import hpcdl"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HPCDL_TIMELINE_MAX_EVENTS='0'" in proc.stderr, proc.stderr
