#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs parstrat (editable) with its development
# tools, only when needed: when .venv already holds an install made from this very
# pyproject.toml (a stamp keeps its hash), it does nothing and prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.parstrat-installed
want="$("$PYTHON" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install -e ".[dev]"
echo "$want" > "$STAMP"
