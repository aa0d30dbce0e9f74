"""act(gate)*up at T x 16384 -> T x 8192 (llama): Inductor with a dynamic (unbacked-like) T vs static vs ours."""
import torch, torch.nn.functional as F
import triton.testing
from custom_ops.triton_gemv import act_mul
torch._dynamo.config.cache_size_limit = 64
def f(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u
fs = torch.compile(f, dynamic=False)
fd = torch.compile(f, dynamic=True)
from torch._dynamo.decorators import mark_unbacked
_fu = torch.compile(f)
def fu(x):
    mark_unbacked(x, 0)
    return _fu(x)
for T in (64, 256, 512, 2048):
    xs = [torch.randn(T, 16384, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    for x in xs[:1]:
        torch.testing.assert_close(fd(x), f(x)); torch.testing.assert_close(fu(x), f(x)); torch.testing.assert_close(act_mul(x, "silu"), f(x), atol=2e-2, rtol=2e-2)
    res = {}
    for name, fn in (("static", fs), ("dynamic", fd), ("unbacked", fu), ("ours", lambda x: act_mul(x, "silu"))):
        i = [0]
        def call():
            i[0] = (i[0] + 1) % len(xs); fn(xs[i[0]])
        res[name] = triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
    mb = T * 16384 * 2 * 1.5 / 1e6
    print(f"T={T}: " + ", ".join(f"{k} {v:.2f} us ({mb / v:.2f} TB/s)" for k, v in res.items()), flush=True)
