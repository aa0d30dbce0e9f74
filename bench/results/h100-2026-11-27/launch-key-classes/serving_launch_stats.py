"""Launch-cache hits and misses while an engine serves prompts of varying lengths (gemma-3-1b)."""
import sys, time, random, torch
from bench.common import build_model
from bench.paged import BLOCK_SIZE
from engine import LLM, SamplingParams
from custom_ops import triton_launch
model = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-1b"
net = build_model(model)
llm = LLM(net, max_num_seqs=16, max_model_len=1024 + 64, block_size=BLOCK_SIZE, prefill_graphs=True, show_progress=False)
rng = random.Random(0)
vocab = net.config.vocab_size
def prompts(n):
    return [[rng.randrange(vocab) for _ in range(rng.randint(16, 900))] for _ in range(n)]
llm.generate(prompts(4), SamplingParams(max_tokens=4, ignore_eos=True))
before = dict(triton_launch.stats)
t0 = time.perf_counter()
for _ in range(4):
    outs = llm.generate(prompts(16), SamplingParams(max_tokens=16, ignore_eos=True))
wall = time.perf_counter() - t0
d = {k: triton_launch.stats[k] - before[k] for k in before}
stats = llm.stats()
print(f"{model}: 64 prompts of 16-900 tokens, 16 out, 4 generate calls: {wall:.2f} s; launch cache {d}; "
      f"steps by mode {stats['modes']}; TTFT median {sorted(o.ttft_s for o in outs)[8] * 1e3:.1f} ms (last call)", flush=True)
llm.close()
