"""Does a decode GEMV get faster when its weight was prefetched into L2 while a latency-bound kernel
ran? Graph of reps x [flush L2; sleep (+ prefetch on a side stream); gemv], vs without prefetch."""
import sys
import torch
import triton
import triton.language as tl

from custom_ops.triton_gemv import gemv
from custom_ops.gemv_table import GEMV_CONFIGS


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * THREADS * CHUNK + tl.arange(0, THREADS).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    addr = base + offs
    if MODE == 0:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        # per 128-byte line prefetch
        for i in tl.static_range(0, CHUNK // 128):
            a = addr + i * 128
            ok = (offs + i * 128) < nbytes
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [a, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w, mode=0, chunk=4096, threads=128):
    nbytes = w.numel() * w.element_size()
    grid = triton.cdiv(nbytes, chunk * threads)
    _prefetch_kernel[(grid,)](w.data_ptr(), nbytes, CHUNK=chunk, THREADS=threads, MODE=mode, num_warps=threads // 32)


def run(n, k, sleep_cycles, variant, reps=20):
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    flush_src = torch.empty(64 << 20, device="cuda", dtype=torch.float32)  # 256 MB
    flush_dst = torch.empty_like(flush_src)
    cfg = GEMV_CONFIGS.get((n, k))
    side = torch.cuda.Stream()

    def body():
        for _ in range(reps):
            flush_dst.copy_(flush_src)
            if variant in ("pref", "pref_line"):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(w, mode=0 if variant == "pref" else 1)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            if variant in ("pref", "pref_line"):
                torch.cuda.current_stream().wait_stream(side)
            if variant != "nogemv":
                gemv(x, w, cfg, out=out)

    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            body()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    times.sort()
    ref = (x.float() @ w.float().t())
    assert variant == 'nogemv' or torch.allclose(out.float(), ref, atol=0.5, rtol=0.05), (out.float() - ref).abs().max()
    return times[len(times) // 2]


if __name__ == "__main__":
    shapes = [(2560, 4096), (6144, 2560), (3072, 3072), (1152, 1024), (1536, 1152), (2560, 9728)]
    for n, k in shapes:
        mb = n * k * 2 / 1e6
        for sleep in (0, 12000, 20000):
            r = {v: run(n, k, sleep, v) for v in ("nogemv", "cold", "pref", "pref_line")}
            print(f"{n}x{k} ({mb:.1f} MB) sleep={sleep}: nogemv {r['nogemv']:.2f} us; gemv cold "
                  f"{r['cold'] - r['nogemv']:.2f} us, after prefetch {r['pref'] - r['nogemv']:.2f} us, "
                  f"line-prefetch {r['pref_line'] - r['nogemv']:.2f} us", flush=True)
