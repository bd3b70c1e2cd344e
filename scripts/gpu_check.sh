#!/usr/bin/env bash
# The one prepared device check, for one H200 call under 9 minutes. Sections run in this order,
# each under its own time limit (they add up to 480 s), every figure written to
# $OUT/gpu_check.json the moment it is measured (bench/gpu_check.py), so a section cut short
# keeps what it had and the ones after it still run:
#   tokens           bf16 prompt logprobs, torch and Triton backends, TP=1, against float32 HF
#   flash            flash prefill TF/s, head dim 128, causal, 1k/8k: default vs tuned tile, SDPA
#   peak             the bf16 matmul peak (every MFU's denominator)
#   engine_eager     Llama-3-8B's layer shape (4 layers, random weights): start-up, prefill 1k/8k, MFU
#   engine_compiled  the same with compile=True: start-up (compile + autotune), prefill, MFU
#   decode           the decode kernel's K/V read rate
#   tp2              one rank's compute at TP=2's shapes (half the heads and FFN)
#   kernel tests     tests/test_kernels*.py compiled on the GPU, at fixed tiles (no autotuning)
#
#   bash scripts/gpu_check.sh             # on the device machine (python3 of its image)
#   bash scripts/gpu_check.sh --dry-run   # here: the same steps at tiny sizes, Triton interpreted,
#                                         # each limit x3
#
# Needs torch, Triton, transformers and pytest: not Ray, Hydra, gguf or a network (the device
# image has none of them). GPU_CHECK_PY picks the python (default: .venv/bin/python where it
# exists and the dry run, else python3). The exit status is non-zero if any section failed.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
    --dry-run|--cpu-dry-run) MODE=cpu ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [ -z "${GPU_CHECK_PY:-}" ]; then
    if [ "$MODE" = cpu ] && [ -x .venv/bin/python ]; then GPU_CHECK_PY=.venv/bin/python
    else GPU_CHECK_PY=python3; fi
fi
PY=$GPU_CHECK_PY
OUT_DIR=${OUT:-${TMPDIR:-/tmp}/gpu_check_out}
JSON=$OUT_DIR/gpu_check.json
MODELS=${TMPDIR:-/tmp}/gpu_check_models  # random checkpoints, shared by the sections
DRY=(); [ "$MODE" = cpu ] && DRY=(--dry-run)
FAILED=()
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = cpu ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi

# step NAME SECONDS COMMAND...: run it under timeout, log its outcome, never stop the script
step() {
    local name=$1 limit=$2 rc=0 start=$SECONDS
    shift 2
    echo
    echo "=== $name (limit ${limit}s) ==="
    timeout --kill-after=5 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "=== $name: ok in $((SECONDS - start))s ==="
    else
        [ "$rc" -eq 124 ] && echo "=== $name: TIMED OUT after ${limit}s ===" \
            || echo "=== $name: FAILED (exit $rc) after $((SECONDS - start))s ==="
        FAILED+=("$name")
    fi
}

# The limits are the GPU's. A dry run interprets Triton and compiles for a CPU: each limit x3.
SCALE=1; [ "$MODE" = cpu ] && SCALE=3

section() {  # section NAME SECONDS [ENV=VALUE ...]
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    step "$name" "$limit" env "$@" "$PY" -m bench.gpu_check "$name" --json "$JSON" \
        --models "$MODELS" "${DRY[@]}"
}


main() {
    mkdir -p "$OUT_DIR" "$MODELS"
    rm -f "$JSON"
    echo "gpu_check ($MODE) in $PWD at $(date -u +%FT%TZ), figures in $JSON"
    section versions 10
    if [ "${FAILED[*]-}" = versions ]; then
        echo "gpu_check: cannot run here"
        exit 1
    fi
    section tokens 60 PREFILL_AUTOTUNE=0  # correctness: one tile is enough
    section flash 40
    section peak 10
    section engine_eager 45
    section engine_compiled 90
    section decode 15
    section tp2 60
    # The TP=2 engine test starts Ray, which the device image lacks (TP=1 runs the same path).
    # One process (no pyproject addopts): the image's pytest has no xdist for `-n 2`.
    step "kernel tests" $((150 * SCALE)) env PREFILL_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider \
        -o addopts="" \
        tests/test_kernels.py tests/test_kernels_gpu_config.py tests/test_kernels_step.py \
        tests/test_kernels_compile.py \
        --deselect "tests/test_kernels.py::test_engine_with_triton_backend_matches_torch[2]"
    echo
    if [ ${#FAILED[@]} -eq 0 ]; then
        echo "gpu_check ($MODE): all sections passed; figures: $JSON"
    else
        echo "gpu_check ($MODE): FAILED: ${FAILED[*]}; figures so far: $JSON"
        exit 1
    fi
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.log"
else
    main
fi
