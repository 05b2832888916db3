#!/usr/bin/env bash
# Run JAX's vmap test files twice (plain jax.vmap, then chunkop.vmap(chunk_size=2)) and compare.
# Usage: benchmarks/jax_suite/run.sh [DIR] [FILE...]   (DIR defaults to /tmp/jax_tests; see README.md)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PY:-$HERE/../../.venv/bin/python}"
DIR="${1:-/tmp/jax_tests}"; shift || true
FILES=("$@"); [ ${#FILES[@]} -eq 0 ] && FILES=(batching_test lax_vmap_test custom_api_test)
export JAX_NUM_GENERATED_CASES="${JAX_NUM_GENERATED_CASES:-5}"
cp "$HERE/conftest.py" "$DIR/conftest.py"
mkdir -p "$DIR/out"
cd "$DIR"
for f in "${FILES[@]}"; do  # one at a time: the machine has 2 cores
  for mode in base swap; do
    swap=0; [ "$mode" = swap ] && swap=1
    CHUNKOP_SWAP=$swap CHUNKOP_CALLS="out/calls_${mode}_${f}.json" "$PY" -m pytest "$f.py" -n 0 \
      -p no:cacheprovider -q --junitxml="out/${mode}_${f}.xml" > "out/${mode}_${f}.log" 2>&1
    tail -1 "out/${mode}_${f}.log"
  done
done
"$PY" "$HERE/compare.py" "$DIR/out" "${FILES[@]}"
