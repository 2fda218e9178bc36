"""Build hpcdl's extensions with the MPI compiler wrapper.

Each ext/_NAME.pyx becomes the module hpcdl._NAME, compiled together with the
C++ sources in src/_NAME/ and src/common/ (when they exist). The compiler is
the MPI C++ wrapper, the first of: $MPICXX; the mpicxx beside $MPICC; the one in
this Python's environment (PyPI's mpich wheel installed there); an mpicxx on PATH
(a site MPI module); the mpich wheel that pip's isolated build environment holds
as a build requirement (a bare environment: pip install hpcdl[mpich]).
"""

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
        if not self.parallel:  # pip passes no -j: compile the extensions side by side
            self.parallel = int(os.environ.get("HPCDL_BUILD_JOBS") or os.cpu_count() or 1)

    def build_extensions(self):
        mpicxx = find_mpicxx()
        print(f"hpcdl: compiling with {mpicxx}")
        # Keep Python's flags, swap the program (older setuptools lack the *_cxx ones).
        for attr in ("compiler_so", "compiler_so_cxx", "compiler_cxx", "linker_so", "linker_so_cxx"):
            argv = getattr(self.compiler, attr, None)
            if argv:
                self.compiler.set_executable(attr, [mpicxx] + list(argv[1:]))
        super().build_extensions()


def extensions():
    exts = []
    for pyx in sorted(glob.glob(os.path.join("ext", "_*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        sources = [pyx] + sorted(glob.glob(os.path.join("src", name, "*.cc"))) \
            + sorted(glob.glob(os.path.join("src", "common", "*.cc")))
        exts.append(Extension(
            f"hpcdl.{name}", sources, language="c++",
            include_dirs=["include", mpi4py.get_include()],
            extra_compile_args=["-std=c++17", "-O3", "-Wall", "-Wno-unused-function"]
            + os.environ.get("HPCDL_CXXFLAGS", "").split(),
            extra_link_args=["-lstdc++", "-pthread"],
            depends=sorted(glob.glob("include/hpcdl/*.hpp") + glob.glob("ext/libhpcdl/*.pxd")),
        ))
    return cythonize(exts, include_path=["ext"], compiler_directives={"language_level": 3},
                     nthreads=int(os.environ.get("HPCDL_BUILD_JOBS", 0)))


setup(ext_modules=extensions(), cmdclass={"build_ext": MPIBuildExt})
