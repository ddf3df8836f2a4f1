#!/usr/bin/env bash
# Installs what is missing (see setup.sh), then runs the whole test suite (tests/ and the doctests)
# on 8 virtual CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check parstrat tests examples benchmarks
.venv/bin/python -m pytest -q tests parstrat "$@"
