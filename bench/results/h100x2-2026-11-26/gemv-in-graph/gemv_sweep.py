"""In-graph GEMV config sweep: one engine, the batch-1 decode graph re-captured per candidate config
(one shape changed at a time), median replay at context 576. python .scratch/gemv_sweep.py MODEL"""
import json, sys, time
import torch
from bench.common import build_model
from bench.decode import graph_replay_ms
from custom_ops import gemv_table
from custom_ops.gemv_table import GemvConfig as C
from engine import LLM

model = sys.argv[1]
net = build_model(model)
vocab = net.config.vocab_size
llm = LLM(net, max_num_seqs=1, max_model_len=640, prefill_graphs=False, show_progress=False, decode_graph_sizes=(1,))
runner = llm.runtime.runner
base = dict(gemv_table.GEMV_CONFIGS)
shapes = {(n, k) for (n, k) in base}
used = []
# shapes this model has: find by its linear weights
for mod in net.modules():
    w = getattr(mod, "weight", None)
    if w is not None and w.dim() == 2 and tuple(w.shape) in shapes and tuple(w.shape) not in used:
        used.append(tuple(w.shape))

CANDIDATES = [C(4, 512, 1), C(8, 256, 1), C(8, 512, 1), C(8, 1024, 1), C(16, 256, 1), C(16, 512, 1), C(32, 256, 1),
              C(8, 512, 2), C(16, 256, 2), C(16, 512, 2), C(16, 256, 4), C(8, 512, 4), C(32, 256, 4),
              C(16, 256, 8), C(8, 512, 1, num_warps=8), C(16, 512, 1, num_warps=8)]

if len(sys.argv) > 3:  # a short list
    CANDIDATES = [C(16, 512, 1), C(8, 1024, 1), C(4, 512, 1), C(16, 512, 1, num_warps=8), C(8, 256, 1), C(8, 512, 1)]

def measure():
    with torch.inference_mode():
        runner.decode_graphs.capture((1,), False)
        return graph_replay_ms(runner, vocab, 1, 576, 200)

def log(**kw):
    print(json.dumps(kw), flush=True)

t0 = time.time()
log(kind="base", ms=measure())
for shape in used:
    k = shape[1]
    for cand in CANDIDATES:
        if cand == base[shape] or cand.block_k * cand.split_k > 4 * k:
            continue
        gemv_table.GEMV_CONFIGS[shape] = cand
        try:
            ms = measure()
        except Exception as exc:  # a config the kernel refuses: report and go on
            log(kind="error", shape=shape, config=cand.label(), error=str(exc)[:200])
            ms = None
        gemv_table.GEMV_CONFIGS[shape] = base[shape]
        log(kind="cand", shape=shape, config=cand.label(), ms=ms)
        if time.time() - t0 > float(sys.argv[2] if len(sys.argv) > 2 else 200):
            break
    log(kind="base", ms=measure(), after=shape)
llm.close()
