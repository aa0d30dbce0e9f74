"""The engine's step loop alone on the CPU: the forward and the LM head replaced by fixed tensors, so a
step's time is the host's own (scheduling, staging, sampling's bookkeeping, the front end).

    python loop_bench.py MODEL plain|process|inline [REPO]   (MODEL: llama-3.2-3b, gemma-3-1b; REPO: the tree to time)

Batch 64, 300-token prompts, 200 tokens out, the model's config shrunk by bench.host.null_forward_config
with a 4,096-token vocabulary; `process` / `inline`: the Gemma tokenizer (bench/.tokenizer, made by
`python -m bench tokenizer`) and two stop strings, the front end in its process or on the step thread.
Prints the median inter-token latency of the decode steps of each of 5 generate calls (after one
warm-up call) and their median: the loop's time per step. One torch thread."""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else "/work/main")
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
from bench.frontend import load_tokenizer, STOP_STRINGS
model, variant = sys.argv[1], sys.argv[2]
cfg = null_forward_config(load_config(model)); cfg["vocab_size"] = 4096
net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
tok = load_tokenizer("/work/main/bench/.tokenizer", 4096) if variant != "plain" else None
B = 64
llm = LLM(net, tokenizer=tok, max_num_seqs=B, max_model_len=1024, block_size=16, show_progress=False,
          frontend_process=variant == "process")
H = torch.zeros(8192, cfg["hidden_size"])
g = torch.Generator().manual_seed(0)
L = torch.randn(B, 4096, generator=g)
llm.runtime.runner.run_forward = lambda meta, mode, n: H[:n]
llm.runtime.runner.model.compute_logits = lambda h: L[:h.shape[0]]
sp = SamplingParams(max_tokens=200, ignore_eos=True, stop=list(STOP_STRINGS) if tok else None)
res = []
for rep in range(6):
    outs = llm.generate(torch.randint(0, 4096, (B, 300), generator=g).tolist(), sp)
    if rep:
        gaps = sorted(x for o in outs for x in o.inter_token_latencies_s[5:] if x > 0)
        res.append(statistics.median(gaps) * 1e3)
print(f"{model} {variant}: loop {statistics.median(res):.3f} ms/step (runs {' '.join(f'{r:.3f}' for r in res)})")
llm.close()
