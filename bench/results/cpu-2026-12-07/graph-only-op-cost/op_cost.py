import time, statistics, torch
import custom_ops  # registers infer::
torch.set_num_threads(1)
x = torch.randn(4, 8); w = torch.randn(8, 8)
gu = torch.randn(4, 16); wd = torch.randn(8, 8)
def t(fn, n=20000):
    res=[]
    for _ in range(7):
        s=time.perf_counter()
        for _ in range(n): fn()
        res.append((time.perf_counter()-s)/n*1e6)
    return statistics.median(res)
with torch.inference_mode():
    a = t(lambda: torch.ops.aten.linear(x, w))
    b = t(lambda: torch.ops.infer.linear(x, w, None))
    c = t(lambda: torch.ops.infer.gated_linear(gu, wd, "silu"))
    d = t(lambda: torch.ops.aten.linear(torch.ops.infer.act_and_mul(gu, "silu"), wd))
print(f"aten.linear {a:.2f} us; infer.linear {b:.2f} us (+{b-a:.2f}); infer.gated_linear {c:.2f} us; act_and_mul op + aten.linear {d:.2f} us (+{c-d:.2f})")
