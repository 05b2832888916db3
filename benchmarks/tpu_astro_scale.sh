#!/usr/bin/env bash
# Issue #41 on the lent TPU v5e: the astro_los reconstruction (standard response, the 3-D prior) on
# the seed's sky grid (1024 x 768 pixels x 516 bins) with N synthetic stars, from the repository
# root, the project's pure-Python dependencies carried as wheels in .whl-tpu/ (benchmarks/README.md,
# "On a TPU"): `bash benchmarks/tpu_astro_scale.sh N [SAMPLES [LAYOUT [FLAGS...]]]` (FLAGS: more
# of reconstruct.py's, e.g. --no-demos: straight from the catalog to the reconstruction). The run's
# log and results.json (every stage's seconds, compiled memory, the fit against the truth) land in
# $OUT (or benchmarks/results/tpu) as astro_scale_N.{log,json}; its large outputs stay in /tmp.
set -uo pipefail
n="${1:?number of lines}"
samples="${2:-8}"
layout="${3:-auto}"
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results/tpu}"
mkdir -p "$out"
{ uptime; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } 2>&1 | tee "$out/astro_scale_${n}_$layout.log"
python3 examples/astro_los/reconstruct.py --size seed --n-los "$n" --samples "$samples" \
    --layout "$layout" --no-fit-s --no-figures --out /tmp/astro_scale "${@:4}" 2>&1 | tee -a "$out/astro_scale_${n}_$layout.log"
cp /tmp/astro_scale/results.json "$out/astro_scale_${n}_$layout.json" 2> /dev/null
uptime | tee -a "$out/astro_scale_${n}_$layout.log"
