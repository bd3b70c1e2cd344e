#!/usr/bin/env bash
# The one prepared device check: the Triton kernel tests compiled on the GPU, then the benchmark
# (bench.kernel_bench): the bf16 matmul peak, attention TF/s at head dim 64/128 and 1k/2k/8k
# tokens against torch SDPA (naming its backend), a chunk after a prefix, decode, and an engine
# with Llama-3-8B's layer shape prefilling 1k/2k/8k (MFU against that peak), compile on vs off,
# and a torch.profiler split of one 8k prefill. Figures go to $OUT/kernel_bench.json.
# Sized for one H200 call under 8 minutes: every step runs under `timeout` and the limits add up
# to 470 s; a normal run should take 4 to 5 minutes (an estimate: it has not run on a GPU yet;
# the kernels have been compiled for sm_90 here with engine.rank.kernels.aot_check).
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --cpu-dry-run   # here: same steps, tiny sizes, Triton interpreted
#   GPU_CHECK_PY=/work/main/.venv/bin/python bash scripts/gpu_check.sh --cpu-dry-run  # an existing venv
#
# Everything printed also goes to $OUT/gpu_check.log when OUT is set (the device tool's folder).
# A failed step is reported and the rest still run, so one run shows as much as it can; the exit
# status is non-zero if any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."

# seconds per step (overridable): setup is expected to fail fast offline, the tests compile a few
# dozen kernel variants, the benchmark autotunes the prefill for two head dims (~1 min) and
# builds and loads a 1.1B 8B-shaped model (~1 min) before timing
SETUP_S=${GPU_CHECK_SETUP_S:-40} INFO_S=${GPU_CHECK_INFO_S:-20}
TESTS_S=${GPU_CHECK_TESTS_S:-130} BENCH_S=${GPU_CHECK_BENCH_S:-260}
KERNEL_TESTS=(tests/test_kernels.py tests/test_kernels_gpu_config.py tests/test_kernels_step.py
              tests/test_kernels_compile.py)
PY=${GPU_CHECK_PY:-.venv/bin/python}  # e.g. GPU_CHECK_PY=/path/to/.venv/bin/python for a dry run
FAILED=()

usage() { echo "usage: bash scripts/gpu_check.sh [--cpu-dry-run]" >&2; exit 2; }

# step NAME SECONDS COMMAND...: run it under timeout, log its outcome, never abort the script
step() {
    local name=$1 limit=$2 rc=0 start=$SECONDS
    shift 2
    echo
    echo "=== $name (limit ${limit}s) ==="
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "=== $name: ok in $((SECONDS - start))s ==="
    else
        [ "$rc" -eq 124 ] && echo "=== $name: TIMED OUT after ${limit}s ===" \
            || echo "=== $name: FAILED (exit $rc) after $((SECONDS - start))s ==="
        FAILED+=("$name")
    fi
}

# A venv made by a python3 that is itself a venv (/opt/torch/.venv on the device machine) sees
# the base interpreter's packages, not that venv's CUDA torch: point it there with a .pth file.
link_image_packages() {
    "$PY" -c "import torch" 2>/dev/null && return 0
    local site
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" >"$site/_image_packages.pth"
    echo "linked .venv to python3's packages: $(tr '\n' ' ' <"$site/_image_packages.pth")"
}

prepare_gpu_venv() {
    unset TRITON_INTERPRET  # compiled kernels: the interpreter would read GPU memory as host
    # created here, as setup.sh would, so that it can be linked before setup.sh's pip runs:
    # unlinked, pip would try to fetch a second torch of several GB
    # (without pip where the base python has no ensurepip, as Debian's may not)
    [ -x "$PY" ] || python3 -m venv --system-site-packages .venv \
        || python3 -m venv --system-site-packages --without-pip .venv
    link_image_packages
    # the device machine reaches no package index, so setup.sh's pip install fails there: fail
    # fast (no retries) and go on with the image's packages and the source tree on PYTHONPATH
    step "setup.sh" "$SETUP_S" env PIP_RETRIES=0 PIP_TIMEOUT=5 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        bash scripts/setup.sh
    if [ "${FAILED[*]-}" = "setup.sh" ]; then
        echo "(setup.sh failing offline is expected; continuing with the image's packages)"
        FAILED=()
    fi
    if ! "$PY" -c "import torch, triton, pytest, transformers" 2>/dev/null; then
        echo "$PY lacks the image's packages even when linked: using python3 itself"
        PY=python3
    fi
}

prepare_cpu_venv() {
    export TRITON_INTERPRET=1
    # setup.sh would pip install into the existing venv; a dry run only needs it to exist
    [ -x "$PY" ] || step "setup.sh" "$SETUP_S" bash scripts/setup.sh
}

# what the kernels will run on, printed where the log starts
VERSIONS_PY='
import os, sys, torch, triton
interp = os.environ.get("TRITON_INTERPRET")
print(f"python {sys.version.split()[0]} ({sys.executable})  torch {torch.__version__} "
      f"(CUDA {torch.version.cuda})  triton {triton.__version__}  TRITON_INTERPRET={interp}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
          f"capability {p.major}.{p.minor}")
import engine  # the source tree, installed or on PYTHONPATH
print("engine from", os.path.dirname(engine.__file__))
'

show_machine() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        step "nvidia-smi" 20 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,clocks.sm,clocks.max.sm,temperature.gpu,power.draw
    else
        echo "no nvidia-smi here; $(nproc) CPU cores"
    fi
    step "versions" "$INFO_S" "$PY" -c "$VERSIONS_PY"
}

main() {
    local mode=gpu
    case "${1:-}" in
        --cpu-dry-run) mode=cpu ;;
        "") ;;
        *) usage ;;
    esac
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check ($mode) in $PWD at $(date -u +%FT%TZ)"
    "prepare_${mode}_venv"
    show_machine
    if [ "$mode" = gpu ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
        echo "no CUDA device visible to $PY: nothing to check"
        exit 1
    fi
    step "kernel tests" "$TESTS_S" "$PY" -m pytest -q "${KERNEL_TESTS[@]}" --durations=5
    local out=${OUT:-${TMPDIR:-/tmp}/gpu_check_out}
    mkdir -p "$out"
    if [ "$mode" = gpu ]; then  # prints the config the autotuner picks for each key
        step "benchmark" "$BENCH_S" env TRITON_PRINT_AUTOTUNING=1 "$PY" -m bench.kernel_bench \
            --json "$out/kernel_bench.json"
    else  # tiny shapes that still span several tiles, interpreted: proves the script runs
        step "benchmark" "$BENCH_S" "$PY" -m bench.kernel_bench --cpu-dry-run \
            --json "$out/kernel_bench.json"
    fi
    echo "figures: $out/kernel_bench.json"
    echo
    if [ ${#FAILED[@]} -eq 0 ]; then
        echo "gpu_check ($mode): all steps passed"
    else
        echo "gpu_check ($mode): FAILED: ${FAILED[*]}"
        exit 1
    fi
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main "$@" 2>&1 | tee "$OUT/gpu_check.log"  # pipefail: the script's status stays main's
else
    main "$@"
fi
