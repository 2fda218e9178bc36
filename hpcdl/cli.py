"""The `hpcdl` command line. Each subcommand is one `_cmd_NAME(args)` function
registered in `_parser()`; heavy imports happen inside the command."""

import argparse
import os
import sys


def _cmd_info(args):
    from mpi4py import MPI

    import hpcdl

    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    print(f"hpcdl {hpcdl.__version__}")
    print(f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()}")
    print(f"MPI standard: {'.'.join(map(str, MPI.Get_version()))}")
    print(f"thread level: {levels.get(MPI.Query_thread(), MPI.Query_thread())} (hpcdl needs multiple)")
    print(f"ranks: {MPI.COMM_WORLD.Get_size()}")
    return 0


def _parse_bytes(text):
    """'512M', '2G', '1048576' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(text[-1:], 1)
    try:
        value = float(text[:-1] if text[-1:] in units else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return int(value)


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
        result = store.pack(args.src, args.dst, shards=args.shards, shard_bytes=args.shard_bytes,
                            comm=comm, force=args.force, progress=not args.quiet, threads=args.threads)
    except (OSError, ValueError) as exc:
        if comm.Get_rank() == 0:
            print(f"hpcdl pack: error: {exc}", file=sys.stderr)
        return 1
    if comm.Get_rank() == 0:
        mb = result.bytes / 1e6
        reused = f", {result.reused_shards} reused from an earlier run" if result.reused_shards else ""
        print(f"packed {result.samples} samples ({mb:.1f} MB) into {result.shards} shards{reused} in "
              f"{result.seconds:.1f} s ({result.samples / result.seconds:.0f} files/s, "
              f"{mb / result.seconds:.1f} MB/s) with {comm.Get_size()} rank(s) -> {args.dst}")
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


def _cmd_verify(args):
    st = _open_store(args)
    if st is None:
        return 1
    report = st.verify(progress=not args.quiet)
    mb = report.bytes_read / 1e6
    print(f"verified {report.samples} samples in {len(st.shard_paths)} shards: read {mb:.1f} MB in "
          f"{report.seconds:.2f} s ({mb / max(report.seconds, 1e-9):.1f} MB/s)")
    if not report.problems:
        print("OK: every checksum matches")
        return 0
    print(f"FAILED: {len(report.problems)} bad sample(s)")
    for index, name, reason in report.problems[:20]:
        print(f"  sample {index} {name!r}: {reason}")
    if len(report.problems) > 20:
        print(f"  ... and {len(report.problems) - 20} more")
    return 1


def _cmd_ls(args):
    import numpy as np

    st = _open_store(args)
    if st is None:
        return 1
    sizes = st.sizes
    print(f"store {st.root} (format version {st.attrs['format_version']}, packed from {st.attrs['source']})")
    print(f"samples: {len(st)}   bytes: {int(sizes.sum())} ({sizes.sum() / 1e6:.1f} MB)")
    if len(st):
        print(f"sample size: min {int(sizes.min())}  median {int(np.median(sizes))}  "
              f"mean {sizes.mean():.0f}  max {int(sizes.max())} bytes")
    print(f"shards: {len(st.shard_paths)}")
    for k, path in enumerate(st.shard_paths):
        lo, n = int(st.shard_first[k]), int(st.shard_counts[k])
        status = " DAMAGED" if any(d[0] == k for d in st.damaged) else ""
        print(f"  {os.path.basename(path)}  samples {lo}..{lo + n - 1}  {os.path.getsize(path) if os.path.exists(path) else 0} bytes{status}")
    counts = np.bincount(st.labels[st.labels >= 0], minlength=len(st.classes))
    print(f"classes: {len(st.classes)}" + (f"  (unlabelled top-level files: {int((st.labels < 0).sum())})"
                                             if (st.labels < 0).any() else ""))
    for label, name in enumerate(st.classes[:args.classes]):
        print(f"  {label:5d}  {name}  {int(counts[label])}")
    if len(st.classes) > args.classes:
        print(f"  ... and {len(st.classes) - args.classes} more (--classes N shows more)")
    print(f"skipped when packed: {len(st.skipped)}")
    if args.skipped:
        _print_skipped(st.skipped, len(st.skipped))
    elif st.skipped:
        _print_skipped(st.skipped, 5)
    return 0


def _parser():
    parser = argparse.ArgumentParser(prog="hpcdl", description="hpcdl: distributed DL training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="version, MPI library and thread level")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("pack", help="pack a directory of small files into an HDF5 store",
                       description="Pack every file under SRC into an hpcdl store in directory DST "
                       "(class = first-level sub-directory). Run under mpiexec -n P to split the work.")
    p.add_argument("src", metavar="SRC", help="source directory")
    p.add_argument("dst", metavar="DST", help="destination directory (created)")
    p.add_argument("--shards", type=int, default=None, help="number of shards (default: by --shard-bytes)")
    p.add_argument("--shard-bytes", type=_parse_bytes, default="1G",
                   help="target shard size when --shards is not given (default 1G)")
    p.add_argument("--force", action="store_true", help="replace an existing store at DST")
    p.add_argument("--threads", type=int, default=8, help="files read at once per rank (default 8)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pack)
    p = sub.add_parser("verify", help="check every sample's checksum of a store")
    p.add_argument("dst", metavar="DST", help="store directory (or its manifest.h5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("ls", help="summary of a store: counts, sizes, label histogram")
    p.add_argument("dst", metavar="DST", help="store directory (or its manifest.h5)")
    p.add_argument("--classes", type=int, default=50, help="classes to list (default 50)")
    p.add_argument("--skipped", action="store_true", help="list every file skipped when packing")
    p.set_defaults(func=_cmd_ls)
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
