"""The backing store's speed, measured cheaply, and the one rule that turns
it into the prefetcher's coalesced-fill read settings (docs/prefetch.md,
"Read settings from the store's speed").

    iops, bandwidth = measure(store.shard_paths)     # ~0.2 s, a few MB at most
    read_settings(iops, bandwidth, staging_bytes, tier_bytes)
"""

import os
import random
import time

PROBE_SECONDS = 0.2          # the whole probe's budget (the small reads get half)
SMALL_READ = 4096            # one request's worth: its time is the per-request cost
SMALL_READS = 8
LARGE_READ = 4 << 20         # the sequential read the bandwidth is taken from, at most
LARGE_CHUNK = 1 << 20
# A page-cache hit reads in microseconds: the clamps keep what such a probe derives sane.
MAX_IOPS, MAX_BANDWIDTH = 1e7, 1e11
MIN_GAP, MAX_GAP = 4 << 10, 4 << 20
MIN_READ, MAX_READ = 1 << 20, 64 << 20
MAX_LOOKAHEAD = 1 << 30
SPAN_GAPS = 16               # a span of 16 gaps: one request's cost is ~1/17 of the span's time
WINDOW_SPANS = 8             # a look-ahead window of 8 spans: dense enough in the file for spans to merge

__all__ = ["measure", "read_settings"]


def _clamp(value, low, high):
    return int(min(max(value, low), max(high, low)))


def read_settings(iops, bandwidth, staging_bytes=64 << 20, tier_bytes=1 << 62):
    """{read_gap, read_bytes, lookahead_bytes} for a store doing ``iops`` reads/s
    at ``bandwidth`` bytes/s: the gap whose bytes take as long as one more
    request (bandwidth / iops, within [4 KiB, 4 MiB]); spans SPAN_GAPS gaps
    long within [1 MiB, 64 MiB] and the staging buffer (each filler holds one
    span); a look-ahead of WINDOW_SPANS spans, at most the tiers' bytes (the
    window's samples occupy their tier slots) and 1 GiB."""
    if not (iops > 0 and bandwidth > 0):
        raise ValueError(f"iops and bandwidth must be positive, got {iops!r} and {bandwidth!r}")
    gap = _clamp(bandwidth / iops, MIN_GAP, MAX_GAP)
    read_bytes = _clamp(SPAN_GAPS * gap, MIN_READ, min(MAX_READ, staging_bytes))
    lookahead = _clamp(WINDOW_SPANS * read_bytes, read_bytes, min(MAX_LOOKAHEAD, tier_bytes))
    return {"read_gap": gap, "read_bytes": read_bytes, "lookahead_bytes": lookahead}


def measure(paths, seconds=PROBE_SECONDS):
    """(iops, bandwidth) of reading the files ``paths``, within about ``seconds``
    and SMALL_READS x 4 KiB + LARGE_READ bytes: random 4 KiB reads with read-ahead
    off give the per-request time (iops = 1 / median); a sequential read at a
    random offset, less one request, gives the bandwidth. Random offsets make a
    page-cache hit unlikely; a hit reads as a very fast store (clamped to
    MAX_IOPS, MAX_BANDWIDTH). OSError when no file can be read."""
    files = [(p, os.path.getsize(p)) for p in paths]
    files = [(p, size) for p, size in files if size > 0]
    if not files:
        raise OSError("no store file to measure (all empty)")
    rng = random.Random()
    deadline = time.monotonic() + seconds
    times = []
    fds = {}
    try:
        while len(times) < SMALL_READS and (len(times) < 2 or time.monotonic() < deadline - seconds / 2):
            path, size = rng.choice(files)
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: one request each
            offset = rng.randrange(max(size - SMALL_READ, 0) // 4096 + 1) * 4096
            t0 = time.perf_counter()
            os.pread(fds[path], SMALL_READ, offset)
            times.append(time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
    latency = max(sorted(times)[len(times) // 2], 1.0 / MAX_IOPS)
    path, size = max(files, key=lambda f: f[1])
    offset = rng.randrange(max(size - LARGE_READ, 0) // 4096 + 1) * 4096
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        got, t0 = 0, time.perf_counter()
        while got < LARGE_READ and (got == 0 or time.monotonic() < deadline):
            chunk = len(os.pread(fd, LARGE_CHUNK, offset + got))
            if not chunk:
                break
            got += chunk
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    bandwidth = min(got / max(elapsed - latency, elapsed / 2, 1e-9), MAX_BANDWIDTH)
    return 1.0 / latency, bandwidth
