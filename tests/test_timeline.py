"""HPCDL_TIMELINE writes one valid Chrome trace with a track per rank."""

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


def test_timeline_has_every_rank_and_ring_phase(tmp_path):
    trace_path = tmp_path / "run.json"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, HPCDL_TIMELINE=str(trace_path))
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, "-c", PROGRAM], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert trace["otherData"] == {"ranks": 4, "missing_ranks": []}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(4):
        mine = {(e["name"], e["cat"]) for e in spans if e["pid"] == rank}
        for i in range(3):
            assert {(f"grad.{i}", "negotiate"), (f"grad.{i}", "reduce_scatter"),
                    (f"grad.{i}", "allgather")} <= mine, (rank, mine)
        assert ("op#0", "broadcast") in mine
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(4)}
    assert not list(tmp_path.glob("run.json.rank*"))  # parts merged and removed
