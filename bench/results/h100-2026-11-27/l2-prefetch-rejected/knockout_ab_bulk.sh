#!/bin/bash
export PYTHONPATH=.
for m in qwen3-4b gemma-3-1b; do
  for v in 0 bulk bulk_after 0 bulk; do
    s=$(date +%s)
    r=$(INFER_GRAPHS_L2_PREFETCH=$v timeout 120 python -m bench.knockout $m none 576 2>&1 | grep -E "replay_ms|Error" | tail -1)
    echo "$m $v $r ($(( $(date +%s) - s )) s)"
  done
done
