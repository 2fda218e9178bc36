"""The parts of hpcdl and the lines between them (docs/architecture.json) hold:
every C++ #include, Cython `cdef extern from` and Python import (lazy ones
too) of the repository is read, and each must stay within what its part may
use. Listed exceptions must still be needed, so the list cannot rot."""

import ast
import glob
import json
import os
import re

import pytest

from conftest import ROOT

ARCH = json.load(open(os.path.join(ROOT, "docs", "architecture.json")))
PARTS = ARCH["parts"]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)
EXTERN = re.compile(r'^\s*cdef\s+extern\s+from\s+"([^"]+)"', re.M)
# The one Python module the bindings part makes.
BINDINGS_MODULE = "hpcdl._core"


def part_of(path):
    """The part whose longest path prefix matches `path` (relative to the root), or None."""
    best, best_len = None, -1
    for name, part in PARTS.items():
        for prefix in part["paths"]:
            if path.startswith(prefix) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def part_of_module(module):
    """The part of an hpcdl module ("hpcdl.torch.data"), None for a module outside the repository."""
    if module == BINDINGS_MODULE:
        return "bindings"
    if module != "hpcdl" and not module.startswith("hpcdl."):
        return None
    return part_of(module.replace(".", "/") + "/")


def files(*patterns):
    found = set()
    for pattern in patterns:
        found.update(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))
    return sorted(found)


def cpp_uses(path):
    """(header path relative to the root, line text) for each hpcdl header the file includes."""
    text = open(os.path.join(ROOT, path)).read()
    pattern = EXTERN if path.endswith((".pxd", ".pxi", ".pyx")) else INCLUDE
    return [("include/" + inc, inc) for inc in pattern.findall(text) if inc.startswith("hpcdl/")]


