#!/usr/bin/env bash
# Installs everything, then trains the seed MLP on MNIST (extra flags pass through),
# e.g. bash scripts/train.sh --strategy hybrid --data 2 --stages 4 --hidden 512 512 512
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/parstrat train "$@"
