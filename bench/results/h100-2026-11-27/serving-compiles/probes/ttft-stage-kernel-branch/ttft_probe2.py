"""python .scratch/ttft_probe2.py: e2e's engine and workload (gemma-3-1b, batches 16 then 64, 512-token
prompts, 128 tokens out); prints TTFT per generate, then per-step host timing of one b64 generate:
interval between execute() calls and time inside execute, by step kind, for the first 40 steps."""
import sys, statistics, time, torch
from bench.common import build_model
from bench.paged import BLOCK_SIZE
from engine import LLM, SamplingParams
from engine.config import default_decode_graph_sizes

net = build_model("gemma-3-1b")
llm = LLM(net, max_num_seqs=64, max_model_len=512 + 128 + BLOCK_SIZE, block_size=BLOCK_SIZE, prefill_graphs=True,
          show_progress=False, decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(64)) | {16, 64})))
g = torch.Generator().manual_seed(0)
vocab = net.config.vocab_size
prompts = lambda b: torch.randint(0, vocab, (b, 512), generator=g).tolist()
for b in (16, 64):
    llm.generate(prompts(b), SamplingParams(max_tokens=8, ignore_eos=True))
    for rep in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts(b), SamplingParams(max_tokens=128, ignore_eos=True))
        print(f"b{b} rep {rep}: wall {1e3 * (time.perf_counter() - t):.1f} ms, TTFT median "
              f"{1e3 * statistics.median(o.ttft_s for o in outs):.1f} ms, max {1e3 * max(o.ttft_s for o in outs):.1f}")
runner = llm.runtime.runner
orig = runner.execute
log = []
def timed(out, *a, **k):
    t0 = time.perf_counter()
    r = orig(out, *a, **k)
    log.append((t0, time.perf_counter(), out.num_tokens, out.is_uniform_decode, len(out.chunks)))
    return r
runner.execute = timed
t = time.perf_counter()
outs = llm.generate(prompts(64), SamplingParams(max_tokens=128, ignore_eos=True))
print(f"timed b64: TTFT median {1e3 * statistics.median(o.ttft_s for o in outs):.1f} ms")
prev = None
for i, (s, e, n, dec, c) in enumerate(log[:45]):
    print(f"step {i:3d} {'FULL ' if dec else 'mixed'} tokens {n:5d} chunks {c:3d} start +{1e3*(s - t):8.2f} ms "
          f"gap {1e3*(s - prev) if prev else 0:7.2f} ms in-execute {1e3*(e - s):6.2f} ms")
    prev = e
llm.close()
