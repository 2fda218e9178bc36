"""The `hpcdl` command line. Each subcommand is one `_cmd_NAME(args)` function
registered in `_parser()`; heavy imports happen inside the command."""

import argparse
import os
import shutil
import subprocess
import sys


def _mpi_cuda_support():
    """ "yes"/"no" from MPIX_Query_cuda_support of the libmpi this process loaded, or "unknown"
    (no such function there, or no way to find the library). hpcdl stages CUDA tensors through
    host memory either way; a CUDA-aware MPI could take device pointers directly."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted(
                {line.split()[-1] for line in maps if os.path.basename(line.split()[-1]).startswith("libmpi.so")}
            )
    except OSError:
        return "unknown"
    for path in paths:
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return "yes" if query() else "no"
    return "unknown"


def _cmd_info(args):
    from mpi4py import MPI

    import hpcdl

    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    print(f"hpcdl {hpcdl.__version__}")
    print(f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()}")
    print(f"MPI standard: {'.'.join(map(str, MPI.Get_version()))}")
    print(f"thread level: {levels.get(MPI.Query_thread(), MPI.Query_thread())} (hpcdl needs multiple)")
    print(f"ranks: {MPI.COMM_WORLD.Get_size()}")
    print(
        f"CUDA-aware MPI: {_mpi_cuda_support()} (MPIX_Query_cuda_support; hpcdl stages CUDA tensors "
        "through pinned host memory either way)"
    )
    return 0


def _print_skipped(skipped, limit):
    for name, reason in skipped[:limit]:
        print(f"  skipped {name}: {reason}")
    if len(skipped) > limit:
        print(f"  ... and {len(skipped) - limit} more (hpcdl ls DST --skipped lists them all)")


def _cmd_pack(args):
    from mpi4py import MPI

    from hpcdl import store

    comm = MPI.COMM_WORLD
    try:
        result = store.pack(
            args.src,
            args.dst,
            shards=args.shards,
            shard_bytes=args.shard_bytes,
            comm=comm,
            force=args.force,
            progress=not args.quiet,
            threads=args.threads or store.DEFAULT_THREADS,
        )
    except (OSError, ValueError) as exc:
        if comm.Get_rank() == 0:
            print(f"hpcdl pack: error: {exc}", file=sys.stderr)
        return 1
    if comm.Get_rank() == 0:
        mb = result.bytes / 1e6
        reused = f", {result.reused_shards} reused from an earlier run" if result.reused_shards else ""
        print(
            f"packed {result.samples} samples ({mb:.1f} MB) into {result.shards} shards{reused} in "
            f"{result.seconds:.1f} s ({result.samples / result.seconds:.0f} files/s, "
            f"{mb / result.seconds:.1f} MB/s) with {comm.Get_size()} rank(s) -> {args.dst}"
        )
        if result.skipped:
            print(f"WARNING: {len(result.skipped)} file(s) skipped (not packed):", file=sys.stderr)
            _print_skipped(result.skipped, 10)
    return 0


def _open_store(args):
    """The store at args.dst, damaged shards allowed (they are reported), or None after an error."""
    from hpcdl import store
    from hpcdl.errors import HpcdlError

    try:
        return store.Store(args.dst, allow_damaged=True)
    except (OSError, HpcdlError) as exc:
        print(f"hpcdl {args.command}: error: {exc}", file=sys.stderr)
        return None


def _verify_findings(st, report):
    """The problems of a verify report, one entry per shard-level cause: a damaged
    shard once with its sample count, a reason repeated by samples of one shard
    (e.g. truncated) once with their count, a sample's own reason (a checksum) alone.
    Each entry: {shard, first, samples, reason} plus name for a single sample."""
    import numpy as np

    findings = [
        {"shard": os.path.basename(path), "first": first, "samples": count, "reason": reason}
        for path, first, count, reason in report.damaged
    ]
    groups = {}
    for index, name, reason in report.problems:
        shard = int(np.searchsorted(st.shard_first, index, side="right")) - 1
        groups.setdefault((shard, reason), []).append((index, name))
    for (shard, reason), samples in groups.items():
        entry = {
            "shard": os.path.basename(st.shard_paths[shard]),
            "first": samples[0][0],
            "samples": len(samples),
            "reason": reason,
        }
        if len(samples) == 1:
            entry["name"] = samples[0][1]
        findings.append(entry)
    return sorted(findings, key=lambda e: e["first"])


def _cmd_verify(args):
    import json

    from hpcdl import store
    from hpcdl.errors import HpcdlError

    if args.json:
        try:
            st = store.Store(args.dst, allow_damaged=True)
        except (OSError, HpcdlError) as exc:
            print(json.dumps({"store": args.dst, "error": str(exc)}))
            return 1
    else:
        st = _open_store(args)
        if st is None:
            return 1
    report = st.verify(progress=not (args.quiet or args.json))
    findings = _verify_findings(st, report)
    bad = sum(f["samples"] for f in findings)
    if args.json:
        print(
            json.dumps(
                {
                    "store": st.root,
                    "samples": report.samples,
                    "shards": len(st.shard_paths),
                    "bytes_read": report.bytes_read,
                    "seconds": report.seconds,
                    "ok": report.samples - bad,
                    "bad": bad,
                    "problems": findings,
                }
            )
        )
        return 0 if not findings else 1
    mb = report.bytes_read / 1e6
    print(
        f"verified {report.samples} samples in {len(st.shard_paths)} shards: read {mb:.1f} MB in "
        f"{report.seconds:.2f} s ({mb / max(report.seconds, 1e-9):.1f} MB/s)"
    )
    if not findings:
        print("OK: every checksum matches")
        return 0
    print(f"FAILED: {bad} bad sample(s)")
    for f in findings[:20]:
        if "name" in f:
            print(f"  sample {f['first']} {f['name']!r}: {f['reason']}")
        else:
            print(f"  {f['shard']}: {f['samples']} samples from {f['first']}: {f['reason']}")
    if len(findings) > 20:
        print(f"  ... and {len(findings) - 20} more")
    return 1


def _cmd_ls(args):
    import numpy as np

    st = _open_store(args)
    if st is None:
        return 1
    readable = np.ones(len(st), dtype=bool)
    for k, _ in st.damaged:
        readable[st.shard_first[k] : st.shard_first[k] + st.shard_counts[k]] = False
    sizes = st.sizes[readable]
    total = int(st.shard_data_bytes.sum())  # the manifest's figure: a damaged shard's sizes are unknown
    print(f"store {st.root} (format version {st.attrs['format_version']}, packed from {st.attrs['source']})")
    print(f"samples: {len(st)}   bytes: {total} ({total / 1e6:.1f} MB)")
    if len(sizes):
        print(
            f"sample size: min {int(sizes.min())}  median {int(np.median(sizes))}  "
            f"mean {sizes.mean():.0f}  max {int(sizes.max())} bytes"
        )
    print(f"shards: {len(st.shard_paths)}")
    for k, path in enumerate(st.shard_paths):
        lo, n = int(st.shard_first[k]), int(st.shard_counts[k])
        status = " DAMAGED" if any(d[0] == k for d in st.damaged) else ""
        print(
            f"  {os.path.basename(path)}  samples {lo}..{lo + n - 1}  {os.path.getsize(path) if os.path.exists(path) else 0} bytes{status}"
        )
    counts = np.bincount(st.labels[st.labels >= 0], minlength=len(st.classes))
    print(
        f"classes: {len(st.classes)}"
        + (f"  (unlabelled top-level files: {int((st.labels < 0).sum())})" if (st.labels < 0).any() else "")
    )
    for label, name in enumerate(st.classes[: args.classes]):
        print(f"  {label:5d}  {name}  {int(counts[label])}")
    if len(st.classes) > args.classes:
        print(f"  ... and {len(st.classes) - args.classes} more (--classes N shows more)")
    print(f"skipped when packed: {len(st.skipped)}")
    if args.skipped:
        _print_skipped(st.skipped, len(st.skipped))
    elif st.skipped:
        _print_skipped(st.skipped, 5)
    for k, reason in st.damaged:
        print(f"hpcdl ls: error: {os.path.basename(st.shard_paths[k])} is damaged: {reason}", file=sys.stderr)
    return 1 if st.damaged else 0


# Set by mpiexec (MPICH, Intel MPI), srun --mpi=pmi2 / pmix and Open MPI's mpirun in each rank.

# name: (what it measures, its small defaults; N = -n). Options given after these win.
BENCHES = {
    "allreduce": (
        "allreduce bandwidth: hpcdl against MPI_Allreduce (bench/allreduce.py)",
        ["--sizes", "64KiB,1MiB,4MiB", "--systems", "hpcdl,mpi", "--budget", "0.5", "--max-iters", "20"],
    ),
    "store": (
        "small-file reads: files, h5py and the store, 1 and N ranks (bench/store.py)",
        [
            "--fs",
            "plain",
            "--files",
            "2000",
            "--classes",
            "10",
            "--cold-samples",
            "500",
            "--strace-samples",
            "500",
            "--repeats",
            "1",
            "--shards",
            "2",
            "--ranks",
            "1,N",
        ],
    ),
    "prefetch": (
        "epoch time and stalls: DataLoader against the prefetcher on N ranks (bench/prefetch.py)",
        [
            "--slowfs",
            "",
            "--files",
            "1000",
            "--epochs",
            "2",
            "--batch",
            "16*N",
            "--compute",
            "0.01",
            "--ranks",
            "N",
            "--variants",
            "emulated",
            "--runs",
            "1",
            "--prefetch-factors",
            "4",
        ],
    ),
}


def mpiexec_path():
    """The mpiexec of this Python's MPI: beside sys.executable (PyPI's mpich in a venv), else beside
    the mpicc mpi4py was built with (a site MPI), else the first on PATH."""
    import mpi4py

    mpicc = mpi4py.get_config().get("mpicc")
    for folder in (os.path.dirname(sys.executable), os.path.dirname(shutil.which(mpicc) or mpicc) if mpicc else None):
        if folder and os.access(os.path.join(folder, "mpiexec"), os.X_OK):
            return os.path.join(folder, "mpiexec")
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "no mpiexec beside this Python, beside mpi4py's mpicc or on PATH; "
            "load your site's MPI module or pip install mpich"
        )
    return found


def bench_dir():
    """bench/ beside the hpcdl package of a checkout (run in place: PYTHONPATH=$PWD or `pip install
    -e .`). The benchmarks are repository tools, not installed: `hpcdl bench NAME` runs
    bench/NAME.py as `python bench/NAME.py` would, never as part of hpcdl's import graph
    (docs/building.md)."""
    package = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(package), "bench")
    if not os.path.isfile(os.path.join(folder, "allreduce.py")):
        raise FileNotFoundError(
            f"no benchmark scripts beside {package}: the benchmarks are bench/ of a checkout of hpcdl, "
            "not installed; run hpcdl bench with the checkout's hpcdl (pip install -e . or PYTHONPATH=CHECKOUT), "
            "or python CHECKOUT/bench/NAME.py with this one"
        )
    return folder


def load_bench(name):
    """bench/NAME.py as a module of its own (not hpcdl.*), run as `python bench/NAME.py` would."""
    import importlib.util

    path = os.path.join(bench_dir(), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"hpcdl_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_argv(args):
    """The bench script's arguments: small defaults, then --out, then what the user added."""
    n = args.ranks
    defaults = [
        {"N": str(n), "1,N": "1" if n == 1 else f"1,{n}", "16*N": str(16 * n)}.get(a, a) for a in BENCHES[args.bench][1]
    ]
    if getattr(args, "slowfs", False):  # the scripts' own default: the emulated slow file system
        at = defaults.index("--fs" if args.bench == "store" else "--slowfs")
        del defaults[at : at + 2]
    return defaults + ["--out", args.out] + args.bench_args


