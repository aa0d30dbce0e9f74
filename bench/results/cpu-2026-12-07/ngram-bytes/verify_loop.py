"""The step loop's host time per step, plain decode against prompt-lookup verify steps (k = 4, every
proposal accepted), batch 1, the forward and the LM head replaced by a fixed next-token rule (CPU).

The "model" continues a cycle of 50 tokens; the prompt is the cycle twice, so prompt lookup finds each
continuation 50 tokens back and proposes 4 tokens the rule accepts."""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
cfg = null_forward_config(load_config("llama-3.2-3b")); cfg["vocab_size"] = 4096
CYCLE = 50
SUCC = torch.arange(4096); SUCC[100:100 + CYCLE] = 100 + (torch.arange(CYCLE) + 1) % CYCLE
def engine(spec):
    net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
    llm = LLM(net, max_num_seqs=4, max_model_len=2048, block_size=16, show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3} if spec else None)
    runner = llm.runtime.runner
    H = torch.zeros(8192, cfg["hidden_size"])
    def forward(meta, mode, n):
        H[:n, 0] = runner.buffers.input_ids[:n].float()  # each row carries its token to the "LM head"
        return H[:n]
    def logits(h):
        out = torch.zeros(h.shape[0], 4096)
        out[torch.arange(h.shape[0]), SUCC[h[:, 0].long()]] = 1.0
        return out
    runner.run_forward = forward
    runner.model.compute_logits = logits
    return llm
prompt = [100 + i for i in range(CYCLE)] * 2
sp = SamplingParams(max_tokens=600, ignore_eos=True)
for spec in (False, True):
    llm = engine(spec)
    res, toks = [], []
    for rep in range(6):
        steps0 = llm.num_steps
        s = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        dt = time.perf_counter() - s
        if rep:
            res.append(dt / (llm.num_steps - steps0) * 1e6)
            toks.append(len(out.token_ids) / (llm.num_steps - steps0))
    assert out.token_ids[:3] == [100, 101, 102], out.token_ids[:5]
    print(f"{'verify (k=4)' if spec else 'plain decode'}: {statistics.median(res):.1f} us/step "
          f"({' '.join(f'{r:.1f}' for r in res)}), {statistics.median(toks):.2f} tokens/step")
    llm.close()
