"""Full-collection cost of a started engine, and the gen-2 collections during generate (gemma-3-1b, e2e's
engine and workload: batches 16 then 64, 512-token prompts, 128 tokens out)."""
import gc, sys, time, statistics, torch
from bench.common import build_model
from bench.paged import BLOCK_SIZE
from engine import LLM, SamplingParams
from engine.config import default_decode_graph_sizes

net = build_model("gemma-3-1b")
llm = LLM(net, max_num_seqs=64, max_model_len=512 + 128 + BLOCK_SIZE, block_size=BLOCK_SIZE, prefill_graphs=True,
          show_progress=False, decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(64)) | {16, 64})))
print("frozen objects", gc.get_freeze_count(), "tracked", len(gc.get_objects()))
for _ in range(2):
    t = time.perf_counter(); gc.collect(); print(f"full collection of the open engine: {1e3*(time.perf_counter()-t):.1f} ms")
events, start = [], {}
def cb(phase, info):
    if phase == "start":
        start[info["generation"]] = time.perf_counter()
    elif info["generation"] == 2:
        events.append((time.perf_counter(), 1e3 * (time.perf_counter() - start[2])))
gc.callbacks.append(cb)
g = torch.Generator().manual_seed(0)
for b in (16, 64):
    llm.generate(torch.randint(0, net.config.vocab_size, (b, 512), generator=g).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
    for rep in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(torch.randint(0, net.config.vocab_size, (b, 512), generator=g).tolist(),
                            SamplingParams(max_tokens=128, ignore_eos=True))
        gens = [(round(1e3 * (t - t0)), round(d, 1)) for t, d in events if t >= t0]
        print(f"b{b} rep {rep}: wall {1e3*(time.perf_counter()-t0):.0f} ms, TTFT median "
              f"{1e3*statistics.median(o.ttft_s for o in outs):.1f} ms; gen-2 collections (at ms, took ms): {gens}")
print("all gen-2 collections after start-up (took ms):", [round(d, 1) for _, d in events])
llm.close()
print("frozen after close", gc.get_freeze_count())
