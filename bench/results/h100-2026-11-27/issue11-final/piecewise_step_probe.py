"""Piecewise prefill step: host issue time (GPU asleep), GPU time (host far ahead), wall time, cProfile."""
import sys, time, statistics, torch
from bench.common import build_model
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata
from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
from custom_ops import RuntimeMode
model, t = sys.argv[1], int(sys.argv[2])
net = build_model(model)
kv = PagedKV.allocate(net, 1 + blocks_per_seq(t))
backend = InferGraphsBackend(BackendConfig(capture_sizes=(t,)))
compiled = torch.compile(net, backend=backend, fullgraph=True)
device = net.model.embed_tokens.weight.device
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
        torch.cuda._sleep(400_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        for _ in range(10): step()
        b.record()
        host = (time.perf_counter() - t0) / 10 * 1e6
        torch.cuda.synchronize()
        gpu = a.elapsed_time(b) / 10 * 1e3
        walls = []
        for _ in range(10):
            torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
        print(f"{model} T={t}: host issue {host:.0f} us/step, GPU {gpu:.0f} us/step (host ahead), "
              f"wall median {statistics.median(walls):.0f} us", flush=True)
    print("backend stats", {k: v for k, v in vars(backend.stats).items() if k != "capture_seconds"})
    import cProfile, pstats
    torch.cuda._sleep(400_000_000)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(10): step()
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