def _cmd_bench(args):
    if args.ranks < 1:
        print("hpcdl bench: error: -n must be at least 1", file=sys.stderr)
        return 2
    try:
        bench_dir()  # before any rank starts: an install without a checkout has no bench/
    except FileNotFoundError as exc:
        print(f"hpcdl bench: error: {exc}", file=sys.stderr)
        return 2
    from hpcdl import _env

    launched = _env.launched_by_mpi()
    self_launch = args.bench == "allreduce" and not launched and args.ranks > 1
    if self_launch or args.bench != "allreduce":
        try:
            mpiexec = mpiexec_path()
        except FileNotFoundError as exc:
            print(f"hpcdl bench: error: {exc}", file=sys.stderr)
            return 2
    if self_launch:
        # One process as typed: start the ranks, each of which runs the benchmark in-process.
        cmd = [
            mpiexec,
            "-n",
            str(args.ranks),
            sys.executable,
            "-m",
            "hpcdl",
            "bench",
            "allreduce",
            "--out",
            args.out,
        ] + args.bench_args
        print(f"[hpcdl] {' '.join(cmd)}", flush=True)
        return subprocess.call(cmd)
    if args.bench != "allreduce":
        if launched:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() > 1:
                if MPI.COMM_WORLD.Get_rank() == 0:
                    print(
                        f"hpcdl bench {args.bench}: error: run it as one process; it starts its own "
                        f"mpiexec -n {args.ranks} (-n N)",
                        file=sys.stderr,
                    )
                return 2
    status = load_bench(args.bench).main(_bench_argv(args)) or 0
    if args.bench == "prefetch" and status == 0 and not args.slowfs:
        print(
            "the store was a plain temporary directory (no slow file system; --slowfs for it); the "
            "model rows predict the throttled file system of --iops/--bps"
        )
    return status


