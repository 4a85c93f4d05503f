#!/usr/bin/env bash
# Set up, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One thread per process: the suite runs servers and subprocesses beside the model, and OpenMP
# teams that share 2 cores with other busy threads stall badly (spin barriers).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
