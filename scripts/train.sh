#!/usr/bin/env bash
# Installs what is missing (see setup.sh), then trains: by default the seed MLP on MNIST.
# Extra flags pass through to `parstrat train`, e.g.
# bash scripts/train.sh --strategy hybrid --data-parallel 2 --stages 4 --hidden 512 512 512
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/parstrat train "$@"
