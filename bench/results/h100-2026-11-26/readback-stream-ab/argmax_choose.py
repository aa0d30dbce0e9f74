import logging, sys, torch
sys.path.insert(0, ".")
logging.basicConfig(level=logging.INFO, format="%(message)s")
from engine.argmax import RowArgmax
from custom_ops.triton_argmax import row_argmax
for v in (128256, 151936, 262144):
    x = torch.randn(64, v, device="cuda", dtype=torch.bfloat16)
    RowArgmax().choose(x)
    for n in (1, 16, 64):
        y = x[:n]
        assert torch.equal(row_argmax(y), y.argmax(-1))
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, fn in (("torch", lambda: y.argmax(-1)), ("triton", lambda: row_argmax(y))):
            for _ in range(5): fn()
            torch.cuda.synchronize(); torch.cuda._sleep(2_000_000); s.record()
            for _ in range(50): fn()
            e.record(); e.synchronize()
            print(f"V={v} N={n} {name}: {s.elapsed_time(e) * 1e3 / 50:.1f} us")
