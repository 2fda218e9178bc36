"""One MPI per process: the core must use the libmpi that mpi4py loaded.

Two MPI libraries in one process do not mix: mpi4py initializes its own and
the core would call the other, never initialized. `import hpcdl` loads the
core through `load_core`, which fails with an `ImportError` naming both
libraries when the core brought in a second one. `setup.py` runs this file as
a script (`python hpcdl/_mpi_check.py`) to learn which libmpi mpi4py loads,
so the build and the import apply the same rule. Standard library only: the
build loads it by path, without importing hpcdl.
"""

import ctypes
import json
import os
import re

LIBMPI = re.compile(r"^libmpi\.so(\.\d+)*$")  # libmpi.so.12 (MPICH), libmpi.so.40 (Open MPI); not libmpi_cxx
REBUILD = (
    "rebuild hpcdl against the MPI that mpi4py loads: in this environment, "
    "MPICC=/path/to/that/mpicc pip install --no-build-isolation --force-reinstall --no-deps hpcdl "
    "(or ./scripts/bootstrap.sh in a checkout); docs/building.md"
)


def loaded_libmpis():
    """Real paths of the libmpi files mapped into this process, in load order."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith("/") and LIBMPI.match(os.path.basename(path)):
                real = os.path.realpath(path)
                if real not in found:
                    found.append(real)
    return found


def library_version(path):
    """The first line of MPI_Get_library_version of the libmpi at `path` (callable before MPI_Init)."""
    try:
        lib = ctypes.CDLL(path, os.RTLD_LOCAL)
        text = ctypes.create_string_buffer(8192)
        length = ctypes.c_int(0)
        if lib.MPI_Get_library_version(text, ctypes.byref(length)) != 0:
            return "(MPI_Get_library_version failed)"
        lines = text.value.decode(errors="replace").strip().splitlines()
        return lines[0].strip() if lines else "(empty library version)"
    except (OSError, AttributeError) as exc:
        return f"({exc})"


def describe(path):
    return f"{path} ({library_version(path)})"


def mismatch_message(what, theirs, ours, rebuild=REBUILD):
    return (
        f"{what}: two MPI libraries, which do not mix in one process.\n"
        f"  mpi4py loads:  {describe(theirs)}\n"
        f"  hpcdl's core:  {describe(ours)}\n"
        f"Fix: {rebuild}"
    )


def load_core(import_core):
    """Import the core with `import_core()` after mpi4py.MPI; raise ImportError if it brought a second libmpi."""
    before = loaded_libmpis()
    error = None
    try:
        core = import_core()
    except Exception as exc:  # e.g. "mpi4py.MPI.Datatype size changed": built against another mpi.h
        error = exc
    added = [path for path in loaded_libmpis() if path not in before]
    if before and added:
        raise ImportError(mismatch_message("hpcdl cannot load its core", before[0], added[0])) from error
    if error is not None:
        raise error
    return core


def mpi4py_libmpi():
    """{"path", "version"} of the libmpi mpi4py loads in this environment (MPI not initialized)."""
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    libs = loaded_libmpis()
    if not libs:
        raise SystemExit("mpi4py.MPI loaded no libmpi.so* file")
    return {"path": libs[0], "version": library_version(libs[0])}


if __name__ == "__main__":
    print(json.dumps(mpi4py_libmpi()))
