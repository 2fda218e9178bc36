"""hpcdl/_env.py is the one place the library reads the environment, it names
every HPCDL_* variable the library uses, and docs/tuning.md's table is its own."""

import pathlib
import re

import pytest

from hpcdl import _env

from conftest import ROOT

PACKAGE = pathlib.Path(ROOT) / "hpcdl"


def test_docs_table_is_the_modules():
    tuning = (pathlib.Path(ROOT) / "docs" / "tuning.md").read_text()
    assert _env.doc_table() in tuning, "docs/tuning.md's table differs: paste python -m hpcdl._env's output there"


def test_only_the_env_module_reads_the_environment():
    readers = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if path.name != "_env.py" and re.search(r"os\.environ|getenv\(", path.read_text())
    ]
    assert readers == []


def test_every_variable_the_library_names_is_in_the_module():
    known = set(_env.VARIABLES) | {variable for *_, variable in _env.ENGINE_SETTINGS.values()}
    named = set()
    for path in list(PACKAGE.rglob("*.py")) + list((pathlib.Path(ROOT) / "ext").glob("*.pxi")):
        named |= {name for name in re.findall(r"HPCDL_[A-Z0-9_]+", path.read_text()) if not name.endswith("_")}
    assert named - known == set()
    assert set(_env.ENGINE_DOCS) == {variable for *_, variable in _env.ENGINE_SETTINGS.values()}


@pytest.mark.parametrize(
    "name,text", [("HPCDL_DLIO_RAM", "12 parsecs"), ("HPCDL_TIMELINE_WAIT_SECONDS", "-1"), ("HPCDL_DLIO_THREADS", "+4")]
)
def test_bad_text_names_the_variable(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=f"environment variable {name}='{re.escape(text)}'"):
        _env.get(name)


def test_values_are_parsed_and_unset_gives_the_default(monkeypatch):
    monkeypatch.setenv("HPCDL_DLIO_RAM", "2M")
    monkeypatch.setenv("HPCDL_ABORT_ON_EXCEPTION", "0")
    monkeypatch.delenv("HPCDL_DLIO_DISK", raising=False)
    assert _env.get("HPCDL_DLIO_RAM") == 2 << 20
    assert _env.get("HPCDL_ABORT_ON_EXCEPTION", True) is False
    assert _env.get("HPCDL_DLIO_DISK", 7) == 7


@pytest.mark.parametrize(
    "setting,visible,expected",
    [
        (None, None, None),
        (None, "0,1", "CUDA_VISIBLE_DEVICES='0,1'"),
        (None, "GPU-2fa61452", "CUDA_VISIBLE_DEVICES='GPU-2fa61452'"),
        (None, "", None),
        (None, "NoDevFiles", None),
        (None, "-1", None),
        ("0", "0,1", None),
        ("1", None, "HPCDL_EXPECT_GPU=1"),
        ("auto", "3", "CUDA_VISIBLE_DEVICES='3'"),
    ],
)
def test_a_gpu_is_expected_where_the_launcher_gave_the_rank_one(monkeypatch, setting, visible, expected):
    for name, value in (("HPCDL_EXPECT_GPU", setting), ("CUDA_VISIBLE_DEVICES", visible)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _env.gpu_expected() == expected


def test_a_bad_expect_gpu_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("HPCDL_EXPECT_GPU", "yes")
    with pytest.raises(ValueError, match="HPCDL_EXPECT_GPU='yes': expected auto, 0 or 1"):
        _env.gpu_expected()