def python_imports(path, source=None):
    """Every module a Python file imports, lazy imports included: `from hpcdl import store` names hpcdl.store."""
    tree = ast.parse(source if source is not None else open(os.path.join(ROOT, path)).read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            if node.module == "hpcdl" or node.module.startswith("hpcdl."):
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def exception_for(path, module):
    for exc in ARCH["exceptions"]:
        if exc["file"] == path and (module == exc["imports"] or module.startswith(exc["imports"] + ".")):
            return exc
    return None


def python_violations(path, source=None):
    """What `path`'s imports cross: (module, why) for each import its part may not make."""
    part = part_of(path)
    allowed = set(PARTS[part]["may_use"]) | {part}
    forbidden = PARTS[part].get("forbidden_modules", [])
    out = []
    for module in python_imports(path, source):
        target = part_of_module(module)
        if target is not None and target not in allowed:
            out.append((module, f"{part} may not use {target}"))
        top = module.split(".")[0]
        if top in forbidden and not exception_for(path, module):
            out.append((module, f"{part} may not import {top}"))
    return out


def cpp_violations(path, uses):
    part = part_of(path)
    allowed = set(PARTS[part]["may_use"]) | {part}
    out = []
    for header, text in uses:
        target = part_of(header)
        if target is None:
            out.append((text, "a header outside every part's folder"))
        elif not os.path.exists(os.path.join(ROOT, header)):
            out.append((text, "no such header"))
        elif target not in allowed:
            out.append((text, f"{part} may not use {target}"))
    return out


CPP_FILES = files("include/**/*.hpp", "src/**/*.cc")
CYTHON_FILES = files("ext/*.pyx", "ext/*.pxi", "ext/libhpcdl/*.pxd")
PYTHON_FILES = files("hpcdl/**/*.py", "bench/*.py", "examples/*.py")


def test_every_source_belongs_to_a_part():
    orphans = [path for path in CPP_FILES + CYTHON_FILES + PYTHON_FILES if part_of(path) is None]
    assert len(CPP_FILES) > 40 and len(PYTHON_FILES) > 40 and not orphans, orphans


@pytest.mark.parametrize("path", CPP_FILES + CYTHON_FILES)
def test_cpp_includes_stay_within_their_part(path):
    assert not cpp_violations(path, cpp_uses(path))


def test_the_core_knows_no_python():
    offending = [
        path
        for path in CPP_FILES
        if re.search(r'^\s*#\s*include\s*[<"](Python\.h|numpy/|pybind11/)', open(os.path.join(ROOT, path)).read(), re.M)
    ]
    assert not offending


@pytest.mark.parametrize("path", PYTHON_FILES)
def test_python_imports_stay_within_their_part(path):
    assert not python_violations(path)


def closure(header):
    seen, todo = set(), [header]
    while todo:
        path = todo.pop()
        if path in seen or not os.path.exists(os.path.join(ROOT, path)):
            continue
        seen.add(path)
        todo.extend(h for h, _ in cpp_uses(path))
    return seen - {header}


@pytest.mark.parametrize("header", [k for k in ARCH["light_headers"] if k != "about"])
def test_light_headers_pull_in_no_kernels(header):
    pulled = closure(header)
    heavy = sorted(p for p in pulled for banned in ARCH["light_headers"][header] if p.startswith(banned))
    assert pulled  # the includes were read
    assert not heavy, f"{header} pulls in {heavy}"


def test_every_listed_exception_is_still_needed():
    for exc in ARCH["exceptions"]:
        imported = python_imports(exc["file"])
        assert any(m == exc["imports"] or m.startswith(exc["imports"] + ".") for m in imported), (
            f"{exc['file']} no longer imports {exc['imports']}: remove its exception from docs/architecture.json"
        )


def test_the_check_catches_a_crossing():
    """The checker itself: the lines it must refuse are refused."""
    assert python_violations("hpcdl/collectives.py", "import torch\n") == [("torch", "python_api may not import torch")]
    assert python_violations("hpcdl/torch/data.py", "from hpcdl import _core\n") == [
        ("hpcdl._core", "torch_adapter may not use bindings")
    ]
    assert python_violations("hpcdl/prefetch.py", "import hpcdl.torch.data\n") == [
        ("hpcdl.torch.data", "python_api may not use torch_adapter")
    ]
    assert python_violations("hpcdl/collectives.py", "import matplotlib\n")  # the exception is measure.py's alone
    assert cpp_violations("include/hpcdl/algorithms/ring.hpp", [("include/hpcdl/engine/engine.hpp", "x")]) == [
        ("x", "algorithms may not use engine")
    ]
    assert cpp_violations("include/hpcdl/codecs/topk.hpp", [("include/hpcdl/algorithms/ring.hpp", "y")]) == [
        ("y", "codecs may not use algorithms")
    ]
    assert cpp_violations("src/engine/engine.cc", [("include/hpcdl/flat.hpp", "z")]) == [
        ("z", "a header outside every part's folder")
    ]


# mpi4py's blocking collectives. hpcdl's Python side waits in none of them, where a rank
# that never comes would block the others with no message, but call_on_every_rank's
# own (hpcdl/_agree.py says why); the rest go through _agree's waited_* collectives.
BLOCKING_COLLECTIVES = {
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "gather", "reduce", "scan", "scatter",
    "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Barrier", "Bcast", "Exscan",
    "Gather", "Gatherv", "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Scan", "Scatter", "Scatterv",
}  # fmt: skip
COMMUNICATOR = re.compile(r"comm|world", re.I)  # mpi4py receivers: comm, self.pipeline_comm, MPI.COMM_WORLD
# call_on_every_rank: its wait is one rank's step, long by design; measure.slowest: a
# benchmark's timing barrier, where polling would add its sleeps to the times measured.
BLOCKING_ALLOWED = {("hpcdl/_agree.py", "call_on_every_rank"), ("hpcdl/measure.py", "slowest")}


def blocking_collectives(path, source=None, allowed=BLOCKING_ALLOWED):
    """(function, line, call) for each blocking mpi4py collective `path` calls on a
    communicator outside the ``allowed`` (file, function)s."""
    tree = ast.parse(source if source is not None else open(os.path.join(ROOT, path)).read(), path)
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in BLOCKING_COLLECTIVES
                and COMMUNICATOR.search(ast.unparse(child.func.value))
                and (path, function) not in allowed
            ):
                found.append((function, child.lineno, ast.unparse(child.func)))
            visit(child, inner)

    visit(tree, None)
    return found


@pytest.mark.parametrize("path", files("hpcdl/**/*.py"))
def test_no_blocking_mpi_collective_outside_the_agreements(path):
    assert not blocking_collectives(path)


def test_the_blocking_collective_check_catches_one():
    source = "def f(comm):\n    x = comm.bcast(1, root=0)\n    hpcdl.allgather(x)\n    self.pipeline_comm.Barrier()\n"
    assert blocking_collectives("hpcdl/prefetch.py", source) == [
        ("f", 2, "comm.bcast"),
        ("f", 4, "self.pipeline_comm.Barrier"),
    ]
    assert blocking_collectives("hpcdl/_agree.py", "def call_on_every_rank(comm):\n    comm.allgather(1)\n") == []
    for path, function in BLOCKING_ALLOWED:  # each allowance is still needed
        assert function in [f for f, _, _ in blocking_collectives(path, allowed=set())]
