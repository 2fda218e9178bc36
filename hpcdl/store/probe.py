"""The backing store's speed, measured cheaply, and the one rule that turns
it into the prefetcher's coalesced-fill read settings (docs/prefetch.md,
"Read settings from the store's speed").

    iops, bandwidth, parallel_gain = measure(store.shard_paths)     # ~0.8 s, 48 MB at most
    read_settings(iops, bandwidth, staging_bytes, tier_bytes, parallel_gain)
"""

import os
import random
import threading
import time

from hpcdl import _core

PROBE_SECONDS = 0.2  # the one-stream probe's budget: 40% small reads, 60% the sequential read
SMALL_READ = 4096  # one request's worth: its time is the per-request cost
SMALL_READS = 64
LARGE_READ = 16 << 20  # the sequential read the bandwidth is taken from, at most
LARGE_CHUNK = 1 << 20
# A page-cache hit reads in microseconds: the clamps keep what such a probe derives sane.
MAX_IOPS, MAX_BANDWIDTH = 1e7, 1e11
MIN_GAP, MAX_GAP = 4 << 10, 4 << 20
MIN_READ, MAX_READ = 1 << 20, 64 << 20
MAX_LOOKAHEAD = 1 << 30
SPAN_GAPS = 16  # a span of 16 gaps: one request's cost is ~1/17 of the span's time
WINDOW_SPANS = 8  # a look-ahead window of 8 spans: dense enough in the file for spans to merge
PARALLEL_SECONDS = 0.6  # one reader, then PARALLEL_STREAMS at once: half of it each
PARALLEL_STREAMS = 4  # ... each at most LARGE_READ / PARALLEL_STREAMS bytes
PARALLEL_CHUNK = 256 << 10  # their read size: many pieces in each phase's measured half
PARALLEL_GAIN = 1.5  # concurrent reads worth having: at least this times one stream's bandwidth

__all__ = ["measure", "read_settings"]


def _clamp(value, low, high):
    return int(min(max(value, low), max(high, low)))


def read_settings(iops, bandwidth, staging_bytes=_core.DEFAULT_STAGING_BYTES, tier_bytes=1 << 62, parallel_gain=None):
    """{read_gap, read_bytes, lookahead_bytes, read_concurrency} for a store doing
    ``iops`` reads/s at ``bandwidth`` bytes/s: the gap whose bytes take as long
    as one more request (bandwidth / iops, within [4 KiB, 4 MiB]); spans
    SPAN_GAPS gaps long within [1 MiB, 64 MiB] and the staging buffer (each
    filler holds one span); a look-ahead of WINDOW_SPANS spans, at most the
    tiers' bytes (the window's samples occupy their tier slots) and 1 GiB;
    read_concurrency 1 (one span at a time, soonest-needed first) when
    concurrent reads gave less than PARALLEL_GAIN times one stream's bandwidth
    (``parallel_gain``), else 0: every filler reads at once (also when the gain
    is unknown, None)."""
    if not (iops > 0 and bandwidth > 0):
        raise ValueError(f"iops and bandwidth must be positive, got {iops!r} and {bandwidth!r}")
    gap = _clamp(bandwidth / iops, MIN_GAP, MAX_GAP)
    read_bytes = _clamp(SPAN_GAPS * gap, MIN_READ, min(MAX_READ, staging_bytes))
    lookahead = _clamp(WINDOW_SPANS * read_bytes, read_bytes, min(MAX_LOOKAHEAD, tier_bytes))
    concurrency = 1 if parallel_gain is not None and parallel_gain < PARALLEL_GAIN else 0
    return {"read_gap": gap, "read_bytes": read_bytes, "lookahead_bytes": lookahead, "read_concurrency": concurrency}


def _steady(amounts, times):
    """amount per second over the later half of a run of reads: a store that
    lets a burst through before it throttles (the cgroup throttle passes a
    100 ms slice's worth at once, then waits ~90 ms) is measured after the
    first burst, waits included (a mean, not a median: the waits are the rate)."""
    half = len(times) // 2
    return sum(amounts[half:]) / max(sum(times[half:]), 1e-9)


