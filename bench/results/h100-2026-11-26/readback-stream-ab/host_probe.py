"""Where a decode step's host time goes in LLM.generate (overlapped loop), no profiler: per-step
medians of each part, and the wait for the previous step's tokens (0 wait = the host is the bottleneck)."""
import statistics, sys, time, collections
sys.path.insert(0, ".")
import torch
from bench.common import build_model
from engine import LLM, SamplingParams
import engine.overlap as ov
from engine.config import default_decode_graph_sizes

model = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-1b"
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
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
timed(loop.scheduler, "schedule")
timed(loop, "_launch")
timed(loop, "_resolve")
timed(loop, "_publish")
timed(loop, "step", "overlap.step")
timed(llm, "_detokenize")
runner = llm.runtime.runner
timed(runner, "execute")
timed(llm.runtime.sampler, "sample")
timed(ov, "_read_back")
import engine.staging as stg
def h2d(values, dtype, device):
    t0 = time.perf_counter(); host = torch.tensor(values, dtype=dtype); t1 = time.perf_counter()
    ring = stg.ring_for(device); t2 = time.perf_counter()
    out = ring.to_device(host); t3 = time.perf_counter()
    T["h2d: torch.tensor"].append(t1 - t0); T["h2d: ring_for"].append(t2 - t1); T["h2d: to_device"].append(t3 - t2)
    return out
ov.host_to_device = h2d
timed(stg.PinnedRing, "_reserve", "ring._reserve")
_orig_to = torch.Tensor.to
timed(ov, "host_to_device")
timed(runner.decode_graphs, "replay", "graph.replay")
Ev = torch.cuda.Event
orig_sync = Ev.synchronize
def sync(self):
    t = time.perf_counter(); orig_sync(self); T["ready.synchronize"].append(time.perf_counter() - t)
Ev.synchronize = sync
timed(llm, "_step", "LLM._step")
vocab = net.config.vocab_size
g = torch.Generator().manual_seed(0)
for b in batches:
    prompts = lambda: torch.randint(0, vocab, (b, 512), generator=g).tolist()
    llm.generate(prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
    T.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts(), SamplingParams(max_tokens=128, ignore_eos=True))
    total = time.perf_counter() - t
    print(f"===== {model} batch {b}: generate {total*1e3:.1f} ms for 128 tokens; per step {total/128*1e3:.3f} ms")
    for k, v in sorted(T.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:22s} n={len(v):4d} median {statistics.median(v)*1e6:8.1f} us  mean {statistics.mean(v)*1e6:8.1f} us")
    print("ring waits", [r.waits for r in stg._rings.values()], "in flight", [len(r.in_flight) for r in stg._rings.values()])
llm.close()
