#!/bin/bash
# L2 prefetch of o_proj during decode attention: knockout replay A/B
export PYTHONPATH=.
for m in qwen3-4b llama-3.2-3b gemma-3-1b; do
  for v in 0 start after 0 start; do
    s=$(date +%s)
    r=$(INFER_GRAPHS_L2_PREFETCH=$v timeout 120 python -m bench.knockout $m none 576 2>&1 | grep replay_ms | tail -1)
    echo "$m $v $r ($(( $(date +%s) - s )) s)"
  done
done
