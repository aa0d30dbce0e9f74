#!/usr/bin/env bash
# Execute the three notebooks on the GPU machine (no Jupyter there) and leave them, with their
# outputs, under $OUT/nb/. Usage: bash bench/notebooks/run_gpu.sh SECONDS_PER_NOTEBOOK
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 MPLBACKEND=Agg
mkdir -p "$OUT/nb"
for nb in profile_steps capture_cost graph_coverage; do
  start=$(date +%s)
  timeout "${1:-150}" python3 bench/notebooks/execute.py "bench/notebooks/$nb.ipynb" "$OUT/nb/$nb.ipynb"
  echo "notebook $nb rc=$? in $(( $(date +%s) - start ))s"
done