def _parser():
    from hpcdl import __version__
    from hpcdl.units import positive_int_type, size_type

    parser = argparse.ArgumentParser(prog="hpcdl", description="hpcdl: distributed DL training tools")
    parser.add_argument("--version", action="version", version=f"hpcdl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="version, MPI library, thread level and whether the MPI is CUDA-aware")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser(
        "pack",
        help="pack a directory of small files into an HDF5 store",
        description="Pack every file under SRC into an hpcdl store in directory DST "
        "(class = first-level sub-directory). Run under mpiexec -n P to split the work.",
    )
    p.add_argument("src", metavar="SRC", help="source directory")
    p.add_argument("dst", metavar="DST", help="destination directory (created)")
    p.add_argument(
        "--shards",
        type=positive_int_type("--shards"),
        default=None,
        help="number of shards (default: by --shard-bytes)",
    )
    p.add_argument(
        "--shard-bytes",
        type=size_type(),
        default="1G",
        help="target shard size when --shards is not given (default 1G)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing store at DST")
    p.add_argument(
        "--threads",
        type=positive_int_type("--threads"),
        default=None,
        help="files read at once per rank (default: hpcdl.store.DEFAULT_THREADS)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pack)
    p = sub.add_parser("verify", help="check every sample's checksum of a store")
    p.add_argument("dst", metavar="DST", help="store directory (or its manifest.h5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object on stdout: store, samples, shards, "
        "bytes_read, seconds, ok, bad, problems [{shard, first, samples, reason[, name]}] (or error)",
    )
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("ls", help="summary of a store: counts, sizes, label histogram")
    p.add_argument("dst", metavar="DST", help="store directory (or its manifest.h5)")
    p.add_argument("--classes", type=int, default=50, help="classes to list (default 50)")
    p.add_argument("--skipped", action="store_true", help="list every file skipped when packing")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser(
        "bench",
        help="run a benchmark with small defaults: a table, CSV and PNG",
        description="Run one of hpcdl's benchmarks (bench/NAME.py) with small defaults "
        "that finish in well under a minute; rank 0 prints a table and writes CSV and PNG "
        "to --out.",
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, (summary, defaults) in BENCHES.items():
        b = benches.add_parser(
            name,
            help=summary,
            description=summary,
            allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"defaults passed to bench/{name}.py: {' '.join(repr(a) if not a else a for a in defaults)}"
            f"\nAny other option goes to bench/{name}.py and wins over these; its options: "
            f"python bench/{name}.py --help (bench/ of a checkout)",
        )
        b.add_argument(
            "-n",
            dest="ranks",
            type=int,
            default=4,
            metavar="N",
            help="ranks (default 4)"
            + ("; under mpiexec/srun: the ranks it was started with" if name == "allreduce" else ""),
        )
        b.add_argument("--out", default="hpcdl-bench", help="directory for the CSV and PNG (default ./hpcdl-bench)")
        if name != "allreduce":
            b.add_argument(
                "--slowfs",
                action="store_true",
                help="use the emulated slow file system "
                "(bench/slowfs.sh; needs root) instead of a plain temporary directory",
            )
        b.set_defaults(func=_cmd_bench)
    return parser


def main(argv=None):
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra  # the bench script's own options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
