"""Per-step host time of LLM.generate's overlapped loop by part (medians), no profiler."""
import statistics, sys, time, collections
import torch
from bench.common import build_model
from engine import LLM, SamplingParams
import engine.overlap as ov
from engine.config import default_decode_graph_sizes

model = sys.argv[1]
batches = [int(b) for b in sys.argv[2].split(",")]
T = collections.defaultdict(list)

def timed(obj, name, key=None):
    fn = getattr(obj, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[key or name].append(time.perf_counter() - t)
    setattr(obj, name, wrapper)

net = build_model(model)
llm = LLM(net, max_num_seqs=max(batches), max_model_len=512 + 160, block_size=16, prefill_graphs=True,
          show_progress=False, decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(max(batches))) | set(batches))))
loop = llm._overlap
runner = llm.runtime.runner
timed(loop.scheduler, "schedule", "1 schedule")
timed(loop, "_launch", "2 _launch (all)")
timed(runner, "_prepare", "2a runner._prepare")
timed(runner.buffers, "load", "2b buffers.load")
timed(runner.decode_graphs, "replay", "2c graph.replay")
timed(llm.runtime.sampler, "sample", "2d sampler.sample")
timed(loop._read_back, "copy", "2e read_back.copy")
timed(loop, "_advance", "2f _advance")
timed(loop, "_resolve", "3 _resolve (all)")
timed(loop, "_publish", "4 _publish")
timed(llm, "_detokenize", "5 _detokenize")
timed(llm, "_step", "0 LLM._step")
Ev = torch.cuda.Event
orig_sync = Ev.synchronize
def sync(self):
    t = time.perf_counter(); orig_sync(self); T["3a event wait"].append(time.perf_counter() - t)
Ev.synchronize = sync
vocab = net.config.vocab_size
g = torch.Generator().manual_seed(0)
for b in batches:
    prompts = lambda: torch.randint(0, vocab, (b, 512), generator=g).tolist()
    llm.generate(prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
    T.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts(), SamplingParams(max_tokens=128, ignore_eos=True))
    total = time.perf_counter() - t
    itl = statistics.median(x for o in outs for x in o.inter_token_latencies_s[8:]) * 1e3 if hasattr(outs[0], "inter_token_latencies_s") else float("nan")
    print(f"===== {model} batch {b}: per step {total/128*1e3:.3f} ms, ITL median {itl:.3f} ms")
    for k, v in sorted(T.items()):
        print(f"  {k:22s} n={len(v):4d} median {statistics.median(v)*1e6:8.1f} us  mean {statistics.mean(v)*1e6:8.1f} us")
llm.close()
