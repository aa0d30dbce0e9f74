"""Host time of the step() that launches a 512-token prefill under a FULL (mixed-graph) dispatch, CPU,
the mixed graph faked (returns hidden rows); cProfile of those steps."""
import sys, time, statistics, cProfile, pstats, torch
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
from engine.worker.dispatch import Dispatcher
cfg = null_forward_config(load_config(sys.argv[2] if len(sys.argv) > 2 else "llama-3.2-3b")); cfg["vocab_size"] = 4096
T = int(sys.argv[3]) if len(sys.argv) > 3 else 512
class FakeMixed:
    def __init__(self, runner):
        self.runner, self.sizes, self.replays, self.capture_seconds = runner, (T,), 0, 0.0
        self.h = torch.zeros(T, cfg["hidden_size"])
    def replay(self, n):
        self.replays += 1
        return self.h[:n]
    def release(self): pass
net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
llm = LLM(net, max_num_seqs=8, max_model_len=2048, max_num_batched_tokens=T, block_size=16, show_progress=False,
          async_scheduling=True)
runner = llm.runtime.runner
runner.dispatcher = Dispatcher(mixed_sizes=(T,), mixed_graphs_wanted=True)
runner.mixed_graphs = FakeMixed(runner)
sp = SamplingParams(max_tokens=2, ignore_eos=True)
import random
def one(prof=None):
    llm.add_request([random.randrange(4096) for _ in range(T)], sp)
    s = time.perf_counter()
    if prof: prof.enable()
    llm.step()
    if prof: prof.disable()
    dt = time.perf_counter() - s
    while llm.has_unfinished_requests():
        llm.step()
    return dt * 1e3
for _ in range(5): one()
times = [one() for _ in range(30)]
print(f"prefill step host ms median {statistics.median(times):.3f} (min {min(times):.3f}); modes {dict(runner.dispatcher.mode_counts)}")
pr = cProfile.Profile()
for _ in range(20): one(pr)
pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
