"""Pinned host -> device upload between two small kernels: the copy engine (copy_, non_blocking) against a
Triton kernel reading the pinned memory itself (zero-copy), us per iteration, host queued ahead."""
import torch, triton, triton.language as tl, time

@triton.jit
def _upload(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

def run(words, variant, iters=400):
    host = torch.arange(words, dtype=torch.int64).pin_memory()
    dev = torch.zeros(words, dtype=torch.int64, device="cuda")
    a = torch.zeros(4096, device="cuda"); b = torch.zeros(4096, device="cuda")
    block = 1024
    def up():
        if variant == "memcpy":
            dev.copy_(host, non_blocking=True)
        else:
            _upload[(triton.cdiv(words, block),)](host, dev, words, BLOCK=block, num_warps=4)
    up(); torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host), variant
    host.add_(1)
    up(); torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host), variant
    for _ in range(20):
        a.add_(1); up(); b.add_(1)
    torch.cuda.synchronize(); torch.cuda._sleep(50_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        a.add_(1); up(); b.add_(1)
    e.record(); e.synchronize()
    return s.elapsed_time(e) * 1e3 / iters

for words in (2048, 8192, 32768):
    base = None
    for v in ("memcpy", "triton", "memcpy", "triton"):
        print(f"words {words} ({words*8//1024} KiB) {v}: {run(words, v):.2f} us per iteration", flush=True)
# reference: the two kernels alone
a = torch.zeros(4096, device="cuda"); b = torch.zeros(4096, device="cuda")
torch.cuda.synchronize(); torch.cuda._sleep(50_000_000)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(400):
    a.add_(1); b.add_(1)
e.record(); e.synchronize(); print(f"two kernels alone: {s.elapsed_time(e)*1e3/400:.2f} us per iteration")
