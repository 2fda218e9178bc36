"""Build hpcdl's extensions with the MPI compiler wrapper.

One extension module, hpcdl._core: ext/_core.pyx (which includes the topic
files ext/*.pxi) compiled together with every C++ source src/*/*.cc, so each
singleton of the core exists once (docs/building.md says why not a shared
libhpcdl). It links the libmpi that mpi4py loads (hpcdl/_mpi_check.py
finds it; in pip's isolated build for an environment with no MPI yet, the
mpich build requirement's, which the mpich extra installs), by its path, and
compiles with an MPI C++ wrapper that links that same file on its own: $MPICXX
or the one beside $MPICC when named, else the first found in that MPI's bin/,
this environment's bin/, on PATH, or the mpich build requirement. No match
stops the build with both libraries named.
"""

import concurrent.futures
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import mpi4py
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def load_mpi_check():
    """hpcdl/_mpi_check.py by its path (importing hpcdl would initialize MPI): the one MPI rule."""
    spec = importlib.util.spec_from_file_location("hpcdl_mpi_check", MPI_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MPI_CHECK = os.path.join(HERE, "hpcdl", "_mpi_check.py")
mpi_check = load_mpi_check()


def choose_mpi():
    """(the MPI C++ wrapper, the libmpi it links): the libmpi is the one mpi4py loads, and the wrapper
    is one that links that very file by itself, so its mpi.h matches too."""
    explicit = explicit_wrapper()
    env = dict(os.environ)
    wheel = build_requirement_mpich()
    if wheel and not explicit and "MPI4PY_LIBMPI" not in env \
            and not glob.glob(os.path.join(sys.prefix, "lib", "libmpi.so*")):
        # pip's isolated build for an environment with no MPI yet (pip install hpcdl[mpich]): the
        # mpich extra will put this same wheel's libmpi.so.12 in the environment, first in mpi4py's search.
        env["MPI4PY_LIBMPI"] = wheel[1]
    proc = subprocess.run([sys.executable, MPI_CHECK], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"hpcdl: mpi4py cannot load an MPI library here:\n{proc.stdout}{proc.stderr}")
    target = json.loads(proc.stdout.splitlines()[-1])["path"]
    tried = []
    for wrapper in [explicit] if explicit else wrapper_candidates(target, wheel):
        linked = wrapper_libmpi(wrapper)
        if linked == target:
            return wrapper, target
        tried.append(f"{wrapper} links {mpi_check.describe(linked) if linked else 'no libmpi (its probe failed)'}")
    sys.exit("hpcdl: no MPI compiler wrapper links the libmpi that mpi4py loads,\n"
             f"  {mpi_check.describe(target)}\n" + "".join(f"  {line}\n" for line in tried)
             + "Name the wrapper of mpi4py's MPI: MPICC=/path/to/mpicc pip install --no-build-isolation . "
             "(or MPICXX=...), or build mpi4py against your MPI first "
             "(MPICC=/path/to/mpicc pip install --no-binary=mpi4py mpi4py); docs/building.md.")


def explicit_wrapper():
    """$MPICXX, or the C++ wrapper beside $MPICC (or $MPICC itself: a C wrapper still links)."""
    if os.environ.get("MPICXX"):
        return shutil.which(os.environ["MPICXX"]) or os.environ["MPICXX"]
    mpicc = os.environ.get("MPICC")
    if not mpicc:
        return None
    path = shutil.which(mpicc) or mpicc
    name = os.path.basename(path)
    suffix = name[len("mpicc"):] if name.startswith("mpicc") else ""  # Debian's mpicc.openmpi: mpicxx.openmpi
    for name in ("mpicxx", "mpic++", "mpiCC"):
        candidate = os.path.join(os.path.dirname(path), name + suffix)
        if os.path.exists(candidate):
            return candidate
    return path


def wrapper_candidates(libmpi, wheel):
    """Wrappers that may link `libmpi`: its installation's bin/, those on PATH (Debian names them
    mpicxx.openmpi, mpicxx.mpich too), the mpich build requirement's."""
    names = ("mpicxx", "mpic++", "mpiCC", "mpicxx.openmpi", "mpicxx.mpich")
    folders = [os.path.join(os.path.dirname(os.path.dirname(libmpi)), "bin"), os.path.join(sys.prefix, "bin")]
    folders += [folder for folder in os.environ.get("PATH", "").split(os.pathsep) if folder]
    seen = set()
    for path in [os.path.join(folder, name) for folder in folders for name in names] + ([wheel[0]] if wheel else []):
        if os.access(path, os.X_OK) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            yield path


def wrapper_libmpi(wrapper):
    """The real path of the libmpi `wrapper` links on its own: a tiny program linked with -Wl,-t
    (the linker names each file it uses)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.cc")
        with open(source, "w") as fh:
            fh.write("#include <mpi.h>\nint main() { return MPI_Init(0, 0); }\n")
        try:
            proc = subprocess.run([wrapper, source, "-o", os.path.join(tmp, "probe"), "-Wl,-t"],
                                  capture_output=True, text=True, timeout=300)
        except OSError:
            return None
        if proc.returncode != 0:
            return None
        for token in re.findall(r"[^\s()]+", proc.stdout + proc.stderr):
            if token.startswith("/") and mpi_check.LIBMPI.match(os.path.basename(token)) \
                    and os.path.isfile(token) and is_elf(token):
                return os.path.realpath(token)  # the mpich wheel's libmpi.so is a linker script naming .so.12
    return None


def is_elf(path):
    with open(path, "rb") as fh:
        return fh.read(4) == b"\x7fELF"


def build_requirement_mpich():
    """(mpicxx, libmpi) of an mpich wheel importable here but installed outside this environment:
    under pip's build isolation the build requirement, in a temporary prefix pip deletes afterwards."""
    try:
        dist = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = {file.name: os.path.realpath(dist.locate_file(file)) for file in dist.files or ()}
    libmpi = files.get("libmpi.so.12")
    if "mpicxx" not in files or not libmpi or libmpi.startswith(os.path.realpath(sys.prefix) + os.sep):
        return None
    return files["mpicxx"], libmpi


class MPIBuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:  # pip passes no -j: compile the sources side by side
            self.parallel = int(os.environ.get("HPCDL_BUILD_JOBS") or os.cpu_count() or 1)

    def build_extensions(self):
        mpicxx, libmpi = choose_mpi()
        print(f"hpcdl: compiling with {mpicxx} for {mpi_check.describe(libmpi)}")
        for ext in self.extensions:
            # libmpi by its path, its folder searched first and written as RUNPATH: no -L that
            # setuptools puts earlier (Python's LIBDIR, /usr/lib/x86_64-linux-gnu for Debian's
            # Python) can make the wrapper's own -lmpi find another MPI there.
            folder = os.path.dirname(libmpi)
            ext.library_dirs = [folder] + list(ext.library_dirs)
            ext.runtime_library_dirs = [folder] + list(ext.runtime_library_dirs)
            ext.extra_link_args = [libmpi] + list(ext.extra_link_args)
        # Keep Python's flags, swap the program (older setuptools lack the *_cxx ones).
        for attr in ("compiler_so", "compiler_so_cxx", "compiler_cxx", "linker_so", "linker_so_cxx"):
            argv = getattr(self.compiler, attr, None)
            if argv:
                self.compiler.set_executable(attr, [mpicxx] + list(argv[1:]))
        compile_side_by_side(self.compiler, int(self.parallel))
        super().build_extensions()


def compile_side_by_side(compiler, jobs):
    """build_ext's -j builds extensions side by side; the one extension's sources
    would compile one after another, so compile them on `jobs` threads instead."""
    one_by_one = compiler.compile

    def compile(sources, *args, **kwargs):
        if jobs <= 1 or len(sources) <= 1:
            return one_by_one(sources, *args, **kwargs)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            objects = list(pool.map(lambda source: one_by_one([source], *args, **kwargs), sources))
        return [obj for objs in objects for obj in objs]

    compiler.compile = compile


def extensions():
    sources = [os.path.join("ext", "_core.pyx")] + sorted(glob.glob(os.path.join("src", "*", "*.cc")))
    core = Extension(
        "hpcdl._core", sources, language="c++",
        include_dirs=["include", mpi4py.get_include()],
        extra_compile_args=["-std=c++17", "-O3", "-Wall", "-Wno-unused-function"]
        + os.environ.get("HPCDL_CXXFLAGS", "").split(),
        extra_link_args=["-lstdc++", "-pthread"],
        depends=sorted(glob.glob("include/hpcdl/**/*.hpp", recursive=True) + glob.glob("ext/*.pxi")
                       + glob.glob("ext/libhpcdl/*.pxd")),
    )
    return cythonize([core], include_path=["ext"], compiler_directives={"language_level": 3})


setup(ext_modules=extensions(), cmdclass={"build_ext": MPIBuildExt})
