#!/usr/bin/env bash
# Issue 15's checks on the device (a CUDA build of torch with a GPU present),
# in one call of the device tool; results under $OUT.
#
#   STEPS="suite sweep-dynamic" bash scripts/gpu/conformance.sh
#
# Steps:
#   suite             the whole test suite, CPU tests included (pytest -n)
#   sweep-dynamic     OpInfo sweep on the CPU, every 4th op, dynamic=True,
#                     both wrappers
#   sweep-backward    the same through backward
#   upstream-tests    PyTorch's own cpp_wrapper tests in both modes
#                     (tools/conformance.py; needs .pytorch_tests/ carried)
#   models            benchmarks/model_sweep.py on CUDA: every transformers
#                     family and timm model, five settings, against eager
# Knobs: SUITE_WORKERS, SUITE_TIMEOUT, SUITE_FIRST, SWEEP_JOBS, SWEEP_TIMEOUT,
# UPSTREAM_TIMEOUT, UPSTREAM_ARGS, MODELS_TIMEOUT, MODELS_ARGS (the *_ARGS
# are read as shell words, so a quoted -k expression stays one argument:
# UPSTREAM_ARGS='-k "not test_linear_with_pointwise" -n 15').
set -u -o pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
export NCCL_NVLS_ENABLE=0

has_step() { [[ " ${STEPS:-suite} " == *" $1 "* ]]; }

echo "== machine"
nvidia-smi -L || true
$PYTHON -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, "triton", triton.__version__, "devices:", torch.cuda.device_count())'
nproc
$PYTHON -c 'from torch_cppwrap._inductor.codecache import prepare_runtime; prepare_runtime("cuda"); prepare_runtime("cpu")'

sweep() {  # sweep NAME EXTRA_ARGS...
    local name=$1; shift
    echo "== OpInfo sweep ($name), started $(date +%T)"
    timeout -s INT "${SWEEP_TIMEOUT:-400}" $PYTHON benchmarks/opinfo_sweep.py --compare \
        --step 4 --jobs "${SWEEP_JOBS:-8}" --timeout 120 --out "/tmp/sweep_$name.json" "$@" \
        > "$OUT/sweep_$name.md" 2> "/tmp/sweep_$name.log"
    echo "sweep $name exit status: $?"
    cp "/tmp/sweep_$name.json" "$OUT/" 2>/dev/null
    sed -n 1,12p "$OUT/sweep_$name.md"
}

# The sweeps run beside the suite: each takes its own cores.
pids=()
if has_step sweep-dynamic; then sweep dynamic --dynamic & pids+=($!); fi
if has_step sweep-backward; then sweep backward --backward & pids+=($!); fi

if has_step suite; then
    echo "== the whole suite, started $(date +%T)"
    # -v: a run cut by its time limit prints no summary, and -q would then
    # leave its failures unnamed (session 10's first suite run on the H200).
    # SIGINT, not SIGTERM: a cut pytest still prints its failures' tracebacks
    # and the summary (session 40's H100 run lost both to a SIGTERM).
    # SUITE_FIRST: test files to hand out first (pytest drops the repeat),
    # for a call with less time than the whole suite takes.
    timeout -s INT -k 30 "${SUITE_TIMEOUT:-420}" $PYTHON -X faulthandler -m pytest \
        ${SUITE_FIRST:-} tests -v -rfEs \
        --tb=short -p no:cacheprovider -n "${SUITE_WORKERS:-6}" > "$OUT/suite.log" 2>&1
    echo "suite exit status: $?"
    grep -E "(FAILED|ERROR) tests/|passed|failed" "$OUT/suite.log" | tail -30
fi

if has_step upstream-tests; then
    echo "== PyTorch's cpp_wrapper tests in both modes, started $(date +%T)"
    # The work dir is ours, not UPSTREAM_ARGS': its per-run progress records
    # (each test's outcome as it ends) come back flat, so a run cut by the
    # call's limit still says what it did (session 41 lost one: the device
    # tool returns no file nested that deep).
    work=/tmp/upstream_work
    eval "upstream_args=(${UPSTREAM_ARGS:-})"
    timeout -s INT -k 30 "${UPSTREAM_TIMEOUT:-400}" $PYTHON tools/conformance.py \
        --test-dir .pytorch_tests/test/inductor --out "$OUT/upstream_tests.md" \
        --work-dir "$work" "${upstream_args[@]}" > "/tmp/upstream_tests.log" 2>&1
    echo "upstream tests exit status: $?"
    for record in "$work"/*/*/progress.jsonl; do
        [[ -e $record ]] || continue
        run=${record#"$work"/}
        run=${run%/progress.jsonl}
        cp "$record" "$OUT/progress.${run//\//.}.jsonl"
    done
    tail -40 /tmp/upstream_tests.log
fi

if has_step models; then
    echo "== real models on CUDA, started $(date +%T)"
    eval "models_args=(${MODELS_ARGS:-})"
    timeout -s INT -k 30 "${MODELS_TIMEOUT:-400}" $PYTHON benchmarks/model_sweep.py \
        --device cuda --out "$OUT/models" "${models_args[@]}" > /tmp/models.log 2>&1
    echo "model sweep exit status: $?"
    cp /tmp/models.log "$OUT/models/"
    grep -E "^\[" /tmp/models.log | tail -30
fi

for pid in "${pids[@]}"; do wait "$pid"; done
echo "== done $(date +%T)"
