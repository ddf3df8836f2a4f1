#!/usr/bin/env bash
# Installs what is missing (see setup.sh), then runs the whole test suite (tests/ and the doctests)
# on 8 virtual CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check parstrat tests examples benchmarks
# Two workers, one test file each at a time (module fixtures compile once): one
# process alone leaves a core idle while XLA compiles.
.venv/bin/python -m pytest -q -n 2 --dist loadfile tests parstrat "$@"
