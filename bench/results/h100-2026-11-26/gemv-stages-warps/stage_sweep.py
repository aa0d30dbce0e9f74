"""Scratch: each batch-1 table entry's num_stages / num_warps neighbours, timed in the decode graph."""
import dataclasses, json, sys, time
sys.path.insert(0, ".")
import torch
from bench import gemv_graph
from bench.common import build_model
from bench.decode import graph_replay_ms
from custom_ops import gemv_table
from engine import LLM

model = sys.argv[1]
net = build_model(model)
llm = LLM(net, max_num_seqs=1, max_model_len=576 + 64, prefill_graphs=False, show_progress=False, decode_graph_sizes=(1,))
runner = llm.runtime.runner
table = gemv_table.GEMV_CONFIGS

def replay():
    with torch.inference_mode():
        runner.decode_graphs.capture((1,), False)
        return graph_replay_ms(runner, net.config.vocab_size, 1, 576, 200)

base = [replay()]
rows = []
for shape in gemv_graph.model_shapes(net):
    entry = table[shape]
    cands = [dataclasses.replace(entry, num_stages=s) for s in (1, 2, 4) if s != entry.num_stages]
    cands += [dataclasses.replace(entry, num_warps=w) for w in (2, 8) if w != entry.num_warps]
    for c in cands:
        table[shape] = c
        try:
            ms = replay()
        finally:
            table[shape] = entry
        rows.append(dict(shape=shape, config=c.label() + f"st{c.num_stages}", ms=ms))
    base.append(replay())
llm.close()
b = sorted(base)[len(base) // 2]
print(json.dumps(dict(model=model, base=base)))
for r in rows:
    print(f"{model} {r['shape']} {r['config']} {1e3 * (r['ms'] - b):+.1f} us")
