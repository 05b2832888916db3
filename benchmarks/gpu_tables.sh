#!/usr/bin/env bash
# The GPU tables in one run of under 10 minutes, for the day a GPU is at hand (never part of CI).
#
#   benchmarks/gpu_tables.sh [OUT_DIR]        (default benchmarks/results/gpu)
#
# Needs a Python whose jax runs on a CUDA GPU (PY=..., default python3; e.g. a venv with
# `pip install -e ".[test]" "jax[cuda12]"`), and nothing from the network. Writes, into OUT_DIR:
#   gpu_machine.txt                 the GPU, driver, jax version, load, time
#   segment_gpu.{json,md}           A.T.mv: scatter-add vs per-target segment sum (bench_segment.py),
#                                   uniform / sorted / skewed / one-target lines: the measurement
#                                   that decides whether `segment_key` should be the GPU default
#   los_parity.{json,md}            the LOS operator against hand-written and unchunked JAX
#                                   (bench_los_parity.py, the cancellation-free weights)
# Each step has its own time limit (5 + 4 minutes); a step that runs out leaves the others' files.
# CHUNKOP_GPU_TABLES_ON_CPU=1 runs the same steps at small sizes on a CPU (to check the script).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/gpu}"
PY="${PY:-python3}"
mkdir -p "$OUT"
if [ "${CHUNKOP_GPU_TABLES_ON_CPU:-0}" = 1 ]; then
    N_LOS=65536 REPEATS=3
else
    N_LOS=1048576 REPEATS=7
    if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
        echo "gpu_tables.sh: $PY's jax has no GPU backend (jax.default_backend() is not 'gpu');" \
            "install jax[cuda12] there, or set CHUNKOP_GPU_TABLES_ON_CPU=1 to check the script on a CPU." >&2
        exit 2
    fi
fi
{
    date -u
    uptime
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'
} > "$OUT/gpu_machine.txt" 2>&1
status=0
timeout 300 "$PY" benchmarks/bench_segment.py --n-los "$N_LOS" --repeats "$REPEATS" --out "$OUT" || status=$?
timeout 240 "$PY" benchmarks/bench_los_parity.py --n-los "$N_LOS" --repeats "$REPEATS" --forms expm1 --out "$OUT" ||
    status=$?
uptime >> "$OUT/gpu_machine.txt"
ls -l "$OUT"
exit "$status"
