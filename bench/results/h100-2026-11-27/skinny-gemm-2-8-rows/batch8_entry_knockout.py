"""gemma-3-1b decode graph at 4 and 8 rows: the table as is, then each shape's 2-8-row entry removed
(cuBLAS) in turn, re-captured; median replay ms."""
import sys, torch
from bench.common import build_model
from bench.decode import graph_replay_ms
from custom_ops import gemv_table
from engine import LLM
model = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-1b"
net = build_model(model)
llm = LLM(net, max_num_seqs=8, max_model_len=576 + 64, prefill_graphs=False, show_progress=False, decode_graph_sizes=(4, 8))
runner = llm.runtime.runner
def replay(b):
    with torch.inference_mode():
        runner.decode_graphs.capture((4, 8), False)
        return graph_replay_ms(runner, net.config.vocab_size, b, 576, 100)
def both():
    return " ".join(f"b{b} {replay(b):.4f}" for b in (4, 8))
print("table as is:", both(), flush=True)
for shape, by_rows in list(gemv_table.SKINNY_CONFIGS.items()):
    if 8 not in by_rows or shape not in {tuple(m.weight.shape) for m in net.modules() if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2}:
        continue
    entry = by_rows.pop(8)
    try:
        print(f"without {shape} (was {getattr(entry, 'label', lambda: entry)()}):", both(), flush=True)
    finally:
        by_rows[8] = entry
print("table as is:", both(), flush=True)
llm.close()
