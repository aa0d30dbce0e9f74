"""One device call: sweep the FP8 batch-1 GEMV tiles of llama-3.2-3b in its decode graph (bench
gemv_graph --quantization fp8: the base and every pick at once timed in the sweep's engine), then with
the picks in custom_ops.gemv_table.FP8_GEMV_CONFIGS (in this process) the decode suite's bf16 and FP8
rows next to their floors, and the FP8 GPU tests.
Usage: python bench/results/h100-2026-12-06/fp8-tiles/fp8_tiles.py OUT_DIR SWEEP_BUDGET_S [CANDIDATES]
CANDIDATES: tiles (the run here) or neighbours, the second pass: each entry's tile (FP8_GEMV_TUNED once
the first pass's picks are in it) with other stages and warps."""
import json
import sys

import pytest

from bench import decode, gemv_graph
from custom_ops import gemv_table
from custom_ops.gemv_table import GemvConfig

out, budget = sys.argv[1], float(sys.argv[2])
candidates = sys.argv[3] if len(sys.argv) > 3 else "tiles"
sweep = gemv_graph.run("llama-3.2-3b", time_budget_s=budget, quantization="fp8", candidate_set=candidates)
sweep.write(out)
print(sweep.markdown(), flush=True)
picks = {tuple(int(v) for v in shape.split("x")): GemvConfig(**cfg)
         for shape, cfg in sweep.meta["pick_configs"].items()}
print("picks", picks, flush=True)
gemv_table.FP8_GEMV_CONFIGS.update(picks)
code = pytest.main(["-q", "tests/test_fp8_gpu.py", "-o", "faulthandler_timeout=120"])
print("fp8 GPU tests exit code", int(code), flush=True)
after = decode.run("llama-3.2-3b", batches="1,16", contexts="512", peers="none", quantization="fp8")
print(after.markdown(), flush=True)
with open(f"{out}/decode-with-picks.md", "w") as f:
    f.write(after.markdown())
json.dump({"picks": sweep.meta["pick_configs"], "fp8_gpu_tests_exit": int(code)}, open(f"{out}/picks.json", "w"))
