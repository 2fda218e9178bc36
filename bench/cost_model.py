"""A communication cost model of one gradient allreduce per step, per scheme,
calibrated and validated on the emulated cluster, and its predictions to P = 1024.

Schemes (SCHEMES): hpcdl's dense ring ("dense"; recursive doubling up to 64 KiB), MPI_Allreduce ("mpi"), the
compressed rings over 2-byte payloads ("fp16", "bf16") and blockwise Int8
("int8"), and TopK 1% as the sparse allgather ("topk_allgather") or the split
allreduce ("topk_split"). Alpha-beta form, per rank and call, for P ranks, N
float32 values, k = ceil(r N) kept values (docs/performance.md, "Cost model", gives
the formulas):

    time = rounds x alpha + (messages - rounds) x overhead + transfer + compute, where
    transfer = max(bytes sent x beta, net x (bytes sent + received) / share),
    compute  = kappa x (single-core kernel seconds per value x the values the scheme
               encodes, decodes, adds, selects or sums) / share;
    the rings pipeline transfer and compute chunk by chunk, the other schemes run
    them one after the other. share: the part of a core a rank gets (1 with a core
    per rank; measured on the shared emulated cluster).

Subcommands (every figure that was not measured is an empty cell, never 0):

    python bench/cost_model.py codecs --out bench/results         # CPU terms, one core
    HPCDL_NET_BURST=32kb flock /tmp/hpcdl-netcluster.lock bench/netcluster.sh --hosts 2 --rate 20mbit \\
        run -- mpiexec -n 2 bench/netns-exec.sh python bench/cost_model.py measure --out bench/results
    python bench/cost_model.py validate --out bench/results       # fit on P = 2, table for P = 2, 4, 8
    python bench/cost_model.py predict --out bench/results        # P = 2 .. 1024 at 10 and 100 Gbit/s
    python bench/cost_model.py compare bench/results/hosts8-50mbit.csv   # a bench/allreduce.py run
"""

import argparse
import csv
import hashlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

SCHEMES = ("dense", "mpi", "fp16", "bf16", "int8", "topk_allgather", "topk_split")
RING_WIDTH = {"dense": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256}  # wire bytes per value
TOPK_RATIO = 0.01
CHUNK_BYTES = 4 << 20  # hpcdl's default ring chunk (kDefaultChunkBytes)
# hpcdl's dense allreduce of at most this many bytes runs by recursive doubling (kRecursiveDoublingMaxBytes)
RECURSIVE_DOUBLING_MAX_BYTES = 64 << 10
# above it, over a power-of-two P of at least HALVING_DOUBLING_MIN_RANKS, one of at most this many
# bytes per rank runs by halving-doubling (kHalvingDoublingMaxSegmentBytes)
HALVING_DOUBLING_MAX_SEGMENT_BYTES = 64 << 10
HALVING_DOUBLING_MIN_RANKS = 8  # kHalvingDoublingMinRanks
ALLGATHER_LONG_BYTES = 512 << 10  # MPICH: allgather by recursive doubling below this total, ring above
CODEC_TERMS = ("add", "fp16_enc", "fp16_dec", "bf16_enc", "bf16_dec", "int8_enc", "int8_dec", "topk_select", "topk_sum")


# ---- the model ----


@dataclass(frozen=True)
class Machine:
    """alpha: seconds per round of messages; beta: seconds per byte on a rank's link (one
    direction); overhead: seconds per further message of a round (an all-to-all's P - 2);
    codec: CPU seconds per float32 value of each kernel on one core (CODEC_TERMS); kappa: the
    library's CPU per kernel CPU (error feedback's residual traffic, engine, Python); net: CPU
    seconds per byte sent or received (the TCP stack; 0 with RDMA); cpu_share: the part of a
    core each rank gets while all compute at once (measured), else min(1, cores / P) with
    cores = None for a core per rank; burst: bytes a rank's link sends at once before its
    rate applies (the emulated cluster's token bucket, full when a call starts; 0 on a real link)."""

    alpha: float
    beta: float
    codec: dict
    overhead: float = 0.0
    kappa: float = 1.0
    net: float = 0.0
    cpu_share: float = None
    cores: float = None
    burst: float = 0.0

    def share(self, p):
        if self.cpu_share is not None:
            return self.cpu_share
        return 1.0 if self.cores is None else min(1.0, self.cores / p)


def topk_k(n, ratio=TOPK_RATIO):
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def log2_rounds(p):
    return math.ceil(math.log2(p)) if p > 1 else 0


def doubling_steps(p):
    """(rounds, buffers sent and reduced) of the recursive doubling on its busiest rank: log2 q
    for q the largest power of two <= P; when q < P, a folded pair's odd rank adds two rounds
    (the pair's values in, the result out) and one buffer each."""
    q = 1 << (p.bit_length() - 1)
    doubling = q.bit_length() - 1
    return (doubling, doubling) if q == p else (doubling + 2, doubling + 1)


def dense_algorithm(p, n):
    """hpcdl's algorithm for a dense allreduce of n float32 over p ranks (the core's choice,
    hpcdl._core.dense_allreduce_algorithm): "recursive doubling", "halving-doubling" or "ring"."""
    nbytes = 4 * n
    if nbytes <= RECURSIVE_DOUBLING_MAX_BYTES:
        return "recursive doubling"
    if (
        p >= HALVING_DOUBLING_MIN_RANKS
        and p & (p - 1) == 0
        and nbytes <= p * HALVING_DOUBLING_MAX_SEGMENT_BYTES
        and nbytes <= 2**31 - 1
    ):
        return "halving-doubling"
    return "ring"


