"""Where a batch-1 verify step's time goes: graph replays alone (GPU, host far ahead) and whole steps."""
import statistics, sys, time, torch
sys.path.insert(0, ".")
from bench.common import build_model
from bench.measure import gpu_ms_host_ahead
from bench.spec import ReplayProposer
from engine import LLM, SamplingParams
from engine.spec.config import SpeculativeConfig

k = 4
llm = LLM(build_model("llama-3.2-3b"), max_num_seqs=32, max_model_len=512, show_progress=False,
          speculative_config={"method": "ngram", "num_speculative_tokens": k})
runner = llm.runtime.runner
prompt = torch.randint(3, 128000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(max_tokens=128, ignore_eos=True)

def timed(proposer):
    llm.scheduler.proposer = proposer
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    t0, s0 = time.perf_counter(), llm.num_steps
    outs = llm.generate([prompt], params)
    wall = time.perf_counter() - t0
    steps = llm.num_steps - s0
    return wall / steps * 1e3, sum(outs[0].inter_token_latencies_s) / 127 * 1e3

print("plain step ms, ms/token", timed(None))
dec = gpu_ms_host_ahead(lambda: runner.decode_graphs.replay(1, 1))
print("decode graph (1) gpu ms", dec)
rej = ReplayProposer(SpeculativeConfig(k, 1, 3), {}, 128256, 1.0, backoff=False)
rej.continuations = {tuple(prompt): prompt + [5] * 200}
print("rejected verify step ms, ms/token", timed(rej))
mixed = runner.mixed_graphs
for n in (2, 5):
    print(f"mixed graph ({n}) gpu ms", gpu_ms_host_ahead(lambda: mixed.replay(n)))
hid = mixed.replay(5)
print("lm head 5 rows gpu ms", gpu_ms_host_ahead(lambda: llm.model.compute_logits(hid[:5])))
print("lm head 1 row gpu ms", gpu_ms_host_ahead(lambda: llm.model.compute_logits(hid[:1])))
# host time of one verify step with the GPU asleep
from engine.spec.sampling import VerifyLayout, sample_verify
logits = llm.model.compute_logits(hid[:5])
req = type("R", (), {})()
print("stats", {k: v for k, v in llm.stats()["spec_decode"].items()}, llm.stats()["modes"])
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
llm.scheduler.proposer = rej
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
