"""Every file under bench/results is one the docs show: named in the code of
docs/*.md or README.md (a name or path, with shell braces and globs:
`bench/results/a{,-run2}.{csv,png}`, `b.*`: a glob starts with a name), or the run a quoted command
writes or names in code (`--tag NAME`, `--name NAME`, a command's comment: every NAME.*), or the
data behind a shown file (its other suffixes: the CSV and JSON of a shown
PNG), or the companions of a shown run the docs describe once for all runs
(NAME-run2.*: a repeat; NAME-runs.csv: every run's row; NAME-memory.csv;
NAME-model-inputs.csv; NAME-model.*: the model beside the measured run)."""

import fnmatch
import pathlib
import re

from conftest import ROOT

RESULTS = pathlib.Path(ROOT) / "bench" / "results"
# A shown run's companions: its repeats (-run2, ...), then every run's rows, memory, model inputs, the model.
COMPANION = r"(-run[0-9]+)?(-runs|-memory|-model-inputs|-model)?"


def _expand(pattern):
    """Shell brace expansion: a{b,c}d -> abd, acd (nested and repeated)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [word for choice in match.group(1).split(",") for word in _expand(head + choice + tail)]


def _stem(name):
    return name.split(".", 1)[0]


def unreferenced(names, docs):
    code = " ".join(re.findall(r"```.*?```|`[^`]+`|^    .*$", docs, flags=re.S | re.M))
    tokens = re.findall(r"[\w.\-*{},/]+", code) + re.findall(r"bench/results/[\w.\-*{},]+", docs)
    patterns = {p for token in tokens for p in _expand(token.split("/")[-1].strip(".,"))}
    tags = {p for tag in re.findall(r"--(?:tag|name)[ =]([\w\-{},]+)", docs) for p in _expand(tag)}
    shown = {
        n
        for n in names
        if n in patterns
        or _stem(n) in tags | patterns
        or any(fnmatch.fnmatchcase(n, p) for p in patterns if "*" in p and re.match(r"[\w\-]{3}", p))
    }
    stems = {_stem(n) for n in shown}
    return sorted(n for n in names if not any(re.fullmatch(re.escape(stem) + COMPANION, _stem(n)) for stem in stems))


def test_every_result_file_is_shown_by_the_docs():
    root = pathlib.Path(ROOT)
    docs = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    names = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()]
    assert unreferenced(names, docs) == [], "not shown by any doc: remove them, or show them in docs/"


def test_the_reference_rules_can_fail():
    docs = (
        "see `bench/results/a{,-run2}.{csv,png}` and `b.json`, `cc-*.csv`, `ls *`;\n```\npython bench/x.py --tag e\n```\n"
        "f.csv in prose only"
    )
    names = [
        "a.csv",
        "a-run2.png",
        "a-runs.csv",
        "b.json",
        "cc-1.csv",
        "cc-1.json",
        "d.csv",
        "e.png",
        "e-memory.csv",
        "e-run2-memory.csv",
        "f.csv",
    ]
    assert unreferenced(names, docs) == ["d.csv", "f.csv"]
