#!/usr/bin/env bash
# Run JAX's vmap test files twice (plain jax.vmap, then chunkop.vmap(chunk_size=2)) and compare.
# Usage: benchmarks/jax_suite/run.sh [DIR] [FILE...]   (DIR defaults to /tmp/jax_tests; see README.md)
# Environment:
#   JAX_NUM_GENERATED_CASES  default 5 (the same in both runs)
#   CHUNKOP_REV   the commit of this repository whose chunkop is measured (default HEAD): its src/ is
#                 exported to DIR/out/chunkop_src and put first on PYTHONPATH, so edits to src/ while
#                 the (long) runs go on do not leak into them; "worktree" measures the working tree.
#   MODES         default "base swap"; "swap" reruns only the chunkop runs (the base runs do not
#                 import chunkop, so a new chunkop commit needs only those)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DIR="${1:-/tmp/jax_tests}"; shift || true
FILES=("$@"); [ ${#FILES[@]} -eq 0 ] && FILES=(batching_test lax_vmap_test custom_api_test api_test lax_control_flow_test)
export JAX_NUM_GENERATED_CASES="${JAX_NUM_GENERATED_CASES:-5}"
REV="${CHUNKOP_REV:-HEAD}"
MODES="${MODES:-base swap}"
cp "$HERE/conftest.py" "$DIR/conftest.py"
mkdir -p "$DIR/out"
if [ "$REV" != worktree ]; then
  rm -rf "$DIR/out/chunkop_src" && mkdir -p "$DIR/out/chunkop_src"
  git -C "$ROOT" archive "$REV" src | tar -x -C "$DIR/out/chunkop_src"
  export PYTHONPATH="$DIR/out/chunkop_src/src${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  echo "date: $(date -u +%FT%TZ)"
  echo "chunkop: $([ "$REV" = worktree ] && echo "working tree of $(git -C "$ROOT" rev-parse HEAD) ($(git -C "$ROOT" status --short src | wc -l) files changed under src/)" || git -C "$ROOT" rev-parse "$REV")"
  echo "chunkop imported from: $(cd "$DIR" && "$PY" -c 'import chunkop; print(chunkop.__file__)')"
  echo "jax: $("$PY" -c 'import jax, jaxlib; print(jax.__version__, "jaxlib", jaxlib.__version__)')"
  echo "JAX_NUM_GENERATED_CASES=$JAX_NUM_GENERATED_CASES modes: $MODES"
  for f in "${FILES[@]}"; do echo "sha256 $(sha256sum "$DIR/$f.py" | cut -d' ' -f1) $f.py"; done
} > "$DIR/out/provenance_$(echo $MODES | tr ' ' '_').txt"
cat "$DIR/out/provenance_$(echo $MODES | tr ' ' '_').txt"
cd "$DIR"
for f in "${FILES[@]}"; do  # one at a time: the machine has 2 cores
  for mode in $MODES; do
    swap=0; [ "$mode" = swap ] && swap=1
    CHUNKOP_SWAP=$swap CHUNKOP_CALLS="out/calls_${mode}_${f}.json" "$PY" -m pytest "$f.py" -n 0 \
      -p no:cacheprovider -q --junitxml="out/${mode}_${f}.xml" > "out/${mode}_${f}.log" 2>&1
    echo "$mode $f: $(tail -1 "out/${mode}_${f}.log")"
  done
done
"$PY" "$HERE/compare.py" "$DIR/out" "${FILES[@]}" --categories "$HERE/categories.json"
