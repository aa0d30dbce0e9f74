import importlib.util, statistics, sys, time, torch
spec = importlib.util.spec_from_file_location("old_input_buffers", sys.argv[1])
old = importlib.util.module_from_spec(spec); sys.modules["old_input_buffers"] = old; spec.loader.exec_module(old)
from engine.worker.input_buffers import StaticBuffers as New
def bench(cls, n_rows, reps=3000):
    b = cls(2048, 64, 256, torch.device("cpu"), 64 * 5)
    ids = list(range(n_rows)); pos = [300 + i for i in range(n_rows)]; slots = [4000 + i for i in range(n_rows)]
    qsl = list(range(n_rows + 1)); lens = [301 + i for i in range(n_rows)]
    tables = [list(range(1, 21)) for _ in range(n_rows)]
    li = list(range(n_rows)); si = list(range(n_rows))
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); b.load(ids, pos, slots, qsl, lens, tables, li, (), (), si); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
for r in range(4):
    print(" ".join(f"{name} b{n}={bench(cls, n):.1f}" for n in (5, 64) for name, cls in (("old", old.StaticBuffers), ("new", New))))
