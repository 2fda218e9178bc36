"""Allreduce bandwidth: hpcdl against MPI_Allreduce and torch.distributed (gloo).

Run under mpiexec; every system reduces the same float32 buffers in the same
run, interleaved iteration by iteration so they meet the same conditions:

    mpiexec -n 4 python bench/allreduce.py                      # one host
    bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/allreduce.py --tag cluster                 # emulated 1 Gbit/s cluster
    mpiexec -n 4 python bench/allreduce.py --systems hpcdl \\
        --chunk-bytes 64KiB,256KiB,1MiB,4MiB --sizes 16MiB,64MiB    # chunk-size sweep
    mpiexec -n 4 python bench/allreduce.py --systems mpi \\
        --compression 'none,fp16,int8,topk(ratio=0.01)' --sizes 4MiB,64MiB    # codecs

Per size and system: median and min over iterations of the slowest rank's
time, algbw = bytes / time and busbw = algbw * 2(p-1)/p (as nccl-tests
reports), in MB/s (10^6 bytes/s), and the process CPU time per rank and call
(all threads: the engine's included; mean over ranks, median over iterations)
with its share of the call's time (1.0 = one core busy for the whole call), so
a run on the emulated cluster shows whether the CPU or the link binds; the
load average at the start of each size is in the CSV too. Each system's result is checked against the
exact sum once per size, so a fast wrong answer cannot win; a compressed
system is lossy, so it is checked against the documented tolerance of its codec
instead (docs/compression.md), and its wire bytes per call (hpcdl.stats) go
into the CSV. Rank 0 prints a
table and writes <out>/<tag>.csv (one row per run, system and size),
<out>/<tag>.png (busbw against size) and <out>/<tag>.json (the settings).
Under bench/netcluster.sh the TCP stream rate it measured
(HPCDL_BENCH_STREAM_MBPS) is shown as the line to reach.
"""

import argparse
import csv
import hashlib
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcdl.measure import rate, ratio, show

DTYPE = np.float32
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "K": 1 << 10, "MIB": 1 << 20, "M": 1 << 20, "GIB": 1 << 30, "G": 1 << 30}
DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB"


def parse_bytes(text):
    """'4KiB' -> 4096, '1MiB' -> 1048576, '512' -> 512."""
    text = text.strip()
    digits = len(text) - len(text.lstrip("0123456789"))
    unit = text[digits:].strip().upper()
    if digits == 0 or unit not in UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 4096, 64KiB, 16MiB)")
    return int(text[:digits]) * UNITS[unit]