def _sequential(path, offset, limit, deadline, chunks, chunk_bytes=LARGE_CHUNK):
    """Reads ``path`` from ``offset`` in ``chunk_bytes`` pieces until ``limit`` bytes,
    its end or ``deadline`` (at least 2 pieces); appends (bytes, start, end) to ``chunks``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        got = 0
        while got < limit and (len(chunks) < 2 or time.monotonic() < deadline):
            t0 = time.monotonic()
            chunk = len(os.pread(fd, chunk_bytes, offset + got))
            if not chunk:
                break
            chunks.append((chunk, t0, time.monotonic()))
            got += chunk
    finally:
        os.close(fd)


def _random_offset(rng, size, length):
    return rng.randrange(max(size - length, 0) // 4096 + 1) * 4096


def _disjoint_offsets(rng, size, length, count, taken):
    """``count`` random offsets whose ``length``-byte reads (plus read-ahead) overlap
    none of ``taken`` [(begin, end)] nor each other, so none is served from the
    page cache that another read filled; None when the file has no room for them."""
    margin = 4 << 20
    chosen = []
    for _ in range(100 * count):
        if len(chosen) == count:
            return chosen
        at = _random_offset(rng, size, length)
        if all(at + length + margin <= b or e + margin <= at for b, e in taken):
            chosen.append(at)
            taken = taken + [(at, at + length)]
    return chosen if len(chosen) == count else None


def _streams_rate(path, offsets, limit, seconds):
    """Bytes/s of len(offsets) concurrent sequential readers, each from its offset,
    over the later half of the phase's wall-clock window (a throttle's first
    burst left out; a piece read across the midpoint counts by its time in it)."""
    streams = [[] for _ in offsets]
    start = time.monotonic()
    readers = [
        threading.Thread(target=_sequential, args=(path, at, limit, start + seconds, chunks, PARALLEL_CHUNK))
        for at, chunks in zip(offsets, streams)
    ]  # os.pread releases the GIL: the reads overlap
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    pieces = [piece for chunks in streams for piece in chunks]
    end = max(t1 for _, _, t1 in pieces)
    mid = (start + end) / 2
    inside = sum(n * (t1 - max(t0, mid)) / max(t1 - t0, 1e-9) for n, t0, t1 in pieces if t1 > mid)
    return inside / max(end - mid, 1e-9)


def measure(paths, seconds=PROBE_SECONDS, parallel_seconds=PARALLEL_SECONDS):
    """(iops, bandwidth, parallel_gain) of reading the files ``paths``, within
    about ``seconds`` + ``parallel_seconds`` and at most SMALL_READS x 4 KiB +
    3 x LARGE_READ bytes: random 4 KiB reads with read-ahead off give the IOPS,
    1 MiB sequential reads from a random offset the bandwidth (request costs
    included: what a long span gets), each as the steady rate of the later
    half of its reads (_steady). Then one reader and PARALLEL_STREAMS readers
    at once, each phase's rate over the later half of its wall-clock window
    (_streams_rate), from offsets no earlier read has cached: their ratio is
    the parallel gain (about 1 on one throttled device, more on a striped
    file system or an SSD with a deep queue; None when the largest file has no
    room for reads that avoid each other's cache). Random offsets make a page-cache
    hit unlikely; a hit reads as a very fast store (clamped to MAX_IOPS,
    MAX_BANDWIDTH). OSError when no file can be read."""
    files = [(p, os.path.getsize(p)) for p in paths]
    files = [(p, size) for p, size in files if size > 0]
    if not files:
        raise OSError("no store file to measure (all empty)")
    rng = random.Random()
    start = time.monotonic()
    times, fds = [], {}
    try:
        while len(times) < SMALL_READS and (len(times) < 4 or time.monotonic() < start + 0.4 * seconds):
            path, size = rng.choice(files)
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: one request each
            offset = _random_offset(rng, size, SMALL_READ)
            t0 = time.perf_counter()
            os.pread(fds[path], SMALL_READ, offset)
            times.append(time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
    iops = min(_steady([1] * len(times), times), MAX_IOPS)
    path, size = max(files, key=lambda f: f[1])
    chunks, offset = [], _random_offset(rng, size, LARGE_READ)
    _sequential(path, offset, LARGE_READ, start + seconds, chunks)
    bandwidth = min(_steady([n for n, _, _ in chunks], [t1 - t0 for _, t0, t1 in chunks]), MAX_BANDWIDTH)
    # One reader, then PARALLEL_STREAMS at once, each phase measured alike, none re-reading cached bytes.
    limit = LARGE_READ // PARALLEL_STREAMS
    first = _disjoint_offsets(rng, size, LARGE_READ, 1, [(offset, offset + LARGE_READ)])
    rest = first and _disjoint_offsets(
        rng, size, limit, PARALLEL_STREAMS, [(offset, offset + LARGE_READ), (first[0], first[0] + LARGE_READ)]
    )
    if not rest:  # a store too small to read apart from the cache: the gain is unknown
        return iops, bandwidth, None
    alone = _streams_rate(path, first, LARGE_READ, parallel_seconds / 2)
    together = _streams_rate(path, rest, limit, parallel_seconds / 2)
    return iops, bandwidth, together / max(alone, 1e-9)
