"""The docs' commands are the ones that exist: every shell command in a code
block of README.md and docs/*.md that runs `hpcdl ...`, `python bench/...`,
`python examples/...`, `python -m hpcdl...`, `sbatch slurm/...` or a script of
scripts/, bench/ or slurm/ names files that exist, subcommands that exist and
options the real argument parsers accept. Nothing is run: each program's
parser is called (in a subprocess per program, up to its parse_args) with the
documented arguments. A `...` in a command ends what is checked of it."""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

from conftest import ROOT

PAGES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
REPO_PATH = re.compile(r"(?<![\w/$.-])(?:\./)?((?:bench|scripts|slurm|examples|docs|tests|hpcdl)/[\w./*-]*[\w*])")
LAUNCHER_VALUE_OPTIONS = {"-n", "-np", "-N", "-ppn", "-f", "-hosts", "--ntasks", "--nodes"}

# Runs in a subprocess: each documented argv through the program's own parser,
# stopping right after parse_args returns (no benchmark or training runs).
PROBE = r"""
import argparse, contextlib, importlib, importlib.abc, importlib.machinery, io, json, os, runpy, sys, types

class Parsed(Exception):
    pass

# torch and tensorflow are stand-ins that accept any use at import time: only the
# parsers matter here, and importing TensorFlow takes tens of seconds on a busy machine.
class Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        return cls

class StandIn(metaclass=Anything):
    pass

class StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn

class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "tensorflow"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, StandInFinder())

parse_args = argparse.ArgumentParser.parse_args

def parse_and_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise Parsed()

kind, target, argvs = json.loads(sys.argv[1])
if kind == "path":
    sys.path.insert(0, os.path.dirname(target))  # as `python SCRIPT` has it
verdicts = []
for argv in argvs:
    err = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "hpcdl":  # the CLI, then for `bench` the benchmark's own parser
                from hpcdl import cli
                sys.argv = ["hpcdl"] + argv
                parser = cli._parser()
                args, extra = parser.parse_known_args(argv)
                if args.command != "bench":
                    if extra:
                        parser.error("unrecognized arguments: " + " ".join(extra))
                    raise Parsed()
                args.bench_args = extra
                cli.load_bench(args.bench).main(cli._bench_argv(args))
            else:
                sys.argv = [target] + argv
                if kind == "path":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
        verdicts.append("returned without parsing its arguments")
    except Parsed:
        verdicts.append(None)
    except SystemExit as exc:
        verdicts.append(err.getvalue().strip().splitlines()[-1:] or ["exit %s" % exc.code])
    finally:
        argparse.ArgumentParser.parse_args = parse_args
print("VERDICTS " + json.dumps(verdicts))
"""


