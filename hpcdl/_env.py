"""Every environment variable the library reads, its parser and its range: the
one module that reads ``os.environ``.

The engine's settings are the core's one table (``kEnvSettings`` in
include/hpcdl/engine/settings.hpp, here ``_core.ENV_SETTINGS``): its C++
threads read them themselves (include/hpcdl/util/env.hpp), and
``engine_settings()`` checks them at ``import hpcdl`` by the same rule, so a bad
value fails every rank alike before a thread reads it. The rest are read here
only. docs/tuning.md's table of variables is ``doc_table()``
(tests/unit/test_env.py keeps them equal).
"""

import os
import re

from hpcdl import _core
from hpcdl.units import parse_bytes

# The engine's settings: key -> (type, low, high or None, variable).
ENGINE_SETTINGS = _core.ENV_SETTINGS

# Variables an MPI launcher (mpiexec, srun) sets in each rank it starts.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def check_setting(key, value, source):
    """value as the engine setting's type, or ValueError naming source when it is
    not a number in bounds. Integer text must be decimal digits only (no sign,
    space or '_'): the rule the C++ side (env_long) reads the same variables by."""
    kind, low, high, _ = ENGINE_SETTINGS[key]
    try:
        if kind is int and isinstance(value, str) and not re.fullmatch(r"[0-9]+", value):
            raise ValueError(value)
        value = kind(value)
    except (TypeError, ValueError):
        value = None
    if value is None or value != value or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{source}: expected {'an integer' if kind is int else 'a number'} {bounds}")
    return value


def engine_settings():
    """The engine settings set in the environment, checked: {key: value}."""
    found = {}
    for key, (_, _, _, variable) in ENGINE_SETTINGS.items():
        text = os.environ.get(variable)
        if text is not None:
            found[key] = check_setting(key, text, f"environment variable {variable}={text!r}")
    return found


def _text(text):
    return text


def _flag_unless_0(text):
    return text != "0"


def _flag_if_1(text):
    return text == "1"


def _seconds(text):
    value = float(text)
    if not value >= 0:
        raise ValueError("expected a number >= 0")
    return value


def _auto_or_flag(text):
    if text not in ("auto", "0", "1"):
        raise ValueError("expected auto, 0 or 1")
    return text


def _count(text):
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError("expected an integer >= 0 (decimal digits)")
    return int(text)


class Variable:
    """One variable read by the Python side: how its text is parsed, and its docs row."""

    __slots__ = ("name", "parse", "default", "range", "what")

    def __init__(self, name, parse, default, range, what):
        self.name, self.parse, self.default, self.range, self.what = name, parse, default, range, what


VARIABLES = {
    v.name: v
    for v in (
        Variable(
            "HPCDL_ABORT_ON_EXCEPTION",
            _flag_unless_0,
            "1",
            "0 turns it off",
            "with several ranks, an uncaught exception ends the job (`MPI_Abort`) instead of leaving the other "
            "ranks waiting ([troubleshooting.md](troubleshooting.md)); read at `import hpcdl`",
        ),
        Variable(
            "HPCDL_EXPECT_GPU",
            _auto_or_flag,
            "auto",
            "`auto`, 0 or 1",
            "`import hpcdl.torch` (or `hpcdl.tensorflow`) fails when the framework sees no GPU although the rank "
            "should have one: "
            "`auto` when `CUDA_VISIBLE_DEVICES` names devices (as Slurm sets it for `--gpus`), 1 always, 0 "
            "never ([troubleshooting.md](troubleshooting.md))",
        ),
        Variable(
            "HPCDL_TIMELINE",
            _text,
            "unset",
            "a path",
            "record a Chrome-trace timeline of every rank into this file ([troubleshooting.md](troubleshooting.md))",
        ),
        Variable(
            "HPCDL_TIMELINE_WAIT_SECONDS",
            _seconds,
            "30",
            ">= 0",
            "how long rank 0 waits at exit for the other ranks' timeline parts",
        ),
        Variable(
            "HPCDL_TRACE",
            _text,
            "unset",
            "a path",
            "the prefetcher's own trace file (ignored while `HPCDL_TIMELINE` is set) ([prefetch.md](prefetch.md))",
        ),
        Variable(
            "HPCDL_DLIO_TRAIN_STORE",
            _text,
            "`DATA/train.hpcdl`",
            "a path",
            "DLIO's training store ([dlio.md](dlio.md))",
        ),
        Variable("HPCDL_DLIO_VALID_STORE", _text, "`DATA/valid.hpcdl`", "a path", "DLIO's evaluation store"),
        Variable("HPCDL_DLIO_RAM", parse_bytes, "1G", "a size (`32G`)", "DLIO: the RAM tier per rank"),
        Variable("HPCDL_DLIO_DISK_DIR", _text, "unset (off)", "a directory", "DLIO: the node-local disk tier"),
        Variable("HPCDL_DLIO_DISK", parse_bytes, "0", "a size", "DLIO: the disk tier's bytes per rank"),
        Variable(
            "HPCDL_DLIO_THREADS",
            _count,
            "max(4, `reader.read_threads`)",
            ">= 0 (0: 1)",
            "DLIO: staging threads per rank",
        ),
        Variable(
            "HPCDL_DLIO_READ_CONCURRENCY",
            _text,
            "auto",
            "`auto` or an integer >= 0",
            "DLIO: the prefetcher's `read_concurrency`",
        ),
        Variable(
            "HPCDL_DLIO_PACK",
            _flag_if_1,
            "0",
            "1 turns it on",
            "DLIO: pack the data set into the store at start-up when it is missing (collective)",
        ),
    )
}

