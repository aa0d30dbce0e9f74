"""LLM.step() (the server's path: an output per request per step) on the CPU with the forward stubbed:
median us per step over 5 runs of 150 decode steps at batch 64 (after one warm-up run).

    python step_bench.py plain|process [REPO]   (process: the Gemma tokenizer, 2 stop strings, the front end's process)"""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "/work/main")
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
from bench.frontend import load_tokenizer, STOP_STRINGS
variant = sys.argv[1]
cfg = null_forward_config(load_config("llama-3.2-3b")); cfg["vocab_size"] = 4096
net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
tok = load_tokenizer("/work/main/bench/.tokenizer", 4096) if variant != "plain" else None
B = 64
llm = LLM(net, tokenizer=tok, max_num_seqs=B, max_model_len=1024, block_size=16, show_progress=False,
          frontend_process=variant == "process")
H = torch.zeros(8192, cfg["hidden_size"]); g = torch.Generator().manual_seed(0); L = torch.randn(B, 4096, generator=g)
llm.runtime.runner.run_forward = lambda meta, mode, n: H[:n]
llm.runtime.runner.model.compute_logits = lambda h: L[:h.shape[0]]
sp = SamplingParams(max_tokens=400, ignore_eos=True, stop=list(STOP_STRINGS) if tok else None)
res = []
for rep in range(6):
    for i in range(B): llm.add_request(torch.randint(0, 4096, (300,), generator=g).tolist(), sp)
    for _ in range(40): llm.step()
    t = time.perf_counter()
    for _ in range(150): llm.step()
    dt = (time.perf_counter() - t) / 150 * 1e6
    while llm.has_unfinished_requests(): llm.step()
    if rep: res.append(dt)
print(f"{variant}: step() {statistics.median(res):.1f} us/step ({' '.join(f'{r:.0f}' for r in res)})")
llm.close()