def traffic(scheme, p, n, ratio=TOPK_RATIO):
    """(messages sent, bytes sent) per rank per call: the counts the model charges alpha and beta."""
    if p < 2:
        return 0, 0.0
    if scheme == "dense" and dense_algorithm(p, n) == "recursive doubling":
        rounds, buffers = doubling_steps(p)
        return rounds, buffers * 4.0 * n
    if scheme == "dense" and dense_algorithm(p, n) == "halving-doubling":
        return 2 * log2_rounds(p), 2.0 * (p - 1) / p * 4.0 * n
    if scheme in RING_WIDTH:
        chunks = max(1, math.ceil(4.0 * math.ceil(n / p) / CHUNK_BYTES))
        return 2 * (p - 1) * chunks, 2.0 * (p - 1) / p * n * RING_WIDTH[scheme]
    if scheme == "mpi":  # MPICH, long messages: reduce-scatter by recursive halving + allgather by doubling
        return 2 * log2_rounds(p), 2.0 * (p - 1) / p * 4.0 * n
    k = topk_k(n, ratio)
    if scheme == "topk_allgather":
        total = 8.0 * k * p
        return (p - 1 if total >= ALLGATHER_LONG_BYTES else log2_rounds(p)), (p - 1) * 8.0 * k
    if scheme == "topk_split":  # docs/compression.md: balance, pairs, 4 radix rounds, ties, result
        bins = min(n, max(4 * p, k // 64))
        volume = 2.0 * (p - 1) / p * (8.0 * k + 4.0 * bins + 4.0 * 1024) + 8.0 * (p - 1)
        # The pairs' pairwise exchange (one message to one peer per round: P - 1); 5 allreduces,
        # 1 allgather and 1 allgatherv (the result, k pairs in all): recursive doubling, log2 P each.
        return (p - 1) + 7 * log2_rounds(p), volume
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def latency_rounds(scheme, p, n, ratio=TOPK_RATIO):
    """Rounds per call: messages that wait for an earlier one. Each scheme's messages are
    rounds of their own (the split's pairwise exchange: one message a round), so none pays
    the per-message overhead of an all-to-all's further messages."""
    return traffic(scheme, p, n, ratio)[0]


def kernel_seconds(scheme, p, n, codec):
    """CPU seconds per rank per call of the bare kernels on one core."""
    if p < 2:
        return 0.0
    part = (p - 1) / p
    if scheme == "dense" and dense_algorithm(p, n) == "recursive doubling":
        return doubling_steps(p)[1] * n * codec["add"]
    if scheme in ("dense", "mpi"):
        return part * n * codec["add"]
    if scheme in ("fp16", "bf16", "int8"):  # each value encoded once, decoded in both phases
        return n * codec[f"{scheme}_enc"] + 2.0 * part * n * codec[f"{scheme}_dec"]
    if scheme in ("topk_allgather", "topk_split"):
        # select, then the blocked sum (allgather) or clearing the candidates and writing the
        # k results (split); both a pass over the buffer, priced as the top-k decode kernel.
        return n * (codec["topk_select"] + codec["topk_sum"])
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def cpu_seconds(scheme, p, n, m, ratio=TOPK_RATIO):
    """CPU seconds per rank per call on a core of its own: kappa x kernels + the TCP stack."""
    return m.kappa * kernel_seconds(scheme, p, n, m.codec) + m.net * 2.0 * traffic(scheme, p, n, ratio)[1]


def predict_time(scheme, p, n, m, ratio=TOPK_RATIO):
    """Seconds per call, slowest rank. The transfer goes at the slower of the link and the
    TCP stack; the kernels either pipeline with it (the ring) or run before and after (the rest)."""
    if p < 2:
        return 0.0
    msgs, sent = traffic(scheme, p, n, ratio)
    share = m.share(p)
    compute = m.kappa * kernel_seconds(scheme, p, n, m.codec) / share
    transfer = max(max(0.0, sent - m.burst) * m.beta, m.net * 2.0 * sent / share)
    if scheme in RING_WIDTH and (scheme != "dense" or dense_algorithm(p, n) == "ring"):
        # msgs units in 2(P-1) dependent steps: within a step the chunks pipeline the transfer
        # against the kernels; each step boundary waits for one chunk of the faster of the two.
        per_link, per_cpu = transfer / msgs, compute / msgs
        return msgs * (m.alpha + max(per_link, per_cpu)) + 2 * (p - 1) * min(per_link, per_cpu)
    rounds = latency_rounds(scheme, p, n, ratio)
    return rounds * m.alpha + (msgs - rounds) * m.overhead + transfer + compute


# ---- measurement helpers ----


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def parse_size(text):
    from hpcdl.units import parse_bytes  # the library's one byte-size parser

    return parse_bytes(text)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path, fields, rows):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fields, restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def num(text):
    return None if text in ("", None) else float(text)


# ---- codecs: CPU terms on one core ----


def cmd_codecs(args):
    """Thread CPU seconds per float32 value of each kernel, median of --repeats."""
    import numpy as np

    from hpcdl.compression import BF16, FP16, Int8, TopK
    from hpcdl.measure import cell, rate, show

    n = parse_size(args.size) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    y, out = x.copy(), np.empty_like(x)

    def per_value(fn):
        fn()  # page faults of fresh buffers
        times = []
        for _ in range(args.repeats):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        t = statistics.median(times)
        return t / n if t > 0 else None

    terms = {"add": per_value(lambda: np.add(y, x, out=y))}
    for name, codec in (("fp16", FP16()), ("bf16", BF16()), ("int8", Int8()), ("topk", TopK(TOPK_RATIO))):
        enc = np.empty(codec.encoded_size(n), dtype=np.uint8)
        enc_t = per_value(lambda: codec.encode_into(x, enc))
        dec_t = per_value(lambda: codec.decode_into(enc, out))
        terms["topk_select" if name == "topk" else f"{name}_enc"] = enc_t
        terms["topk_sum" if name == "topk" else f"{name}_dec"] = dec_t
    load = load_average()
    rows = [
        {
            "term": t,
            "seconds_per_value": cell(terms[t]),
            "GBps_of_float32": cell(rate(4e-9, terms[t])),
            "values": n,
            "repeats": args.repeats,
            "load_avg": cell(load),
            "note": "" if terms[t] else "missing: the thread clock read no time (use a larger --size)",
        }
        for t in CODEC_TERMS
    ]
    path = os.path.join(args.out, "cost-model-codecs.csv")
    write_rows(path, list(rows[0]), rows)
    for t in CODEC_TERMS:
        print(f"{t:12} {show(rate(4e-9, terms[t]), '8.2f')} GB/s of float32 input")
    print(f"wrote {path} (load average {load})")
    return 0


def load_codecs(out):
    rows = read_rows(os.path.join(out, "cost-model-codecs.csv"))
    terms = {r["term"]: num(r["seconds_per_value"]) for r in rows}
    missing = [t for t in CODEC_TERMS if terms.get(t) is None]
    if missing:
        raise SystemExit(f"cost-model-codecs.csv lacks {', '.join(missing)}: rerun `cost_model.py codecs`")
    return terms


# ---- measure: under mpiexec on the emulated cluster ----

MEASURE_FIELDS = [
    "ranks",
    "rate",
    "burst",
    "stream_MBps",
    "scheme",
    "bytes",
    "run",
    "calls",
    "time_median_s",
    "time_min_s",
    "cpu_per_rank_s",
    "bytes_sent_per_rank",
    "link_bytes_per_rank",
    "cpu_share",
    "load_start",
    "load_end",
    "check",
]


def link_bytes_sent():
    """Bytes this rank's emulated host sent on eth0 (headers included), None outside netcluster.sh."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def cpu_share(comm, seconds=0.05):
    """The part of a core a rank gets while every rank computes at once (a machine shared
    with other jobs, or more ranks than cores): thread CPU time over wall time of a numpy
    loop all ranks start together; the median over ranks."""
    import numpy as np

    a = np.ones(1 << 16, np.float32)
    comm.Barrier()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a *= 1.0000001
    share = (time.thread_time() - cpu0) / (time.perf_counter() - t0)
    return statistics.median(comm.allgather(min(1.0, share)))


def cmd_measure(args):
    """Per size and run: every scheme interleaved call by call, each after --idle seconds
    (so none inherits another's drained token bucket); the slowest rank's wall time,
    the mean process CPU per rank, hpcdl.stats() bytes sent per rank (hpcdl's schemes) and the
    bytes eth0 sent per rank (every scheme, on the emulated cluster). Results are checked
    (dense against MPI within float32 rounding, lossy ones bitwise equal on all ranks)."""
    import numpy as np
    from mpi4py import MPI

    import hpcdl
    from hpcdl.compression import BF16, FP16, Int8, TopK

    comm = MPI.COMM_WORLD
    mpi_comm = comm.Dup()
    codecs = {
        "dense": None,
        "fp16": FP16(),
        "bf16": BF16(),
        "int8": Int8(),
        "topk_allgather": TopK(TOPK_RATIO, "allgather"),
        "topk_split": TopK(TOPK_RATIO, "split"),
    }
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise SystemExit(f"unknown scheme(s) {bad}; choose from {SCHEMES}")
    rate = os.environ.get("HPCDL_NET_RATE", "")
    stream = os.environ.get("HPCDL_BENCH_STREAM_MBPS", "")
    rows = []

    def call(scheme, work):
        if scheme == "mpi":
            mpi_comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        else:
            hpcdl.allreduce(work, op="sum", name=f"cost_model.{scheme}", compression=codecs[scheme])

    def timed(scheme, work, source):
        np.copyto(work, source)
        time.sleep(args.idle)  # the links' token buckets refill: every call starts with a full burst
        comm.Barrier()
        tx0, cpu0, t0 = link_bytes_sent(), time.process_time(), time.perf_counter()
        call(scheme, work)
        wall, cpu, tx = time.perf_counter() - t0, time.process_time() - cpu0, link_bytes_sent()
        return wall, cpu, (None if tx is None or tx0 is None else tx - tx0)

    for run in range(args.runs):
        for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
            n = nbytes // 4
            source = np.random.default_rng(1000 + comm.rank).standard_normal(n).astype(np.float32)
            work = np.empty_like(source)
            load_start = comm.bcast(load_average(), root=0)
            shares = [cpu_share(comm)]
            checks, sent = {}, {}
            reference = source.copy()
            mpi_comm.Allreduce(MPI.IN_PLACE, reference, op=MPI.SUM)
            for scheme in schemes:  # the checked call, then a warm-up
                hpcdl.compression.reset_state()
                hpcdl.stats(reset=True)
                timed(scheme, work, source)
                if scheme == "dense":
                    ok = bool(np.allclose(work, reference, rtol=1e-5, atol=1e-5 * comm.size))
                else:
                    digest = hashlib.sha1(work.tobytes()).hexdigest()
                    ok = len(set(comm.allgather(digest))) == 1
                checks[scheme] = comm.allreduce(ok, op=MPI.LAND)
                timed(scheme, work, source)
                stats = hpcdl.stats(reset=True).get("allreduce", {})
                ops = sum(r["ops"] for r in stats.values())
                sent[scheme] = (
                    comm.allreduce(sum(r["bytes_sent"] for r in stats.values()) / ops) / comm.size if ops else None
                )
            walls, cpus, links = ({s: [] for s in schemes} for _ in range(3))
            for _ in range(args.calls):
                for scheme in schemes:
                    wall, cpu, tx = timed(scheme, work, source)
                    walls[scheme].append(comm.allreduce(wall, op=MPI.MAX))
                    cpus[scheme].append(comm.allreduce(cpu) / comm.size)
                    txs = comm.allgather(tx)
                    if None not in txs:
                        links[scheme].append(sum(txs) / comm.size)
                shares.append(cpu_share(comm))
            load_end = comm.bcast(load_average(), root=0)
            for scheme in schemes:
                rows.append(
                    {
                        "ranks": comm.size,
                        "rate": rate,
                        "burst": os.environ.get("HPCDL_NET_BURST", ""),
                        "stream_MBps": stream,
                        "scheme": scheme,
                        "bytes": nbytes,
                        "run": run,
                        "calls": args.calls,
                        "time_median_s": statistics.median(walls[scheme]),
                        "time_min_s": min(walls[scheme]),
                        "cpu_per_rank_s": statistics.median(cpus[scheme]),
                        "bytes_sent_per_rank": "" if sent[scheme] is None else sent[scheme],
                        "link_bytes_per_rank": statistics.median(links[scheme]) if links[scheme] else "",
                        "cpu_share": statistics.median(shares),
                        "load_start": load_start,
                        "load_end": load_end,
                        "check": "ok" if checks[scheme] else "WRONG",
                    }
                )
                if comm.rank == 0:
                    print(
                        f"P={comm.size} {rate} run {run} {nbytes >> 10} KiB {scheme:15} "
                        f"{1e3 * statistics.median(walls[scheme]):9.1f} ms  "
                        f"cpu {1e3 * statistics.median(cpus[scheme]):7.1f}"
                        f" ms  {checks[scheme] and 'ok' or 'WRONG'}  share {statistics.median(shares):.2f}"
                        f"  load {load_start}->{load_end}",
                        flush=True,
                    )
    mpi_comm.Free()
    if comm.rank == 0:
        path = os.path.join(args.out, f"cost-model-measured-p{comm.size}.csv")
        write_rows(path, MEASURE_FIELDS, rows)
        print(f"wrote {path}")
    return 0 if all(r["check"] == "ok" for r in rows) else 1


# ---- validate: fit on P = 2, compare at every measured P ----


def medians(rows):
    """{(ranks, scheme, bytes): (median over runs of time, of CPU per rank, of hpcdl's bytes sent,
    rows, of eth0's bytes sent, of the measured CPU share)}."""
    groups = {}
    for r in rows:
        if r["check"] != "ok":
            continue
        groups.setdefault((int(r["ranks"]), r["scheme"], int(r["bytes"])), []).append(r)
    out = {}
    for key, rs in groups.items():
        sent = [num(r["bytes_sent_per_rank"]) for r in rs if num(r["bytes_sent_per_rank"]) is not None]
        wire = [num(r.get("link_bytes_per_rank")) for r in rs if num(r.get("link_bytes_per_rank")) is not None]
        shares = [num(r["cpu_share"]) for r in rs if num(r["cpu_share"])]
        out[key] = (
            statistics.median(float(r["time_median_s"]) for r in rs),
            statistics.median(float(r["cpu_per_rank_s"]) for r in rs),
            statistics.median(sent) if sent else None,
            rs,
            statistics.median(wire) if wire else None,
            statistics.median(shares) if shares else None,
        )
    return out


def fit_cpu(points, codec):
    """kappa and poll from P = 2 points: the process CPU per rank that hpcdl's schemes used
    (MPI_Allreduce spins while it waits, so not it) = kappa x kernels + poll x wall time
    (the engine's polite wait wakes up while the link is busy), least squares on relative
    errors, both >= 0. A TCP term per wire byte is not resolved on these links: bytes and
    wall time are proportional there, and the fit gives the CPU to poll."""
    rows = [
        (kernel_seconds(s, p, b // 4, codec), v[0], v[1]) for (p, s, b), v in points.items() if s != "mpi" and v[1] > 0
    ]
    if not rows:
        return 1.0, 0.0

    def solve(cols):
        # normal equations of sum ((sum_c x_c) / y - 1)^2 over the chosen columns
        xs = [[r[c] / r[2] for c in cols] for r in rows]
        a = [[sum(x[i] * x[j] for x in xs) for j in range(len(cols))] for i in range(len(cols))]
        rhs = [sum(x[i] for x in xs) for i in range(len(cols))]
        if len(cols) == 1:
            return [rhs[0] / a[0][0]]
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        return [(rhs[0] * a[1][1] - rhs[1] * a[0][1]) / det, (a[0][0] * rhs[1] - a[1][0] * rhs[0]) / det]

    kappa, poll = solve([0, 1])
    if poll < 0:
        return solve([0])[0], 0.0
    if kappa < 0:
        return 0.0, solve([1])[0]
    return kappa, poll


def fit(points, codec, stream_beta, burst, kappa=1.0):
    """alpha and beta from P = 2 points {(P, scheme, bytes): (seconds, ..., measured CPU share)},
    the CPU terms given: least squared relative error on a log grid of alpha (1 us .. 10 ms)
    and a grid of link rates from 70 % to 110 % of the one-way TCP stream (a ring sends both
    ways at once: data and the other direction's ACKs share each link's queue)."""
    best = None
    for j in range(41):
        beta = stream_beta / (0.70 + 0.01 * j)
        for i in range(241):
            m = Machine(1e-6 * 10 ** (i / 60), beta, codec, kappa=kappa, burst=burst)
            err = sum(
                (predict_time(s, p, b // 4, replace(m, cpu_share=v[-1])) / v[0] - 1) ** 2
                for (p, s, b), v in points.items()
            )
            if best is None or err < best[0]:
                best = (err, m)
    return best[1]


VALIDATE_FIELDS = [
    "ranks",
    "scheme",
    "bytes",
    "runs",
    "measured_s",
    "predicted_s",
    "predicted_over_measured",
    "best_s",
    "predicted_over_best",
    "within_20pct",
    "bytes_sent_measured",
    "link_bytes_measured",
    "bytes_sent_model",
    "cpu_per_rank_s",
    "cpu_model_s",
    "cpu_share",
    "load_range",
    "rate",
    "stream_MBps",
    "note",
]


def cmd_validate(args):
    from hpcdl.measure import cell, ratio

    codec = load_codecs(args.out)
    rows = []
    for p in args.ranks:
        path = os.path.join(args.out, f"cost-model-measured-p{p}.csv")
        if os.path.exists(path):
            rows += read_rows(path)
    points = medians(rows)
    calib = {k: v for k, v in points.items() if k[0] == 2}
    if not calib:
        raise SystemExit("no P = 2 measurement to calibrate on (cost-model-measured-p2.csv)")
    streams = [num(r["stream_MBps"]) for r in rows if r["ranks"] == "2" and num(r["stream_MBps"])]
    stream_beta = 1.0 / (1e6 * statistics.median(streams))
    kappa, poll = fit_cpu(calib, codec)
    m = fit(calib, codec, stream_beta, args.burst, kappa)
    out = []
    for p in args.ranks:
        for scheme in SCHEMES:
            sizes = sorted({k[2] for k in points if k[0] == p and k[1] == scheme})
            for b in sizes:
                t, cpu, sent, rs, wire, share = points[p, scheme, b]
                mine = replace(m, cpu_share=share, cores=args.cores)
                pred = predict_time(scheme, p, b // 4, mine)
                q = ratio(pred, t)
                best = statistics.median(float(r["time_min_s"]) for r in rs)
                loads = [num(r[f]) for r in rs for f in ("load_start", "load_end") if num(r[f]) is not None]
                out.append(
                    {
                        "ranks": p,
                        "scheme": scheme,
                        "bytes": b,
                        "runs": len(rs),
                        "measured_s": t,
                        "predicted_s": pred,
                        "predicted_over_measured": cell(q),
                        "best_s": best,
                        "predicted_over_best": cell(ratio(pred, best)),
                        "within_20pct": "" if q is None else ("yes" if abs(q - 1) <= 0.2 else "no"),
                        "bytes_sent_measured": cell(sent),
                        "link_bytes_measured": cell(wire),
                        "bytes_sent_model": traffic(scheme, p, b // 4)[1],
                        "cpu_per_rank_s": cpu,
                        "cpu_model_s": cpu_seconds(scheme, p, b // 4, mine),
                        "cpu_share": cell(share),
                        "load_range": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "",
                        "rate": rs[0]["rate"],
                        "stream_MBps": rs[0]["stream_MBps"],
                        "note": "calibration point" if p == 2 else "",
                    }
                )
        if not any(k[0] == p for k in points):
            out.append({"ranks": p, "note": f"not measured: no cost-model-measured-p{p}.csv with a passing check"})
    path = os.path.join(args.out, "cost-model-validation.csv")
    write_rows(path, VALIDATE_FIELDS, out)
    params = os.path.join(args.out, "cost-model-params.csv")
    write_rows(
        params,
        ["parameter", "value", "unit", "source"],
        [
            {"parameter": "alpha", "value": m.alpha, "unit": "s per round of messages", "source": "fit, P = 2"},
            {"parameter": "beta", "value": m.beta, "unit": "s per byte", "source": "fit, P = 2"},
            {
                "parameter": "stream_beta",
                "value": stream_beta,
                "unit": "s per byte",
                "source": "one TCP stream hn0 -> hn1 (netcluster.sh), P = 2 runs",
            },
            {"parameter": "burst", "value": m.burst, "unit": "bytes", "source": "netcluster.sh tbf burst"},
            {
                "parameter": "kappa",
                "value": m.kappa,
                "unit": "library CPU / bare kernel CPU",
                "source": "process CPU per rank, P = 2",
            },
            {
                "parameter": "poll",
                "value": poll,
                "unit": "CPU s per wall s of a call (not charged)",
                "source": "process CPU per rank, P = 2",
            },
            {"parameter": "cores", "value": cell(args.cores), "unit": "cores shared by the ranks", "source": "machine"},
        ]
        + [
            {"parameter": t, "value": codec[t], "unit": "CPU s per float32 value", "source": "codecs, one core"}
            for t in CODEC_TERMS
        ],
    )
    print(
        f"alpha {m.alpha * 1e6:.1f} us, 1/beta {1 / m.beta / 1e6:.2f} MB/s (stream {1 / stream_beta / 1e6:.2f}), "
        f"burst {m.burst:.0f} B, "
        f"kappa {m.kappa:.2f}, poll {poll:.3f} CPU s per wall s"
    )
    print(
        f"{'P':>3} {'scheme':15} {'size':>8} {'measured ms':>12} {'model ms':>9} {'model/meas':>10} "
        f"{'model/best':>10} {'share':>5} load"
    )
    for r in out:
        if r.get("scheme"):
            print(
                f"{r['ranks']:>3} {r['scheme']:15} {r['bytes'] >> 10:>6}Ki {1e3 * r['measured_s']:12.1f} "
                f"{1e3 * r['predicted_s']:9.1f} {r['predicted_over_measured']:10.2f} "
                f"{r['predicted_over_best']:10.2f} {r['cpu_share']:5.2f} {r['load_range']}"
            )
        else:
            print(f"{r['ranks']:>3} {r['note']}")
    print(f"wrote {path}, {params}")
    return 0


# ---- compare: the model at the points of a bench/allreduce.py run ----


def allreduce_scheme(system, p):
    """bench/allreduce.py's system name -> the model's scheme, None for one the model lacks."""
    if system == "mpi":
        return "mpi"
    if system == "hpcdl":
        return "dense"
    inner = system[len("hpcdl[") : -1] if system.startswith("hpcdl[") else ""
    for name in ("fp16", "bf16", "int8"):
        if inner.startswith(name):
            return name
    if inner.startswith("topk(ratio=0.01"):
        if "algorithm=" in inner:
            return "topk_" + inner.split("algorithm=")[1].rstrip(")")
        return "topk_allgather" if p == 2 else "topk_split"  # what auto picks at 64 MiB (docs/compression.md)
    return None


COMPARE_FIELDS = [
    "ranks",
    "system",
    "scheme",
    "bytes",
    "runs",
    "stream_MBps",
    "cpu_share",
    "measured_s",
    "predicted_s",
    "predicted_over_measured",
    "within_20pct",
    "speedup_vs_mpi_measured",
    "speedup_vs_mpi_model",
    "cpu_per_rank_s",
    "cpu_model_s",
    "wire_bytes_per_rank",
    "bytes_sent_model",
]


def cmd_compare(args):
    """Medians over runs of a bench/allreduce.py CSV against the model with the P = 2 fit
    (cost-model-params.csv): beta scaled by the run's own TCP stream (the fit's 1/beta over
    its stream), the CPU share of that P from cost-model-measured-p{P}.csv (same machine,
    same ranks on the same cores) unless --share is given. Modelled CPU per rank: kappa x
    kernels, plus the fitted poll x the modelled time for hpcdl's schemes."""
    from hpcdl.measure import cell, ratio

    codec = load_codecs(args.out)
    fitted = {r["parameter"]: num(r["value"]) for r in read_rows(os.path.join(args.out, "cost-model-params.csv"))}
    rows = [r for r in read_rows(args.csv) if r["correct"] == "True" and r["time_median_s"]]
    if not rows:
        raise SystemExit(f"{args.csv}: no correct measurement")
    out = []
    for key in sorted({(int(r["ranks"]), r["system"], int(r["bytes"])) for r in rows}):
        p, system, b = key
        scheme = allreduce_scheme(system, p)
        mine = [r for r in rows if (int(r["ranks"]), r["system"], int(r["bytes"])) == key]
        mpi = [r for r in rows if (int(r["ranks"]), r["system"], int(r["bytes"])) == (p, "mpi", b)]
        stream = statistics.median(float(r["stream_MBps"]) for r in mine)
        share = args.share
        if share is None:
            path = os.path.join(args.out, f"cost-model-measured-p{p}.csv")
            shares = [num(r["cpu_share"]) for r in read_rows(path)] if os.path.exists(path) else []
            share = statistics.median(v for v in shares if v) if any(shares) else None
        m = Machine(
            fitted["alpha"],
            fitted["beta"] / fitted["stream_beta"] / (1e6 * stream),
            codec,
            kappa=fitted["kappa"],
            cpu_share=share,
            cores=fitted.get("cores"),
            burst=args.burst,
        )
        t = statistics.median(float(r["time_median_s"]) for r in mine)
        t_mpi = statistics.median(float(r["time_median_s"]) for r in mpi) if mpi else None
        cpu = [num(r.get("cpu_per_rank_s")) for r in mine if num(r.get("cpu_per_rank_s")) is not None]
        wire = [num(r["wire_bytes"]) / p for r in mine if num(r["wire_bytes"]) is not None]
        pred = predict_time(scheme, p, b // 4, m) if scheme else None
        q = ratio(pred, t)
        # hpcdl's engine also burns the fitted poll CPU per wall second while it waits (not charged
        # to the time); MPI_Allreduce spins instead, which the model does not price.
        cpu_model = (
            None
            if pred is None
            else cpu_seconds(scheme, p, b // 4, m) + (0.0 if scheme == "mpi" else (fitted.get("poll") or 0.0) * pred)
        )
        out.append(
            {
                "ranks": p,
                "system": system,
                "scheme": scheme or "",
                "bytes": b,
                "runs": len(mine),
                "stream_MBps": stream,
                "cpu_share": cell(share),
                "measured_s": t,
                "predicted_s": cell(pred),
                "predicted_over_measured": cell(q),
                "within_20pct": "" if q is None else ("yes" if abs(q - 1) <= 0.2 else "no"),
                "speedup_vs_mpi_measured": cell(ratio(t_mpi, t)),
                "speedup_vs_mpi_model": cell(ratio(predict_time("mpi", p, b // 4, m), pred) if scheme else None),
                "cpu_per_rank_s": cell(statistics.median(cpu) if cpu else None),
                "cpu_model_s": cell(cpu_model),
                "wire_bytes_per_rank": cell(statistics.median(wire) if wire else None),
                "bytes_sent_model": cell(traffic(scheme, p, b // 4)[1] if scheme else None),
            }
        )
    stem = os.path.splitext(os.path.basename(args.csv))[0]
    path = os.path.join(args.out, f"{stem}-model.csv")
    write_rows(path, COMPARE_FIELDS, out)
    from hpcdl.measure import save_figure

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4.8))
        xs = range(len(out))
        ax.bar([x - 0.2 for x in xs], [1e3 * r["measured_s"] for r in out], 0.4, label="measured (median of runs)")
        ax.bar([x + 0.2 for x in xs], [1e3 * (r["predicted_s"] or 0) for r in out], 0.4, label="cost model")
        ax.set_xticks(list(xs), [f"P={r['ranks']} {r['scheme'] or r['system']}" for r in out], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("time per call, slowest rank (ms)")
        ax.set_title(f"{stem}: {out[0]['bytes'] / 2**20:g} MiB float32, stream {out[0]['stream_MBps']:.2f} MB/s")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        return fig

    figure = os.path.join(args.out, f"{stem}-model.png")
    plotted = save_figure(figure, draw)
    print(
        f"{'P':>3} {'system':62} {'measured ms':>11} {'model ms':>9} {'model/meas':>10} {'x mpi':>6} "
        f"{'model x mpi':>11} {'cpu ms':>7} {'model cpu':>9}"
    )
    for r in out:
        print(
            f"{r['ranks']:>3} {r['system'] + ' (' + r['scheme'] + ')':62} {1e3 * r['measured_s']:11.1f} "
            + " ".join(
                f"{v:>{w}}"
                for v, w in (
                    (show_ms(r["predicted_s"]), 9),
                    (show_num(r["predicted_over_measured"]), 10),
                    (show_num(r["speedup_vs_mpi_measured"]), 6),
                    (show_num(r["speedup_vs_mpi_model"]), 11),
                    (show_ms(r["cpu_per_rank_s"]), 7),
                    (show_ms(r["cpu_model_s"]), 9),
                )
            )
        )
    print(f"wrote {path}" + (f", {figure}" if plotted else ""))
    return 0


def show_ms(value):
    return "-" if value == "" else f"{1e3 * value:.1f}"


def show_num(value):
    return "-" if value == "" else f"{value:.2f}"


# ---- predict: P = 2 .. 1024 on real links ----


def cmd_predict(args):
    codec = load_codecs(args.out)
    kappa = args.kappa
    if kappa is None:  # the library's overhead over the bare kernels, as validate fitted it
        path = os.path.join(args.out, "cost-model-params.csv")
        fitted = {r["parameter"]: num(r["value"]) for r in read_rows(path)} if os.path.exists(path) else {}
        kappa = fitted.get("kappa") or 1.0
    if len(args.gbits) != len(args.alpha_us):
        raise SystemExit("--gbits and --alpha-us need one value per link")
    n = parse_size(args.size) // 4
    ranks = [2**i for i in range(1, 11)]
    rows = []
    for gbit, alpha_us in zip(args.gbits, args.alpha_us):
        m = Machine(
            alpha_us * 1e-6,
            8.0 / (gbit * 1e9 * args.efficiency),
            codec,
            args.overhead_us * 1e-6,
            kappa,
            args.net_cpu_ns * 1e-9,
        )
        for p in ranks:
            for scheme in args.schemes.split(","):
                msgs, sent = traffic(scheme, p, n)
                rows.append(
                    {
                        "link_Gbit": gbit,
                        "alpha_us": alpha_us,
                        "overhead_us": args.overhead_us,
                        "kappa": kappa,
                        "net_cpu_ns": args.net_cpu_ns,
                        "ranks": p,
                        "scheme": scheme,
                        "bytes": 4 * n,
                        "messages_per_rank": msgs,
                        "rounds": latency_rounds(scheme, p, n),
                        "bytes_sent_per_rank": sent,
                        "cpu_per_rank_s": cpu_seconds(scheme, p, n, m),
                        "predicted_s": predict_time(scheme, p, n, m),
                    }
                )
    path = os.path.join(args.out, args.tag + ".csv")
    write_rows(path, list(rows[0]), rows)
    from hpcdl.measure import save_figure

    def draw(plt):
        fig, axes = plt.subplots(1, len(args.gbits), figsize=(6 * len(args.gbits), 4.8), sharey=True)
        axes = axes if len(args.gbits) > 1 else [axes]
        for ax, gbit, alpha_us in zip(axes, args.gbits, args.alpha_us):
            for scheme in args.schemes.split(","):
                mine = [r for r in rows if r["link_Gbit"] == gbit and r["scheme"] == scheme]
                ax.plot([r["ranks"] for r in mine], [1e3 * r["predicted_s"] for r in mine], marker="o", label=scheme)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(p) for p in ranks])
            ax.set_yscale("log")
            ax.set_xlabel("ranks P (one core each)")
            ax.set_title(f"{gbit:g} Gbit/s links, alpha {alpha_us:g} us")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("predicted time per allreduce call (ms)")
        axes[0].legend()
        fig.suptitle(
            f"Cost model: one allreduce of {4 * n / 2**20:g} MiB float32 per step (TopK {TOPK_RATIO:.0%}; "
            f"CPU = {kappa:.2f} x single-core kernels, one core per rank)"
        )
        fig.tight_layout()
        return fig

    figure = os.path.join(args.out, args.tag + ".png")
    plotted = save_figure(figure, draw)
    for gbit in args.gbits:
        print(f"{gbit:g} Gbit/s, {4 * n / 2**20:g} MiB: ms per call")
        schemes = args.schemes.split(",")
        print(f"{'P':>5} " + " ".join(f"{s:>15}" for s in schemes))
        for p in ranks:
            cells = [
                next(r for r in rows if r["link_Gbit"] == gbit and r["ranks"] == p and r["scheme"] == s)
                for s in schemes
            ]
            print(f"{p:>5} " + " ".join(f"{1e3 * c['predicted_s']:15.2f}" for c in cells))
    print(f"wrote {path}" + (f", {figure}" if plotted else ""))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("codecs", help="CPU seconds per value of each kernel, one core")
    c.add_argument("--size", default="64MiB")
    c.add_argument("--repeats", type=int, default=7)
    m = sub.add_parser("measure", help="under mpiexec: time every scheme, interleaved")
    m.add_argument("--sizes", default="1MiB,4MiB")
    m.add_argument("--schemes", default="dense,mpi,fp16,int8,topk_allgather,topk_split")
    m.add_argument("--runs", type=int, default=3)
    m.add_argument("--calls", type=int, default=3, help="timed calls per scheme, size and run")
    m.add_argument(
        "--idle",
        type=float,
        default=0.05,
        help="seconds of idle links before every call (>= burst / rate: 13 ms for a 32 KB bucket at 20 Mbit/s)",
    )
    v = sub.add_parser("validate", help="fit alpha/beta on P = 2; model against measurement")
    v.add_argument("--ranks", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4, 8])
    v.add_argument(
        "--cores",
        type=float,
        default=float(os.cpu_count()),
        help="cores the emulated hosts share, for rows without a measured CPU share (default: this machine's)",
    )
    v.add_argument(
        "--burst",
        type=float,
        default=32 << 10,
        help="token bucket bytes per link "
        "(tc's kb are KiB: HPCDL_NET_BURST=32kb as in the measure command gives the default)",
    )
    r = sub.add_parser("predict", help="predictions for P = 2 .. 1024")
    r.add_argument("--size", default="64MiB", help="float32 gradient bytes per call")
    r.add_argument("--gbits", type=lambda t: [float(x) for x in t.split(",")], default=[10.0, 100.0])
    r.add_argument(
        "--alpha-us",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[10.0, 2.0],
        help="seconds per message for each link, in us",
    )
    r.add_argument(
        "--overhead-us", type=float, default=1.0, help="seconds per further message of a round (an all-to-all's), in us"
    )
    r.add_argument("--efficiency", type=float, default=0.95, help="goodput / line rate")
    r.add_argument(
        "--net-cpu-ns",
        type=float,
        default=0.0,
        help="CPU ns per wire byte (0: RDMA-like offload; see cost-model-params.csv for TCP)",
    )
    r.add_argument(
        "--kappa",
        type=float,
        default=None,
        help="library CPU / kernel CPU (default: the fitted value in <out>/cost-model-params.csv, else 1)",
    )
    r.add_argument("--schemes", default=",".join(SCHEMES))
    r.add_argument("--tag", default="cost-model-predict", help="file stem of <out>/<tag>.csv and .png")
    k = sub.add_parser("compare", help="the model at the points of a bench/allreduce.py CSV")
    k.add_argument("csv", help="bench/allreduce.py's <out>/<tag>.csv, run under netcluster.sh")
    k.add_argument(
        "--share",
        type=float,
        default=None,
        help="CPU share per rank (default: the median measured at the same P in <out>/cost-model-measured-p<P>.csv)",
    )
    k.add_argument("--burst", type=float, default=32 << 10, help="token bucket bytes per link")
    for q in (c, m, v, r, k):
        q.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return {
        "codecs": cmd_codecs,
        "measure": cmd_measure,
        "validate": cmd_validate,
        "predict": cmd_predict,
        "compare": cmd_compare,
    }[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
