"""The `hpcdl` command line. Each subcommand is one `_cmd_NAME(args)` function
registered in `_parser()`; heavy imports happen inside the command."""

import argparse
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


def _parser():
    parser = argparse.ArgumentParser(prog="hpcdl", description="hpcdl: distributed DL training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="version, MPI library and thread level")
    p.set_defaults(func=_cmd_info)
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
