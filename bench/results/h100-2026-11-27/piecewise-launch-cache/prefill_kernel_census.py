"""Kernel census of prefill at T tokens: FULL graph (compiled, one graph) and piecewise; GPU time by kernel."""
import sys, time, collections, torch
from torch.profiler import profile, ProfilerActivity
from bench.common import build_model
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata
from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
from custom_ops import RuntimeMode
model = sys.argv[1]
tokens = [int(x) for x in sys.argv[2].split(",")]
net = build_model(model)
kv = PagedKV.allocate(net, 1 + blocks_per_seq(max(tokens)))
backend = InferGraphsBackend(BackendConfig(capture_sizes=tuple(tokens)))
compiled = torch.compile(net, backend=backend, fullgraph=True)
device = net.model.embed_tokens.weight.device

def census(fn, n=10):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            agg[e.name][0] += e.device_time / n
            agg[e.name][1] += 1
    return agg

with torch.inference_mode():
    for t in sorted(tokens, reverse=True):
        meta = step_metadata(1, 0, t, device)
        ids, pos = step_inputs(1, 0, t, net.config.vocab_size, device, seed=t)
        def run_model(fn, mode):
            with kv.context(meta, mode, t):
                if fn is compiled:
                    mark_token_dim(ids, pos)
                hidden = fn(ids, pos)
            return net.compute_logits(hidden[-1:])
        pw = lambda: run_model(compiled, RuntimeMode.PIECEWISE)
        for _ in range(3): pw()
        torch.cuda.synchronize()
        # host launch time vs step time
        t0 = time.perf_counter(); 
        for _ in range(20): pw()
        th = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize(); tw = (time.perf_counter() - t0) / 20 * 1e3
        run_model(compiled, RuntimeMode.FULL); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=backend.pool):
            run_model(compiled, RuntimeMode.FULL)
        g.replay(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20): g.replay()
        torch.cuda.synchronize(); tf = (time.perf_counter() - t0) / 20 * 1e3
        print(f"\n=== {model} T={t}: piecewise host-issue {th:.3f} ms, wall {tw:.3f} ms; full graph {tf:.3f} ms")
        for name, fn in (("full", g.replay), ("piecewise", pw)):
            agg = census(fn)
            tot = sum(v[0] for v in agg.values())
            print(f"--- {name}: GPU kernel sum {tot/1e3:.3f} ms, {sum(v[1] for v in agg.values())//10} kernels/step")
            for k, (us, c) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]:
                print(f"{us:9.1f} us {c//10:4d}x  {k[:110]}")
