"""What one small op between two graph replays adds to the step (GPU-bound loop, host far ahead)."""
import statistics, time, torch
torch.cuda.init()
dev = torch.device("cuda")
s = torch.cuda.Stream()
x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x)
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    for _ in range(3):
        for _ in range(20): y.copy_(x)
    g.capture_begin()
    for _ in range(20): y.copy_(x)   # ~0.7 ms of memory-bound work in ~20 kernels
    g.capture_end()
torch.cuda.synchronize()
pinned = torch.zeros(64, dtype=torch.int64, pin_memory=True)
dsmall = torch.zeros(64, dtype=torch.int64, device=dev)
logits = torch.randn(1, 262144, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()

def h2d(): dsmall.copy_(pinned, non_blocking=True)
def d2h(): pinned.copy_(dsmall, non_blocking=True)
def kern(): dsmall.add_(1)
def argmax(): logits.argmax(dim=-1)
def d2h_side():
    ev = torch.cuda.Event(); ev.record()
    side.wait_event(ev)
    with torch.cuda.stream(side):
        pinned.copy_(dsmall, non_blocking=True)
def event_only():
    torch.cuda.Event().record()

variants = {"none": [], "1 kernel": [kern], "2 kernels": [kern, kern], "1 H2D": [h2d], "2 H2D": [h2d, h2d],
            "1 D2H": [d2h], "D2H + 2 H2D": [d2h, h2d, h2d], "kernel D2H kernel H2D H2D kernel": [kern, d2h, kern, h2d, h2d, kern],
            "D2H on side stream": [d2h_side], "argmax 262k bf16": [argmax], "event record": [event_only]}
N = 200
res = {}
for rep in range(3):
    for name, ops in variants.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(5_000_000)  # host runs ahead of the GPU from here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(N):
            g.replay()
            for op in ops: op()
        end.record(); end.synchronize()
        res.setdefault(name, []).append(start.elapsed_time(end) * 1e3 / N)
base = statistics.median(res["none"])
for name, v in res.items():
    m = statistics.median(v)
    print(f"{name:36s} {m:8.1f} us/step  (+{m - base:5.1f} us)")
