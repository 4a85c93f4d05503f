#!/usr/bin/env bash
# Set up, then run the main job: generation on the embedded model through the paged engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pagedllm.entrypoints.demo "$@"
