"""silu(gate)*up: Inductor vs custom act_mul; llama prefill GEMMs: cuBLAS vs cuBLASLt vs fp32-reduce, per rows."""
import torch, torch.nn.functional as F
from custom_ops.triton_gemv import act_mul
torch.manual_seed(0)
def graph_time(fns, reps=20):
    for f in fns: f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns: f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2] / len(fns) * 1e3
K = 8192
ind = torch.compile(lambda x: F.silu(x[:, :K]) * x[:, K:], dynamic=False)
for T in (64, 128, 256, 512):
    xs = [torch.randn(T, 2 * K, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    ref = (F.silu(xs[0][:, :K].float()) * xs[0][:, K:].float())
    a = ind(xs[0]); b = act_mul(xs[0], "silu")
    e1 = ((a.float()-ref).abs().max()/ref.abs().max()).item(); e2 = ((b.float()-ref).abs().max()/ref.abs().max()).item()
    ti = graph_time([lambda x=x: ind(x) for x in xs]); tc = graph_time([lambda x=x: act_mul(x, "silu") for x in xs])
    mb = T * 3 * K * 2 / 1e6
    print(f"act_mul T={T}: inductor {ti:.1f} us ({mb/ti:.2f} TB/s, err {e1:.1e}), custom {tc:.1f} us ({mb/tc:.2f} TB/s, err {e2:.1e})", flush=True)
shapes = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}
for T in (64, 128, 256, 512):
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(max(2, int(160e6 // (n * k * 2))))]
        x = torch.randn(T, k, dtype=torch.bfloat16, device="cuda")
        row = []
        for lib, red in (("cublas", True), ("cublaslt", True), ("cublas", False), ("cublaslt", False)):
            torch.backends.cuda.preferred_blas_library(lib)
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = red
            us = graph_time([lambda w=w: F.linear(x, w) for w in ws])
            row.append(f"{lib}{'' if red else '-fp32red'} {us:.1f}")
        torch.backends.cuda.preferred_blas_library("cublas"); torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        fl = 2 * T * n * k; print(f"gemm T={T} {name} {n}x{k}: " + ", ".join(row) + f"  (mem {n*k*2/3.0e6:.1f} us, compute@700T {fl/700e6:.1f} us)", flush=True)
