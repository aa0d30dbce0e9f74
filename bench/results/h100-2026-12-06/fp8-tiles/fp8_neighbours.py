"""The second pass, one device call: each FP8 entry's tile (FP8_GEMV_TUNED after the first pass, else the
bf16 table's) with other stages and warps (bench gemv_graph --quantization fp8 --candidates neighbours),
then with its picks in FP8_GEMV_CONFIGS (in this process) the FP8 GPU tests and the decode suite.
Usage: python bench/results/h100-2026-12-06/fp8-tiles/fp8_neighbours.py OUT_DIR SWEEP_BUDGET_S"""
import json
import sys

import pytest

from bench import decode, gemv_graph
from custom_ops import gemv_table
from custom_ops.gemv_table import GemvConfig

out, budget = sys.argv[1], float(sys.argv[2])
sweep = gemv_graph.run("llama-3.2-3b", time_budget_s=budget, quantization="fp8", candidate_set="neighbours")
sweep.write(out)
print(sweep.markdown(), flush=True)
picks = {tuple(int(v) for v in shape.split("x")): GemvConfig(**cfg)
         for shape, cfg in sweep.meta["pick_configs"].items()}
print("picks", picks, flush=True)
gemv_table.FP8_GEMV_CONFIGS.update(picks)
code = pytest.main(["-q", "tests/test_fp8_gpu.py", "tests/test_triton_gemv.py", "-o", "faulthandler_timeout=120"])
print("GPU tests exit code", int(code), flush=True)
after = decode.run("llama-3.2-3b", batches="1,16,64", contexts="512", peers="none", quantization="fp8")
print(after.markdown(), flush=True)
with open(f"{out}/decode-with-picks.md", "w") as f:
    f.write(after.markdown())
json.dump({"picks": sweep.meta["pick_configs"], "gpu_tests_exit": int(code)}, open(f"{out}/picks.json", "w"))
