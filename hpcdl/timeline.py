"""Timeline: a Chrome-trace / Perfetto JSON of every collective and prefetcher stall.

Set ``HPCDL_TIMELINE=/path/run.json`` (or call ``enable(path)``): the engine
records, per operation, the wait for agreement ("negotiate") and the ring
phases ("reduce_scatter", "allgather"); the prefetcher records its stalls and
fetches. One process track per rank, one thread track per part (engine,
prefetcher). Open the file in https://ui.perfetto.dev or chrome://tracing.

At exit (hpcdl's one exit hook) each rank writes ``path.rank<N>.part`` and rank 0 merges the parts it
finds into ``path``. No MPI call happens at exit, so a rank that died early
never makes the others hang: rank 0 waits a bounded time
(``HPCDL_TIMELINE_WAIT_SECONDS``, default 30) for missing parts and notes them.
"""

import glob
import json
import os
import sys
import time

from mpi4py import MPI

from hpcdl import _core, _env

TRACKS = {0: "engine", 1: "prefetcher"}
# Events a rank keeps in memory (~140 B each); later ones are counted and the
# trace says how many (HPCDL_TIMELINE_MAX_EVENTS).
DEFAULT_MAX_EVENTS = 1_000_000
DROPPED = "hpcdl_dropped_events"  # a rank's metadata event: how many it did not keep
_state = {"path": None}


def record(on=True):
    """Start (or stop) the core's one event list, which keeps at most
    HPCDL_TIMELINE_MAX_EVENTS events (default 1,000,000) until they are taken."""
    _core.timeline_enable(on, _env.engine_settings().get("timeline_max_events", DEFAULT_MAX_EVENTS))


def enable(path, comm=None):
    """Record from now on; the merged trace is written to ``path`` at exit."""
    comm = MPI.COMM_WORLD if comm is None else comm
    _state.update(path=os.path.abspath(path), rank=comm.Get_rank(), size=comm.Get_size())
    stale = _part(_state["path"], _state["rank"])  # left by an earlier run that died
    if os.path.exists(stale):
        os.remove(stale)
    record()  # the engine and the prefetcher record into this one list


def enabled():
    """Whether this process records a timeline (HPCDL_TIMELINE or enable())."""
    return _state["path"] is not None


def _part(path, rank):
    return f"{path}.rank{rank}.part"


def spans(rank, raw):
    """The core's recorded events (_core.timeline_take()) as Chrome-trace "X" events of process `rank`."""
    return [
        {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": track, "ts": start, "dur": dur}
        for name, cat, start, dur, track in raw
    ]


def write_trace(path, events, **other):
    """A Chrome-trace JSON file of `events`, replaced whole (never left half-written)."""
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if other:
        trace["otherData"] = other
    with open(path + ".tmp", "w") as f:
        json.dump(trace, f)
    os.replace(path + ".tmp", path)


def _events(rank, raw, dropped):
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    events += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for tid, name in TRACKS.items()
    ]
    if dropped:
        events.append({"name": DROPPED, "ph": "M", "pid": rank, "args": {"events": dropped}})
    return events + spans(rank, raw)


def write():
    """Write this rank's part, and on rank 0 merge the parts into the trace. At exit
    (hpcdl's exit hook), after the prefetchers closed and the engine stopped: no
    event is recorded after them."""
    path, rank, size = _state["path"], _state["rank"], _state["size"]
    part = _part(path, rank)
    with open(part + ".tmp", "w") as f:
        json.dump(_events(rank, *_core.timeline_take()), f)
    os.replace(part + ".tmp", part)
    if rank != 0:
        return
    deadline = time.monotonic() + _env.get("HPCDL_TIMELINE_WAIT_SECONDS", 30.0)
    parts = [_part(path, r) for r in range(size)]
    while not all(os.path.exists(p) for p in parts) and time.monotonic() < deadline:
        time.sleep(0.05)
    merged, missing = [], []
    for r, p in enumerate(parts):
        if not os.path.exists(p):
            missing.append(r)
            continue
        with open(p) as f:
            merged += json.load(f)
    dropped = {e["pid"]: e["args"]["events"] for e in merged if e["name"] == DROPPED}
    write_trace(path, merged, ranks=size, missing_ranks=missing, dropped_events=dropped)
    for p in glob.glob(f"{glob.escape(path)}.rank*.part"):
        os.remove(p)
    note = f", no part from ranks {missing}" if missing else ""
    if dropped:
        note += f"; {sum(dropped.values())} events past HPCDL_TIMELINE_MAX_EVENTS not kept (ranks {sorted(dropped)})"
    print(
        f"[hpcdl rank 0] timeline: {len(merged)} events from {size - len(missing)} ranks in {path}{note}",
        file=sys.stderr,
    )