def format_bytes(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def byte_list(text):
    sizes = [parse_bytes(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError("empty size list")
    return sizes


# ---- systems: each reduces a float32 numpy array in place, summing over ranks ----


class System:
    """One allreduce implementation under test. `run` is what is timed."""

    name = "?"

    def prepare(self):
        """Untimed, before every call of run (e.g. select a tunable)."""

    def reset(self):
        """Untimed, before the call whose result is checked (e.g. forget state)."""

    def run(self, work):
        raise NotImplementedError

    def correct(self, work, expected, comm):
        """This rank's verdict on one result: exact on integer data, within float32
        summation rounding on normal data."""
        if expected.sum_abs is None:
            return bool(np.array_equal(work, expected.values))
        return bool(np.all(np.abs(work - expected.values) <= expected.rounding(comm.size)))

    def wire_bytes(self):
        """Bytes this rank sent since the last call, when the system can tell (else None)."""
        return None

    def close(self):
        pass


def parse_codec(text):
    """A codec text as hpcdl.compression.from_text reads it ('none', 'fp16', 'int8',
    'int8(block=64)', 'topk(ratio=0.01)' ...) -> an hpcdl codec (None = dense)."""
    from hpcdl.compression import NoCompression, from_text

    codec = from_text(text)
    return None if isinstance(codec, NoCompression) else codec


class HpcdlSystem(System):
    def __init__(self, comm, chunk_bytes=None, hang_seconds=120.0, codec_text="none"):
        import hpcdl

        self.hpcdl, self.comm, self.chunk_bytes, self.hang_seconds = hpcdl, comm, chunk_bytes, hang_seconds
        self.codec = parse_codec(codec_text)
        self.name = "hpcdl" if chunk_bytes is None else f"hpcdl[chunk={format_bytes(chunk_bytes)}]"
        if self.codec is not None:
            self.name += f"[{codec_text}]"
        if chunk_bytes is None:
            self.chunk_bytes = hpcdl.configure()["chunk_bytes"]

    def prepare(self):
        self.hpcdl.configure(chunk_bytes=self.chunk_bytes)

    def reset(self):
        # The checked call starts from no residual; timed calls keep it, as training steps do.
        if self.codec is not None:
            self.hpcdl.compression.reset_state()

    def correct(self, work, expected, comm):
        """Integer data: dense, fp16 and bf16 exact (partial sums of these small integers
        are representable). Normal data: dense within float32 rounding, fp16/bf16 within
        p roundings of the partial sums. int8: within the ring bound of
        docs/compression.md (doubled per encoding for stochastic rounding). topk: ranks
        agree bitwise, and every value is 0 or a partial
        sum of the exact one (integers) or at most the sum of magnitudes (normal)."""
        name = None if self.codec is None else self.codec.name
        p, ints = comm.size, expected.sum_abs is None
        if name is None or (ints and name in ("fp16", "bf16")):
            return super().correct(work, expected, comm)
        err = np.abs(work - expected.values)
        if name in ("fp16", "bf16"):
            unit = 2.0**-11 if name == "fp16" else 2.0**-8
            return bool(np.all(err <= p * unit * expected.sum_abs + expected.rounding(p)))
        same = len(set(comm.allgather(hashlib.sha1(work.tobytes()).hexdigest()))) == 1
        if name == "int8":
            # A_i (sum over ranks of the absmax of i's block) is at most p * max |x|; stochastic
            # rounding errs by up to a whole scale step per encoding, nearest by half of one.
            step = 1 / 127 if self.codec.rounding == "stochastic" else 1 / 254
            bound = ((1 + step) ** p - 1) * p * expected.max_abs + 1e-3
            return same and bool(np.all(err <= bound + (0 if ints else expected.rounding(p))))
        if ints:
            return same and bool(np.all((work >= 0) & (work <= expected.values)))
        return same and bool(np.all(np.abs(work) <= expected.sum_abs * (1 + 1e-5)))

    def wire_bytes(self):
        rows = self.hpcdl.stats(reset=True).get("allreduce", {})
        return sum(r["bytes_sent"] for r in rows.values())

    def run(self, work):
        try:
            self.hpcdl.allreduce_async(work, op="sum", comm=self.comm, name=self.name, compression=self.codec).wait(
                timeout=self.hang_seconds
            )
        except TimeoutError:
            # The engine thread is stuck in MPI and cannot be stopped: say so and end the job.
            print(
                f"[bench rank {self.comm.rank}] {self.name}: allreduce of {format_bytes(work.nbytes)} not "
                f"finished after {self.hang_seconds:g} s; aborting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)


class MpiSystem(System):
    name = "mpi"

    def __init__(self, comm):
        self.comm = comm.Dup()

    def run(self, work):
        self.comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)

    def close(self):
        self.comm.Free()


class GlooSystem(System):
    """torch.distributed with the gloo backend; rendezvous at MASTER_ADDR (default 127.0.0.1)."""

    name = "gloo"

    def __init__(self, comm):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        if port is None and comm.rank == 0:
            with socket.socket() as probe:  # a free port on rank 0's host
                probe.bind((addr, 0))
                port = probe.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)

    def run(self, work):
        self.dist.all_reduce(self.torch.from_numpy(work))

    def close(self):
        self.dist.destroy_process_group()


def make_systems(names, chunk_sizes, comm, hang_seconds, codecs=()):
    """Systems in the order asked for; hpcdl once per chunk size when a sweep is
    asked, and once per codec (first, in the order given) when codecs are asked."""
    codec_systems = [HpcdlSystem(comm, None, hang_seconds, c) for c in codecs]
    factories = {
        "hpcdl": lambda: [HpcdlSystem(comm, c, hang_seconds) for c in (chunk_sizes or [None])],
        "mpi": lambda: [MpiSystem(comm)],
        "gloo": lambda: [GlooSystem(comm)],
    }
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(factories)}")
    return codec_systems + [system for n in names if not (codecs and n == "hpcdl") for system in factories[n]()]


# ---- measurement ----


def rank_input(count, rank, data):
    """ "ints": small integers, so every partial sum is exact in float32 (but about
    1/13 of the values tie at every magnitude). "normal": standard normal values,
    seeded by rank, like gradients (no ties)."""
    if data == "normal":
        return np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)
    return ((np.arange(count, dtype=np.int64) * 7 + rank) % 13).astype(DTYPE)


