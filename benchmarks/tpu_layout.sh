#!/usr/bin/env bash
# Issue #40 on the lent TPU v5e (benchmarks/RESULTS.md, "Windowed rows"), from the repository
# root, with the project's pure-Python dependencies carried as wheels in .whl-tpu/ (README.md of
# benchmarks/, "On a TPU"): `bash benchmarks/tpu_layout.sh scale` (54M lines, chunk 4096, with
# a few solver iterations), then `bash benchmarks/tpu_layout.sh rest` ("auto" at 54M lines, the
# seed's 132400 lines at 516 and 512 bins, 3.9M lines). Results in $OUT (or benchmarks/results/tpu).
set -uo pipefail
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results/tpu}"
uptime
case "${1:-scale}" in
scale)
    python3 benchmarks/bench_layout.py --lines 54000000 --n-pix 786432 --n-bins 516 --chunk 4096 --rounds 2 \
        --solve --out "$out"
    ;;
rest)
    python3 benchmarks/bench_layout.py --lines 54000000 --n-pix 786432 --n-bins 516 --chunk auto --rounds 2 \
        --which sorted --out "$out"
    python3 benchmarks/bench_layout.py --lines 132400 --n-pix 786432 --n-bins 516,512 --chunk 4096 --rounds 5 \
        --which plain,windowed,sorted --out "$out"
    python3 benchmarks/bench_layout.py --lines 3932160 --n-pix 786432 --n-bins 516 --chunk 4096 --rounds 3 \
        --which plain,windowed,sorted,floor --out "$out"
    ;;
esac
uptime
