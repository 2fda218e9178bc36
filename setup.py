"""Build hpcdl's extensions with the MPI compiler wrapper.

One extension module, hpcdl._core: ext/_core.pyx (which includes the topic
files ext/*.pxi) compiled together with every C++ source src/*/*.cc, so each
singleton of the core exists once (docs/building.md says why not a shared
libhpcdl). The compiler is
the MPI C++ wrapper, the first of: $MPICXX; the mpicxx beside $MPICC; the one in
this Python's environment (PyPI's mpich wheel installed there); an mpicxx on PATH
(a site MPI module); the mpich wheel that pip's isolated build environment holds
as a build requirement (a bare environment: pip install hpcdl[mpich]).
"""

import concurrent.futures
import glob
import importlib.metadata
import os
import shutil
import sys

import mpi4py
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def find_mpicxx():
    if os.environ.get("MPICXX"):
        return os.environ["MPICXX"]
    mpicc = os.environ.get("MPICC")
    if mpicc:
        path = shutil.which(mpicc) or mpicc
        for name in ("mpicxx", "mpic++", "mpiCC"):
            candidate = os.path.join(os.path.dirname(path), name)
            if os.path.exists(candidate):
                return candidate
        return mpicc  # a C wrapper still links; libstdc++ is added below
    own = os.path.join(sys.prefix, "bin", "mpicxx")
    if os.access(own, os.X_OK):
        return own
    wheel = build_requirement_mpicxx()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, "mpicxx")
        if folder and os.access(candidate, os.X_OK) and os.path.realpath(candidate) != wheel:
            return candidate
    if wheel:
        return wheel
    sys.exit("hpcdl: no MPI C++ compiler found. Install one (pip install mpich, or load your "
             "site's MPI module) or name it with MPICXX=/path/to/mpicxx or MPICC=/path/to/mpicc.")


def build_requirement_mpicxx():
    """The mpicxx of an mpich wheel importable here but installed elsewhere: under pip's build
    isolation the build requirement, in a temporary prefix that pip puts first on PATH. An
    extension it links gets a RUNPATH into that prefix, which pip then deletes: it loads because
    `import hpcdl` imports mpi4py.MPI first, which puts the installed libmpi.so.12 in the process."""
    try:
        dist = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == "mpicxx":
            return os.path.realpath(dist.locate_file(file))
    return None


class MPIBuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:  # pip passes no -j: compile the sources side by side
            self.parallel = int(os.environ.get("HPCDL_BUILD_JOBS") or os.cpu_count() or 1)

    def build_extensions(self):
        mpicxx = find_mpicxx()
        print(f"hpcdl: compiling with {mpicxx}")
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
