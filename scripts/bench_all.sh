#!/usr/bin/env bash
# Runs every `pagedllm bench <name>` at its default (full) size, one after the other, writing
# <name>.md/.json/.png into bench/ (or $1) and each bench's wall time into <out>/wall_times.txt.
# Optional baselines join when installed (scripts/setup_baselines.sh; PAGEDLLM_VLLM_PYTHON for vLLM).
# Extra arguments after the folder go to every bench (e.g. --dtype bfloat16).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench}"
shift || true
mkdir -p "$out"
: > "$out/wall_times.txt"
for name in throughput sweep waste latency memory prefix context decode perplexity alloc attention; do
    echo "== pagedllm bench $name $*" >&2
    t0=$(date +%s)
    pagedllm bench "$name" --out "$out" "$@" > /dev/null
    rc=$?
    echo "$name $(( $(date +%s) - t0 )) s rc=$rc" | tee -a "$out/wall_times.txt" >&2
done
