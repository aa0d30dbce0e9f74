#!/bin/bash
# Final issue-11 measurements, part B: prefill of the three models, qwen3's knockout.
export PYTHONPATH=.
mkdir -p $OUT/r
for m in qwen3-4b llama-3.2-3b gemma-3-1b; do
  s=$(date +%s)
  timeout 150 python -m bench prefill --model $m --tokens 64,128,256,512 --peers none --out $OUT/r > $OUT/r/prefill-$m.log 2>&1
  echo "prefill $m rc=$? $(( $(date +%s) - s )) s"
  grep -E "^\| (piecewise|full_graph) \|" $OUT/r/prefill-$m.md 2>/dev/null
done
s=$(date +%s)
timeout 200 python -m bench knockout --model qwen3-4b --out $OUT/r > $OUT/r/knockout-qwen3-4b.log 2>&1
echo "knockout rc=$? $(( $(date +%s) - s )) s"; cat $OUT/r/knockout-qwen3-4b.md 2>/dev/null | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
