#!/usr/bin/env bash
# The whole GPU check in one go, for one call of the device tool:
#   the runtime extension's build, tests/test_gpu.py, the profile of one call
#   (scripts/gpu/profile_call.py) and the benchmark (python benchmarks/bench.py
#   --device cuda).
# Logs and results go under $OUT (default /tmp/cppwrap_gpu_out).
#
#   PYTHONUNBUFFERED=1 bash scripts/gpu/run_all.sh 2>&1 | tee $OUT/log
#
# Knobs: STEPS (default "tests bench"; add "profile", "compile-profile"
# (a cold compile per workload and mode under cProfile,
# scripts/gpu/profile_compile.py, with COMPILE_PROFILE_ARGS and
# COMPILE_PROFILE_TIMEOUT), or "cores" for the
# host's speed on each CPU (scripts/gpu/host_cores.py); "dist-tests" and
# "dist-bench" need two GPUs: tests/test_distributed.py on NCCL and
# benchmarks/bench_tp.py), TEST_TIMEOUT, TEST_WORKERS, PROFILE_TIMEOUT,
# PROFILE_ARGS, BENCH_TIMEOUT, BENCH_ARGS (passed to the bench, e.g.
# --workloads seed --quick; the real-model table: --modes
# python,upstream,cppwrap,cppwrap-no-replay,reduce-overhead --jobs 3
# --warm-jobs 2 --quick, three models a call (282-315 s of bench in session
# 33, upstream's cold steps 39-48 s, its warm ones 23-30 s; all eight models
# in three calls back to back); rows are written as each step ends),
# TIMING_CPU (the bench's and profile_call.py's --timing-cpu: a CPU, or
# "auto" for the fastest one by host_cores.py),
# SETTLE_S (the bench's --settle-s, default 10: each warm process waits up
# to that long for the host's other processes to fall quiet before it times),
# DIST_TEST_TIMEOUT, DIST_BENCH_TIMEOUT,
# DIST_BENCH_ARGS (passed to bench_tp.py, e.g. --blocks 4).
set -u -o pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
# Inductor probes the host's vector ISAs by building and loading test programs
# in a fresh `python -c "import torch ..."` each, ~20 s apiece on that machine,
# in every process whose first C++ build it is; with CUDA graphs there is no
# C++ kernel for the ISA to matter to.  Trust /proc/cpuinfo instead (applies
# to every mode of the benchmark alike).
export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-1}

echo "== machine"
nvidia-smi -L || true
$PYTHON -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name(0), "devices:", torch.cuda.device_count(), "bytecode written:", not sys.dont_write_bytecode, "under", sys.pycache_prefix)'
g++ --version | head -1
nproc

echo "== runtime extension and precompiled headers (built once per Inductor cache)"
$PYTHON -c '
import time
from torch_cppwrap._inductor.codecache import prepare_runtime
start = time.perf_counter()
prepare_runtime("cuda")
prepare_runtime("cpu")
print(f"runtime extension and headers ready in {time.perf_counter() - start:.1f} s")'

has_step() { [[ " ${STEPS:-tests bench} " == *" $1 "* ]]; }

# One timing CPU for the profile and the bench alike.
if [[ "${TIMING_CPU:-}" == auto ]]; then
    TIMING_CPU=$($PYTHON scripts/gpu/host_cores.py --print-fastest)
fi

if has_step cores; then
    echo "== the host's speed on each CPU (scripts/gpu/host_cores.py), two processes"
    $PYTHON scripts/gpu/host_cores.py --out "$OUT/host_cores.json"
    $PYTHON scripts/gpu/host_cores.py
fi

if has_step tests; then
    echo "== tests/test_gpu.py"
    timeout "${TEST_TIMEOUT:-270}" $PYTHON -X faulthandler -m pytest tests/test_gpu.py -v -rfEs \
        --tb=short -p no:cacheprovider -n "${TEST_WORKERS:-4}" 2>&1 | tee "$OUT/pytest.log"
    echo "tests exit status: $?"
fi

if has_step profile; then
    echo "== where a call's time goes (scripts/gpu/profile_call.py)"
    timeout "${PROFILE_TIMEOUT:-200}" $PYTHON scripts/gpu/profile_call.py --out "$OUT/profile" \
        ${TIMING_CPU:+--timing-cpu $TIMING_CPU} ${PROFILE_ARGS:-}
    echo "profile exit status: $?"
    # Four files per model and mode: the device tool brings back at most 8
    # files from $OUT, so they travel as one archive (profile.md stays out).
    cp "$OUT/profile/profile.md" "$OUT/profile.md" 2>/dev/null
    tar -czf "$OUT/profile.tar.gz" -C "$OUT" profile && rm -rf "$OUT/profile"
fi

if has_step compile-profile; then
    echo "== where a cold compile goes (scripts/gpu/profile_compile.py, cProfile)"
    timeout "${COMPILE_PROFILE_TIMEOUT:-300}" $PYTHON scripts/gpu/profile_compile.py \
        --out "$OUT/compile_profile" ${COMPILE_PROFILE_ARGS:-}
    echo "compile profile exit status: $?"
    tar -czf "$OUT/compile_profile.tar.gz" -C "$OUT" compile_profile && rm -rf "$OUT/compile_profile"
fi

if has_step bench; then
    echo "== benchmark (python benchmarks/bench.py --device cuda)"
    # One timing round per mode unless BENCH_ARGS asks for more: upstream's
    # warm compile alone takes ~27 s here, and a device call ends at 600 s.
    timeout "${BENCH_TIMEOUT:-400}" $PYTHON benchmarks/bench.py --device cuda \
        --out "$OUT/bench" --rounds 1 ${TIMING_CPU:+--timing-cpu $TIMING_CPU} \
        --settle-s "${SETTLE_S:-10}" \
        ${BENCH_ARGS:-}
    echo "benchmark exit status: $?"
fi

# NVLink multicast (NVLS) stays off for NCCL on this machine.
if has_step dist-tests; then
    echo "== tests/test_distributed.py on two GPUs (NCCL)"
    NCCL_NVLS_ENABLE=0 timeout "${DIST_TEST_TIMEOUT:-500}" $PYTHON -X faulthandler -m pytest \
        tests/test_distributed.py -v -rfEs --tb=short -p no:cacheprovider -k Cuda \
        2>&1 | tee "$OUT/pytest_distributed.log"
    echo "distributed tests exit status: $?"
fi

if has_step dist-bench; then
    echo "== tensor-parallel MLP benchmark (benchmarks/bench_tp.py, two GPUs)"
    NCCL_NVLS_ENABLE=0 timeout "${DIST_BENCH_TIMEOUT:-500}" $PYTHON benchmarks/bench_tp.py \
        --out "$OUT/bench_tp.json" ${DIST_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_tp.log"
    echo "tp benchmark exit status: $?"
fi
