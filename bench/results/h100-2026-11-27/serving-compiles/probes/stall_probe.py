"""Where the one-off stall of the first measured batch-64 generate goes (gemma-3-1b, e2e's engine and
workload). A thread samples the main thread's stack every 2 ms while a step has run > 20 ms."""
import collections, statistics, sys, threading, time, traceback, torch
from bench.common import build_model
from bench.paged import BLOCK_SIZE
from engine import LLM, SamplingParams
from engine.config import default_decode_graph_sizes

net = build_model("gemma-3-1b")
llm = LLM(net, max_num_seqs=64, max_model_len=512 + 128 + BLOCK_SIZE, block_size=BLOCK_SIZE, prefill_graphs=True,
          show_progress=False, decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(64)) | {16, 64})))
main_id = threading.get_ident()
state = {"t0": None, "step": 0}
samples = collections.Counter()
slow = []
def sampler():
    while not state.get("stop"):
        time.sleep(0.002)
        t0 = state["t0"]
        if t0 is not None and time.perf_counter() - t0 > 0.02:
            frame = sys._current_frames().get(main_id)
            if frame is not None:
                st = traceback.extract_stack(frame)
                key = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in reversed(st[-14:]))
                samples[key] += 1
threading.Thread(target=sampler, daemon=True).start()
orig = llm._step
def step():
    state["t0"] = time.perf_counter()
    try:
        return orig()
    finally:
        d = time.perf_counter() - state["t0"]
        state["t0"] = None
        state["step"] += 1
        if d > 0.02:
            slow.append((state["step"], round(d * 1e3, 1)))
llm._step = step
g = torch.Generator().manual_seed(0)
for b in (16, 64):
    llm.generate(torch.randint(0, net.config.vocab_size, (b, 512), generator=g).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
    for rep in range(3):
        slow.clear(); samples_before = sum(samples.values())
        t0 = time.perf_counter()
        outs = llm.generate(torch.randint(0, net.config.vocab_size, (b, 512), generator=g).tolist(),
                            SamplingParams(max_tokens=128, ignore_eos=True))
        print(f"b{b} rep {rep}: wall {1e3*(time.perf_counter()-t0):.0f} ms, TTFT median "
              f"{1e3*statistics.median(o.ttft_s for o in outs):.1f} ms; steps > 20 ms (step no, ms): {slow[:10]}")
state["stop"] = True
print("stacks sampled during steps > 20 ms:")
for key, n in samples.most_common(8):
    print(f"{n:5d}  {key}\n")
llm.close()