class Expected:
    """The exact sum of every rank's input, with what the checks' bounds need."""

    def __init__(self, count, size, data):
        if data == "ints":
            self.values = sum(rank_input(count, r, data) for r in range(size)).astype(DTYPE)
            self.sum_abs, self.max_abs = None, 12.0
            return
        self.values = np.zeros(count, np.float64)
        self.sum_abs = np.zeros(count, np.float32)
        self.max_abs = 0.0
        for r in range(size):
            x = rank_input(count, r, data)
            self.values += x
            self.sum_abs += np.abs(x)
            self.max_abs = max(self.max_abs, float(np.abs(x).max(initial=0.0)))

    def rounding(self, size):
        """Float32 rounding of a sum of `size` terms, per element (with margin)."""
        return size * 2.0**-23 * self.sum_abs + 1e-30


def timed_call(comm, system, work, source):
    """(wall seconds, process CPU seconds) of one call on this rank."""
    np.copyto(work, source)
    system.prepare()
    comm.Barrier()
    cpu0, t0 = time.process_time(), time.perf_counter()
    system.run(work)
    return time.perf_counter() - t0, time.process_time() - cpu0


def load_average():
    """The 1-minute load average of the machine, None where /proc cannot tell."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def measure_size(comm, systems, nbytes, args):
    """{system name: [per-iteration seconds, slowest rank]} or None for a wrong result,
    {system name: bytes sent per call, summed over ranks} where known, and
    {system name: [per-iteration process CPU seconds, mean over ranks]}."""
    count = nbytes // np.dtype(DTYPE).itemsize
    source = rank_input(count, comm.rank, args.data)
    work = np.empty_like(source)
    expected = Expected(count, comm.size, args.data)
    live, results, wire, warm_s = [], {}, {}, 0.0
    for system in systems:
        system.wire_bytes()
        system.reset()
        timed_call(comm, system, work, source)
        sent = system.wire_bytes()
        if sent is not None:
            wire[system.name] = comm.allreduce(sent)
        correct = comm.allreduce(system.correct(work, expected, comm), op=MPI.LAND)
        if not correct:
            results[system.name] = None
            continue
        for _ in range(args.warmup):
            warm_s = max(warm_s, timed_call(comm, system, work, source)[0])
        live.append(system)
    del expected
    if args.iters:
        iters = args.iters
    else:
        slowest = comm.allreduce(warm_s, op=MPI.MAX)
        iters = int(min(args.max_iters, max(args.min_iters, args.budget / max(slowest, 1e-6))))
    times, cpus = np.zeros((len(live), iters)), np.zeros((len(live), iters))
    for i in range(iters):  # interleaved: iteration i of every system, then i + 1
        for s, system in enumerate(live):
            times[s, i], cpus[s, i] = timed_call(comm, system, work, source)
    slowest_rank, cpu_sum = np.empty_like(times), np.empty_like(cpus)
    comm.Allreduce(times, slowest_rank, op=MPI.MAX)
    comm.Allreduce(cpus, cpu_sum, op=MPI.SUM)
    cpu = {}
    for s, system in enumerate(live):
        results[system.name] = slowest_rank[s].tolist()
        cpu[system.name] = (cpu_sum[s] / comm.size).tolist()
    return results, wire, cpu


def bandwidths(nbytes, seconds, ranks):
    """(algbw, busbw) in MB/s; (None, None) when the clock read no time (not measured, never 0)."""
    algbw = rate(nbytes / 1e6, seconds)
    return (None, None) if algbw is None else (algbw, algbw * 2 * (ranks - 1) / ranks)


# ---- output (rank 0) ----

FIELDS = [
    "tag",
    "run",
    "system",
    "ranks",
    "bytes",
    "iters",
    "time_median_s",
    "time_min_s",
    "algbw_MBps",
    "busbw_MBps",
    "busbw_best_MBps",
    "correct",
    "stream_MBps",
    "wire_bytes",
    "cpu_per_rank_s",
    "cpu_share",
    "load_average",
]


def write_atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_csv(path, rows):
    def write(f):
        w = csv.DictWriter(f, FIELDS, restval="")
        w.writeheader()
        w.writerows(rows)

    write_atomic(path, write)


def summarize(rows, names):
    """{(system, bytes): median over runs of busbw}, None where any run was wrong."""
    out = {}
    for name in names:
        for nbytes in sorted({r["bytes"] for r in rows}):
            mine = [r for r in rows if r["system"] == name and r["bytes"] == nbytes]
            measured = [r["busbw_MBps"] for r in mine if r.get("busbw_MBps") is not None]
            if measured:
                ok = all(r["correct"] for r in mine)
                out[name, nbytes] = statistics.median(measured) if ok else None
    return out


def print_table(summary, names, sizes, stream):
    head = ["size"] + [f"{n} busbw" for n in names]
    base = names[0]
    others = [n for n in names[1:]]
    head += [f"{base}/{n}" for n in others]
    if stream:
        head.append(f"{base}/stream")
    lines = [head]
    for nbytes in sizes:
        cells = [format_bytes(nbytes)]
        for n in names:
            v = summary.get((n, nbytes))
            cells.append("WRONG" if v is None else f"{v:.1f}")
        b = summary.get((base, nbytes))
        for n in others:
            v = summary.get((n, nbytes))
            cells.append(f"{b / v:.2f}" if b and v else "-")
        if stream:
            cells.append(f"{100 * b / stream:.0f}%" if b else "-")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(
        "busbw in MB/s (10^6 bytes/s), median over runs of each run's median time"
        + (f"; TCP stream {stream:.1f} MB/s" if stream else "")
    )


def print_codec_table(rows, names, sizes):
    """Per size and system: median time, effective bandwidth (original bytes / time),
    wire bytes per call (all ranks), and speedup over MPI_Allreduce when it ran."""

    def median_of(name, nbytes, field):
        vals = [r[field] for r in rows if r["system"] == name and r["bytes"] == nbytes and r["correct"]]
        return statistics.median(vals) if vals else None

    print(
        f"{'size':>6}  {'system':<24} {'time ms':>9} {'eff MB/s':>9} {'wire MB':>9} {'vs mpi':>7} "
        f"{'cpu/rank ms':>11} {'cpu share':>9}"
    )
    for nbytes in sizes:
        t_mpi = median_of("mpi", nbytes, "time_median_s")
        for name in names:
            t = median_of(name, nbytes, "time_median_s")
            if t is None:
                print(f"{format_bytes(nbytes):>6}  {name:<24} {'WRONG':>9}")
                continue
            w = [r["wire_bytes"] for r in rows if r["system"] == name and r["bytes"] == nbytes]
            wire_mb = f"{w[0] / 1e6:9.2f}" if w and w[0] != "" else f"{'-':>9}"
            speedup = show(ratio(t_mpi, t), "7.2f", f"{'-':>7}")
            eff = show(rate(nbytes / 1e6, t), "9.1f", f"{'-':>9}")
            cpu = median_of(name, nbytes, "cpu_per_rank_s")
            cpu_ms = show(None if cpu is None else cpu * 1e3, "11.1f", f"{'-':>11}")
            share = show(ratio(cpu, t), "9.2f", f"{'-':>9}")
            print(f"{format_bytes(nbytes):>6}  {name:<24} {t * 1e3:9.1f} {eff} {wire_mb} {speedup} {cpu_ms} {share}")


def draw(plt, summary, names, sizes, stream, title):
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in names:
        xs = [s for s in sizes if summary.get((n, s))]
        ax.plot(xs, [summary[n, s] for s in xs], marker="o", label=n)
    if stream:
        ax.axhline(stream, color="gray", linestyle="--", label=f"TCP stream {stream:.0f} MB/s")
        ax.axhline(0.95 * stream, color="gray", linestyle=":", label="95% of stream")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_bytes(s) for s in sizes], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"message sizes in bytes, comma-separated (KiB/MiB/GiB suffixes; default {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--systems",
        default="hpcdl,mpi,gloo",
        help="comma-separated, from hpcdl, mpi, gloo; the first is the one the ratio columns are about",
    )
    p.add_argument(
        "--chunk-bytes",
        default="",
        help="sweep hpcdl's chunk size over this list "
        "(one hpcdl system per value); default: hpcdl's configured chunk size",
    )
    p.add_argument(
        "--compression",
        default="",
        help="comma-separated codecs for hpcdl, one system each "
        "(hpcdl.compression.from_text's syntax, e.g. none,fp16,int8,'topk(ratio=0.01)'); they replace "
        "'hpcdl' in --systems and come first",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=0,
        help="timed iterations per size and system (default 0: adaptive, about --budget seconds each)",
    )
    p.add_argument("--budget", type=float, default=2.0, help="seconds per size and system when adaptive")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations after the checked one")
    p.add_argument(
        "--data",
        choices=["ints", "normal"],
        default="ints",
        help="input values: small integers (exact checks; heavy ties, top-k's worst case) "
        "or standard normal (gradient-like)",
    )
    p.add_argument("--runs", type=int, default=1, help="repeat the whole sweep; the table shows medians over runs")
    p.add_argument(
        "--hang-seconds",
        type=float,
        default=120.0,
        help="abort the job when one hpcdl allreduce takes longer than this",
    )
    p.add_argument("--out", default="bench/results", help="directory for <tag>.csv/.png/.json")
    p.add_argument("--tag", default="allreduce", help="file name stem and plot title")
    args = p.parse_args(argv)
    args.sizes = byte_list(args.sizes)
    args.chunk_sizes = byte_list(args.chunk_bytes) if args.chunk_bytes else []
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    from hpcdl.compression import from_text_list

    args.codecs = [str(codec) for codec in from_text_list(args.compression)]
    itemsize = np.dtype(DTYPE).itemsize
    bad = [format_bytes(s) for s in args.sizes if s <= 0 or s % itemsize]
    if bad:
        raise ValueError(f"sizes must be positive multiples of {itemsize} bytes (float32): {', '.join(bad)}")
    if args.iters < 0 or args.min_iters < 1 or args.max_iters < args.min_iters or args.runs < 1 or args.warmup < 0:
        raise ValueError("need --iters >= 0, 1 <= --min-iters <= --max-iters, --runs >= 1, --warmup >= 0")
    return args


def main(argv=None):
    comm = MPI.COMM_WORLD
    try:
        args = parse_args(argv)
        systems = make_systems(args.systems, args.chunk_sizes, comm, args.hang_seconds, args.codecs)
    except ValueError as e:  # the same on every rank: all of them stop
        if comm.rank == 0:
            print(f"[bench rank 0] error: {e}", file=sys.stderr)
        return 2
    stream = float(os.environ["HPCDL_BENCH_STREAM_MBPS"]) if os.environ.get("HPCDL_BENCH_STREAM_MBPS") else None
    names = [s.name for s in systems]
    rows = []
    progress = None
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        from tqdm import tqdm

        progress = tqdm(total=args.runs * len(args.sizes), desc="[bench rank 0] allreduce", file=sys.stderr)
    for run in range(args.runs):
        for nbytes in args.sizes:
            load = comm.bcast(load_average(), root=0)
            results, wire, cpu = measure_size(comm, systems, nbytes, args)
            for name in names:
                times = results[name]
                row = {
                    "tag": args.tag,
                    "run": run,
                    "system": name,
                    "ranks": comm.size,
                    "bytes": nbytes,
                    "correct": times is not None,
                    "stream_MBps": stream or "",
                    "wire_bytes": wire.get(name, ""),
                    "load_average": "" if load is None else load,
                }
                if times:
                    median, best = statistics.median(times), min(times)
                    row.update(iters=len(times), time_median_s=median, time_min_s=best)
                    row["algbw_MBps"], row["busbw_MBps"] = bandwidths(nbytes, median, comm.size)
                    row["busbw_best_MBps"] = bandwidths(nbytes, best, comm.size)[1]
                    row["cpu_per_rank_s"] = statistics.median(cpu[name])
                    row["cpu_share"] = ratio(row["cpu_per_rank_s"], median)
                rows.append(row)
            if progress:  # kept current, so an aborted sweep leaves what it measured
                write_csv(os.path.join(args.out, args.tag + ".csv"), rows)
                progress.set_postfix(size=format_bytes(nbytes))
                progress.update()
    for system in systems:
        system.close()
    if comm.rank != 0:
        return 0
    progress.close()
    wrong = sorted({(r["system"], format_bytes(r["bytes"])) for r in rows if not r["correct"]})
    summary = summarize(rows, names)
    print(f"{args.tag}: {comm.size} ranks, {args.runs} run(s)")
    print_table(summary, names, args.sizes, stream)
    if args.codecs:
        print_codec_table(rows, names, args.sizes)
    stem = os.path.join(args.out, args.tag)
    write_csv(stem + ".csv", rows)
    meta = {
        "command": " ".join(sys.argv),
        "ranks": comm.size,
        "runs": args.runs,
        "systems": names,
        "stream_MBps": stream,
        "mpi": MPI.Get_library_version().splitlines()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
    }
    write_atomic(stem + ".json", lambda f: json.dump(meta, f, indent=1))
    from hpcdl.measure import save_figure

    title = f"allreduce busbw, {comm.size} ranks ({args.tag})"
    plotted = save_figure(stem + ".png", lambda plt: draw(plt, summary, names, args.sizes, stream, title))
    print(f"wrote {stem}.csv, {stem}.json" + (f", {stem}.png" if plotted else ""))
    if wrong:
        print("WRONG results: " + ", ".join(f"{s} at {b}" for s, b in wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
