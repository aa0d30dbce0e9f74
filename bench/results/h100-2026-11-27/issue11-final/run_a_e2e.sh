#!/bin/bash
# Final issue-11 measurements, part A: e2e of the three models at HEAD, one machine.
export PYTHONPATH=.
mkdir -p $OUT/r
for m in llama-3.2-3b qwen3-4b gemma-3-1b; do
  s=$(date +%s)
  timeout 200 python -m bench e2e --model $m --peers none --out $OUT/r > $OUT/r/e2e-$m.log 2>&1
  echo "e2e $m rc=$? $(( $(date +%s) - s )) s"
  grep -E "^\| (1|16|64) \|" $OUT/r/e2e-$m.md 2>/dev/null
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