def shell_lines(text):
    """(line number, command) of fenced shell blocks and indented code blocks, continuations joined."""
    out, fence, indented, previous_blank, pending, start = [], None, False, True, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is None:  # an indented block starts after a blank line and ends at unindented text
            indented = line.startswith("    ") and (indented or previous_blank) or (indented and not stripped)
        previous_blank = not stripped
        if not stripped or not (fence in SHELL_FENCES if fence is not None else indented):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def simple_commands(line):
    """The commands of one shell line, split at ; && || | and with comments and redirections removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: not a shell command
        return []
    commands, current, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in (";", "&&", "||", "|", "&", "(", ")"):
            commands.append(current)
            current = []
        elif set(token) <= set("<>&") and ("<" in token or ">" in token):
            skip = True  # the redirection's target
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def sbatch_target(script):
    """What an sbatch script runs before its arguments: ("hpcdl", [words]) or ("path", file, [words]), or None."""
    with open(os.path.join(ROOT, script)) as f:
        for line in f:
            words = line.split()
            if '"$@"' not in words:
                continue
            words = [
                w
                for w in words[: words.index('"$@"')]
                if w != "launch" and not w.startswith('"$') or w.startswith('"$HPCDL_HOME/')
            ]
            if words[:1] == ["hpcdl"]:
                return "hpcdl", words[1:]
            if words[:1] == ["python"] and len(words) >= 2:
                return "path", words[1].strip('"').replace("$HPCDL_HOME/", ""), words[2:]
    return None


def case_labels(script):
    """The subcommands of a script that dispatches with `case ${1:-} in` (empty when it does not)."""
    with open(os.path.join(ROOT, script)) as f:
        text = f.read()
    dispatch = re.search(r'^case "?\$\{?1(:-)?\}?"? in$(.*?)^esac', text, re.M | re.S)
    if dispatch is None:
        return set()
    return {label for labels in re.findall(r"^\s*([\w|-]+)\)", dispatch.group(2), re.M) for label in labels.split("|")}


def classify(words):
    """(kind, target, argv) to check for one simple command, or None when it is not one of ours."""
    i = 0
    while i < len(words):
        w = words[i]
        if re.match(r"^[A-Za-z_]\w*=", w) or w in ("sudo", "time", "nice", "exec"):
            i += 1
        elif w in ("timeout", "flock"):
            i += 2
        elif w in ("mpiexec", "mpirun", "srun"):
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 2 if words[i] in LAUNCHER_VALUE_OPTIONS else 1
        elif w.endswith("bench/netcluster.sh"):
            j = i + 1
            while words[j : j + 1] in (["--hosts"], ["--rate"], ["--cpus"]):  # its options, before the subcommand
                j += 2
            if words[j : j + 2] == ["run", "--"]:
                i = j + 2
                continue
            words = words[: i + 1] + words[j:]
            break
        elif w.endswith("bench/netns-exec.sh"):
            i += 1
        else:
            break
    words = words[i:]
    if "..." in words:
        words = words[: words.index("...")]
    if not words:
        return None
    head, rest = words[0], words[1:]
    if head == "hpcdl":
        return "hpcdl", "hpcdl", rest
    if head in ("python", "python3"):
        if rest[:2] == ["-m", "hpcdl"]:
            return "hpcdl", "hpcdl", rest[2:]
        if rest[:1] == ["-m"] and rest[1:2] and rest[1].startswith("hpcdl."):
            return "module", rest[1], rest[2:]
        if rest and rest[0].endswith(".py") and REPO_PATH.fullmatch(rest[0]):
            return "path", rest[0].removeprefix("./"), rest[1:]
        return None
    if head == "sbatch":
        scripts = [k for k, w in enumerate(rest) if w.endswith(".sbatch")]
        if not scripts:
            return None
        return "sbatch", rest[scripts[0]], rest[scripts[0] + 1 :]
    if REPO_PATH.fullmatch(head) and head.endswith(".sh"):
        return "sh", head.removeprefix("./"), rest
    return None


def documented_commands():
    """Every command of ours in the docs: (where, kind, target, argv, the line's repo paths)."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for number, line in shell_lines(text):
            for words in simple_commands(line):
                checked = classify(words)
                if checked:
                    found.append((f"{page}:{number}: {line}", *checked, REPO_PATH.findall(" ".join(words))))
    return found


def test_documented_commands_exist_and_parse():
    commands = documented_commands()
    kinds = {kind for _, kind, *_ in commands}
    assert {"hpcdl", "path", "sbatch", "sh"} <= kinds, kinds  # the extraction finds them
    problems, probes = [], {}
    for where, kind, target, argv, paths in commands:
        for path in paths:
            if not glob.glob(os.path.join(ROOT, path)):  # a shell pattern matches at least one file
                problems.append(f"{where}\n    no such file: {path}")
        if kind == "sh":
            labels = case_labels(target) if os.path.exists(os.path.join(ROOT, target)) else set()
            if labels and argv and argv[0] not in labels:
                problems.append(f"{where}\n    {target} has no subcommand {argv[0]!r} ({', '.join(sorted(labels))})")
            continue
        if kind == "sbatch":
            if not os.path.exists(os.path.join(ROOT, target)):
                continue  # reported above
            runs = sbatch_target(target)
            if runs is None:
                if argv:
                    problems.append(f"{where}\n    {target} takes no arguments")
                continue
            kind, target, argv = (
                ("hpcdl", "hpcdl", runs[1] + argv) if runs[0] == "hpcdl" else ("path", runs[1], runs[2] + argv)
            )
        if kind == "path":
            target = os.path.join(ROOT, target)
            if not os.path.exists(target):
                continue  # reported above
        probes.setdefault((kind, target), []).append((where, argv))
    running = {
        key: subprocess.Popen(
            [sys.executable, "-c", PROBE, json.dumps([*key, [a for _, a in uses]])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3"),
        )
        for key, uses in probes.items()
    }
    for key, proc in running.items():
        out, err = proc.communicate(timeout=300)
        verdict_lines = [line for line in out.splitlines() if line.startswith("VERDICTS ")]
        if not verdict_lines:
            problems.append(f"{key[1]}: the parser check did not run:\n{err[-2000:]}")
            continue
        for (where, argv), verdict in zip(probes[key], json.loads(verdict_lines[-1][9:])):
            if verdict is not None:
                problems.append(f"{where}\n    {key[1]} {' '.join(argv)}: {verdict}")
    assert not problems, f"{len(problems)} documented command(s) do not work:\n" + "\n".join(problems)


def test_the_checker_catches_drift(tmp_path):
    """A wrong option, subcommand or file in a command is found, a right one is not."""
    assert classify(shlex.split("mpiexec -n 4 python bench/allreduce.py --sizes 1MiB")) == (
        "path",
        "bench/allreduce.py",
        ["--sizes", "1MiB"],
    )
    assert classify(shlex.split("sudo HPCDL_X=1 hpcdl bench store -n 2 ...")) == (
        "hpcdl",
        "hpcdl",
        ["bench", "store", "-n", "2"],
    )
    assert classify(shlex.split("pip install .")) is None
    assert simple_commands('eval "$(scripts/slurm-cluster.sh env)" && hpcdl info > out.txt # note') == [
        ["eval", "$(scripts/slurm-cluster.sh env)"],
        ["hpcdl", "info"],
    ]
    assert sbatch_target("slurm/pack.sbatch") == ("hpcdl", ["pack"])
    assert sbatch_target("slurm/allreduce_bench.sbatch") == ("path", "bench/allreduce.py", [])
    assert sbatch_target("slurm/store_bench.sbatch") == ("path", "bench/store.py", ["--fs", "plain"])
    assert "start" in case_labels("scripts/slurm-cluster.sh")
    argvs = [
        ["info"],
        ["info", "--bogus"],
        ["bench", "allreduce", "--sizes", "4KiB"],
        ["bench", "allreduce", "--no-such"],
        ["nosuch"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(["hpcdl", "hpcdl", argvs])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    verdicts = json.loads(proc.stdout.split("VERDICTS ")[1])
    assert [v is None for v in verdicts] == [True, False, True, False, False], verdicts
    assert "--no-such" in verdicts[3][0] and "invalid choice" in verdicts[4][0]
