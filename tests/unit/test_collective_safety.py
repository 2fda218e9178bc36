"""Every MPI test is collective-safe: a check that fails on one rank must not leave the
other ranks waiting in the next collective. So in code an MPI test runs (the test, the
helpers and fixtures it reaches in its module and in the tests/helpers modules it imports
from), a bare `assert`, `pytest.raises`,
`pytest.fail` or `pytest.skip` is refused: verdicts go through `agree(comm, ok, detail)`,
and code that may raise runs inside `collective(comm, fn)` or `outcome(fn)` (conftest.py),
which catch on every rank and agree before anything is asserted."""

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parents[1]  # tests/: unit/, mpi/ and helpers/
GUARDS = {"collective", "outcome"}  # run their function argument with every rank's exception caught
LOCAL_FAILS = {"pytest.raises", "pytest.fail", "pytest.skip", "pytest.xfail"}


def _marked_mpi(marks):
    """True when one of the marks (decorators, or pytestmark's value) is pytest.mark.mpi."""
    return any(ast.unparse(m.func if isinstance(m, ast.Call) else m) == "pytest.mark.mpi" for m in marks)


def _is_fixture(func):
    return any("fixture" in ast.unparse(d) for d in func.decorator_list)


def read_helper(module):
    """Source of a tests/helpers module named as imported (`helpers.store`)."""
    return (TESTS / (module.replace(".", "/") + ".py")).read_text()


def unsafe_checks(source, filename="<test>", read_helper=read_helper):
    """(line, function, what) of every one-rank failure in code an MPI test of this module runs;
    a function of an imported helpers module is named `module.function`, its line is in that module."""
    tree = ast.parse(source, filename)
    module_mpi = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
        and _marked_mpi(n.value.elts if isinstance(n.value, (ast.List, ast.Tuple)) else [n.value])
        for n in tree.body
    )
    trees = {None: tree}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers."):
            trees[node.module] = ast.parse(read_helper(node.module), node.module)
    functions, label = {}, {}
    for module, t in reversed(trees.items()):  # the test module's own names win
        for n in t.body:
            if isinstance(n, ast.FunctionDef):
                functions[n.name], label[id(n)] = n, n.name if module is None else f"{module}.{n.name}"
    todo = [
        f for name, f in functions.items() if name.startswith("test") and (module_mpi or _marked_mpi(f.decorator_list))
    ]
    guarded = set()  # nested functions and lambdas handed to collective()/outcome()
    for node in (n for t in trees.values() for n in ast.walk(t)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GUARDS:
            for arg in node.args:
                guarded.add(arg.id if isinstance(arg, ast.Name) else id(arg))
    seen, found = set(), []
    while todo:
        func = todo.pop()
        if func.name in seen:
            continue
        seen.add(func.name)
        reached = [a.arg for a in func.args.args]  # fixtures by parameter name
        stack = list(func.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                key = node.name if isinstance(node, ast.FunctionDef) else id(node)
                if key in guarded:
                    continue
            if isinstance(node, ast.Assert):
                found.append((node.lineno, label[id(func)], "assert"))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in LOCAL_FAILS:
                found.append((node.lineno, label[id(func)], ast.unparse(node.func)))
            elif isinstance(node, ast.Name):
                reached.append(node.id)
            stack.extend(ast.iter_child_nodes(node))
        for name in reached:
            helper = functions.get(name)
            if helper is not None and (not name.startswith("test") or _is_fixture(helper)):
                todo.append(helper)
    return sorted(found)


def test_mpi_tests_decide_together():
    paths = sorted(TESTS.glob("*/test_*.py"))
    # the scan must see both folders, or it would pass by looking nowhere
    assert {p.parent.name for p in paths} >= {"unit", "mpi"} and len(paths) >= 30, paths
    problems = []
    for path in paths:
        for line, func, what in unsafe_checks(path.read_text(), str(path)):
            problems.append(f"{path.relative_to(TESTS)}:{line} in {func}: {what} on one rank; use agree()/collective()")
    assert not problems, "\n".join(problems)


def test_the_scan_finds_what_it_refuses():
    source = """
import pytest
def helper(comm):
    assert comm.rank >= 0
def safe(comm):
    def check():
        assert comm.rank >= 0
    collective(comm, check)
    collective(comm, lambda: pytest.fail("caught on every rank"))
@pytest.mark.mpi
def test_a(comm):
    helper(comm)
    safe(comm)
    with pytest.raises(ValueError):
        pass
def test_single_process():
    assert True
"""
    assert unsafe_checks(source) == [(4, "helper", "assert"), (14, "test_a", "pytest.raises")]


@pytest.mark.parametrize("mark", ["pytestmark = pytest.mark.mpi", "pytestmark = [pytest.mark.mpi]"])
def test_module_marks_count(mark):
    source = f"import pytest\n{mark}\ndef test_b():\n    assert 1\n"
    assert unsafe_checks(source) == [(4, "test_b", "assert")]


def test_the_scan_follows_imports_from_helper_modules():
    helper = "def shared(x):\n    assert x\ndef unused():\n    assert False\n"
    source = "import pytest\nfrom helpers.cases import shared\n@pytest.mark.mpi\ndef test_c(comm):\n    shared(comm)\n"
    assert unsafe_checks(source, read_helper={"helpers.cases": helper}.get) == [(2, "helpers.cases.shared", "assert")]
