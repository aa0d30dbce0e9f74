"""Row argmax GPU time per call by CUDA-graph replay (20 calls a graph): the engine's default chunk
against others, and torch's, at the sampler's shapes."""
import itertools, torch
from custom_ops.triton_argmax import _row_argmax_kernel, _workspace, MAX_MERGE_BLOCK, argmax_chunk
from custom_ops.triton_common import cdiv, next_power_of_2, sm_count
from custom_ops.triton_launch import launch

def call(x, out, chunk, warps):
    n, v = x.shape
    nc = cdiv(v, chunk)
    keys, arr = _workspace(x.device, n, nc) if nc > 1 else (out, out)
    launch(_row_argmax_kernel, (n, nc), (x, out, keys, arr, x.stride(0), v, nc),
           dict(CHUNK=chunk, BLOCK_CHUNKS=min(next_power_of_2(nc), MAX_MERGE_BLOCK), SPLIT=nc > 1, num_warps=warps))

def graph_us(fn, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(ts)[3]

torch.manual_seed(0)
sms = sm_count(torch.device("cuda"))
for v in (262144, 151936, 128256):
    for n in (1, 16, 64):
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
        ref = x.float().argmax(-1)
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        dchunk = argmax_chunk(n, v, sms); dwarps = 4 if dchunk <= 2048 else 8
        res = []
        for chunk, warps in itertools.product((1024, 2048, 4096, 8192, 16384), (2, 4, 8, 16)):
            if chunk // (32 * warps) < 8 or chunk // (32 * warps) > 128: continue
            call(x, out, chunk, warps); torch.cuda.synchronize()
            assert torch.equal(out, ref), (v, n, chunk, warps)
            res.append((graph_us(lambda: call(x, out, chunk, warps)), chunk, warps))
        res.sort()
        default = next(t for t, c, w in res if (c, w) == (dchunk, dwarps))
        torch_us = graph_us(lambda: torch.argmax(x, -1, out=out))
        print(f"V={v} N={n} torch {torch_us:.2f} default c{dchunk}w{dwarps} {default:.2f} best " + "  ".join(f"c{c}w{w}:{t:.2f}" for t, c, w in res[:5]), flush=True)
