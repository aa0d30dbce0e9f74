"""Host issue time of a piecewise prefill step with the GPU asleep, and what Triton's JITFunction.run and
the graph replays take of it; then one attention launch timed through JITFunction.run, through the
compiled launcher directly, and Triton's argument binder alone; then a cProfile of 10 steps.

    PYTHONPATH=. python host_issue_probe.py llama-3.2-3b 64

The per-launch timings need a tree whose launches still go through JITFunction.run (the base of the
A/B, 689991a): with custom_ops.triton_launch every launch after the first skips it, so the probe finds
no recorded call to replay and stops with an error after the step lines and the cProfile (run it from
the repo root of the tree to measure; the step lines are what README.md quotes for both trees)."""
import sys, time, torch, triton
from triton.runtime import jit as tjit
from bench.common import build_model
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata
from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
from custom_ops import RuntimeMode
import custom_ops.triton_prefill as tp
model, t = sys.argv[1], int(sys.argv[2])
net = build_model(model)
kv = PagedKV.allocate(net, 1 + blocks_per_seq(t))
backend = InferGraphsBackend(BackendConfig(capture_sizes=(t,)))
compiled = torch.compile(net, backend=backend, fullgraph=True)
device = net.model.embed_tokens.weight.device
acc = {"triton": 0.0, "replay": 0.0, "launch_prefill": 0.0, "n_tr": 0, "n_rep": 0}
orig_run, orig_replay, orig_lp = tjit.JITFunction.run, torch.cuda.CUDAGraph.replay, tp.launch_prefill
last = {}
def run(self, *a, **k):
    t0 = time.perf_counter(); r = orig_run(self, *a, **k); acc["triton"] += time.perf_counter() - t0; acc["n_tr"] += 1
    last["a"], last["k"], last["kernel"] = a, k, r
    return r
def replay(self):
    t0 = time.perf_counter(); orig_replay(self); acc["replay"] += time.perf_counter() - t0; acc["n_rep"] += 1
tjit.JITFunction.run = run; torch.cuda.CUDAGraph.replay = replay
with torch.inference_mode():
    meta = step_metadata(1, 0, t, device)
    ids, pos = step_inputs(1, 0, t, net.config.vocab_size, device, seed=t)
    def step():
        with kv.context(meta, RuntimeMode.PIECEWISE, t):
            mark_token_dim(ids, pos)
            return compiled(ids, pos)
    for _ in range(5): step()
    torch.cuda.synchronize()
    for rep in range(3):
        for k in acc: acc[k] = 0
        torch.cuda._sleep(300_000_000)
        t0 = time.perf_counter()
        for _ in range(10): step()
        tot = (time.perf_counter() - t0) / 10 * 1e6
        torch.cuda.synchronize()
        print(f"step host {tot:.0f} us: triton run {acc['triton']/10*1e6:.0f} us ({acc['n_tr']//10} calls), "
              f"replay {acc['replay']/10*1e6:.0f} us ({acc['n_rep']//10} calls)", flush=True)
