#!/usr/bin/env bash
# Fails when a C++ file of include/ or src/ is not formatted as .clang-format
# says (clang-format 14, the version pinned in requirements.txt and Debian's
# 12 "bookworm"), or a Python file of hpcdl/ tests/ bench/ examples/ has a
# finding of `ruff check` or is not formatted as `ruff format` would (ruff,
# pinned in requirements.txt, configured in pyproject.toml);
# `scripts/lint.sh --fix` formats them in place and applies ruff's safe fixes.
# The architecture's lines are checked by tests/unit/test_architecture.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCDL_VENV:-.venv}
CLANG_FORMAT=${CLANG_FORMAT:-}
if [ -z "$CLANG_FORMAT" ]; then
  if [ -x "$VENV/bin/clang-format" ]; then CLANG_FORMAT="$VENV/bin/clang-format"
  elif command -v clang-format >/dev/null; then CLANG_FORMAT=$(command -v clang-format)
  else echo "lint.sh: no clang-format (pip install -r requirements.txt, or apt-get install clang-format)" >&2; exit 2
  fi
fi
RUFF=${RUFF:-}
if [ -z "$RUFF" ]; then
  if [ -x "$VENV/bin/ruff" ]; then RUFF="$VENV/bin/ruff"
  elif command -v ruff >/dev/null; then RUFF=$(command -v ruff)
  else echo "lint.sh: no ruff (pip install -r requirements.txt)" >&2; exit 2
  fi
fi
python_dirs=(hpcdl tests bench examples)
mapfile -t files < <(git ls-files 'include/*.hpp' 'src/*.cc')
if [ "${1:-}" = "--fix" ]; then
  "$CLANG_FORMAT" -i "${files[@]}"
  "$RUFF" format "${python_dirs[@]}"
  "$RUFF" check --fix "${python_dirs[@]}"
else
  "$CLANG_FORMAT" --dry-run -Werror "${files[@]}"
  "$RUFF" check "${python_dirs[@]}"
  "$RUFF" format --check "${python_dirs[@]}"
fi