# The engine's variables: their defaults (the C++ side's) and what they do, for the docs table.
ENGINE_DOCS = {
    "HPCDL_CHUNK_BYTES": (
        f"{_core.DEFAULT_CHUNK_BYTES >> 20} MiB",
        "ring pipeline chunk (also `hpcdl.configure(chunk_bytes=)`; the same on every rank)",
    ),
    "HPCDL_STALL_WARNING_SECONDS": (
        f"{_core.DEFAULT_STALL_WARNING_SECONDS:g}",
        "warn when an operation waits for ranks that have not submitted it (0: off)",
    ),
    "HPCDL_STALL_ERROR_SECONDS": (
        f"{_core.DEFAULT_STALL_ERROR_SECONDS:g} (torch.distributed's default timeout; 0: wait forever)",
        "fail such an operation instead",
    ),
    "HPCDL_WAIT_SLEEP_US": (
        "200",
        "longest sleep between polls of a waiting operation (0: poll without sleeping; the engine "
        "thread's within 1 us to 1 ms; a wait only point-to-point transfers keep grows "
        "past it, [pipeline.md](pipeline.md))",
    ),
    "HPCDL_ENGINE_SLICE_US": ("100", "the engine thread's scheduler slice (Linux 6.12+; 0: the system's)"),
    "HPCDL_AGREEMENT_FLAT": (
        "0",
        "1: every rank reports to the coordinator directly instead of up the report tree "
        "(`bench/agreement.py` compares them)",
    ),
    "HPCDL_AGREEMENT_RADIX": (
        "4",
        "the report tree's radix k: ceil(log_k P) hops each way, up to (k - 1) ceil(log_k P) "
        "children at the coordinator (2: binomial; [architecture.md](architecture.md))",
    ),
    "HPCDL_AGREEMENT_ONE_HOP_RANKS": (
        "4",
        "on a communicator of at most this many ranks (and a flat report tree), an operation every "
        "rank submitted alone runs on the descriptions each rank sends every other, one hop instead "
        "of the plan's two (0: never; [architecture.md](architecture.md))",
    ),
    "HPCDL_TIMELINE_MAX_EVENTS": (
        "1000000",
        "trace events a rank keeps in memory while `HPCDL_TIMELINE` (or the "
        "prefetcher's `HPCDL_TRACE`) records, ~140 B each; later ones are counted "
        "in the trace's `otherData.dropped_events` and named at exit",
    ),
    "HPCDL_RESIDUAL_TTL_OPS": (
        "1000",
        "a name's error-feedback residual is freed once this many named compressed "
        "allreduces ran on its communicator without it (0: never; "
        "[compression.md](compression.md#residual-memory))",
    ),
}


def get(name, default=None):
    """Variable ``name`` parsed, or ``default`` when it is unset; ValueError naming it when its text is bad."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return VARIABLES[name].parse(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={text!r}: {exc}") from None


# CUDA_VISIBLE_DEVICES values that give a process no GPU (Slurm writes NoDevFiles for a step without one).
NO_GPU_VISIBLE = ("", "-1", "NoDevFiles")


def gpu_expected():
    """Why this rank should see a GPU (text for an error), or None: HPCDL_EXPECT_GPU, and under
    its default, a CUDA_VISIBLE_DEVICES that names devices."""
    setting = get("HPCDL_EXPECT_GPU", "auto")
    if setting != "auto":
        return "HPCDL_EXPECT_GPU=1" if setting == "1" else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() in NO_GPU_VISIBLE:
        return None
    return f"CUDA_VISIBLE_DEVICES={visible!r}"


def launched_by_mpi():
    """Whether this process was started by an MPI launcher."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def doc_table():
    """docs/tuning.md's table of every variable, as markdown rows."""
    rows = ["| variable | default | range | what |", "|---|---|---|---|"]
    for kind, low, high, variable in ENGINE_SETTINGS.values():
        bounds = f">= {low}" if high is None else f"{low} to {high}"
        rows.append(
            f"| `{variable}` | {ENGINE_DOCS[variable][0]} | {'integer' if kind is int else 'number'} "
            f"{bounds} | {ENGINE_DOCS[variable][1]} |"
        )
    rows += [f"| `{v.name}` | {v.default} | {v.range} | {v.what} |" for v in VARIABLES.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(doc_table())
