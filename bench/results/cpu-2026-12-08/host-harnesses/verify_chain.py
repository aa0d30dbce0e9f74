"""Exposed host chain of a verify step (CPU): from the host taking the previous verify step's tokens
(StepLoop._resolve) to the next step's graph launch (the fake verify graph's replay), batch 1, k = 4,
prompt lookup accepting every proposal; decode graphs and verify graphs faked so the runner takes the
GPU's FULL path. Also the whole step time."""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
from engine.worker.dispatch import Dispatcher
cfg = null_forward_config(load_config("llama-3.2-3b")); cfg["vocab_size"] = 4096
CYCLE = 50
SUCC = torch.arange(4096); SUCC[100:100 + CYCLE] = 100 + (torch.arange(CYCLE) + 1) % CYCLE
MODE = sys.argv[2] if len(sys.argv) > 2 else "accept"
if MODE == "reject":  # proposals never agree: the model continues the cycle backwards
    SUCC[100:100 + CYCLE] = 100 + (torch.arange(CYCLE) - 1) % CYCLE
marks = {}
class FakeGraphs:
    def __init__(self, runner, sizes):
        self.runner, self.sizes, self.replays = runner, sizes, 0
        self.replays_by_size, self.capture_seconds, self.graph_bytes = {}, 0.0, 0
    def replay(self, n, real):
        marks.setdefault("launch", []).append(time.perf_counter())
        self.replays += 1
        ids = self.runner.buffers.input_ids[:n]
        out = torch.zeros(n, 4096)
        out[torch.arange(n), SUCC[ids]] = 1.0
        return out
    def release(self):
        pass
    def argmax_keys(self, n, real):
        return None
def engine():
    net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
    llm = LLM(net, max_num_seqs=4, max_model_len=2048, block_size=16, show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    runner = llm.runtime.runner
    runner.dispatcher = Dispatcher(decode_sizes=(1, 2, 4), decode_graphs_wanted=True, verify_sizes=(5,))
    runner.decode_graphs = FakeGraphs(runner, (1, 2, 4))
    runner.verify_graphs = FakeGraphs(runner, (5,))
    loop = llm._loop
    orig = loop._resolve
    def resolve(step):
        if step.verify is not None:
            marks.setdefault("read", []).append(time.perf_counter())
        return orig(step)
    loop._resolve = resolve
    return llm
prompt = [100 + i for i in range(CYCLE)] * 2
sp = SamplingParams(max_tokens=600 if MODE == "accept" else 150, ignore_eos=True)
llm = engine()
chains, steps = [], []
for rep in range(8):
    marks.clear()
    steps0 = llm.num_steps
    s = time.perf_counter()
    out = llm.generate([prompt], sp)[0]
    dt = time.perf_counter() - s
    if rep < 2:
        continue
    launches = marks["launch"]
    # each read is followed by the next launch
    c = []
    for r in marks["read"]:
        nxt = [l for l in launches if l > r]
        if nxt:
            c.append((nxt[0] - r) * 1e6)
    chains.append(statistics.median(c))
    steps.append(dt / (llm.num_steps - steps0) * 1e6)
print(f"{MODE}: chain read->launch median {statistics.median(chains):.1f} us ({' '.join(f'{x:.1f}' for x in chains)}); "
      f"step {statistics.median(steps):.1f} us; modes {dict(llm.runtime.runner.dispatcher.mode_counts)}; "
      f"tokens/step {len(out.token_ids) / (llm.num_steps - steps0):.2f}")
llm.close()
