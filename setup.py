"""Build hpcdl's extensions with the MPI compiler wrapper.

Each ext/_NAME.pyx becomes the module hpcdl._NAME, compiled together with the
C++ sources in src/_NAME/ and src/common/ (when they exist). The compiler is
the MPI C++ wrapper: $MPICXX, else the mpicxx beside $MPICC, else the one in
this Python's environment (PyPI's mpich wheel), else mpicxx on PATH.
"""

import glob
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
    for candidate in (os.path.join(sys.prefix, "bin", "mpicxx"), shutil.which("mpicxx")):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("hpcdl: no MPI C++ compiler found. Install one (pip install mpich, or load your "
             "site's MPI module) or name it with MPICXX=/path/to/mpicxx or MPICC=/path/to/mpicc.")


class MPIBuildExt(build_ext):
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
