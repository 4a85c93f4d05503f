#!/usr/bin/env bash
# Set up, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One thread per process: the suite runs servers and subprocesses beside the model, and OpenMP
# teams that share 2 cores with other busy threads stall badly (spin barriers).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers, a test file each at a time (a file's module fixtures stay in one process): much of a test's time
# is spent waiting on servers and subprocesses it started, so two workers on 2 cores take ~18 min where one took ~29.
python3 -m pytest -q -p no:cacheprovider -n "${PAGEDLLM_TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
