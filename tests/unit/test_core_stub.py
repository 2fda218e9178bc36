"""hpcdl/_core.pyi (kept by hand) declares exactly the extension's public names."""

import ast
import inspect
import pathlib

from hpcdl import _core

from conftest import ROOT


def _declared(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return names


def test_stub_names_equal_the_modules_public_names():
    tree = ast.parse((pathlib.Path(ROOT) / "hpcdl" / "_core.pyi").read_text())
    public = {name for name in dir(_core) if not name.startswith("_") and not inspect.ismodule(getattr(_core, name))}
    assert _declared(tree) == public


def test_stub_classes_declare_the_public_methods():
    tree = ast.parse((pathlib.Path(ROOT) / "hpcdl" / "_core.pyi").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not issubclass(getattr(_core, node.name), Warning):
            declared = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
            }
            public = {n for n in vars(getattr(_core, node.name)) if not n.startswith("_")}
            assert public <= declared, (node.name, public - declared)
